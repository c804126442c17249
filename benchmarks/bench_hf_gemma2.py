"""The cost of seeing one row of every head of a Gemma-2-shaped model (attention softcapping).

A random ``Gemma2Model`` at gemma-2-2b's widths (hidden 2304, 8 query heads over 4 key/value
heads of width 256, MLP 9216, attention softcap 50, sliding window 4096, query scale 1/16) with
``--layers`` layers (default 2: one sliding, one global; the cost per layer is what is compared,
so a few layers suffice), fp32, one forward of T tokens in these modes, each in a fresh child
process:

- ``multihead``: the plain forward on ``attn_implementation="multihead"`` (softcap on the core);
- ``capture``: the same inside ``multihead.capture(model, rows=[-1])``: one query row of every
  head of every layer, (1, 8, 1, T) per layer, recomputed under the softcap;
- ``eager``: transformers' own eager attention, without weights (the T×T path every other tool
  takes to see a softcapped head), for context.

Modes run in ``--rounds`` interleaved rounds; reported: per mode the median forward time and
peak RSS, and capture ÷ multihead, the median of the per-round ratios (target: ≤ 1.15).

Usage::

    python benchmarks/bench_hf_gemma2.py [--lengths 4096] [--layers 2] [--rounds 3] [--quick]

Writes ``benchmarks/results/hf_gemma2.json`` (``hf_gemma2_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from common import (  # noqa: E402
    format_table,
    interleaved_children,
    machine_info,
    timed_forwards,
    write_json,
)

MODES = ("multihead", "capture", "eager")
TARGET = 1.15


def build(quick: bool, layers: int) -> Any:
    import torch
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(
        vocab_size=1000,
        hidden_size=128 if quick else 2304,
        intermediate_size=256 if quick else 9216,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32 if quick else 256,
        query_pre_attn_scalar=32 if quick else 256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    return Gemma2Model(config).eval()


def child(mode: str, length: int, repeats: int, quick: bool, layers: int) -> dict[str, Any]:
    """Run in a fresh process: time ``repeats`` forwards, report seconds and peak RSS."""
    import torch

    import multihead
    import multihead.hf  # noqa: F401 - registers "multihead"

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = build(quick, layers)
    model.set_attn_implementation("eager" if mode == "eager" else "multihead")
    return timed_forwards(model, mode, length, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="timed forwards per child")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all modes")
    parser.add_argument("--quick", action="store_true", help="a tiny model at T=256: a smoke run")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        found = child(args.child[0], int(args.child[1]), args.repeats, args.quick, args.layers)
        print(json.dumps(found))
        return 0
    lengths = [256] if args.quick else args.lengths
    rounds = 1 if args.quick else args.rounds
    try:
        extra = ["--repeats", str(args.repeats), "--layers", str(args.layers)]
        extra += ["--quick"] if args.quick else []
        runs = interleaved_children(__file__, lambda t: MODES, lengths, rounds, extra)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    rows, ratios = [], []
    for length in lengths:
        of_t = [run for run in runs if run["T"] == length]
        for mode in MODES:
            mine = [run for run in of_t if run["mode"] == mode]
            rows.append(
                {
                    "T": length,
                    "mode": mode,
                    "seconds": statistics.median(t for run in mine for t in run["times"]),
                    "peak_rss": max(run["peak_rss"] for run in mine),
                    "recorded_elements": mine[0]["recorded_elements"],
                }
            )
        by = {(run["round"], run["mode"]): statistics.median(run["times"]) for run in of_t}
        per_round = [by[r, "capture"] / by[r, "multihead"] for r in range(rounds)]
        by_mode = {row["mode"]: row for row in rows if row["T"] == length}
        ratios.append(
            {
                "T": length,
                "time": statistics.median(per_round),
                "time_rounds": per_round,
                "peak_rss": by_mode["capture"]["peak_rss"] / by_mode["multihead"]["peak_rss"],
                "eager_vs_multihead": by_mode["eager"]["seconds"] / by_mode["multihead"]["seconds"],
            }
        )
    header = ["T", "mode", "seconds", "peak RSS (MiB)", "recorded"]
    table = [
        [r["T"], r["mode"], f"{r['seconds']:.3f}", f"{r['peak_rss'] / 2**20:.0f}"]
        + [r["recorded_elements"]]
        for r in rows
    ]
    ratio_header = [
        "T",
        "time capture ÷ multihead",
        "peak RSS capture ÷ multihead",
        "time eager ÷ multihead",
    ]
    ratio_rows = [
        [r["T"]] + [f"{r[k]:.3f}" for k in ("time", "peak_rss", "eager_vs_multihead")]
        for r in ratios
    ]
    print(format_table(header, table))
    print(format_table(ratio_header, ratio_rows))
    payload = {
        "machine": machine_info(),
        "quick": args.quick,
        "layers": args.layers,
        "rows": rows,
        "runs": runs,
        "ratios": ratios,
        "target": TARGET,
    }
    widths = "width 128, head 32" if args.quick else "gemma-2-2b widths"
    path = write_json(
        "hf_gemma2_quick" if args.quick else "hf_gemma2",
        payload,
        directory=args.results_dir,
        report={
            "title": "A softcapped model's heads (issue 31): `benchmarks/bench_hf_gemma2.py`",
            "tables": [
                {
                    "caption": f"fp32, batch 1, {widths}, {args.layers} layers, {rounds} "
                    f"interleaved rounds of {args.repeats} forwards per mode, each mode in a "
                    "child process:",
                    "header": header,
                    "rows": table,
                },
                {"header": ratio_header, "rows": ratio_rows},
            ],
            "packages": ["transformers"],
            "load_after": payload["machine"]["load_average"],
            "notes": [f"Target, capture ÷ multihead: time ≤ {TARGET}."],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
