"""The cost of seeing one row of every head of a transformers model at long context.

A Llama-shaped random model (4 layers, width 512, 8 query heads, 2 key/value heads, fp32) runs
one forward of T tokens two ways, each in a fresh child process:

- ``sdpa``: transformers' plain ``attn_implementation="sdpa"`` forward;
- ``multihead``: the plain forward on ``attn_implementation="multihead"`` (for context);
- ``capture``: the same model inside ``multihead.capture(model, rows=[-1])``: one query row of
  every head of every layer recorded, (B, H, 1, T) per layer (the model runs on
  ``"multihead"`` inside the block).

Reported: the median forward time and the peak RSS of each child, and the ratios capture ÷ sdpa
(targets: time <= 1.15x, peak RSS <= 1.1x).

Usage::

    python benchmarks/bench_hf.py [--lengths 4096 16384] [--repeats 3] [--quick]

Writes ``benchmarks/results/hf.json`` (``hf_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from common import format_table, machine_info, write_json  # noqa: E402

MODES = ("sdpa", "multihead", "capture")
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


def child(mode: str, length: int, repeats: int, quick: bool) -> dict[str, Any]:
    """Run in a fresh process: time ``repeats`` forwards, report seconds and peak RSS."""
    import torch

    import multihead
    import multihead.hf  # noqa: F401 - registers "multihead"

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = build(quick)
    model.set_attn_implementation("multihead" if mode == "multihead" else "sdpa")
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
            else:
                model(input_ids=ids, use_cache=False)
            if i > 0:
                times.append(time.perf_counter() - start)
    return {
        "mode": mode,
        "T": length,
        "seconds": sorted(times)[len(times) // 2],
        "rss_before": rss_before,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "recorded_elements": recorded,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model at T=256: a smoke run")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.repeats, args.quick)))
        return 0

    lengths = [256] if args.quick else args.lengths
    repeats = 1 if args.quick else args.repeats
    rows = []
    for length in lengths:
        for mode in MODES:
            command = [sys.executable, __file__, "--child", mode, str(length)]
            command += ["--repeats", str(repeats)] + (["--quick"] if args.quick else [])
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    ratios = []
    for length in lengths:
        by = {r["mode"]: r for r in rows if r["T"] == length}
        ratios.append(
            {
                "T": length,
                "time": by["capture"]["seconds"] / by["sdpa"]["seconds"],
                "peak_rss": by["capture"]["peak_rss"] / by["sdpa"]["peak_rss"],
                "time_vs_multihead": by["capture"]["seconds"] / by["multihead"]["seconds"],
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
        "rows": rows,
        "ratios": ratios,
        "targets": TARGETS,
    }
    path = write_json("hf_quick" if args.quick else "hf", payload, directory=args.results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
