"""multihead: multi-head attention that is correct, fast and visible.

Core (always imported): :mod:`multihead.functional` (``attention()``, the math once) and
:class:`MultiHeadAttention`. Everything else loads on first use, so ``import multihead`` costs
torch and nothing more; parts that need an extra say which one to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from multihead import functional
from multihead._lazy import lazy_getattr
from multihead.attention import MultiHeadAttention

__version__ = "0.2.0"

# public name -> the module that defines it (imported lazily, on first access)
_LAZY: dict[str, str] = {
    "FeedForward": "multihead.layer_parts",
    "TransformerEncoderLayer": "multihead.layers",
    "TransformerEncoder": "multihead.layers",
    "TransformerDecoderLayer": "multihead.layers",
    "SinusoidalPositionalEncoding": "multihead.positions",
    "LearnedPositionalEmbedding": "multihead.positions",
    "KVCache": "multihead.kv_cache",
    "PackedBatch": "multihead.packing",
    "model_map": "multihead.mapping",
    "cache": "multihead.circuits.runs.site_recorder",
    "ActivationCache": "multihead.circuits.runs.activation_cache",
    "ModelMap": "multihead.map_types",
    "capture": "multihead.observe.recorder",
    "head_statistics": "multihead.observe.statistics",
    "corpus_statistics": "multihead.text.corpus",
    "cache_corpus": "multihead.text.corpus_cache",
    "head_distances": "multihead.text.corpus",
    "intervene": "multihead.circuits.steering",
    "record_heads": "multihead.circuits.steering",
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
    "explain": "multihead.explanation",  # the package re-exports it
    "TextModel": "multihead.text.model",
    "load_text_model": "multihead.pretrained.text_loader",
    "minilm": "multihead.pretrained.text_loader",
}
_SUBMODULES = (
    "models",
    "sae",
    "pretrained",
    "distributed",
    "observe",
    "circuits",
    "explanation",
    "text",
    "viz",
    "training",
    "cli",
    "hf",
)

__all__ = ["MultiHeadAttention", "functional", "__version__", *_LAZY, *_SUBMODULES]


_lazy_name = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"multihead.{name}")
    return _lazy_name(name)


def __dir__() -> list[str]:
    return sorted(__all__)
