"""Activation and attribution patching on a Llama-shaped model: what stacking variants buys.

Ratios on a tiny-random ``LlamaForCausalLM`` (4 layers, width 512, 8 query heads on 2
key/value heads, vocabulary 32,000; B = 4 sequences of T = 64 tokens), through the bridge
(``attn_implementation="multihead"``), with the metric the last position's logit difference:

- ``patch_heads(per_position=True)`` (every head at every position: L·H·T = 2,048 patches, the
  variants stacked along the batch, the blocks before the patched layer reused, each patch run
  from its position on) ÷ the naive loop, one forward per patch (what TransformerLens's
  patching functions do; here ``record_heads`` once and ``intervene`` per patch). Target ≥ 4×
  faster on a CPU (issue 30), ≥ 5× on a GPU (issue 21). The naive loop is timed on
  ``--naive-patches`` patches (spread over every layer, head and position) and scaled to all
  2,048; those patches' values must equal ``patch_heads``' (printed: the largest difference).
  The same on the induction model's shape: a random ``TransformerLM`` of 4 layers, width 256,
  8 heads, the induction task's 64 tokens, B = 8 sequences of T = 24 (768 patches). Target
  ≥ 4× faster on a CPU.
- ``attribution_patching(per_position=True)`` (two forwards and one backward) ÷ one plain
  forward of the same batch under ``torch.no_grad()``. Target ≤ 5×.
- ``path_patching`` (senders: two heads of the first layer; receivers: the last layer's heads;
  via q, k and v) ÷ the naive loop, Wang et al.'s two full forwards per number (``intervene``
  freezing every later head at its clean output with the sender's from corrupt, a q/k/v editor
  recording the receiver's input; then a q/k/v editor replacing it). No target; its values
  must equal ``path_patching``'s (printed: the largest difference).

Each measure is the median of ``--rounds`` rounds (wall clock; on a GPU with a synchronisation
around each call). ``--quick`` runs small models (2 layers, width 64, 4 heads on 2, T = 16,
B = 2, vocabulary 100; the TransformerLM 2 layers, width 32, 4 heads, T = 12, B = 2) in
seconds, for the smoke test.

Run:  python benchmarks/bench_patch.py [--rounds 3] [--naive-patches 128] [--device cuda]
      [--dtype bfloat16] [--quick] [--results-dir DIR]
Writes benchmarks/results/patch.json (patch_gpu.json on a GPU; _quick with --quick).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import device_argument, format_table, machine_info, write_json

import multihead

# patch_heads' ratio to the naive loop: at most 1/4 on a CPU (issue 30), 1/5 on a GPU (issue 21)
TARGETS = {
    "patch_heads, every head and position": 1 / 4,
    "patch_heads, every head and position, induction TransformerLM": 1 / 4,
    "attribution_patching": 5.0,
}

FULL = {"layers": 4, "width": 512, "heads": 8, "kv_heads": 2, "vocab": 32000, "T": 64, "B": 4}
QUICK = {"layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "vocab": 100, "T": 16, "B": 2}
# the induction model's shape (multihead's TransformerLM; the task's 64 tokens)
INDUCTION = {"layers": 4, "width": 256, "heads": 8, "vocab": 64, "T": 24, "B": 8}
INDUCTION_QUICK = {"layers": 2, "width": 32, "heads": 4, "vocab": 64, "T": 12, "B": 2}


def build(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> Any:
    """A tiny-random Llama of ``shape`` (seeded), on the bridge, in eval mode."""
    import transformers

    import multihead.hf  # noqa: F401  (registers "multihead")

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["width"],
        intermediate_size=shape["width"] * 11 // 4,
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max(128, shape["T"]),
        attn_implementation="multihead",
    )
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def build_induction(shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> Any:
    """A random ``TransformerLM`` of ``shape`` (seeded), in eval mode."""
    from multihead.models import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(
        shape["vocab"], shape["width"], shape["heads"], shape["layers"], 4 * shape["width"],
        max_len=shape["T"],
    )  # fmt: skip
    return model.to(device=device, dtype=dtype).eval()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def naive_patches(
    model: Any,
    clean: torch.Tensor,
    corrupt: torch.Tensor,
    metric: Callable[[Any], torch.Tensor],
    patches: list[tuple[int, int, int]],
) -> dict[tuple[int, int, int], float]:
    """One forward per patch: corrupt with head (l, h) at position t from clean (denoising)."""
    layers = sorted({layer for layer, _, _ in patches})
    heads = sorted({head for _, head, _ in patches})
    options = dict(multihead.model_map(model).call_options)  # use_cache=False where taken
    out = {}
    with torch.no_grad():
        base = metric(model(corrupt, **options)).mean()
        keys = [(layer, head) for layer in layers for head in heads]
        with multihead.record_heads(model, keys) as clean_rec:
            model(clean, **options)
        with multihead.record_heads(model, keys) as corrupt_rec:
            model(corrupt, **options)
        for layer, head, t in patches:
            patch = corrupt_rec[(layer, head)].clone()
            patch[:, t] = clean_rec[(layer, head)][:, t]
            with multihead.intervene(model, {(layer, head): patch}):
                value = metric(model(corrupt, **options)).mean() - base
            out[(layer, head, t)] = float(value)
    return out


def naive_paths(
    model: Any,
    clean: torch.Tensor,
    corrupt: torch.Tensor,
    metric: Callable[[Any], torch.Tensor],
    senders: list[tuple[int, int]],
    receivers: list[tuple[int, int]],
) -> torch.Tensor:
    """(senders, receivers, 3): Wang et al.'s two runs per number, one full forward each."""
    sites = [site for _, site in multihead.observe.attention_modules(model)]
    every = [(layer, h) for layer, site in enumerate(sites) for h in range(site.num_heads)]
    out = torch.zeros(len(senders), len(receivers), 3)
    with torch.no_grad():
        base = metric(model(clean, use_cache=False)).mean()
        with multihead.record_heads(model, every) as clean_rec:
            model(clean, use_cache=False)
        with multihead.record_heads(model, senders) as corrupt_rec:
            model(corrupt, use_cache=False)
        for i, sender in enumerate(senders):
            edits = {key: clean_rec[key] for key in every if key[0] > sender[0]}
            edits[sender] = corrupt_rec[sender]
            for j, (layer, head) in enumerate(receivers):
                for k, kind in enumerate("qkv"):
                    seen: list[torch.Tensor] = []

                    def record(
                        call: Any, kind: str = kind, head: int = head, seen: Any = seen
                    ) -> None:
                        x = getattr(call, kind)  # (B, H or Hk, T, D)
                        seen.append(x[:, head * x.shape[1] // call.q.shape[1]])

                    def replace(call: Any, k: int = k, head: int = head, seen: Any = seen) -> Any:
                        h = call.q.shape[1]
                        new = [call.q.clone()] + [
                            x.repeat_interleave(h // x.shape[1], 1) for x in (call.k, call.v)
                        ]  # keys and values per query head: the siblings keep theirs
                        new[k][:, head] = seen[0]
                        return tuple(new)

                    with (
                        multihead.intervene(model, edits),
                        sites[layer].register_qkv_editor(record),
                    ):
                        model(clean, use_cache=False)  # run 1
                    with sites[layer].register_qkv_editor(replace):
                        out[i, j, k] = metric(model(clean, use_cache=False)).mean() - base  # run 2
    return out


def spread(shape: dict[str, int], count: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(every patch's count, ``count`` patches (layer, head, position) spread over them all)."""
    every = shape["layers"] * shape["heads"] * shape["T"]
    step = max(1, every // max(1, count))
    patches = [
        (i // (shape["heads"] * shape["T"]), i // shape["T"] % shape["heads"], i % shape["T"])
        for i in range(0, every, step)
    ][:count]
    return every, patches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--naive-patches", type=int, default=128)
    parser.add_argument("--device", type=device_argument, default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, help="default float32 (CPU), bfloat16 (GPU)")
    parser.add_argument("--quick", action="store_true", help="a small model, seconds")
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args()
    device = args.device
    gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    shape = QUICK if args.quick else FULL
    rounds = 1 if args.quick else args.rounds
    model = build(shape, device, dtype)
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(shape["vocab"], (shape["B"], shape["T"]), generator=generator)
    corrupt = clean.clone()
    corrupt[:, shape["T"] // 2] = torch.randint(shape["vocab"], (shape["B"],), generator=generator)
    clean, corrupt = clean.to(device), corrupt.to(device)
    right, wrong = 1, 2

    def metric(output: Any) -> torch.Tensor:
        logits = getattr(output, "logits", output)[:, -1].float()  # the naive loop's output too
        return logits[:, right] - logits[:, wrong]

    every, patches = spread(shape, args.naive_patches)

    def patch() -> torch.Tensor:
        return multihead.patch_heads(model, clean, corrupt, metric, per_position=True).values

    # the induction-shaped TransformerLM: the same sweep and naive loop
    small = INDUCTION_QUICK if args.quick else INDUCTION
    lm = build_induction(small, device, dtype)
    lm_clean = torch.randint(small["vocab"], (small["B"], small["T"]), generator=generator)
    lm_corrupt = lm_clean.clone()
    lm_corrupt[:, small["T"] // 2] = torch.randint(
        small["vocab"], (small["B"],), generator=generator
    )
    lm_clean, lm_corrupt = lm_clean.to(device), lm_corrupt.to(device)
    lm_every, lm_patches = spread(small, args.naive_patches)

    def lm_patch() -> torch.Tensor:
        return multihead.patch_heads(lm, lm_clean, lm_corrupt, metric, per_position=True).values

    lm_naive_values: dict[tuple[int, int, int], float] = {}

    def lm_naive() -> None:
        lm_naive_values.update(naive_patches(lm, lm_clean, lm_corrupt, metric, lm_patches))

    def attribute() -> torch.Tensor:
        return multihead.attribution_patching(
            model, clean, corrupt, metric, per_position=True
        ).values

    def forward() -> None:
        with torch.no_grad():
            model(corrupt, use_cache=False)

    senders = [(0, 0), (0, 1)]
    receivers = [(shape["layers"] - 1, h) for h in range(shape["heads"])]

    def paths() -> torch.Tensor:
        return multihead.path_patching(model, clean, corrupt, metric, senders, receivers).values

    naive_path_values = []

    def naive_path() -> None:
        naive_path_values[:] = [naive_paths(model, clean, corrupt, metric, senders, receivers)]

    naive_values: dict[tuple[int, int, int], float] = {}

    def naive() -> None:
        naive_values.update(naive_patches(model, clean, corrupt, metric, patches))

    times: dict[str, list[float]] = {
        "patch": [], "naive": [], "attribute": [], "forward": [], "paths": [], "naive_paths": [],
        "lm_patch": [], "lm_naive": [],
    }  # fmt: skip
    effects = patch()  # warm-up, and the values compared
    lm_effects = lm_patch()
    attribute()
    forward()
    path_effects = paths()
    for _ in range(rounds):  # interleaved, so that a busy moment hits every contender
        times["patch"].append(timed(patch, device))
        times["naive"].append(timed(naive, device))
        times["lm_patch"].append(timed(lm_patch, device))
        times["lm_naive"].append(timed(lm_naive, device))
        times["attribute"].append(timed(attribute, device))
        times["forward"].append(timed(forward, device))
        times["paths"].append(timed(paths, device))
        times["naive_paths"].append(timed(naive_path, device))
    median = {k: statistics.median(v) for k, v in times.items()}
    naive_all = median["naive"] / len(patches) * every
    difference = max(abs(float(effects[k]) - v) for k, v in naive_values.items())
    scale = max(abs(v) for v in naive_values.values())
    lm_naive_all = median["lm_naive"] / len(lm_patches) * lm_every
    lm_difference = max(abs(float(lm_effects[k]) - v) for k, v in lm_naive_values.items())
    lm_scale = max(abs(v) for v in lm_naive_values.values())
    path_difference = float((path_effects.float().cpu() - naive_path_values[0]).abs().max())
    n_paths = path_effects.numel()
    rows = [
        [
            "patch_heads, every head and position",
            f"{median['patch'] * 1e3:.1f}",
            f"{naive_all * 1e3:.1f}",
            f"naive loop, {every} forwards ({len(patches)} timed)",
            f"{median['patch'] / naive_all:.3f}x",
            f"{naive_all / median['patch']:.1f}x faster",
            ">= 4x faster (CPU), >= 5x (GPU)",
        ],
        [
            "patch_heads, every head and position, induction TransformerLM",
            f"{median['lm_patch'] * 1e3:.1f}",
            f"{lm_naive_all * 1e3:.1f}",
            f"naive loop, {lm_every} forwards ({len(lm_patches)} timed)",
            f"{median['lm_patch'] / lm_naive_all:.3f}x",
            f"{lm_naive_all / median['lm_patch']:.1f}x faster",
            ">= 4x faster (CPU)",
        ],
        [
            "attribution_patching",
            f"{median['attribute'] * 1e3:.1f}",
            f"{median['forward'] * 1e3:.1f}",
            "1 forward",
            f"{median['attribute'] / median['forward']:.2f}x",
            "-",
            "<= 5x",
        ],
        [
            "path_patching",
            f"{median['paths'] * 1e3:.1f}",
            f"{median['naive_paths'] * 1e3:.1f}",
            f"naive loop, {2 * n_paths} forwards",
            f"{median['paths'] / median['naive_paths']:.3f}x",
            f"{median['naive_paths'] / median['paths']:.1f}x faster",
            "-",
        ],
    ]
    headers = ["measure", "ms", "baseline ms", "baseline", "ratio", "speed-up", "target"]
    print(format_table(headers, rows))
    print(
        f"\nlargest |patch_heads - naive| over the {len(patches)} timed patches: {difference:.2e} "
        f"(largest effect {scale:.2e}); {shape}; {dtype}"
    )
    print(
        f"largest |patch_heads - naive| on the induction model over {len(lm_patches)} patches: "
        f"{lm_difference:.2e} (largest effect {lm_scale:.2e}); {small}"
    )
    print(
        f"largest |path_patching - naive| over its {n_paths} numbers ({len(senders)} senders x "
        f"{len(receivers)} receivers x q, k, v): {path_difference:.2e} (largest effect "
        f"{float(naive_path_values[0].abs().max()):.2e})"
    )
    info = machine_info()
    where = info["gpu"]["name"] if gpu else f"{info['cpu']}, {torch.get_num_threads()} threads"
    print(f"{where}, torch {info['torch']}; {rounds} rounds (median)")
    name = ("patch_gpu" if gpu else "patch") + ("_quick" if args.quick else "")
    path = write_json(
        name,
        {
            "machine": info,
            "shape": shape,
            "dtype": str(dtype),
            "rounds": rounds,
            "patches_timed": len(patches),
            "patches": every,
            "seconds": times,
            "naive_all_seconds": naive_all,
            "ratio_patch_to_naive": median["patch"] / naive_all,
            "ratio_attribution_to_forward": median["attribute"] / median["forward"],
            "max_abs_difference": difference,
            "induction_shape": small,
            "induction_patches": lm_every,
            "induction_naive_all_seconds": lm_naive_all,
            "ratio_induction_patch_to_naive": median["lm_patch"] / lm_naive_all,
            "max_abs_induction_difference": lm_difference,
            "path_numbers": n_paths,
            "ratio_paths_to_naive": median["paths"] / median["naive_paths"],
            "max_abs_path_difference": path_difference,
            "targets": TARGETS,
        },
        directory=None if args.results_dir is None else Path(args.results_dir),
        report={
            "title": "Circuits on the GPU: `bench_patch.py --device cuda`"
            if gpu
            else "Circuits (issues 21, 30): `benchmarks/bench_patch.py`",
            "tables": [
                {
                    "caption": f"{', '.join(f'{k}={v}' for k, v in shape.items())}, "
                    f"{str(dtype).removeprefix('torch.')}, {rounds} rounds (median):",
                    "header": headers,
                    "rows": rows,
                    "target_column": "target",
                }
            ],
            "gpu": gpu,
            "load_after": info["load_average"],
            "notes": [
                f"Largest difference from the naive loops: {difference:.1e} (effects to "
                f"{scale:.1e}), {lm_difference:.1e} on the TransformerLM "
                f"({', '.join(f'{k}={v}' for k, v in small.items())}; effects to "
                f"{lm_scale:.1e}), {path_difference:.1e} on paths."
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
