"""The cost of seeing one row of every head of a transformers model at long context.

A Llama-shaped random model (4 layers, width 512, 8 query heads, 2 key/value heads, fp32) runs
one forward of T tokens in these modes, each in a fresh child process (so that each peak RSS is
its own):

- ``sdpa``: transformers' plain ``attn_implementation="sdpa"`` forward;
- ``multihead``: the plain forward on ``attn_implementation="multihead"`` (for context);
- ``capture``: the same model inside ``multihead.capture(model, rows=[-1])``: one query row of
  every head of every layer recorded, (B, H, 1, T) per layer (the model runs on
  ``"multihead"`` inside the block);
- ``eager``: ``attn_implementation="eager"`` with ``output_attentions=True`` (every head's T×T
  weights of every layer), only for T <= ``--eager-max`` (it needs L·H·T² floats and more).

The modes run in ``--rounds`` interleaved rounds (each round starts every mode's child once, in
a rotated order), so that a slow spell of a shared machine hits every mode alike. Reported: per
mode the median forward time over all rounds and the peak RSS; the ratio capture ÷ sdpa is the
median of the per-round ratios (targets: time <= 1.15x, peak RSS <= 1.1x).

On a GPU (``--device cuda``, ``--dtype`` default bfloat16) the model is Llama-shaped at width
2048 (16 layers, 16 query and 4 key/value heads, MLP 5632), built on the device; the modes run in
this one process, in interleaved rounds, each forward timed with CUDA events and its memory read
from ``torch.cuda.max_memory_allocated`` (the peak of one forward above the model's own memory).

Usage::

    python benchmarks/bench_hf.py [--lengths 4096 16384] [--rounds 5] [--repeats 2] [--quick]
    python benchmarks/bench_hf.py --device cuda [--dtype bfloat16] [--lengths 4096] [--quick]

Writes ``benchmarks/results/hf.json`` (``hf_gpu.json`` on a GPU; ``_quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from common import format_table, interleaved_children, machine_info, write_json  # noqa: E402

MODES = ("sdpa", "multihead", "capture", "eager")
TARGETS = {"time": 1.15, "peak_rss": 1.1}


def build(quick: bool) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=128 if quick else 512,
        intermediate_size=256 if quick else 1536,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    return LlamaModel(config).eval()


def build_gpu(quick: bool, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256 if quick else 2048,
        intermediate_size=512 if quick else 5632,
        num_hidden_layers=2 if quick else 16,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaModel(config).to(dtype).eval()


def run_gpu(args: argparse.Namespace) -> int:
    """Every mode in this process on the GPU: CUDA-event times and peak allocated memory."""
    import torch
    from common import cuda_peak_memory, cuda_time

    import multihead
    import multihead.hf  # noqa: F401 - registers "multihead"

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or "bfloat16")
    lengths = [512] if args.quick else args.lengths
    rounds = 1 if args.quick else args.rounds
    model = build_gpu(args.quick, device, dtype)
    recorded: dict[str, int] = {}

    def forward(mode: str, ids: Any) -> Any:
        def run() -> None:
            with torch.no_grad():
                if mode == "capture":
                    with multihead.capture(model, rows=[-1]) as rec:
                        model(input_ids=ids, use_cache=False)
                    recorded[mode] = sum(w.numel() for w in rec.weights)
                elif mode == "eager":
                    out = model(input_ids=ids, use_cache=False, output_attentions=True)
                    recorded[mode] = sum(w.numel() for w in out.attentions)
                else:
                    model(input_ids=ids, use_cache=False)

        return run

    rows, ratios = [], []
    for length in lengths:
        modes = [m for m in MODES if m != "eager" or length <= args.eager_max]
        g = torch.Generator(device=device).manual_seed(1)
        ids = torch.randint(0, 1000, (1, length), generator=g, device=device)
        times: dict[str, list[float]] = {m: [] for m in modes}
        peaks: dict[str, int] = {}
        for r in range(rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                model.set_attn_implementation(mode if mode in ("multihead", "eager") else "sdpa")
                run = forward(mode, ids)
                times[mode].append(cuda_time(run, min_run_time=0.2, warmup=2, max_repeats=10))
                if r == 0:
                    peaks[mode] = cuda_peak_memory(run)
        for mode in modes:
            rows.append(
                {
                    "T": length,
                    "mode": mode,
                    "seconds": _median(times[mode]),
                    "peak_bytes": peaks[mode],
                    "recorded_elements": recorded.get(mode, 0),
                }
            )
        per_round = [c / s for c, s in zip(times["capture"], times["sdpa"], strict=True)]
        ratios.append(
            {
                "T": length,
                "time": _median(per_round),
                "time_rounds": per_round,
                "peak_bytes": peaks["capture"] / peaks["sdpa"],
            }
        )
    info = machine_info()
    gpu = info["gpu"]
    print(f"{gpu['name']}, torch {info['torch']}, {dtype}, {rounds} rounds\n")
    print(
        format_table(
            ["T", "mode", "ms", "peak MiB above the model", "recorded"],
            [
                [r["T"], r["mode"], f"{r['seconds'] * 1e3:.2f}", f"{r['peak_bytes'] / 2**20:.0f}"]
                + [r["recorded_elements"]]
                for r in rows
            ],
        )
    )
    print(
        format_table(
            ["T", "time capture ÷ sdpa", "peak memory capture ÷ sdpa"],
            [[r["T"], f"{r['time']:.3f}", f"{r['peak_bytes']:.3f}"] for r in ratios],
        )
    )
    payload = {
        "machine": info,
        "quick": args.quick,
        "dtype": str(dtype),
        "rows": rows,
        "ratios": ratios,
        "targets": TARGETS,
    }
    name = "hf_gpu_quick" if args.quick else "hf_gpu"
    path = write_json(
        name,
        payload,
        directory=args.results_dir,
        report={
            "title": "capture on a Llama-shaped model on the GPU: `bench_hf.py --device cuda`",
            "tables": [
                {
                    "caption": f"{str(dtype).removeprefix('torch.')}, {rounds} interleaved "
                    "rounds; memory above the model's own:",
                    "header": ["T", "mode", "ms", "peak MiB above the model", "recorded"],
                    "rows": [
                        [r["T"], r["mode"], f"{float(r['seconds']) * 1e3:.2f}"]
                        + [f"{float(r['peak_bytes']) / 2**20:.0f}", r["recorded_elements"]]
                        for r in rows
                    ],
                },
                {
                    "header": ["T", "time capture ÷ sdpa", "peak memory capture ÷ sdpa"],
                    "rows": [
                        [r["T"], f"{r['time']:.3f}", f"{r['peak_bytes']:.3f}"] for r in ratios
                    ],
                },
            ],
            "packages": ["transformers"],
            "gpu": True,
            "load_after": info["load_average"],
        },
    )
    print(f"wrote {path}")
    return 0


def child(mode: str, length: int, repeats: int, quick: bool) -> dict[str, Any]:
    """Run in a fresh process: time ``repeats`` forwards, report seconds and peak RSS."""
    import torch

    import multihead
    import multihead.hf  # noqa: F401 - registers "multihead"

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = build(quick)
    model.set_attn_implementation(mode if mode in ("multihead", "eager") else "sdpa")
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(1))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    recorded = 0
    with torch.no_grad():
        # one untimed run first (the first capture also reads the model's classes once)
        for i in range(repeats + 1):
            start = time.perf_counter()
            if mode == "capture":
                with multihead.capture(model, rows=[-1]) as rec:
                    model(input_ids=ids, use_cache=False)
                recorded = sum(w.numel() for w in rec.weights)
            elif mode == "eager":
                out = model(input_ids=ids, use_cache=False, output_attentions=True)
                recorded = sum(w.numel() for w in out.attentions)
                del out
            else:
                model(input_ids=ids, use_cache=False)
            if i > 0:
                times.append(time.perf_counter() - start)
    return {
        "mode": mode,
        "T": length,
        "times": times,
        "rss_before": rss_before,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "recorded_elements": recorded,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--repeats", type=int, default=2, help="timed forwards per child")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of all modes")
    parser.add_argument(
        "--eager-max", type=int, default=4096, help="run eager output_attentions up to this T"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model at T=256: a smoke run")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--device", default="cpu", help="cpu (children, RSS) or cuda")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="on cuda (default bfloat16); the CPU runs float32",
    )
    parser.add_argument("--child", nargs=2, metavar=("MODE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.repeats, args.quick)))
        return 0

    if args.device != "cpu":
        return run_gpu(args)
    if args.dtype not in (None, "float32"):
        parser.error(f"--dtype {args.dtype} needs --device cuda: the CPU runs float32")
    lengths = [256] if args.quick else args.lengths
    repeats = 1 if args.quick else args.repeats
    rounds = 1 if args.quick else args.rounds
    try:
        runs = interleaved_children(
            __file__,
            lambda t: [m for m in MODES if m != "eager" or t <= args.eager_max],
            lengths,
            rounds,
            ["--repeats", str(repeats)] + (["--quick"] if args.quick else []),
        )
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    rows, ratios = [], []
    for length in lengths:
        of_t = [run for run in runs if run["T"] == length]
        for mode in MODES:
            mine = [run for run in of_t if run["mode"] == mode]
            if mine:
                rows.append(
                    {
                        "T": length,
                        "mode": mode,
                        "seconds": _median([t for run in mine for t in run["times"]]),
                        "peak_rss": max(run["peak_rss"] for run in mine),
                        "recorded_elements": mine[0]["recorded_elements"],
                    }
                )

        def per_round(mode: str, of_t: list[dict[str, Any]] = of_t) -> list[float]:
            """Per round, capture's median time ÷ ``mode``'s."""
            by = {(run["round"], run["mode"]): _median(run["times"]) for run in of_t}
            return [by[r, "capture"] / by[r, mode] for r in range(rounds)]

        by_mode = {row["mode"]: row for row in rows if row["T"] == length}
        ratios.append(
            {
                "T": length,
                "time": _median(per_round("sdpa")),
                "time_rounds": per_round("sdpa"),
                "peak_rss": by_mode["capture"]["peak_rss"] / by_mode["sdpa"]["peak_rss"],
                "time_vs_multihead": _median(per_round("multihead")),
            }
        )
    print(
        format_table(
            ["T", "mode", "seconds", "peak RSS (MiB)", "recorded"],
            [
                [r["T"], r["mode"], f"{r['seconds']:.3f}", f"{r['peak_rss'] / 2**20:.0f}"]
                + [r["recorded_elements"]]
                for r in rows
            ],
        )
    )
    print(
        format_table(
            ["T", "time capture ÷ sdpa", "peak RSS capture ÷ sdpa", "time capture ÷ multihead"],
            [
                [r["T"]] + [f"{r[k]:.3f}" for k in ("time", "peak_rss", "time_vs_multihead")]
                for r in ratios
            ],
        )
    )
    payload = {
        "machine": machine_info(),
        "quick": args.quick,
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "rows": rows,
        "runs": runs,
        "ratios": ratios,
        "targets": TARGETS,
    }
    path = write_json(
        "hf_quick" if args.quick else "hf",
        payload,
        directory=args.results_dir,
        report={
            "title": "Any Hugging Face model (issue 12): `benchmarks/bench_hf.py`",
            "tables": [
                {
                    "caption": f"fp32, batch 1, {rounds} interleaved rounds of {repeats} "
                    "forwards per mode, each mode in a child process:",
                    "header": ["T", "mode", "seconds", "peak RSS (MiB)", "recorded"],
                    "rows": [
                        [r["T"], r["mode"], f"{r['seconds']:.3f}", f"{r['peak_rss'] / 2**20:.0f}"]
                        + [r["recorded_elements"]]
                        for r in rows
                    ],
                },
                {
                    "header": [
                        "T",
                        "time capture ÷ sdpa",
                        "peak RSS capture ÷ sdpa",
                        "time capture ÷ multihead",
                    ],
                    "rows": [
                        [r["T"]]
                        + [f"{r[k]:.3f}" for k in ("time", "peak_rss", "time_vs_multihead")]
                        for r in ratios
                    ],
                },
            ],
            "packages": ["transformers"],
            "load_after": payload["machine"]["load_average"],
            "notes": [
                f"Targets, capture ÷ sdpa: time ≤ {TARGETS['time']}, peak RSS ≤ "
                f"{TARGETS['peak_rss']}."
            ],
        },
    )
    print(f"wrote {path}")
    return 0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


if __name__ == "__main__":
    sys.exit(main())
