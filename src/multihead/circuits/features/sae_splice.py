"""Run a model with an SAE spliced in: :func:`splice_sae`, the activation the SAE reads
replaced by the SAE's reconstruction of it, its features edited or not.

Inside ``with splice_sae(model, sae):`` every call of the model computes, at the site the SAE
reads (``sae.site``, or ``layer=``), for each position's activation x::

    f  = encode(x)                                    (..., F) the features
    f' = f · s + a                                    s: features={i: s_i} (0.0 ablates),
                                                      a: steer={i: a_i}
    x' = decode(f', input=x)                          error=False: the reconstruction
    x' = x + (decode(f', input=x) - decode(f, input=x))
                                                      error=True: decode(f') + the SAE's
                                                      error term x - decode(f)

so that with ``error=True`` and no edit the model computes exactly what it computes without the
SAE (x + 0), and each edit changes the activation by what it changes in the reconstruction:
``steer={i: a}`` adds ``a · W_dec[i]`` (for an SAE that does not normalise its input; with a
``layer_norm`` input it is scaled by the row's σ, as ``decode`` undoes the norm).

Where the activation is replaced (the hooks :func:`multihead.patch` patches each site through):

- ``z`` (B, T, H, Dv): an observer on the layer's attention site returns the replacement (the
  channel :func:`~multihead.circuits.steering.intervene` edits heads through), its heads
  flattened head-major as TransformerLens's ``hook_z`` is, or the one head of
  ``sae.hook_head_index``;
- ``attn_out``, ``mlp_out`` (B, T, E): a forward hook on the block's attention / feed-forward
  module (the map's ``Block.attention`` / ``Block.mlp``) replaces its output;
- ``resid_pre``, ``resid_post``: a forward pre-hook / forward hook on the block replaces its
  input / output;
- ``resid_mid``: the attention's write w is replaced by ``w + (x' - x)``, x = resid_pre + w, so
  that the stream after it is x' (a block that is the sum resid_pre + attn_out + mlp_out; in a
  parallel block the feed-forward network does not read it).

The replacement is position by position, so a batch its model runs packed (N, E) is spliced as
well. Shapes: B batch, T tokens, H heads, Dv a head's output width, E the residual width (an
SAE's ``d_in``), F the SAE's features.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_index, describe
from multihead.circuits.features.sae_features import sae_input, sae_site
from multihead.circuits.runs.site_names import site_label
from multihead.map_types import output_tensor, with_output_tensor
from multihead.mapping import model_heads, model_map
from multihead.observers import AttentionCall, Removable, registered
from multihead.sae.sae import SAE

__all__ = ["splice_sae", "SPLICED_SITES"]

# the sites an SAE may be spliced at
SPLICED_SITES = ("z", "attn_out", "resid_pre", "resid_mid", "mlp_out", "resid_post")
CALLER = "splice_sae"


def _edits(name: str, edits: object, sae: SAE) -> dict[int, float]:
    """``{feature: number}`` checked: features in range (negative from the end), each number
    finite and finite in the SAE's dtype; None is no edit."""
    if edits is None:
        return {}
    if not isinstance(edits, Mapping):
        raise TypeError(
            f"{CALLER}: {name} must be a mapping {{feature: number}} or None, got {describe(edits)}"
        )
    checked: dict[int, float] = {}
    for key, value in edits.items():
        feature = check_index(f"{CALLER}: {name} key", key, sae.d_sae, "features (d_sae)")
        if feature in checked:
            raise ValueError(
                f"{CALLER}: {name} names feature {feature} a second time (negative indices count "
                f"from the end)"
            )
        where = f"{CALLER}: {name}[{key}]"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be a number (an int or a float), got {describe(value)}")
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float (10**400)
            raise ValueError(f"{where} must be a finite number, got {describe(value)}") from None
        held = torch.tensor(number, dtype=torch.float64).to(sae.dtype).item()
        if not math.isfinite(number) or not math.isfinite(held):
            raise ValueError(
                f"{where} must be a finite number (and finite in the SAE's dtype {sae.dtype}), "
                f"got {describe(value)}"
            )
        checked[feature] = number
    return checked


