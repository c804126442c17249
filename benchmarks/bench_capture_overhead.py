"""What ``capture(rows=[-1])`` adds to a forward where launching kernels is what costs: a small
random Llama (8 layers, hidden 128, 8/2 heads) at T = 64 on one CPU thread, so each extra op of
the observer shows. A proxy for the GPU at long lengths, where the forward is launch-bound too.

Usage::

    python benchmarks/bench_capture_overhead.py [--rounds N]

Prints capture ÷ plain per round (medians of 60 forwards each, interleaved) and their median;
run it once per checkout to compare two versions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers

import multihead
import multihead.hf  # noqa: F401  (registers attn_implementation="multihead")


def _median_seconds(fn: Callable[[], None], n: int = 60) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=1024,
    )
    model = transformers.LlamaModel._from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 100, (1, 64))

    def plain() -> None:
        with torch.no_grad():
            model(ids)

    def captured() -> None:
        with torch.no_grad(), multihead.capture(model, rows=[-1]):
            model(ids)

    ratios = [_median_seconds(captured) / _median_seconds(plain) for _ in range(args.rounds)]
    print(
        f"capture ÷ plain per round {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"median {statistics.median(ratios):.3f} (multihead {multihead.__file__})"
    )


if __name__ == "__main__":
    main()
