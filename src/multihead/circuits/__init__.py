"""Cause, not only see: steer heads and find the ones a behaviour runs through.

Everything here acts through the one observer channel
(:meth:`multihead.MultiHeadAttention.register_observer`, its q/k/v editors, and the sites of
:mod:`multihead.hf`): ``intervene`` ablates, scales or patches heads and ``record_heads``
records their outputs (``steering.py``); ``head_importance`` scores every head
(``importance.py``, reusing unchanged blocks' outputs: ``prefix_reuse.py``); ``patch_heads``
(activation patching, ``patching.py``, on the stacked forwards of ``stacked_runs.py`` and the
clean/corrupt inputs of ``input_pair.py``), ``attribution_patching`` (``attribution.py``),
``path_patching`` (``paths.py``) and ``logit_attribution`` (``direct_logit_attribution.py``)
find the heads that carry what differs between two inputs. Seeing heads (capture, statistics)
is :mod:`multihead.observe`, one floor below.
"""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "intervene": "multihead.circuits.steering",
    "record_heads": "multihead.circuits.steering",
    "HeadRecording": "multihead.circuits.steering",
    "head_importance": "multihead.circuits.importance",
    "patch_heads": "multihead.circuits.patching.patch_heads",
    "patch": "multihead.circuits.patching.patch",
    "PatchResult": "multihead.circuits.patching.patch_result",
    "attribution_patching": "multihead.circuits.patching.attribution_patching",
    "path_patching": "multihead.circuits.paths.path_patching",
    "edge_attribution": "multihead.circuits.edges.edge_attribution",
    "EdgeScores": "multihead.circuits.edges.edge_scores",
    "Circuit": "multihead.circuits.edges.edge_scores",
    "faithfulness": "multihead.circuits.edges.faithfulness",
    "faithfulness_curve": "multihead.circuits.edges.faithfulness_curve",
    "FaithfulnessCurve": "multihead.circuits.edges.faithfulness_curve",
    "logit_attribution": "multihead.circuits.decompose.logit_attribution",
    "LogitAttribution": "multihead.circuits.decompose.logit_attribution",
    "logit_lens": "multihead.circuits.decompose.logit_lens",
    "LogitLens": "multihead.circuits.decompose.logit_lens",
    "qk_attribution": "multihead.circuits.decompose.qk_attribution",
    "QKAttribution": "multihead.circuits.decompose.qk_attribution",
    "cache": "multihead.circuits.runs.activation_cache",
    "ActivationCache": "multihead.circuits.runs.activation_cache",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
