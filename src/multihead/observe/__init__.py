"""Observe and steer attention through MultiHeadAttention's one observer channel.

``capture`` records chosen layers, heads and query rows; ``head_statistics`` summarises heads
(``corpus_statistics`` over many texts; ``head_distances`` maps heads by how alike they attend);
``intervene`` ablates, scales or patches heads, ``record_heads`` records their outputs and
``head_importance`` scores them; ``patch_heads`` finds the heads that carry what differs between
two inputs. Everything here is an observer
(:meth:`multihead.MultiHeadAttention.register_observer`).
"""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "capture": "multihead.observe.recorder",
    "Recorder": "multihead.observe.recorder",
    "CapturedAttention": "multihead.observe.recorder",
    "head_statistics": "multihead.observe.statistics",
    "HeadStatistics": "multihead.observe.head_summary",
    "METRICS": "multihead.observe.statistics",
    "corpus_statistics": "multihead.observe.corpus",
    "head_distances": "multihead.observe.head_distance",
    "HeadMap": "multihead.observe.head_distance",
    "attention_modules": "multihead.observe.rows",
    "intervene": "multihead.observe.steering",
    "record_heads": "multihead.observe.steering",
    "HeadRecording": "multihead.observe.steering",
    "head_importance": "multihead.observe.importance",
    "patch_heads": "multihead.observe.patching",
    "attribution_patching": "multihead.observe.attribution",
    "logit_attribution": "multihead.observe.logit_attribution",
    "LogitAttribution": "multihead.observe.logit_attribution",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