def _vector(values: Mapping[int, float], fill: float, sae: SAE) -> Tensor:
    """(F,) ``fill`` but at the features of ``values``, in the SAE's dtype and on its device."""
    vector = torch.full((sae.d_sae,), fill, dtype=torch.float64)
    for feature, value in values.items():
        vector[feature] = value
    return vector.to(device=sae.device, dtype=sae.dtype)


class _Splice:
    """The checked splice: the SAE, its site, and the map from an activation (..., E) to its
    replacement (:meth:`replaced`)."""

    def __init__(
        self,
        model: nn.Module,
        sae: SAE,
        error: object,
        features: object,
        steer: object,
        layer: int | None,
    ) -> None:
        key = sae_site(model, sae, layer, CALLER)
        site, at = key
        if sae.config.is_transcoder:
            raise ValueError(
                f"{CALLER}: sae is a {sae.architecture}: it reads {sae.hook_name!r} and writes "
                f"{sae.hook_name_out!r}, not a reconstruction of what it reads; splice_sae "
                f"splices an SAE (a transcoder is not supported)"
            )
        if site not in SPLICED_SITES:
            raise ValueError(
                f"{CALLER}: sae: the SAE reads {sae.hook_name!r} ({site_label(site, at)}); "
                f"splice_sae splices an SAE of {', '.join(SPLICED_SITES)}"
            )
        if (sae.hook_name or "").endswith(".hook_mlp_in"):
            # the stream goes on with resid_mid itself: replacing the site would change both
            raise ValueError(
                f"{CALLER}: sae: the SAE reads {sae.hook_name!r}, TransformerLens's copy of "
                f"resid_mid that only the feed-forward network reads; splicing that copy is not "
                f"supported (an SAE of resid_mid replaces the stream itself)"
            )
        if not isinstance(error, bool):
            raise TypeError(f"{CALLER}: error must be a bool, got {describe(error)}")
        found = model_heads(model)
        mapped = model_map(model)
        if site == "z":
            if found[at].shard is not None:
                raise ValueError(
                    f"{CALLER}: layer {at}'s heads are split over ranks (tensor parallelism): "
                    f"each rank holds a part of z, which the SAE reads whole"
                )
            shape: tuple[int, ...] | None = (found[at].num_heads, found[at].head_dim)
        else:
            shape = (mapped.width,) if mapped.width is not None else None
        if shape is not None:  # the width checked now, on a tensor holding no values
            sae_input(sae, key, torch.empty((1, 1, *shape), device="meta"), CALLER)
        self.sae, self.key, self.error = sae, key, error
        scales, adds = _edits("features", features, sae), _edits("steer", steer, sae)
        # (F,) each, made once where the features are (encode's output: the SAE's dtype, device)
        self.factors = _vector(scales, 1.0, sae) if scales else None
        self.shift = _vector(adds, 0.0, sae) if adds else None
        self.found, self.mapped = found, mapped
        self.hook_z = sae.reshape_activations == "hook_z"
        self.block = None if site == "z" else mapped.stack_block(at, CALLER)
        # the part's replaced output in the current call, for the post-norm check; weak, so
        # that no activation (or its graph) outlives the call
        self.written: weakref.ref[Tensor] | None = None
        self.part: nn.Module | None = None
        if site in ("attn_out", "resid_mid", "mlp_out"):
            assert self.block is not None
            self.part = self.block.mlp if site == "mlp_out" else self.block.attention
            if self.part is None:
                what = "feed-forward" if site == "mlp_out" else "attention"
                raise ValueError(
                    f"{CALLER}: the SAE reads {site_label(site, at)}, and the map of "
                    f"{mapped.family} does not know block {at}'s {what} module (none, or not "
                    f"known)"
                )

    def _edited(self, f: Tensor) -> Tensor:
        """The features (..., F) with the edits: scaled (zeroed) first, then steered."""
        if self.factors is not None:
            f = f * self.factors  # x · 1.0: the other features bit-exact
        if self.shift is not None:
            f = f + self.shift
        return f

    def replaced(self, x: Tensor) -> Tensor:
        """The replacement of activations ``x`` (..., E) as the SAE reads them: same shape,
        dtype and device (the module docstring's x')."""
        sae = self.sae
        given = x.to(sae.device)
        # a hook_z SAE flattens its input's last two dims itself: (..., 1, E) flattens to E
        given = given[..., None, :] if self.hook_z else given
        f = sae.encode(given)
        edited = self._edited(f)
        y = sae.decode(edited, input=given)
        if self.error:  # x + (decode(f') - decode(f)): x itself where nothing is edited
            unedited = y if edited is f else sae.decode(f, input=given)
            change = y - unedited
            change = change.flatten(-2) if self.hook_z else change
            return x + change.to(device=x.device, dtype=x.dtype)
        y = y.flatten(-2) if self.hook_z else y
        return y.to(device=x.device, dtype=x.dtype)

    # -- the hooks -------------------------------------------------------------------------------

    def hooks(self) -> Iterator[Removable]:
        site, layer = self.key
        if site == "z":
            yield self.found[layer].attention.register_observer(self._heads(layer))
            return
        block = self.block
        assert block is not None
        if site == "resid_pre":
            yield block.module.register_forward_pre_hook(self._stream_in, with_kwargs=True)
        elif site == "resid_post":
            yield block.module.register_forward_hook(self._output)
        elif site == "resid_mid":
            assert self.part is not None
            entering: list[Tensor] = []

            def record(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                entering[:] = [self.mapped.stream_of(args, kwargs)]

            def write(m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
                written = output_tensor(out)
                x = entering[0] + written  # resid_mid (B, T, E)
                new = written + (self._of_site(x) - x)
                self.written = weakref.ref(new)
                return with_output_tensor(out, new)

            yield block.module.register_forward_pre_hook(record, with_kwargs=True)
            yield self.part.register_forward_hook(write)
        else:  # attn_out, mlp_out
            assert self.part is not None
            yield self.part.register_forward_hook(self._output)
        if site in ("attn_out", "mlp_out", "resid_mid"):
            for norm, _ in block.norms:
                yield norm.register_forward_pre_hook(self._refuse_post_norm)

    def _refuse_post_norm(self, m: nn.Module, args: tuple[Any, ...]) -> None:
        """A norm of the block given the part's replaced output itself: the block normalises
        that output before adding it (a post-attention or post-feed-forward norm), so the
        part's output is not the site, and the splice would be wrong: refused."""
        if self.written is None or not args or args[0] is not self.written():
            return
        self.written = None
        site, layer = self.key
        what = "feed-forward" if site == "mlp_out" else "attention"
        raise ValueError(
            f"{CALLER}: block {layer} of {self.mapped.family} passes its {what} module's output "
            f"through {type(m).__name__} before adding it to the stream (a post-{what} norm, "
            f"as Gemma-2/3 and OLMo-2 have): splicing {site_label(site, layer)} there is not "
            f"supported; splice z, resid_pre or resid_post"
        )

    def _of_site(self, x: Tensor) -> Tensor:
        """The replacement of the site's activation (B, T, E), its width checked."""
        self._check_width(x)
        return self.replaced(x)

    def _check_width(self, x: Tensor) -> None:
        # a packed run's (N, E) counts as one row of N positions
        sae_input(self.sae, self.key, x if x.dim() == 3 else x[None], CALLER)

    def _output(self, m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        new = self._of_site(output_tensor(out))
        self.written = weakref.ref(new)  # for the post-norm check: what the block is handed
        return with_output_tensor(out, new)

    def _stream_in(
        self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        stream = self.mapped.stream_of(args, kwargs)
        return self.mapped.with_stream(args, kwargs, self._of_site(stream))

    def _heads(self, layer: int) -> Any:
        head = self.sae.hook_head_index

        def observer(call: AttentionCall, out: Tensor) -> Tensor:
            # out: (B, T, H, Dv) before the output projection; never modified in place
            x = sae_input(self.sae, self.key, out, CALLER)  # (B, T, H·Dv), or (B, T, Dv)
            if head is None:
                return self.replaced(x).unflatten(2, out.shape[2:])  # (B, T, H, Dv)
            new = out.clone()
            new[:, :, head] = self.replaced(x)
            return new

        return observer


@contextlib.contextmanager
def splice_sae(
    model: nn.Module,
    sae: SAE,
    *,
    error: bool = False,
    features: Mapping[int, float] | None = None,
    steer: Mapping[int, float] | None = None,
    layer: int | None = None,
) -> Iterator[None]:
    """Replace the activation an SAE reads by its reconstruction inside the block; the model is
    exactly itself again after.

    Every call of the model inside the block (each step of a generation, each run of a circuit
    function: :func:`multihead.patch`, :func:`multihead.attribution_patching`,
    :func:`multihead.edge_attribution` run with the features in place) computes, at the SAE's
    site, ``decode(f', input=x)`` with ``f' = f · s + a`` the edited features ``f = encode(x)``
    (see the module docstring), and with ``error=True`` adds the SAE's error term ``x -
    decode(f, input=x)``: no edit then changes nothing (the logits are the model's own, bit
    for bit), an edit changes the activation by what it changes in the reconstruction.

    Edits keep gradients (the features, the error term and the reconstruction are computed
    with them; the SAE's own parameters require none), so a gradient method run inside the
    block differentiates through the SAE. Observers registered before see the site's own
    activation, later ones the replacement (as for
    :func:`~multihead.circuits.steering.intervene`). An
    :class:`~multihead.Experiment` built outside the block holds runs made without the SAE:
    build it (or pass the model) inside.

    Args:
        model: multihead's models, any module of multihead's blocks, or a transformers model
            (through :mod:`multihead.hf`).
        sae: a :class:`multihead.sae.SAE` (:func:`multihead.sae.load`) of one of
            :data:`SPLICED_SITES`; not a transcoder. It runs on its own device and dtype (each
            activation is moved there and its replacement back).
        error: keep the SAE's error term (default False: the reconstruction alone).
        features: ``{feature: s}``: feature's activation times ``s`` (``0.0`` ablates it),
            at every position; negative ids count from the end.
        steer: ``{feature: a}``: ``a`` added to the feature's activation (after ``features``'
            scaling) at every position, i.e. ``a · W_dec[feature]`` added to the
            reconstruction for an SAE that does not normalise its input (through ``decode``'s
            denormalisation for one that does; a rescaled top-k SAE divides it by the
            decoder row's norm).
        layer: splice at this layer's site instead of the one the SAE's hook names (negative
            from the end); default the hook's.

    Raises:
        ValueError: an SAE whose hook multihead has no site for (or whose files name none), a
            site not in :data:`SPLICED_SITES`, a transcoder, ``layer`` out of range, a width of
            the site other than ``sae.d_in`` (or the head of ``sae.hook_head_index`` not the
            layer's), a feature id out of range or named twice, a non-finite number (or one the
            SAE's dtype cannot hold), a z site split over ranks, a block whose attention /
            feed-forward module the map does not know (attn_out, resid_mid, mlp_out), a block
            holding more than one attention layer, an SAE of ``hook_mlp_in`` (TransformerLens's
            copy of resid_mid the feed-forward network alone reads). On the first call inside
            the block: attn_out, resid_mid or mlp_out of a block that normalises the part's
            output before adding it (a post-attention or post-feed-forward norm: Gemma-2/3,
            OLMo-2), where the module's output is not the site.
        TypeError: ``sae`` not an SAE, ``layer`` not an int, ``error`` not a bool, ``features``
            or ``steer`` not a mapping of int feature ids to numbers.
        All are raised before anything is registered; a width the map does not know (a model
        without ``width``) is checked at the first call, naming the site.

    Example:
        >>> sae = multihead.sae.load("saes/blocks.1.hook_resid_pre")
        >>> with splice_sae(lm, sae, error=True, features={7: 0.0}):  # feature 7 ablated
        ...     ablated = lm(ids)
    """
    splice = _Splice(model, sae, error, features, steer, layer)
    with registered(splice.hooks()):
        yield
