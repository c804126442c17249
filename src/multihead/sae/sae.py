"""A sparse autoencoder read from SAELens's or Gemma Scope's files: :class:`SAE`.

Letters: ``...`` any leading dims (batch, positions), ``E`` = ``d_in`` (a ``hook_z`` SAE:
``H·D``, heads times head width), ``F`` = ``d_sae`` (features), ``O`` = ``d_out`` (a
transcoder's output width, else ``d_in``).

The formulas are SAELens's (sae_lens/saes/*.py, 6.x), one per architecture::

    x' = norm_in(reshape_in(x)) - b_dec · apply_b_dec_to_input        (a transcoder: norm_in(x))
    h  = x' @ W_enc + b_enc                                           (..., F)
    standard, transcoder, skip_transcoder:      f = relu(h)
    jumprelu, jumprelu_(skip_)transcoder:       f = relu(h) · (h > threshold)
    topk:     f = relu(top-k of h'), zeros elsewhere,  h' = h · ‖W_dec‖ (rescaled) or h
    abstopk:  f = the k entries of h' largest in |·|, signed, zeros elsewhere
    gated:    f = (x' @ W_enc + b_gate > 0) · relu(x' @ (W_enc · exp(r_mag)) + b_mag)
    decode:   y = reshape_out(norm_out(f @ W_dec + b_dec))                (a transcoder: no
              norm_out nor reshape; a rescaled top-k SAE: f / ‖W_dec‖ @ W_dec)
    forward:  decode(encode(x)), plus x @ W_skip.T for a skip transcoder

``norm_in`` / ``norm_out``: ``layer_norm`` (x - μ) / (σ + 1e-5) and back (σ the unbiased std
over the last dim), ``constant_norm_rescale`` x · √E / ‖x‖ and back, else the identity. Undoing
a normalisation needs the statistics of the input that was encoded: :meth:`SAE.decode` takes it
as ``input=`` (SAELens keeps them on the module between its encode and decode calls).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

import torch
from torch import Tensor, nn

from multihead._checks import check_tensor, describe
from multihead.circuits.runs.site_names import SiteKey, site_of_hook_name
from multihead.sae.sae_config import SAEConfig

__all__ = ["SAE"]

T = TypeVar("T")
# sae_lens/saes/sae.py run_time_activation_ln_in
LAYER_NORM_EPS = 1e-5


class _FromConfig(Generic[T]):
    """A read-only attribute of an :class:`SAE`: its config's field of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, sae: SAE, owner: type | None = None) -> T:
        value: T = getattr(sae.config, self.name)
        return value

    def __set__(self, sae: SAE, value: object) -> None:
        raise AttributeError(f"{self.name} is the config's (SAE.config), read-only")


