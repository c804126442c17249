"""The memory of ``feature_sources`` at a long context: one destination row split by (head,
source token) against a plain forward of the same model and tokens.

``multihead.feature_sources(model, ids, sae, features, rows=[-1])`` keeps the attention weights
of the one row asked for, the layer's values and z, and the (rows, F', H, T) split: O(rows·T·H),
never the (T, T) weights (SAEDashboard's DFA builds a (B, dest, src, H·Dv) tensor). Target: its
peak at most 1.2× a plain forward's (``model(ids)`` without gradients, what the split's own
forward costs). The model is a random grouped-query ``LlamaForCausalLM`` through the bridge (4
layers, width 256, 8 query heads on 2 key/value heads, vocabulary 1,000, T = 4,096 tokens,
one text); the SAE a random standard SAE on layer 2's ``hook_z`` (d_in 256, 2,048 features), 16
features split at once.

Each measurement runs in a fresh process (the two alternating, ``--rounds`` each; the medians
reported): the model and tokens are built, one call warms up, and the peak beyond what was held
before is read: in tensors (what the allocator holds; the target's figure) on a GPU
``torch.cuda.max_memory_allocated``, on the CPU the highest "Total Allocated" of torch.profiler's
memory events over a call; beside it on the CPU the first call's peak resident memory (VmHWM),
which also counts what the C allocator keeps. ``--quick``: a smaller model at T = 128, for the smoke
test.

Run:  python benchmarks/bench_feature_sources.py [--rounds 3] [--device cuda] [--quick]
      [--results-dir DIR]   (--memory-probe forward|split: a child's peaks, printed)
Writes benchmarks/results/feature_sources.json (_gpu on a GPU; _quick with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from common import device_argument, format_table, machine_info, peak_bytes, probe_peaks, write_json

import multihead
from multihead.sae import SAE, SAEConfig

SHAPE = {"layers": 4, "width": 256, "heads": 8, "kv_heads": 2, "vocab": 1000, "T": 4096}
QUICK = {**SHAPE, "width": 64, "layers": 3, "T": 128}
LAYER, D_SAE, FEATURES = 2, 2048, 16
TARGET = 1.2


def _model(shape: dict[str, int], device: torch.device) -> Any:
    import transformers

    import multihead.hf  # noqa: F401  (registers "multihead")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["width"],
        intermediate_size=4 * shape["width"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["T"], attn_implementation="multihead",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval().to(device)


def _sae(shape: dict[str, int], device: torch.device) -> SAE:
    width = shape["width"]
    config = SAEConfig(
        architecture="standard", d_in=width, d_sae=D_SAE, d_out=width, dtype=torch.float32,
        apply_b_dec_to_input=True, hook_name=f"blocks.{LAYER}.attn.hook_z",
    ).check("bench_feature_sources")  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    tensors = {
        name: torch.randn(size, generator=generator) / width**0.5
        for name, size in config.tensor_shapes().items()
    }
    return SAE(config, tensors).to(device)


def _probe(what: str, quick: bool, device: torch.device) -> dict[str, int]:
    """The peaks of ``what`` in this process (the module docstring)."""
    shape = QUICK if quick else SHAPE
    model, sae = _model(shape, device), _sae(shape, device)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(shape["vocab"], (1, shape["T"]), generator=generator).to(device)
    features = list(range(FEATURES))

    def forward() -> None:
        with torch.no_grad():
            model(ids)

    def split() -> None:
        multihead.feature_sources(model, ids, sae, features, rows=[-1])

    fn = forward if what == "forward" else split
    fn()  # warm-up: code loaded, the wiring found
    return peak_bytes(fn, device)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--device", type=device_argument, default=torch.device("cpu"))
    parser.add_argument("--memory-probe", choices=["forward", "split"], default=None)
    args = parser.parse_args(argv)
    device = args.device
    if args.memory_probe is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            print(json.dumps(_probe(args.memory_probe, args.quick, device)))
        return 0
    load_before = list(os.getloadavg())
    shape = QUICK if args.quick else SHAPE
    rounds = 1 if args.quick else args.rounds
    seen: dict[str, list[dict[str, int]]] = {"forward": [], "split": []}
    for _ in range(rounds):
        for what in seen:  # alternating
            seen[what].append(probe_peaks(__file__, what, args.quick, device))
    kinds = ["tensors"] + (["resident"] if device.type == "cpu" else [])
    peaks = {
        what: {k: statistics.median(p[k] for p in found) for k in kinds}
        for what, found in seen.items()
    }
    ratio = peaks["split"]["tensors"] / peaks["forward"]["tensors"]
    rows = [
        [
            f"T = {shape['T']}, 1 row, {shape['heads']} heads, {FEATURES} features",
            _mib(peaks["split"]["tensors"]),
            _mib(peaks["forward"]["tensors"]),
            f"{ratio:.2f}x",
            f"<= {TARGET}x",
            "met" if ratio <= TARGET else "MISSED",
        ]
    ]
    headers = ["feature_sources", "MiB", "forward MiB", "ratio", "target", ""]
    if device.type == "cpu":
        resident = peaks["split"]["resident"] / max(peaks["forward"]["resident"], 1)
        headers += ["resident MiB", "forward resident MiB", "resident ratio"]
        rows[0] += [
            _mib(peaks["split"]["resident"]),
            _mib(peaks["forward"]["resident"]),
            f"{resident:.2f}x",
        ]
    print(format_table(headers, rows))
    info = machine_info()
    gpu = device.type == "cuda"
    stem = ("feature_sources_gpu" if gpu else "feature_sources") + ("_quick" if args.quick else "")
    path = write_json(
        stem,
        {"machine": info, "rounds": rounds, "shape": shape, "peaks": peaks, "ratio": ratio,
         "target": TARGET, "features": FEATURES, "d_sae": D_SAE, "layer": LAYER},
        directory=args.results_dir,
        report={
            "title": "feature_sources memory (issue 49): `benchmarks/bench_feature_sources.py`",
            "tables": [
                {
                    "caption": f"Peak memory beyond the model's, each the median of {rounds} "
                    "fresh processes (alternating): `feature_sources(model, ids, sae, "
                    f"{FEATURES} features, rows=[-1])` against `model(ids)` without gradients, "
                    f"a random grouped-query Llama ({shape['layers']} layers, width "
                    f"{shape['width']}, {shape['heads']} query heads on {shape['kv_heads']} "
                    f"key/value heads) and a z SAE of {D_SAE:,} features on layer {LAYER}. "
                    "MiB: the allocator's peak (the target's); resident: the first call's VmHWM.",
                    "header": headers,
                    "rows": rows,
                }
            ],
            "packages": ["transformers"],
            "gpu": gpu,
            "load_before": load_before,
            "load_after": list(os.getloadavg()),
        },
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
