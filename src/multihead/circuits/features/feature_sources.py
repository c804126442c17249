"""Where an SAE feature's pre-activation comes from, split exactly by (head, source token):
:func:`feature_sources` -> :class:`FeatureSources` (SAEDashboard's direct feature attribution).

A head's output at a destination row is a sum over sources, ``z_h[dest] = Σ_src A_h[dest, src]
· v_{kv(h)}[src]`` (grouped-query heads read their key/value head ``kv(h) = h // (H / Hk)``).
With the SAE's input normalisation frozen at the row it is affine in z, so the feature's
pre-activation splits::

    pre_f[dest] = Σ_h Σ_src A_h[dest, src] · (v_{kv(h)}[src] · W'_h[:, f]) + constant_f[dest]

``W'_h`` the head's Dv rows of the SAE's encoder as the row sees it:

- a ``z`` SAE (``hook_z``): ``W_enc``'s rows of head h; ``layer_norm`` centres each column
  (x - mean x = x C) and divides by the row's σ + eps, ``constant_norm_rescale`` multiplies by
  the row's √E / ‖x‖ (each a number of the row, frozen there);
- an ``attn_out`` SAE: the same column read back through the block's post-attention norm
  frozen at the row (Gemma-2/3's ``post_attention_layernorm``:
  :class:`~multihead.circuits.runs.frozen_norm.FrozenNorm`) and the head's rows of the output
  projection (:func:`~multihead.circuits.runs.head_writes.projection_rows`).

The constant holds what no (head, source) owns: ``b_enc - b_dec · W_enc`` (with
``apply_b_dec_to_input``), the output projection's bias and the norm's β read the same way,
and the normalisations' centring of those; it is computed as ``pre - Σ``, and ``pre`` from the
activation itself by the SAE's formula (``x' @ W_enc + b_enc``; a gated SAE's magnitude path,
``x' @ (W_enc · exp(r_mag)) + b_mag``; a top-k SAE's before its ranking or rescaling).

Memory: one forward; the chosen rows' attention weights are recomputed at the layer
(:func:`multihead.observe.rows.observe_rows`: O(B · H · R · S), never T × T) and the call's
values kept by reference; the split is (B, R, H, S, F').

Shapes: B batch, T tokens, S source tokens (= T), R chosen rows, H query heads, Hk key/value
heads, Dv a head's width, E the width the SAE reads, F' the chosen features.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from multihead._checks import check_index, describe, is_int
from multihead.circuits.features.sae_features import sae_input, sae_site
from multihead.circuits.runs.head_writes import projection_rows
from multihead.circuits.runs.input_pair import Tokenizes, model_inputs, run_model
from multihead.circuits.runs.site_recorder import SiteRecorder
from multihead.circuits.runs.wiring import WiringRun
from multihead.heads import head_label
from multihead.mapping import model_heads, model_map
from multihead.observe.rows import observe_rows
from multihead.observers import AttentionCall, registered
from multihead.sae.sae import SAE
from multihead.viz.plots import effects_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["FeatureSources", "feature_sources"]

# the sites an SAE may read for its features to split by head
SPLIT_SITES = ("z", "attn_out")


@dataclass(frozen=True)
class FeatureSources:
    """Each chosen feature's pre-activation at each chosen row, split by (head, source).

    Attributes:
        values: (B, R, H, S, F') the part of head h reading source s (0 where the row does not
            see s: a later token, padding); H is one where the SAE reads one head.
        pre_activation: (B, R, F') the feature's pre-activation at the row.
        constant: (B, R, F') what no (head, source) owns: ``pre_activation - values.sum((2, 3))``.
        rows: the R destination rows (query positions), in [0, T).
        features: the F' features.
        heads: the H heads' labels (``"L5H3"``).
        tokens: per example, the T source tokens as written, for a
            :class:`multihead.TextModel` given texts; else None.
    """

    values: Tensor
    pre_activation: Tensor
    constant: Tensor
    rows: tuple[int, ...]
    features: tuple[int, ...]
    heads: tuple[str, ...]
    tokens: tuple[tuple[str, ...], ...] | None = None

    def total(self) -> Tensor:
        """(B, R, F'): the parts and the constant summed, the pre-activation again."""
        return self.values.sum((2, 3)) + self.constant

    def top(self, k: int, *, example: int = 0) -> list[tuple[int, str, int, int, float]]:
        """The ``k`` parts of ``example`` largest in size, largest first, as (row, head label,
        source position, feature, value)."""
        b, r, h, s, f = self.values.shape
        example = check_index("example", example, b, "examples")
        if not is_int(k) or k < 1:
            raise ValueError(f"k must be a positive int, got {describe(k)}")
        flat = self.values[example].flatten()
        order = flat.abs().topk(min(int(k), flat.numel())).indices.tolist()
        out = []
        for i in order:
            ri, rest = divmod(i, h * s * f)
            hi, rest = divmod(rest, s * f)
            si, fi = divmod(rest, f)
            out.append((self.rows[ri], self.heads[hi], si, self.features[fi], float(flat[i])))
        return out

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per part (a table's rows): example, row, head, source, feature, value, and
        the source token where known."""
        table = []
        values = self.values.tolist()
        for b, per_row in enumerate(values):
            for ri, per_head in enumerate(per_row):
                for hi, per_source in enumerate(per_head):
                    for s, per_feature in enumerate(per_source):
                        for fi, value in enumerate(per_feature):
                            entry: dict[str, Any] = {
                                "example": b,
                                "row": self.rows[ri],
                                "head": self.heads[hi],
                                "source": s,
                                "feature": self.features[fi],
                                "value": value,
                                **({} if self.tokens is None else {"token": self.tokens[b][s]}),
                            }
                            table.append(entry)
        return table

    def plot(
        self, *, row: int | None = None, feature: int | None = None, example: int = 0
    ) -> Figure:
        """Heads × source tokens of one row and feature (default the first of each) as the
        effects heatmap (:func:`multihead.viz.plots.effects_figure`; the ``viz`` extra); the
        sources after the row are left out where it sees none of them (a causal model)."""
        ri = 0 if row is None else _position_of("row", row, self.rows, "rows")
        fi = 0 if feature is None else _position_of("feature", feature, self.features, "features")
        example = check_index("example", example, self.values.shape[0], "examples")
        cells = self.values[example, ri, :, :, fi].detach().float().cpu()  # (H, S)
        # the sources after the row, where it sees none (a causal model's), are left out
        row_at = self.rows[ri]
        if not cells[:, row_at + 1 :].any():
            cells = cells[:, : row_at + 1]
        s = cells.shape[1]
        columns = (
            list(self.tokens[example][:s])
            if self.tokens is not None
            else [str(i) for i in range(s)]
        )
        return effects_figure(
            cells,
            list(self.heads),
            columns,
            title=(
                f"feature {self.features[fi]} at row {self.rows[ri]}: its pre-activation by "
                f"head and source (constant {float(self.constant[example, ri, fi]):.3g})"
            ),
            label="part of the pre-activation",
            xlabel="source token",
            ylabel="head",
        )


def _position_of(name: str, value: Any, chosen: tuple[int, ...], what: str) -> int:
    if not is_int(value) or value not in chosen:
        raise ValueError(f"{name} must be one of the {what} split, {list(chosen)}, got {value!r}")
    return chosen.index(value)


def _features(feature: Any, count: int) -> list[int]:
    if is_int(feature):
        return [check_index("feature", feature, count, "features (d_sae)")]
    if isinstance(feature, (str, bytes)) or not isinstance(feature, Sequence):
        raise TypeError(f"feature must be an int or a sequence of ints, got {describe(feature)}")
    if not feature:
        raise ValueError("feature must name at least one feature, got none")
    return [check_index("feature", f, count, "features (d_sae)") for f in feature]


def _length(inputs: Tensor | dict[str, Any]) -> int:
    """T of checked inputs: the ids' second dimension (a dict's ``input_ids``, or its first
    (B, T, ...) tensor)."""
    if isinstance(inputs, Tensor):
        first: Any = inputs
    else:
        first = inputs.get("input_ids")
        if not isinstance(first, Tensor):
            first = next(v for v in inputs.values() if isinstance(v, Tensor) and v.dim() >= 2)
    if first.dim() < 2:
        raise ValueError(f"inputs must be (B, T) token ids, got {describe(first)}")
    return int(first.shape[1])


def _rows(rows: Any, t: int) -> list[int]:
    if is_int(rows):
        rows = [rows]
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be an int or a sequence of ints, got {describe(rows)}")
    if not rows:
        raise ValueError(f"rows must name at least one destination row of the {t} positions")
    return [check_index("rows", r, t, "positions") for r in rows]


def _frozen_input_norm(sae: SAE, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The SAE's input normalisation of the rows ``x`` (B, R, E) frozen there: (the normalised
    input (B, R, E), the encoder's columns as a part of x reads them (E, F'), the row's factor
    (B, R)), so that ``normalised @ weight == x @ columns · factor`` (+ a constant)."""
    normed, factor, centres = sae.normalized(x)
    return normed, weight - weight.mean(0, keepdim=True) if centres else weight, factor


@torch.no_grad()
def feature_sources(
    model: nn.Module,
    inputs: Any,
    sae: SAE,
    feature: int | Sequence[int],
    *,
    rows: int | Sequence[int],
) -> FeatureSources:
    """The pre-activation of SAE feature(s) ``feature`` at destination ``rows``, split exactly
    by (head, source token) (see the module docstring for the formula), from one forward.

    Args:
        model: multihead's models or a transformers model (through :mod:`multihead.hf`).
        inputs: token ids (B, T), a dict of the model's keyword arguments (an
            ``attention_mask``'s padding gets no part), or for a :class:`multihead.TextModel`
            a text or texts (then the result holds the tokens).
        sae: a :class:`multihead.sae.SAE` reading ``z`` (``blocks.L.attn.hook_z``; a
            ``hook_head_index`` SAE reads that one head) or ``attn_out`` of a layer.
        feature: a feature (int) or features (ints) in [0, d_sae); negative from the end.
        rows: the destination rows (query positions): an int or ints, negative from the end.

    Returns:
        A :class:`FeatureSources`: ``values`` (B, R, H, S, F'), ``pre_activation`` and
        ``constant`` (B, R, F'), with ``values.sum((2, 3)) + constant == pre_activation``.

    Raises:
        ValueError: an SAE of another site (the residual stream's sum of every head and
            feed-forward network has no per-head split), one whose hook has no multihead site,
            a width other than ``sae.d_in``, ``feature`` or ``rows`` out of range or empty, an
            attention output that goes through anything but one norm of its block, a layer
            split over ranks (tensor parallelism).
        TypeError: ``sae``, ``feature`` or ``rows`` of another kind.

    Example:
        >>> split = feature_sources(model, ids, sae, 123, rows=[-1])
        >>> split.top(5)  # [(row, "L5H3", source, 123, value), ...]
    """
    site, layer = key = sae_site(model, sae, None, "feature_sources")
    if site not in SPLIT_SITES:
        why = (
            "the residual stream is the sum of every earlier head and feed-forward network, not "
            "of this layer's heads: it cannot be split by head"
            if site.startswith("resid")
            else f"only an SAE of z (hook_z) or attn_out is split by head and source ({site} is "
            "not what this layer's heads write)"
        )
        raise ValueError(f"feature_sources: the SAE reads {sae.hook_name!r} ({site}): {why}")
    features = _features(feature, sae.d_sae)
    tokens: tuple[tuple[str, ...], ...] | None = None
    if isinstance(model, Tokenizes) and (
        isinstance(inputs, str)
        or (
            isinstance(inputs, (list, tuple)) and inputs and all(isinstance(v, str) for v in inputs)
        )
    ):
        batch = model.tokenize(inputs)
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        width = batch.input_ids.shape[1]
        tokens = tuple(tuple(words) + ("",) * (width - len(words)) for words in batch.tokens)
    checked = model_inputs(model, inputs)
    chosen = _rows(rows, _length(checked))
    found = model_heads(model)[layer]
    if found.shard is not None:
        raise ValueError(
            f"feature_sources: layer {layer}'s heads are split over ranks (tensor parallelism)"
        )
    h, dv = found.num_heads, found.head_dim
    if found.dropout > 0 and any(m.training for m in model.modules()):
        raise ValueError(
            f"feature_sources needs the model in eval mode (model.eval()): layer {layer}'s "
            f"attention dropout ({found.dropout}) would make z differ from Σ_src A v"
        )
    one_head = sae.hook_head_index if site == "z" else None
    if one_head is not None:
        one_head = check_index("feature_sources: sae.hook_head_index", one_head, h, "heads")
    if site == "z":  # the width the SAE reads against the heads', before the run
        sae_input(sae, key, torch.empty(0, 0, h, dv), "feature_sources")

    # one forward: the rows' z (the cache's recorder), their weights and the call's values,
    # and for attn_out the output projection and the post-attention norm (the wiring's run)
    recorder = SiteRecorder(model, checked, names=[("z", layer)], positions=chosen)
    wiring_run = WiringRun(model_map(model), post_norms=True) if site == "attn_out" else None
    seen: list[tuple[Tensor, Tensor]] = []  # the layer's one call

    def consume(slot: int, chunk: Tensor, weights: Tensor, t: int, call: AttentionCall) -> None:
        seen.append((weights, call.v))  # (B, H, R, S), (B, Hk, S, Dv)

    with (
        registered(wiring_run.hooks() if wiring_run is not None else iter(())),
        recorder.recording(),
        observe_rows(
            model,
            layers=[layer],
            heads=None,
            rows=chosen,
            chunk_size=None,
            consume=consume,
            sink_weights="dropped",  # the keys' own shares: z = Σ_src A v, sinks hold no value
        ),
    ):
        run_model(model, checked)
    z = recorder.result()["z", layer]  # (B, R, H, Dv)
    if len(seen) != 1:
        raise ValueError(
            f"feature_sources: layer {layer}'s attention ran {len(seen)} times in one forward; "
            "its split is of one call"
        )
    weights, v = seen[0]
    compute = torch.promote_types(torch.promote_types(z.dtype, sae.dtype), torch.float32)
    rounding = torch.finfo(z.dtype).eps
    ids = torch.tensor(features, device=sae.device)
    # the SAE's tensors where the run's are (a CPU SAE beside a GPU model)
    weight, bias = (t.to(z.device, compute) for t in sae.encoder(ids))  # (E, F'), (F',)
    shift = sae.b_dec.to(z.device, compute) if sae.apply_b_dec_to_input else None
    const = bias - shift @ weight if shift is not None else bias  # (F',): what no input moves

    if wiring_run is None:  # z: the SAE reads the heads' outputs (or one head's)
        x = sae_input(sae, key, z, "feature_sources").to(compute)  # (B, R, E)
        normalised, columns, factor = _frozen_input_norm(sae, x, weight)
        per_head = columns.view(1 if one_head is not None else h, dv, -1)  # (H, Dv, F')
        constant = const.expand(*x.shape[:2], -1)  # (B, R, F')
    else:  # attn_out: through the output projection and the post-attention norm, if any
        projection = wiring_run.wiring.layers[layer].projection
        if projection is None:
            raise ValueError(
                f"feature_sources: no module inside {found.name} is fed its heads' outputs (the "
                f"output projection is outside the attention module the map knows)"
            )
        flat = z.flatten(2)  # (B, R, H·Dv)
        post = wiring_run.post_norm(layer, "feature_sources", rounding, compute)
        written = wiring_run.written(layer)  # (B, T, E) the post-norm's output, or None
        at = torch.tensor(chosen, device=flat.device)
        x = projection(flat) if written is None else written.index_select(1, at)
        x = sae_input(sae, key, x, "feature_sources").to(compute)  # (B, R, E)
        normalised, columns, factor = _frozen_input_norm(sae, x, weight)
        # the projection's bias (what it gives the zero input) and the norm's β own no head
        written_bias = projection(torch.zeros_like(flat[:1, :1]))[0, 0].to(compute)  # (E,)
        constant = const + torch.zeros_like(factor)[..., None]  # (B, R, F')
        if post is not None:  # a frozen norm reads a direction u as γ ⊙ u / σ (less its mean)
            if post.beta is not None:
                constant = constant + factor[..., None] * (post.beta.to(compute) @ columns)
            columns = post.gamma[:, None].to(compute) * columns
            if post.centred:
                columns = columns - columns.mean(0, keepdim=True)
            factor = factor / post.sigma.index_select(1, at.to(post.sigma.device))[..., 0]
        constant = constant + factor[..., None] * (written_bias @ columns)
        rows_of = projection_rows(projection, flat).to(compute).view(h, dv, -1)  # (H, Dv, E)
        per_head = rows_of @ columns  # (H, Dv, E) @ (E, F') -> (H, Dv, F')

    pre = (normalised - (shift if shift is not None else 0.0)) @ weight + bias  # (B, R, F')
    # query head -> the key/value head its values are (a q/k/v editor may hand them per query
    # head: v.shape[1] == h)
    kv = torch.arange(h, device=v.device) // (h // v.shape[1])
    if one_head is not None:
        kv, weights = kv[one_head : one_head + 1], weights[:, one_head : one_head + 1]
    values_in = v.index_select(1, kv).to(compute)  # (B, H, S, Dv)
    read = torch.einsum("bhsd,hdf->bhsf", values_in, per_head.to(values_in.device))
    parts = torch.einsum("bhrs,bhsf->brhsf", weights.to(compute), read)  # (B, R, H, S, F')
    parts.mul_(factor.to(parts.device)[:, :, None, None, None])
    pre, constant = pre.to(parts.device), constant.to(parts.device)
    # the split is checked, not assumed: what the parts and the constant miss is an error
    # (dropout, an editor, a key/value cache: z is then not Σ_src A v of this call)
    missed = (pre - parts.sum((2, 3)) - constant).abs()
    scale = parts.abs().sum((2, 3)) + constant.abs() + pre.abs()
    # relative: a few of the run's rounding steps, and 1e-5 for a norm that computes in float32
    # inside a float64 model (transformers' RMSNorms); what the check catches is larger
    tolerance = 1e-5 + 16 * rounding
    if bool((missed > tolerance * scale + torch.finfo(compute).tiny).any()):
        worst = float((missed / scale.clamp_min(torch.finfo(compute).tiny)).max())
        raise ValueError(
            f"feature_sources: the split of layer {layer}'s feature(s) misses {worst:.2g} of "
            f"their size (the heads' outputs are not Σ_src A v of this call: an editor, "
            f"dropout or cached keys changed them)"
        )
    labels = [head_label(layer, head) for head in (range(h) if one_head is None else [one_head])]
    return FeatureSources(
        values=parts,
        pre_activation=pre,
        constant=constant,
        rows=tuple(chosen),
        features=tuple(features),
        heads=tuple(labels),
        tokens=tokens,
    )
