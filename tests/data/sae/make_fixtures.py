"""Writes the SAELens fixtures that tests/test_sae_load.py loads, with SAELens itself.

Each ``<name>/`` folder here is what ``SAE.save_model`` of SAELens wrote (``cfg.json`` and
``sae_weights.safetensors``) for a tiny SAE of random weights (d_in 12, d_sae 24, a transcoder's
d_out 10; non-zero ``b_dec``, thresholds, gates), and ``expected.safetensors`` beside them holds
fixed inputs ``x`` and what SAELens computed from them: ``features = sae.encode(x)``,
``decoded = sae.decode(features)`` (right after that encode: a normalising SAE undoes the
input's statistics) and ``output = sae(x)``.

Written with sae-lens 6.54.12 (the ``<architecture>`` folders) and sae-lens 5.11.0 (the
``v5_<architecture>`` folders: configs from before 6.0, which multihead converts), each on
torch 2.13.0 (CPU). SAELens needs TransformerLens < 4, so each lives in a virtual environment of
its own, outside multihead's:

    python -m venv /tmp/venv-sae && /tmp/venv-sae/bin/pip install torch==2.13.0
    /tmp/venv-sae/bin/pip install sae-lens==6.54.12 torch==2.13.0
    /tmp/venv-sae/bin/python tests/data/sae/make_fixtures.py

    python -m venv /tmp/venv-sae5 && /tmp/venv-sae5/bin/pip install torch==2.13.0
    /tmp/venv-sae5/bin/pip install sae-lens==5.11.0 torch==2.13.0
    /tmp/venv-sae5/bin/pip install numpy==1.26.4 "pyarrow<16"  # its pyarrow wants numpy 2
    /tmp/venv-sae5/bin/python tests/data/sae/make_fixtures.py

Each run rewrites the folders of its own SAELens version only. The weights are drawn from fixed
seeds, so a rerun writes the same numbers.
"""

# ruff: noqa: E501  (one SAE a line)
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import sae_lens
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
D_IN, D_SAE, D_OUT, K = 12, 24, 10, 4


