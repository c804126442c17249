"""What an SAE is, as its files say it: :class:`SAEConfig`, read from a SAELens ``cfg.json``
(6.x, or a config from before 6.0 converted as SAELens converts it).

SAELens 6 writes ``cfg.json`` as its config dataclass' fields (``d_in``, ``d_sae``, ``dtype``,
``apply_b_dec_to_input``, ``normalize_activations``, ``reshape_activations``; ``k`` and
``rescale_acts_by_decoder_norm`` of a top-k SAE; ``d_out`` of a transcoder), ``architecture``
and ``metadata`` (``hook_name``, ``hook_name_out``, ``hook_head_index``, ``sae_lens_version``,
...): sae_lens/saes/sae.py ``SAEConfig.to_dict``. A config without a version, or older than
6.0, is converted as ``handle_pre_6_0_config`` (sae_lens/loading/pretrained_sae_loaders.py)
does: ``hook_point`` -> ``hook_name``, ``activation_fn: "topk"`` with ``activation_fn_kwargs.k``
-> architecture ``topk``, a bool ``normalize_activations`` -> ``"expected_average_only_in"`` or
``"none"``, ``reshape_activations`` ``"hook_z"`` where the hook name holds ``hook_z``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from multihead._checks import check_choice, describe, is_int

__all__ = [
    "ARCHITECTURES",
    "TRANSCODERS",
    "NORMALIZATIONS",
    "SAE_DTYPES",
    "SAEConfig",
    "sae_lens_config",
]

# SAELens's inference architectures multihead computes (sae_lens/__init__.py register_sae_class;
# its batchtopk and matryoshka SAEs are saved for inference as jumprelu).
TRANSCODERS = (
    "transcoder",
    "skip_transcoder",
    "jumprelu_transcoder",
    "jumprelu_skip_transcoder",
)
ARCHITECTURES = ("standard", "topk", "abstopk", "jumprelu", "gated", *TRANSCODERS)
# sae_lens/saes/sae.py SAEConfig.__post_init__; at inference "expected_average_only_in" and
# "covariance_whitening" are the identity (their factors are folded into the weights, or looked
# up by SAELens's pretrained directory, never read from the SAE's files)
NORMALIZATIONS = (
    "none",
    "expected_average_only_in",
    "constant_norm_rescale",
    "layer_norm",
    "covariance_whitening",
)
# sae_lens/constants.py DTYPE_MAP
SAE_DTYPES = {
    name: dtype
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    for name in (str(dtype).removeprefix("torch."), str(dtype))
}


@dataclass(frozen=True)
class SAEConfig:
    """An SAE's architecture, sizes and how it reads its input.

    Attributes:
        architecture: one of :data:`ARCHITECTURES`.
        d_in: the width of the activations it reads (a ``hook_z`` SAE: heads × head width).
        d_sae: its number of features.
        d_out: the width it writes: ``d_in``, except a transcoder's.
        dtype: the dtype its weights are computed in.
        apply_b_dec_to_input: whether ``b_dec`` is subtracted from the input before encoding.
        normalize_activations: one of :data:`NORMALIZATIONS`.
        reshape_activations: ``"hook_z"`` (the input's last two dims, heads and head width,
            are flattened on encode and restored on decode) or ``"none"``.
        k: the features a top-k SAE keeps; None otherwise.
        rescale_acts_by_decoder_norm: a top-k SAE ranks pre-activations times their decoder
            rows' norms (and decodes features divided by them).
        hook_name: TransformerLens's name of the activation it reads, None when unknown.
        hook_name_out: a transcoder's output hook, None when unknown.
        hook_head_index: the one head it reads of a per-head hook, None for all.
        metadata: the rest of the file's metadata, as written.
    """

    architecture: str
    d_in: int
    d_sae: int
    d_out: int
    dtype: torch.dtype = torch.float32
    apply_b_dec_to_input: bool = False
    normalize_activations: str = "none"
    reshape_activations: str = "none"
    k: int | None = None
    rescale_acts_by_decoder_norm: bool = False
    hook_name: str | None = None
    hook_name_out: str | None = None
    hook_head_index: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_transcoder(self) -> bool:
        return self.architecture in TRANSCODERS

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors the architecture's SAELens class holds and their shapes
        (sae_lens/saes/*.py ``initialize_weights``)."""
        shapes: dict[str, tuple[int, ...]] = {
            "W_enc": (self.d_in, self.d_sae),
            "W_dec": (self.d_sae, self.d_out),
            "b_dec": (self.d_out,),
        }
        if self.architecture == "gated":
            shapes.update(b_gate=(self.d_sae,), b_mag=(self.d_sae,), r_mag=(self.d_sae,))
        else:
            shapes["b_enc"] = (self.d_sae,)
        if self.architecture.startswith("jumprelu"):
            shapes["threshold"] = (self.d_sae,)
        if self.architecture.endswith("skip_transcoder"):
            shapes["W_skip"] = (self.d_out, self.d_in)
        return shapes

    def check(self, where: str) -> SAEConfig:
        """The config itself when its fields fit together; ValueError naming ``where`` and the
        field otherwise."""
        check_choice(f"{where}: architecture", self.architecture, ARCHITECTURES)
        for name in ("d_in", "d_sae", "d_out"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"{where}: {name} must be a positive int, got {describe(value)}")
        check_choice(f"{where}: normalize_activations", self.normalize_activations, NORMALIZATIONS)
        check_choice(f"{where}: reshape_activations", self.reshape_activations, ("none", "hook_z"))
        if self.architecture in ("topk", "abstopk") and not (
            is_int(self.k) and 0 < self.k <= self.d_sae  # type: ignore[operator]
        ):
            raise ValueError(
                f"{where}: k must be an int in [1, d_sae = {self.d_sae}] for a "
                f"{self.architecture} SAE, got {describe(self.k)}"
            )
        if self.is_transcoder and self.apply_b_dec_to_input:
            raise ValueError(
                f"{where}: apply_b_dec_to_input must be false for a {self.architecture} "
                "(its b_dec is of the output's width), got true"
            )
        if not self.is_transcoder and self.d_out != self.d_in:
            raise ValueError(
                f"{where}: d_out must equal d_in = {self.d_in} for a {self.architecture} SAE, "
                f"got {self.d_out}"
            )
        if self.reshape_activations == "hook_z" and self.is_transcoder:
            raise ValueError(
                f"{where}: reshape_activations 'hook_z' is not supported for a "
                f"{self.architecture}, got it"
            )
        if (
            self.reshape_activations == "hook_z"
            and self.hook_name is not None
            and not self.hook_name.endswith("_z")
        ):
            raise ValueError(
                f"{where}: reshape_activations 'hook_z' needs a hook name ending in '_z' "
                f"(sae_lens), got {self.hook_name!r}"
            )
        return self


