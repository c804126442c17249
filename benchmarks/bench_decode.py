"""Incremental decoding with a KVCache against recomputing the whole sequence at every step.

A 4-layer, 256-wide TransformerLM (8 heads, feed-forward 1024) continues a 16-token prompt by 512
tokens, greedily, batch 1:

- total: wall time of ``generate(prompt, 512, use_cache=True)`` and ``use_cache=False``
  (target: the cache ≥ 5× faster);
- per step: the median time of one decoding step at positions 64, 256 and 512, with the cache
  (one new token attends to the cached keys: flat in the position) and without (a forward over
  the whole prefix: grows with it).

Usage::

    python benchmarks/bench_decode.py [--new-tokens 512] [--threads N] [--quick]

Writes benchmarks/results/decode.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import format_table, machine_info, median_time, write_json

from multihead.models import TransformerLM

VOCAB, E, H, LAYERS, FF, PROMPT = 256, 256, 8, 4, 1024, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the cached total")
    parser.add_argument("--quick", action="store_true", help="shorter timing windows")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    min_run = 0.3 if args.quick else 1.0
    n = args.new_tokens
    torch.manual_seed(0)
    model = TransformerLM(VOCAB, E, H, LAYERS, FF, max_len=PROMPT + n + 1).eval()
    prompt = torch.randint(VOCAB, (1, PROMPT))

    # -- totals -----------------------------------------------------------------------------
    model.generate(prompt, 8)  # warm-up
    cached_runs = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        with_cache = model.generate(prompt, n, use_cache=True)
        cached_runs.append(time.perf_counter() - t)
    t = time.perf_counter()
    without = model.generate(prompt, n, use_cache=False)
    recompute_total = time.perf_counter() - t
    cached_total = statistics.median(cached_runs)
    same = bool(torch.equal(with_cache, without))

    # -- per step ---------------------------------------------------------------------------
    positions = [p for p in (64, 256, 512) if p <= PROMPT + n - 1]
    ids = torch.randint(VOCAB, (1, PROMPT + n))
    cache = model.make_cache(1)
    with torch.no_grad():
        model(ids[:, : max(positions)], cache=cache)  # fill the cache once
    rows = []
    for p in positions:
        token = ids[:, p : p + 1]

        def cached_step(p: int = p, token: torch.Tensor = token) -> None:
            cache.lengths = [p] * LAYERS  # the step writes position p; rewind so each call does
            with torch.no_grad():
                model(token, cache=cache)

        def full_step(p: int = p) -> None:
            with torch.no_grad():
                model(ids[:, : p + 1])

        step_cached = median_time(cached_step, min_run_time=min_run)
        step_full = median_time(full_step, min_run_time=min_run)
        rows.append(
            {
                "position": p,
                "cached_ms": step_cached * 1e3,
                "recompute_ms": step_full * 1e3,
                "ratio": step_full / step_cached,
            }
        )

    print(
        f"TransformerLM L={LAYERS} E={E} H={H} FF={FF}, batch 1, prompt {PROMPT}, {n} new tokens, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print()
    print(
        format_table(
            ["decoding", "total s", "ms/token", "speed-up"],
            [
                [
                    "KVCache",
                    f"{cached_total:.2f}",
                    f"{cached_total / n * 1e3:.2f}",
                    f"{recompute_total / cached_total:.1f}x",
                ],
                ["recompute", f"{recompute_total:.2f}", f"{recompute_total / n * 1e3:.2f}", "1.0x"],
            ],
        )
    )
    print(f"(identical tokens: {same}; cached total = median of {args.repeats} runs)")
    print()
    print(
        format_table(
            ["position", "cached ms/step", "recompute ms/step", "ratio"],
            [
                [
                    r["position"],
                    f"{r['cached_ms']:.2f}",
                    f"{r['recompute_ms']:.2f}",
                    f"{r['ratio']:.1f}x",
                ]
                for r in rows
            ],
        )
    )
    flat = max(r["cached_ms"] for r in rows) / min(r["cached_ms"] for r in rows)
    print(f"cached step time, slowest / fastest position: {flat:.2f}x")
    path = write_json(
        "decode",
        {
            "machine": machine_info(),
            "model": {"vocab": VOCAB, "embed_dim": E, "heads": H, "layers": LAYERS, "ff": FF},
            "prompt": PROMPT,
            "new_tokens": n,
            "cached_total_s": cached_total,
            "cached_runs_s": cached_runs,
            "recompute_total_s": recompute_total,
            "speedup": recompute_total / cached_total,
            "identical_tokens": same,
            "per_step": rows,
            "cached_flatness": flat,
        },
        report={
            "title": "Decoding (issue 5): KVCache vs recomputing the sequence, "
            "`benchmarks/bench_decode.py`",
            "tables": [
                {
                    "caption": f"TransformerLM L={LAYERS} E={E} H={H} FF={FF}, batch 1, prompt "
                    f"{PROMPT}, {n} new tokens, {torch.get_num_threads()} threads:",
                    "header": ["decoding", "total s", "ms/token", "speed-up"],
                    "rows": [
                        [
                            "KVCache",
                            f"{cached_total:.2f}",
                            f"{cached_total / n * 1e3:.2f}",
                            f"{recompute_total / cached_total:.1f}x",
                        ],
                        ["recompute", f"{recompute_total:.2f}", f"{recompute_total / n * 1e3:.2f}"]
                        + ["1.0x"],
                    ],
                },
                {
                    "header": ["position", "cached ms/step", "recompute ms/step", "ratio"],
                    "rows": [
                        [
                            r["position"],
                            f"{r['cached_ms']:.2f}",
                            f"{r['recompute_ms']:.2f}",
                            f"{r['ratio']:.1f}x",
                        ]
                        for r in rows
                    ],
                },
            ],
            "notes": [
                f"Identical tokens: {same}; cached step time, slowest / fastest position: "
                f"{flat:.2f}x."
            ],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