def _randomise(sae: Any, seed: int) -> None:
    """Every parameter drawn from N(0, 0.3²); thresholds and gates' magnitudes made positive
    and small, so that some features fire and some do not."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            values = torch.randn(p.shape, generator=g) * 0.3
            if name == "threshold":
                values = values.abs() * 0.5
            p.copy_(values)


def _inputs(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1000))


def _write(name: str, sae: Any, x: torch.Tensor, seed: int) -> None:
    _randomise(sae, seed)
    sae.eval()
    with torch.no_grad():
        features = sae.encode(x)
        decoded = sae.decode(features)
        output = sae(x)
    folder = HERE / name
    shutil.rmtree(folder, ignore_errors=True)
    sae.save_model(folder)
    expected = {"x": x, "features": features, "decoded": decoded, "output": output}
    save_file({k: v.contiguous() for k, v in expected.items()}, folder / "expected.safetensors")
    print(f"wrote {folder.relative_to(HERE)}: {sae.cfg.to_dict()['architecture']}")


def write_v6() -> None:
    from sae_lens import (
        GatedSAE,
        GatedSAEConfig,
        JumpReLUSAE,
        JumpReLUSAEConfig,
        JumpReLUSkipTranscoder,
        JumpReLUSkipTranscoderConfig,
        JumpReLUTranscoder,
        JumpReLUTranscoderConfig,
        SkipTranscoder,
        SkipTranscoderConfig,
        StandardSAE,
        StandardSAEConfig,
        TopKSAE,
        TopKSAEConfig,
        Transcoder,
        TranscoderConfig,
    )
    from sae_lens.saes.abstopk_sae import AbsTopKSAE, AbsTopKSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    def meta(hook: str, out: str | None = None) -> Any:
        more = {"hook_name_out": out} if out is not None else {}
        return SAEMetadata(model_name="tiny", hook_name=hook, **more)

    sizes = {"d_in": D_IN, "d_sae": D_SAE}
    tc = {**sizes, "d_out": D_OUT, "apply_b_dec_to_input": False}
    resid = (5, D_IN)
    saes: list[tuple[str, Any, tuple[int, ...]]] = [
        ("standard", StandardSAE(StandardSAEConfig(**sizes, metadata=meta("blocks.2.hook_resid_pre"))), resid),
        (
            "standard_layer_norm",
            StandardSAE(StandardSAEConfig(**sizes, normalize_activations="layer_norm", metadata=meta("blocks.1.hook_mlp_out"))),
            resid,
        ),
        (
            "standard_constant_norm",
            StandardSAE(StandardSAEConfig(**sizes, normalize_activations="constant_norm_rescale", metadata=meta("blocks.0.hook_attn_out"))),
            resid,
        ),
        (
            "standard_hook_z",
            StandardSAE(StandardSAEConfig(**sizes, reshape_activations="hook_z", metadata=meta("blocks.1.attn.hook_z"))),
            (2, 5, 3, D_IN // 3),
        ),
        ("topk", TopKSAE(TopKSAEConfig(**sizes, k=K, metadata=meta("blocks.3.hook_resid_post"))), resid),
        (
            "topk_rescaled",
            TopKSAE(TopKSAEConfig(**sizes, k=K, rescale_acts_by_decoder_norm=True, apply_b_dec_to_input=False, metadata=meta("blocks.0.hook_resid_mid"))),
            resid,
        ),
        ("abstopk", AbsTopKSAE(AbsTopKSAEConfig(**sizes, k=K, metadata=meta("blocks.2.hook_mlp_out"))), resid),
        (
            "jumprelu",
            JumpReLUSAE(JumpReLUSAEConfig(**sizes, apply_b_dec_to_input=False, metadata=meta("blocks.4.hook_resid_post"))),
            resid,
        ),
        ("gated", GatedSAE(GatedSAEConfig(**sizes, metadata=meta("blocks.1.hook_resid_pre"))), resid),
        (
            "transcoder",
            Transcoder(TranscoderConfig(**tc, metadata=meta("blocks.1.hook_mlp_in", "blocks.1.hook_mlp_out"))),
            resid,
        ),
        (
            "skip_transcoder",
            SkipTranscoder(SkipTranscoderConfig(**tc, metadata=meta("blocks.2.hook_resid_mid", "blocks.2.hook_mlp_out"))),
            resid,
        ),
        (
            "jumprelu_transcoder",
            JumpReLUTranscoder(JumpReLUTranscoderConfig(**tc, normalize_activations="layer_norm", metadata=meta("blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out"))),
            resid,
        ),
        (
            "jumprelu_skip_transcoder",
            JumpReLUSkipTranscoder(JumpReLUSkipTranscoderConfig(**tc, metadata=meta("blocks.3.hook_resid_mid", "blocks.3.hook_mlp_out"))),
            resid,
        ),
    ]  # fmt: skip
    for seed, (name, sae, shape) in enumerate(saes):
        _write(name, sae, _inputs(shape, seed), seed)


def write_v5() -> None:
    from sae_lens import SAE, SAEConfig

    def cfg(architecture: str, hook: str, **more: Any) -> Any:
        base = {
            "architecture": architecture, "d_in": D_IN, "d_sae": D_SAE, "activation_fn_str": "relu",
            "apply_b_dec_to_input": True, "finetuning_scaling_factor": False, "context_size": 16,
            "model_name": "tiny", "hook_name": hook, "hook_layer": int(hook.split(".")[1]),
            "hook_head_index": None, "prepend_bos": True, "dataset_path": "none",
            "dataset_trust_remote_code": False, "normalize_activations": "none",
            "dtype": "float32", "device": "cpu", "sae_lens_training_version": None,
        }  # fmt: skip
        return SAEConfig.from_dict({**base, **more})

    resid = (5, D_IN)
    saes: list[tuple[str, Any, tuple[int, ...]]] = [
        ("v5_standard", SAE(cfg("standard", "blocks.2.hook_resid_pre")), resid),
        ("v5_standard_scaled", SAE(cfg("standard", "blocks.2.hook_resid_pre", finetuning_scaling_factor=True)), resid),
        (
            "v5_topk",
            SAE(cfg("standard", "blocks.1.hook_resid_post", activation_fn_str="topk", activation_fn_kwargs={"k": K})),
            resid,
        ),
        ("v5_jumprelu", SAE(cfg("jumprelu", "blocks.3.hook_mlp_out", apply_b_dec_to_input=False)), resid),
        ("v5_gated", SAE(cfg("gated", "blocks.0.hook_resid_mid")), resid),
        ("v5_hook_z", SAE(cfg("standard", "blocks.1.attn.hook_z")), (2, 5, 3, D_IN // 3)),
    ]  # fmt: skip
    for seed, (name, sae, shape) in enumerate(saes, start=100):
        _write(name, sae, _inputs(shape, seed), seed)


if __name__ == "__main__":
    major = int(sae_lens.__version__.split(".")[0])
    write_v6() if major >= 6 else write_v5()
