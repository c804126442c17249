"""One self-contained interactive HTML page of attention weights.

The page (template: ``page.html`` beside this module) carries its script, style and data inline and
never touches the network, so it works offline, from an e-mail attachment, or inside a notebook.
It shows the whole model:

- a layer and a head selector; hovering a token shades every token by the attention the hovered
  one pays it (drawn on a <canvas>, so 512 tokens are as quick as 16); a heatmap of the selected
  head (rows: queries, each relative to its own peak; columns: keys);
- the model view: every layer × head as a small map (rows: layers, columns: heads; each T × T map
  max-pooled to the thumbnail's pixels), click one to open it, as BertViz's model view;
- the head view: queries left, keys right, lines from the hovered token to the tokens it attends
  to (opacity and width by weight; per head its strongest keys), several heads overlaid in
  distinct colours (shift-click thumbnails or tick heads; a legend names them);
- the head-statistics table with each head's role and, when given, importance (click a row to
  show that head, a column title to sort).

A causal model's maps are lower triangles (the upper one hatched, not drawn as zero) and its head
view draws lines only to earlier tokens. The page measures its own opening (script start to every
view drawn) in ``window.__multiheadReady = {ms, ...}``.

The weights travel compactly: each query row is scaled by its maximum and quantised to 8 bits
(the row maxima are kept as float32), then deflated and base64-encoded; the browser inflates them
with its built-in ``DecompressionStream``. 6 layers × 12 heads × 512² weights (19 million numbers)
become a few megabytes instead of ~300 MB of JSON floats.
"""

from __future__ import annotations

import base64
import html
import json
import zlib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from multihead.memory_budget import format_bytes
from multihead.observe.head_summary import HeadStatistics

__all__ = ["encode_weights", "render_page", "write_page", "check_page_size", "PAGE_WEIGHTS_LIMIT"]

# The most weights a page carries (one byte each once inflated): the browser inflates them and
# draws from them, and pages much past a few hundred MB open slowly or not at all.
PAGE_WEIGHTS_LIMIT = 256 * 2**20


def check_page_size(num_layers: int, num_heads: int, num_tokens: int) -> None:
    """Refuse a page of L·H·T² weights over :data:`PAGE_WEIGHTS_LIMIT`, before any is encoded.

    Raises:
        ValueError: the page would carry more; the message says how much and what to leave out.
    """
    size = num_layers * num_heads * num_tokens**2
    if size > PAGE_WEIGHTS_LIMIT:
        raise ValueError(
            f"the page would carry {format_bytes(size)} of weights ({num_layers} layers × "
            f"{num_heads} heads × {num_tokens}² tokens, one byte each), over its limit of "
            f"{format_bytes(PAGE_WEIGHTS_LIMIT)} (more than a browser opens well): show fewer "
            f"layers or heads, a shorter text, or no page (html)"
        )


def encode_weights(weights: Tensor) -> tuple[bytes, bytes]:
    """Quantise weights row by row to 8 bits.

    Each query row r is stored as round(255 · w[r] / max(w[r])), so every row keeps 8 bits of
    precision relative to its own peak (a diffuse row is not flattened to zeros), and
    w ≈ q / 255 · max(w[r]).

    Args:
        weights: (L, H, T, S) attention weights.

    Returns:
        ``(q, scales)``: q is L·H·T·S bytes (uint8, C order); scales is L·H·T little-endian
        float32 row maxima.
    """
    if not isinstance(weights, Tensor) or weights.dim() != 4:
        got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a (L, H, T, S) tensor, got {got}")
    # One working copy, scaled in place: the weights may be most of the memory there is.
    w = weights.detach().to("cpu", torch.float32).clamp(min=0.0)  # (L, H, T, S)
    scales = w.amax(dim=-1)  # (L, H, T)
    w.div_(scales.clamp(min=1e-30).unsqueeze(-1)).mul_(255.0).round_()
    q = w.to(torch.uint8)
    del w
    return q.numpy().tobytes(), scales.numpy().astype("<f4").tobytes()


def _check_causal(weights: Tensor, tol: float = 1e-6) -> None:
    """Refuse ``causal=True`` for weights that put mass above the diagonal (key after query)."""
    # Layer by layer: a copy of all the weights at once may not fit beside them.
    for layer, per_layer in enumerate(weights.detach()):
        above = per_layer.to(torch.float32).triu(diagonal=1).abs()  # (H, T, T)
        worst = float(above.max()) if above.numel() else 0.0
        if worst <= tol:
            continue
        head, i, j = (int(x) for x in torch.nonzero(above == worst)[0])
        raise ValueError(
            f"causal=True but weights put {worst:.3g} above the diagonal (layer position {layer}, "
            f"head {head}, query {i} on later key {j}): these are not a causal model's weights; "
            f"pass causal=False"
        )


def _template() -> str:
    return (resources.files("multihead.viz") / "page.html").read_text(encoding="utf-8")