def _version_major(raw: dict[str, Any]) -> int | None:
    """The major version of SAELens that wrote a config, None when it does not say."""
    metadata = raw.get("metadata")
    version = raw.get("sae_lens_version") or (
        metadata.get("sae_lens_version") if isinstance(metadata, dict) else None
    )
    match = re.match(r"\d+", version) if isinstance(version, str) else None
    return int(match[0]) if match else None


def _pre_6_0(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """A config from before SAELens 6.0 in 6.0's form (handle_pre_6_0_config)."""
    renames = {
        "hook_point": "hook_name",
        "hook_point_head_index": "hook_head_index",
        "activation_fn_str": "activation_fn",
    }
    cfg = {renames.get(key, key): value for key, value in raw.items()}
    cfg.setdefault("apply_b_dec_to_input", True)
    cfg.setdefault("architecture", "standard")
    hook = cfg.get("hook_name")
    cfg.setdefault("reshape_activations", "hook_z" if "hook_z" in str(hook or "") else "none")
    activation = cfg.get("activation_fn") or "relu"
    kwargs = cfg.get("activation_fn_kwargs") or {}
    if activation == "topk" and isinstance(kwargs, dict) and kwargs.get("k") is not None:
        cfg["architecture"], cfg["k"] = "topk", kwargs.get("k")
    elif activation != "relu":
        # SAELens 6 drops the field and computes a ReLU: refused rather than computed otherwise
        raise ValueError(
            f"{where}: activation_fn must be 'relu', or 'topk' with activation_fn_kwargs.k "
            f"(the activations SAELens 6 computes), got {describe(activation)}"
        )
    normalize = cfg.get("normalize_activations")
    if isinstance(normalize, bool):
        normalize = "expected_average_only_in" if normalize else "none"
    cfg["normalize_activations"] = normalize or "none"
    metadata = dict(cfg.get("metadata") or {})
    for key in ("hook_name", "hook_name_out", "hook_head_index", "model_name"):
        if key in cfg:
            metadata.setdefault(key, cfg.get(key))
    cfg["metadata"] = metadata
    return cfg


def _optional_str(where: str, name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: {name} must be a string or null, got {describe(value)}")
    return value


def _flag(where: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be true or false, got {describe(value)}")
    return value


def sae_lens_config(raw: Any, where: str) -> SAEConfig:
    """The :class:`SAEConfig` of a SAELens ``cfg.json``'s content; ``where`` (the file) names
    it in errors.

    Raises:
        ValueError: not an object, an architecture multihead does not compute, or a field of
            the wrong kind or out of range (one line naming the field).
    """
    if not isinstance(raw, dict):
        raise ValueError(
            f"{where}: must hold a JSON object (SAELens's config), got {describe(raw)}"
        )
    major = _version_major(raw)
    cfg = _pre_6_0(raw, where) if major is None or major < 6 else dict(raw)
    metadata = cfg.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: metadata must be an object, got {describe(metadata)}")
    architecture = cfg.get("architecture")
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{where}: architecture must be one of {', '.join(ARCHITECTURES)} (the SAELens "
            f"architectures multihead computes), got {describe(architecture)}"
        )
    dtype_name = cfg.get("dtype") or "float32"
    if dtype_name not in SAE_DTYPES:
        raise ValueError(
            f"{where}: dtype must be one of {', '.join(SAE_DTYPES)}, got {describe(dtype_name)}"
        )
    head = metadata.get("hook_head_index")
    if head is not None and not (is_int(head) and head >= 0):
        raise ValueError(f"{where}: hook_head_index must be an int >= 0 or null, got {head!r}")
    d_in = cfg.get("d_in")
    return SAEConfig(
        architecture=architecture,
        d_in=d_in,  # type: ignore[arg-type]  # checked below
        d_sae=cfg.get("d_sae"),  # type: ignore[arg-type]
        d_out=cfg.get("d_out") if architecture in TRANSCODERS else d_in,  # type: ignore[arg-type]
        dtype=SAE_DTYPES[dtype_name],
        apply_b_dec_to_input=_flag(
            where, "apply_b_dec_to_input", cfg.get("apply_b_dec_to_input", True)
        ),
        normalize_activations=cfg.get("normalize_activations") or "none",
        reshape_activations=cfg.get("reshape_activations") or "none",
        k=cfg.get("k") if architecture in ("topk", "abstopk") else None,
        rescale_acts_by_decoder_norm=_flag(
            where, "rescale_acts_by_decoder_norm", cfg.get("rescale_acts_by_decoder_norm", False)
        ),
        hook_name=_optional_str(where, "hook_name", metadata.get("hook_name")),
        hook_name_out=_optional_str(where, "hook_name_out", metadata.get("hook_name_out")),
        hook_head_index=head,
        metadata=dict(metadata),
    ).check(where)
