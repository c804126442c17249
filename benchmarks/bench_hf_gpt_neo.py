"""The cost of seeing one row of every head of a TinyStories-shaped GPT-Neo (attention computed
in the module's own code, seen through its score recipe).

A random ``GPTNeoModel`` at TinyStories-33M's shape (width 768, 4 layers of 16 heads,
alternating global and local layers, window 256), fp32, one forward of T tokens in these modes,
each in a fresh child process:

- ``plain``: the model's own forward (GPT-Neo's eager attention, which builds each layer's
  (B, H, T, T) weights);
- ``capture``: the same inside ``multihead.capture(model, rows=[-1])``: one query row of every
  head of every layer, (1, 16, 1, T) per layer, from the recipe's q, k and mask (checked against
  the module's own output on each call until a padded one has passed: every call here).

Modes run in ``--rounds`` interleaved rounds; reported: per mode the median forward time and
peak RSS, and capture ÷ plain (target: peak RSS ≤ 1.2). At ``--check-length`` (512) every row
of every head is captured once and compared with eager's ``output_attentions`` (target ≤ 1e-5).

Usage::

    python benchmarks/bench_hf_gpt_neo.py [--lengths 2048] [--rounds 3] [--quick]

Writes ``benchmarks/results/hf_gpt_neo.json`` (``hf_gpt_neo_quick.json`` with ``--quick``).
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

MODES = ("plain", "capture")
TARGET = 1.2
TOLERANCE = 1e-5


def build(quick: bool) -> Any:
    import torch
    from transformers import GPTNeoConfig, GPTNeoModel

    config = GPTNeoConfig(
        vocab_size=1000,
        hidden_size=64 if quick else 768,
        num_layers=4,
        num_heads=4 if quick else 16,
        attention_types=[[["global", "local"], 2]],
        window_size=16 if quick else 256,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return GPTNeoModel(config).eval()


def child(mode: str, length: int, repeats: int, quick: bool) -> dict[str, Any]:
    """Run in a fresh process: time ``repeats`` forwards, report seconds and peak RSS."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = build(quick)
    return timed_forwards(model, mode, length, repeats)


def check(length: int, quick: bool) -> float:
    """The largest difference between every captured row of a padded batch of two (the
    second with 16 padding tokens on the left) and eager's ``output_attentions``, real rows."""
    import torch

    import multihead

    model = build(quick)
    ids = torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :16] = 0
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        with multihead.capture(model) as rec:
            model(input_ids=ids, attention_mask=mask)
    rows = mask.bool()[:, None, :, None]
    return max(
        float((ours - theirs)[rows.expand_as(theirs)].abs().max())
        for ours, theirs in zip(rec.weights, eager, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--check-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1, help="timed forwards per child")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all modes")
    parser.add_argument("--quick", action="store_true", help="a tiny model at T=128: a smoke run")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        found = child(args.child[0], int(args.child[1]), args.repeats, args.quick)
        print(json.dumps(found))
        return 0
    lengths = [128] if args.quick else args.lengths
    check_length = 64 if args.quick else args.check_length
    rounds = 1 if args.quick else args.rounds
    difference = check(check_length, args.quick)
    try:
        extra = ["--repeats", str(args.repeats)] + (["--quick"] if args.quick else [])
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
                    "peak_rss": statistics.median(run["peak_rss"] for run in mine),
                    "recorded_elements": mine[0]["recorded_elements"],
                }
            )
        by = {(run["round"], run["mode"]): run for run in of_t}
        per_round = [
            by[r, "capture"]["peak_rss"] / by[r, "plain"]["peak_rss"] for r in range(rounds)
        ]
        times = [
            statistics.median(by[r, "capture"]["times"])
            / statistics.median(by[r, "plain"]["times"])
            for r in range(rounds)
        ]
        ratios.append(
            {
                "T": length,
                "peak_rss": statistics.median(per_round),
                "peak_rss_rounds": per_round,
                "time": statistics.median(times),
            }
        )
    by_mode = {(r["T"], r["mode"]): r for r in rows}
    header = [
        "T", "plain s", "capture s", "plain MiB", "capture MiB", "recorded",
        "peak RSS capture ÷ plain", "time capture ÷ plain",
    ]  # fmt: skip
    table = [
        [
            r["T"],
            f"{by_mode[r['T'], 'plain']['seconds']:.3f}",
            f"{by_mode[r['T'], 'capture']['seconds']:.3f}",
            f"{by_mode[r['T'], 'plain']['peak_rss'] / 2**20:.0f}",
            f"{by_mode[r['T'], 'capture']['peak_rss'] / 2**20:.0f}",
            by_mode[r["T"], "capture"]["recorded_elements"],
            f"{r['peak_rss']:.3f}",
            f"{r['time']:.3f}",
        ]
        for r in ratios
    ]
    print(format_table(header, table))
    print(f"every row captured at T={check_length} vs eager: {difference:.2e}")
    payload = {
        "machine": machine_info(),
        "quick": args.quick,
        "rows": rows,
        "runs": runs,
        "ratios": ratios,
        "check": {"T": check_length, "max_diff": difference, "tolerance": TOLERANCE},
        "target": TARGET,
    }
    shape = "width 64, 4 heads" if args.quick else "TinyStories-33M's shape"
    path = write_json(
        "hf_gpt_neo_quick" if args.quick else "hf_gpt_neo",
        payload,
        directory=args.results_dir,
        report={
            "title": "A GPT-Neo's heads through its score recipe (issue 48): "
            "`benchmarks/bench_hf_gpt_neo.py`",
            "tables": [
                {
                    "caption": f"fp32, batch 1, {shape}, 4 layers (global, local), {rounds} "
                    f"interleaved rounds of {args.repeats} forwards per mode, each mode in a "
                    "child process:",
                    "header": header,
                    "rows": table,
                },
            ],
            "packages": ["transformers"],
            "load_after": payload["machine"]["load_average"],
            "notes": [
                f"Target, capture ÷ plain: peak RSS ≤ {TARGET}. Every row of every head "
                f"captured at T = {check_length} (a padded batch of two) equals eager's "
                f"output_attentions to {difference:.1e} (target ≤ {TOLERANCE:.0e})."
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