def render_page(
    weights: Tensor,
    tokens: Sequence[str],
    *,
    special: Sequence[bool] | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    statistics: HeadStatistics | None = None,
    importance: Tensor | None = None,
    focus: int = 0,
    initial: tuple[int, int] = (0, 0),
    title: str = "Attention",
    subtitle: str = "",
    causal: bool = False,
    compress: bool = True,
    qk: Mapping[str, Any] | None = None,
) -> str:
    """The interactive page as one HTML string.

    Args:
        weights: (L, H, T, T) self-attention weights of one sequence.
        tokens: the T tokens.
        special: per token, whether it is a special token ([CLS], [SEP]); shaded grey.
        layers, heads: the layer and head numbers of the weights' L and H axes (labels).
        statistics: a :class:`~multihead.observe.statistics.HeadStatistics` for the table (its
            layers and heads need not match the weights'; rows of heads not shown still list).
        importance: (L', H') one score per head of ``statistics`` (e.g. how far zeroing the
            head moves the sentence embedding): an "importance" column in the table.
        focus: the token whose attention is shown first.
        initial: (layer position, head position) shown first, positions along L and H.
        title, subtitle: shown at the top.
        causal: the weights are a causal (decoder) model's: each query reads only itself and
            earlier tokens; maps are drawn as lower triangles and the head view draws lines only
            to earlier tokens.
        compress: deflate the weights (inflated by the browser's DecompressionStream; every
            current browser has it). Without it the page is ~4/3 of L·H·T² bytes.
        qk: a QK attribution to list beside the head view (plain values: ``head``, ``query``,
            ``key``, ``query_token``, ``key_token``, ``score``, ``weight``, ``pairs`` as
            ``[query-side label, key-side label, value]`` rows, ``rise`` as ``[label, value]``
            rows), or None for no such panel.

    Returns:
        A complete HTML document with no external reference.

    Raises:
        ValueError: a shape or label does not match the weights, ``causal=True`` with weights
            above the diagonal (more than 1e-6), or more weights than a page carries
            (:func:`check_page_size`).
    """
    if (
        not isinstance(weights, Tensor)
        or weights.dim() != 4
        or weights.shape[-1] != weights.shape[-2]
    ):
        got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a (L, H, T, T) self-attention tensor, got {got}")
    n_layers, n_heads, t, _ = weights.shape
    check_page_size(n_layers, n_heads, t)
    if causal:
        _check_causal(weights)
    if len(tokens) != t:
        raise ValueError(f"tokens must hold T={t} tokens, got {len(tokens)}")
    if special is not None and len(special) != t:
        raise ValueError(f"special must hold T={t} flags, got {len(special)}")
    layers = list(range(n_layers)) if layers is None else [int(x) for x in layers]
    heads = list(range(n_heads)) if heads is None else [int(x) for x in heads]
    if len(layers) != n_layers or len(heads) != n_heads:
        raise ValueError(
            f"layers and heads must label the weights' {n_layers} layers and {n_heads} heads, "
            f"got {len(layers)} and {len(heads)}"
        )
    if not 0 <= focus < t:
        raise ValueError(f"focus must be a token position in 0..{t - 1}, got {focus}")
    if not (0 <= initial[0] < n_layers and 0 <= initial[1] < n_heads):
        raise ValueError(
            f"initial must be (layer, head) positions within ({n_layers}, {n_heads}), got {initial}"
        )
    q, scales = encode_weights(weights)
    payload = zlib.compress(q, 6) if compress else q
    data: dict[str, Any] = {
        "title": title,
        "subtitle": subtitle,
        "tokens": list(tokens),
        "special": [bool(x) for x in special] if special is not None else [False] * t,
        "layers": layers,
        "heads": heads,
        "focus": int(focus),
        "causal": bool(causal),
        "initial": {"layer": int(initial[0]), "head": int(initial[1])},
        "encoding": "deflate" if compress else "raw",
        "weights": base64.b64encode(payload).decode("ascii"),
        "scales": base64.b64encode(scales).decode("ascii"),
        "stats": statistics.to_dict() if statistics is not None else None,
        "qk": dict(qk) if qk is not None else None,
    }
    if importance is not None:
        if statistics is None or tuple(importance.shape) != (
            len(statistics.layers),
            len(statistics.heads),
        ):
            raise ValueError(
                f"importance must score the statistics' (L', H') heads, got shape "
                f"{tuple(importance.shape)} and statistics "
                f"{None if statistics is None else (len(statistics.layers), len(statistics.heads))}"
            )
        data["stats"]["importance"] = [[round(float(x), 5) for x in row] for row in importance]
    # "<" escaped so that no token (say "</script>") can end the data block early.
    blob = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    head, tail = _template().split("__DATA__")
    return head.replace("__TITLE__", html.escape(title)) + blob + tail


def write_page(path: str | Path, weights: Tensor, tokens: Sequence[str], **kwargs: Any) -> Path:
    """Write :func:`render_page`'s page to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.write_text(render_page(weights, tokens, **kwargs), encoding="utf-8")
    return path
