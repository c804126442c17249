"""Cause, not only see: steer heads and find the ones a behaviour runs through.

Everything here acts through the one observer channel
(:meth:`multihead.MultiHeadAttention.register_observer`, its q/k/v editors, and the sites of
:mod:`multihead.hf`), on one model and one clean/corrupt pair at a time:

- ``runs/``, the engine: the ``Experiment`` (a model, its sites, the pair and the metric, each
  input run unpatched at most once and recorded for every function run on it), how the model is
  called, the prefix, stacked and suffix runs, and ``cache`` (an ``ActivationCache``
  of the residual stream and every head, TransformerLens's names);
- ``steering.py``: ``intervene`` ablates, scales or patches heads, ``record_heads`` records
  their outputs (a ``HeadRecording``); ``importance.py``: ``head_importance`` scores every head;
- ``patching/``: activation patching, ``patch`` (every site) and ``patch_heads`` (a head's
  output), and ``attribution_patching`` (its first-order estimate), each measured as a
  ``PatchResult``;
- ``paths/``: ``path_patching`` (does a sender reach the metric through a receiver's q, k or v);
- ``edges/``: ``edge_attribution`` (EAP, EAP-IG) scores the edges of the graph as
  ``EdgeScores``, whose ``Circuit`` ``faithfulness`` measures (``faithfulness_curve``: a
  ``FaithfulnessCurve`` over circuit sizes; MIB's files, CPR, CMD and ``Circuit.compare``'s
  ``CircuitComparison``);
- ``decompose/``: exact splits of one number: ``logit_attribution`` (a ``LogitAttribution``),
  ``logit_lens`` (a ``LogitLens``; read through a fitted ``JacobianLens`` or ``TunedLens`` with
  ``lens=``) and ``qk_attribution`` (a ``QKAttribution``);
- ``weights/``: what the weights alone say, no input: ``head_circuits`` (a ``HeadCircuits``)
  gives each head's QK and OV circuits (``HeadCircuit``, a ``FactoredMatrix``), composition
  scores (``CompositionScores``), copying scores (``CopyingScores``) and SVDs (``HeadSVD``).
- ``features/``: SAE features on heads (:mod:`multihead.sae`'s SAEs): ``sae_features`` (the
  features of the site an SAE reads), ``feature_sources`` (a feature's pre-activation split
  exactly by head and source token: a ``FeatureSources``) and ``splice_sae`` (the site replaced
  by the SAE's reconstruction, its features ablated, scaled or steered, inside a ``with`` block).

Seeing heads (capture, statistics) is :mod:`multihead.observe`, floors below.
"""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "intervene": "multihead.circuits.steering",
    "record_heads": "multihead.circuits.steering",
    "HeadRecording": "multihead.circuits.steering",
    "head_importance": "multihead.circuits.importance",
    "patch_heads": "multihead.circuits.patching.patch_heads",
    "Experiment": "multihead.circuits.runs.experiment",
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
    "JacobianLens": "multihead.circuits.decompose.jacobian_lens",
    "sae_features": "multihead.circuits.features.sae_features",
    "feature_sources": "multihead.circuits.features.feature_sources",
    "FeatureSources": "multihead.circuits.features.feature_sources",
    "splice_sae": "multihead.circuits.features.sae_splice",
    "CircuitComparison": "multihead.circuits.edges.edge_scores",
    "TunedLens": "multihead.circuits.decompose.tuned_lens",
    "qk_attribution": "multihead.circuits.decompose.qk_attribution",
    "head_circuits": "multihead.circuits.weights.head_circuits",
    "HeadCircuits": "multihead.circuits.weights.head_circuits",
    "HeadCircuit": "multihead.circuits.weights.head_circuit",
    "FactoredMatrix": "multihead.circuits.weights.factored_matrix",
    "CompositionScores": "multihead.circuits.weights.composition_scores",
    "CopyingScores": "multihead.circuits.weights.copying_scores",
    "HeadSVD": "multihead.circuits.weights.head_svd",
    "QKAttribution": "multihead.circuits.decompose.qk_attribution",
    "cache": "multihead.circuits.runs.site_recorder",
    "ActivationCache": "multihead.circuits.runs.activation_cache",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