class SAE(nn.Module):
    """A sparse autoencoder: ``encode`` an activation into features, ``decode`` them back.

    Built by :func:`multihead.sae.load`; its tensors are parameters named as SAELens names them
    (``W_enc (E, F)``, ``W_dec (F, O)``, ``b_enc (F,)``, ``b_dec (O,)``, and ``threshold``,
    ``b_gate``, ``b_mag``, ``r_mag``, ``W_skip (O, E)`` where the architecture has them), so
    ``sae.to(device, dtype)`` moves them all.

    Attributes:
        config: the :class:`~multihead.sae.sae_config.SAEConfig` it was read with.
        architecture, d_in, d_sae, d_out, k, apply_b_dec_to_input, normalize_activations,
            reshape_activations, hook_name, hook_name_out, hook_head_index: the config's.
        site: multihead's ``(site, layer)`` of ``hook_name`` (``("z", 5)`` for
            ``"blocks.5.attn.hook_z"``), None when multihead has no such site or the files do
            not say.
        site_out: the same of a transcoder's ``hook_name_out``.
    """

    # registered in __init__, those the architecture has (SAEConfig.tensor_shapes)
    W_enc: nn.Parameter
    W_dec: nn.Parameter
    b_dec: nn.Parameter
    b_enc: nn.Parameter
    threshold: nn.Parameter
    b_gate: nn.Parameter
    b_mag: nn.Parameter
    r_mag: nn.Parameter
    W_skip: nn.Parameter

    def __init__(self, config: SAEConfig, tensors: Mapping[str, Tensor]) -> None:
        super().__init__()
        shapes = config.tensor_shapes()
        found = {name: tuple(t.shape) for name, t in tensors.items()}
        if found != shapes:
            raise ValueError(
                f"tensors must be those of the config's {config.architecture} SAE, {shapes}, "
                f"got {found}"
            )
        self.config = config
        for name in shapes:
            self.register_parameter(name, nn.Parameter(tensors[name], requires_grad=False))
        self.site: SiteKey | None = (
            site_of_hook_name(config.hook_name) if config.hook_name is not None else None
        )
        self.site_out: SiteKey | None = (
            site_of_hook_name(config.hook_name_out) if config.hook_name_out is not None else None
        )

    # the config's facts, read-only attributes
    architecture = _FromConfig[str]()
    d_in = _FromConfig[int]()
    d_sae = _FromConfig[int]()
    d_out = _FromConfig[int]()
    k = _FromConfig[int | None]()
    apply_b_dec_to_input = _FromConfig[bool]()
    normalize_activations = _FromConfig[str]()
    reshape_activations = _FromConfig[str]()
    hook_name = _FromConfig[str | None]()
    hook_name_out = _FromConfig[str | None]()
    hook_head_index = _FromConfig[int | None]()

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def __repr__(self) -> str:
        sizes = f"d_in={self.d_in}, d_sae={self.d_sae}"
        sizes += f", d_out={self.d_out}" if self.config.is_transcoder else ""
        return f"SAE({self.architecture}, {sizes}, hook_name={self.hook_name!r}, site={self.site})"

    def require_site(self) -> SiteKey:
        """The ``(site, layer)`` the SAE reads, or ValueError saying why there is none."""
        if self.site is not None:
            return self.site
        if self.hook_name is None:
            raise ValueError(
                "this SAE's files name no hook it reads (hook_name is None): multihead cannot "
                "tell which site of a model its features are of"
            )
        raise ValueError(
            f"this SAE reads {self.hook_name!r}, a hook multihead has no site for (its sites: "
            "multihead.circuits.runs.site_names.SITES, by TransformerLens's names)"
        )

    # -- the formulas ----------------------------------------------------------------------------

    def _flat_input(self, name: str, x: Tensor) -> Tensor:
        """``x`` checked and cast to the SAE's dtype, a ``hook_z`` input's heads flattened:
        (..., E), or (..., H, D) -> (..., H·D)."""
        check_tensor(name, x, floating=True)
        hook_z = self.reshape_activations == "hook_z"
        width = x.shape[-2] * x.shape[-1] if hook_z and x.dim() >= 2 else x.shape[-1]
        if x.dim() == 0 or width != self.d_in:
            want = f"(..., H, D) with H·D = {self.d_in}" if hook_z else f"(..., {self.d_in})"
            raise ValueError(f"{name} must have shape {want} (d_in), got {describe(x)}")
        x = x.to(self.dtype)
        return x.flatten(-2) if hook_z else x  # (..., E)

    def normalized(self, x: Tensor) -> tuple[Tensor, Tensor, bool]:
        """norm_in of a (..., E) input (sae_lens/saes/sae.py _setup_activation_normalization),
        as an affine map frozen at ``x``: (the normalised input (..., E), each row's factor f
        (...,), whether it centres), so that ``norm_in(x) = f · (x - mean(x))`` when it
        centres (``layer_norm``: f = 1 / (σ + eps), σ unbiased), else ``f · x``
        (``constant_norm_rescale``: f = √E / ‖x‖; no normalisation: f = 1)."""
        if self.normalize_activations == "layer_norm":
            centred = x - x.mean(dim=-1, keepdim=True)
            factor = 1.0 / (centred.std(dim=-1) + LAYER_NORM_EPS)
            return centred * factor[..., None], factor, True
        if self.normalize_activations == "constant_norm_rescale":
            factor = self.d_in**0.5 / x.norm(dim=-1)
            return x * factor[..., None], factor, False
        return x, torch.ones_like(x[..., 0]), False

    def encoder(self, features: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The affine map whose output is the pre-activation of the normalised input (less
        ``b_dec`` where ``apply_b_dec_to_input``): (E, F') columns and (F',) bias of
        ``features`` ((F',) int64; default every feature). A gated SAE's is its magnitude path,
        ``W_enc · exp(r_mag)`` and ``b_mag``."""
        if self.architecture == "gated":
            weight, bias = self.W_enc * self.r_mag.exp(), self.b_mag
        else:
            weight, bias = self.W_enc, self.b_enc
        if features is None:
            return weight, bias
        return weight.index_select(1, features), bias.index_select(0, features)

    def _denormalized(self, y: Tensor, x: Tensor | None) -> Tensor:
        """norm_out of a (..., E) reconstruction, with the statistics of the input ``x``."""
        if self.normalize_activations not in ("layer_norm", "constant_norm_rescale"):
            return y
        if x is None:
            raise ValueError(
                f"decode of an SAE with normalize_activations={self.normalize_activations!r} "
                "needs input=, the activations the features were encoded from (their statistics "
                "undo the normalisation), got none"
            )
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            return y * (x - mu).std(dim=-1, keepdim=True) + mu
        return y / (self.d_in**0.5 / x.norm(dim=-1, keepdim=True))

    def _activation(self, hidden_pre: Tensor, sae_in: Tensor) -> Tensor:
        """The features from the pre-activations (..., F)."""
        arch = self.architecture
        if arch.startswith("jumprelu"):
            return hidden_pre.relu() * (hidden_pre > self.threshold).to(hidden_pre.dtype)
        if arch in ("topk", "abstopk"):
            if self.config.rescale_acts_by_decoder_norm:
                hidden_pre = hidden_pre * self.W_dec.norm(dim=-1)
            ranked = hidden_pre.abs() if arch == "abstopk" else hidden_pre
            assert self.k is not None  # SAEConfig.check: a top-k SAE has its k
            top = torch.topk(ranked, k=self.k, dim=-1, sorted=False).indices  # (..., k)
            kept = hidden_pre.gather(-1, top)
            return torch.zeros_like(hidden_pre).scatter_(
                -1, top, kept if arch == "abstopk" else kept.relu()
            )
        if arch == "gated":
            active = (sae_in @ self.W_enc + self.b_gate > 0).to(hidden_pre.dtype)
            return active * hidden_pre.relu()
        return hidden_pre.relu()

    def encode(self, x: Tensor) -> Tensor:
        """The features of activations ``x``.

        Args:
            x: ``(..., E)``; a ``hook_z`` SAE's ``(..., H, D)`` with ``H·D = E``.

        Returns:
            ``(..., F)`` in the SAE's dtype.
        """
        flat = self._flat_input("x", x)
        sae_in = self.normalized(flat)[0]
        if self.apply_b_dec_to_input:
            sae_in = sae_in - self.b_dec
        weight, bias = self.encoder()
        hidden_pre = sae_in @ weight + bias  # (..., E) @ (E, F) -> (..., F)
        return self._activation(hidden_pre, sae_in)

    def decode(self, features: Tensor, *, input: Tensor | None = None) -> Tensor:
        """The reconstruction of ``features`` (a transcoder's output, without its skip).

        Args:
            features: ``(..., F)``.
            input: the activations ``features`` were encoded from, needed where the SAE
                normalises its input (``layer_norm``, ``constant_norm_rescale``: their
                statistics undo it) and by a ``hook_z`` SAE (its head width ``D``); else unused.

        Returns:
            ``(..., O)``; a ``hook_z`` SAE's ``(..., H, D)``.
        """
        check_tensor("features", features, floating=True)
        if features.dim() == 0 or features.shape[-1] != self.d_sae:
            raise ValueError(
                f"features must have shape (..., {self.d_sae}) (d_sae), got {describe(features)}"
            )
        features = features.to(self.dtype)
        if self.config.rescale_acts_by_decoder_norm:
            features = features / self.W_dec.norm(dim=-1)
        out = features @ self.W_dec + self.b_dec  # (..., F) @ (F, O) -> (..., O)
        if self.config.is_transcoder:
            return out
        flat = self._flat_input("input", input) if input is not None else None
        out = self._denormalized(out, flat)
        if self.reshape_activations != "hook_z":
            return out
        if input is None:
            raise ValueError(
                "decode of a hook_z SAE needs input=, the (..., H, D) activations the features "
                "were encoded from (their head width D), got none"
            )
        return out.unflatten(-1, (input.shape[-2], input.shape[-1]))  # (..., H, D)

    def forward(self, x: Tensor) -> Tensor:
        """``decode(encode(x))``, plus ``x @ W_skip.T`` for a skip transcoder: (..., O)."""
        out = self.decode(self.encode(x), input=x)
        if self.architecture.endswith("skip_transcoder"):
            out = out + self._flat_input("x", x) @ self.W_skip.T  # (..., E) @ (E, O)
        return out
