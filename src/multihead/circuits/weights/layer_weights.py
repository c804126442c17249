"""Every head of one attention layer as linear maps: its queries, keys and values from the
attention's input, its write into the stream from its output — read, not named.

At fixed positions the map from an attention module's input x (B, T, E) to one head's queries
(as its kernel is given them: after the projection, a reshape, and rotary positions, a rotation
per position) is affine, ``q = x W_Q + b_Q``; so are its keys and values. :meth:`LayerWeights.
read_all` reads W and b off the module itself: one recording run of the model on two tokens
keeps what each attention module was given besides its input (its positions, its mask), then
each module is run again on probes in place of its input — the zero vector (the bias), the E unit
vectors (W's rows) and one random vector (a check: the map must be affine, else the layer has,
say, a per-head norm on its queries, and its QK circuit does not exist) — and the observer
channel hands back what the kernel was given. Nothing names a family's projections, fused
layouts or rotary tables; a grouped-query layer's keys and values come per key/value head, as
its kernel reads them. The output projection is read the same way, on the unit vectors of the
heads' outputs (:func:`~multihead.circuits.runs.head_writes.projection_rows`).

Positions: the recording run puts its two tokens at positions 0 and p (the map's positions
argument; else a run of p + 1 tokens). A query may be read at one and the keys at the other;
``rotary`` says whether queries or keys differ between the two (rotary positions turn them).

Shapes: E the attention's input width, H query heads, Hk key/value heads, D query/key width,
Dv value width.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from multihead.circuits.runs.attention_replay import replay_attention
from multihead.circuits.runs.head_writes import projection_rows
from multihead.circuits.runs.wiring import Wiring, WiringRun
from multihead.devices import placement
from multihead.map_types import ModelMap
from multihead.observers import AttentionCall, Removable, registered

__all__ = ["LayerWeights"]

_TOKENS = 16_384  # probe tokens per replay of an attention module


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One layer's heads as affine maps of the attention's input x (1, E) (module docstring).

    Attributes:
        q: (H, E, D) and q_bias (H, D): head h's query at the query position is
            ``x @ q[h] + q_bias[h]``.
        k, k_bias: (Hk, E, D), (Hk, D): key/value head g's key at the key position.
        v, v_bias: (Hk, E, Dv), (Hk, Dv): its value.
        o: (H, Dv, E): head h's output z (Dv,) is written as ``z @ o[h]`` (its rows of the
            output projection), or None where no output projection was found.
        o_bias: (E,) the output projection's bias (zeros without one), or None with ``o``.
        scale: the factor on the scores q · k.
        rotary: whether the queries or keys read at the two recorded positions differ.
        not_affine: which of ``"q"``, ``"k"``, ``"v"`` are not affine in the input (a norm
            on them): their maps above are meaningless.
    """

    q: Tensor
    q_bias: Tensor
    k: Tensor
    k_bias: Tensor
    v: Tensor
    v_bias: Tensor
    o: Tensor | None
    o_bias: Tensor | None
    scale: float
    rotary: bool
    not_affine: tuple[str, ...]

    @property
    def group(self) -> int:
        """G, the query heads that read one key/value head (query head h reads h // G)."""
        return self.q.shape[0] // self.k.shape[0]

    @classmethod
    def read_all(
        cls,
        model: nn.Module,
        mapped: ModelMap,
        *,
        query_position: int = 0,
        key_position: int = 0,
        dtype: torch.dtype,
        caller: str,
    ) -> tuple[tuple[LayerWeights, ...], Wiring]:
        """Every layer's weights, queries read at ``query_position`` and keys and values at
        ``key_position`` (one of them 0), and the model's wiring (found in the recording run
        when no earlier run has). Results in ``dtype``.

        Raises:
            ValueError: a layer whose attention is not given a (B, T, E) tensor, a layer split
                over ranks (tensor parallelism), or a model that does not run on two tokens.
        """
        other = max(query_position, key_position, 1)
        if min(query_position, key_position) != 0:
            raise ValueError(f"{caller}: one of the two positions must be 0")
        for site in mapped.sites:
            if site.shard is not None:
                raise ValueError(
                    f"{caller} reads every head's weights on one rank; layer {site.layer} "
                    f"({site.name}) is split over ranks by tensor parallelism"
                )
        recorded, wiring = _record(model, mapped, other)
        found = []
        for site, (args, kwargs, given) in zip(mapped.sites, recorded, strict=True):
            if given is None:
                raise ValueError(
                    f"{caller}: layer {site.layer} ({site.name}) did not run on the model's "
                    f"input of two tokens"
                )
            if given.dim() != 3:
                raise ValueError(
                    f"{caller}: layer {site.layer} ({site.name}) is given a tensor of shape "
                    f"{tuple(given.shape)}, not (B, T, E)"
                )
            end = given.shape[1] - 1
            at = (end if query_position else 0, end if key_position else 0)
            maps = _probed(site.module, site.attention, args, kwargs, given, at)
            wired = wiring.layers[site.layer]
            o, o_bias = _output_rows(wired.projection, site.num_heads, site.head_dim, given)
            q, q_bias, k, k_bias, v, v_bias = (t.to(dtype) for t in maps.tensors)
            found.append(
                cls(
                    q=q,
                    q_bias=q_bias,
                    k=k,
                    k_bias=k_bias,
                    v=v,
                    v_bias=v_bias,
                    o=o.to(dtype) if o is not None else None,
                    o_bias=o_bias.to(dtype) if o_bias is not None else None,
                    scale=maps.scale,
                    rotary=maps.rotary,
                    not_affine=maps.not_affine,
                )  # fmt: skip
            )
        return tuple(found), wiring


