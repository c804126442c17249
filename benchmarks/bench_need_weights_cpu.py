"""need_weights=True on the CPU: MultiHeadAttention against torch.nn.MultiheadAttention
(average_attn_weights=False), float32, B=4, E=512, 8 heads, at T = 128 and 1024.

Usage::

    python benchmarks/bench_need_weights_cpu.py [--rounds N] [--threads N]

Prints ours ÷ torch per round (both timed side by side in one process, interleaved) and the
median; run it once per checkout to compare two versions of multihead.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils.benchmark import Timer

import multihead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    e, h, b = 512, 8, 4
    theirs = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    ours = multihead.MultiHeadAttention.from_torch(theirs).eval()
    for t in (128, 1024):
        x = torch.randn(b, t, e)
        env = {"ours": ours, "theirs": theirs, "x": x, "torch": torch}
        stmt_ours = "with torch.no_grad(): ours(x, need_weights=True)"
        stmt_theirs = (
            "with torch.no_grad(): theirs(x, x, x, need_weights=True, average_attn_weights=False)"
        )
        ratios = []
        for _ in range(args.rounds):
            a = Timer(stmt_ours, globals=env).blocked_autorange(min_run_time=1.0).median
            c = Timer(stmt_theirs, globals=env).blocked_autorange(min_run_time=1.0).median
            ratios.append(a / c)
        print(
            f"T={t}: ours ÷ torch per round {', '.join(f'{r:.3f}' for r in ratios)}; "
            f"median {statistics.median(ratios):.3f} (multihead {multihead.__file__})"
        )


if __name__ == "__main__":
    main()