@dataclass(frozen=True)
class _Probed:
    tensors: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # q, bq, k, bk, v, bv
    scale: float
    rotary: bool
    not_affine: tuple[str, ...]


def _record(
    model: nn.Module, mapped: ModelMap, position: int
) -> tuple[list[tuple[tuple[Any, ...], dict[str, Any], Tensor | None]], Wiring]:
    """Per layer, the (args, kwargs) its attention module was given in a run of the model on
    token 0 at positions 0 and ``position``, and its input (None when it did not run)."""
    known = mapped.positions_argument is not None
    length = 2 if known else position + 1
    device = placement(model)[0]
    ids = torch.zeros(1, length, dtype=torch.long, device=device)
    options = dict(mapped.call_options)
    if known:
        assert mapped.positions_argument is not None
        options[mapped.positions_argument] = torch.tensor([[0, position]], device=device)
    fed: list[tuple[tuple[Any, ...], dict[str, Any], Tensor | None]] = [
        ((), {}, None) for _ in mapped.sites
    ]
    wiring_run = WiringRun(mapped)

    def recorder(layer: int) -> Any:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if fed[layer][2] is None:
                given = mapped.stream_of(args, kwargs)
                fed[layer] = (args, kwargs, given if isinstance(given, Tensor) else None)

        return hook

    def hooks() -> Iterator[Removable]:
        yield from wiring_run.hooks()
        for site in mapped.sites:
            yield site.module.register_forward_pre_hook(recorder(site.layer), with_kwargs=True)

    with registered(hooks()), torch.no_grad():
        model(ids, **options)
    return fed, wiring_run.wiring


def _probed(
    module: nn.Module,
    attention: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    given: Tensor,
    at: tuple[int, int],
) -> _Probed:
    """The affine maps of one attention module's q, k, v at the recorded positions ``at``
    (the queries' index and the keys'), from the module run on probes in place of ``given``
    (its other arguments as recorded: they broadcast over the probes' batch)."""
    length, width = given.shape[1], given.shape[2]
    probes = torch.zeros(width + 2, width, dtype=given.dtype, device=given.device)
    probes[1 : width + 1] = torch.eye(width, dtype=given.dtype, device=given.device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    probes[-1] = torch.randn(width, generator=generator).to(probes)
    scale: list[float] = []
    keep = torch.tensor(sorted({0, length - 1}), device=given.device)

    def read(call: AttentionCall) -> tuple[Tensor, ...]:
        scale.append(float(call.scale))
        return tuple(t.index_select(2, keep) for t in (call.q, call.k, call.v))

    rows = max(1, _TOKENS // length)
    q, k, v = replay_attention(
        module, attention, (args, kwargs), given, probes[:, None], rows, read
    )
    index = {p: i for i, p in enumerate(sorted({0, length - 1}))}
    qi, ki = (index[p] for p in at)
    tensors: list[Tensor] = []
    not_affine = []
    for name, values, i in (("q", q, qi), ("k", k, ki), ("v", v, ki)):
        w, b, affine = _affine(values[:, :, i], probes[-1])
        tensors += [w, b]
        if not affine:
            not_affine.append(name)
    rotary = any(not _close(t[:, :, 0], t[:, :, -1]) for t in (q, k))
    q_w, q_b, k_w, k_b, v_w, v_b = tensors
    return _Probed((q_w, q_b, k_w, k_b, v_w, v_b), scale[0], rotary, tuple(not_affine))


def _affine(values: Tensor, check: Tensor) -> tuple[Tensor, Tensor, bool]:
    """(W (heads, E, D), b (heads, D), affine) from one tensor's values (E + 2, heads, D) on
    the probes (zero, the E unit vectors, ``check``): whether the value on ``check`` is
    ``check @ W + b``."""
    compute = torch.promote_types(values.dtype, torch.float32)
    values = values.to(compute)
    bias = values[0]
    weight = (values[1:-1] - bias).permute(1, 0, 2)  # (heads, E, D)
    predicted = torch.einsum("e,hed->hd", check.to(compute), weight) + bias
    return weight, bias, _close(predicted, values[-1], rounding=torch.finfo(check.dtype).eps)


def _close(a: Tensor, b: Tensor, rounding: float = 0.0) -> bool:
    """Equal up to 1e-3 of the larger's size (a few rounding steps of a half-precision model)."""
    tolerance = max(1e-3, 8 * rounding) * float(torch.maximum(a.abs().max(), b.abs().max()))
    return float((a - b).abs().max()) <= tolerance


def _output_rows(
    projection: nn.Module | None, heads: int, dv: int, like: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """(o (H, Dv, E), bias (E,)) of the output projection, or (None, None) without one."""
    if projection is None:
        return None, None
    flat = torch.zeros(1, 1, heads * dv, dtype=like.dtype, device=like.device)
    with torch.no_grad():
        rows = projection_rows(projection, flat)  # (H·Dv, E)
        bias = projection(flat)[0, 0]
    return rows.view(heads, dv, -1), bias
