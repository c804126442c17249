"""Corpus statistics against the forward they ride on, and over data-parallel ranks.

All-MiniLM-L6-v2 on N sentences of docs/data/sentences.txt (repeated to N), on the CPU:

- ``corpus_statistics`` (multihead's own BERT, every head's statistics folded chunk by chunk
  inside the forward) ÷ sentence-transformers' ``SentenceTransformer(...).encode`` of the same
  texts, same batch size, same threads, measured side by side (interleaved rounds, median).
  Target ≤ 1.5×. Also shown: multihead's own ``encode`` (the forward alone) and
  ``head_distances`` (the other pass of ``multihead explain --corpus``).
- ``--ranks W``: what ``explain --corpus`` computes (``head_distances`` then
  ``corpus_statistics``) in one process with ``--threads`` threads ÷ the same on W spawned gloo
  ranks with ``--threads // W`` threads each (the same total; at least one each), each rank
  running its share of the texts (the slowest rank's time). Target ≥ 1.6× faster with 2 ranks.

Times are wall clock after a warm-up, excluding start-up and model loading (CPU seconds beside
them for the one-process measures); the machine's other work shows in them.

Run:  python benchmarks/bench_corpus.py [--n 2000] [--batch-size 32] [--threads 1] [--rounds 3]
      [--ranks 2] [--quick] [--results-dir DIR]
Writes benchmarks/results/corpus.json (corpus_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import format_table, free_port, machine_info, spawn, write_json

from multihead.pretrained import minilm
from multihead.pretrained.text_loader import minilm_directory
from multihead.text import corpus_statistics, head_distances

SENTENCES = Path(__file__).resolve().parent.parent / "docs" / "data" / "sentences.txt"
TARGETS = {"corpus_statistics / sentence-transformers encode": 1.5, "speed-up on 2 ranks": 1.6}


def corpus(n: int) -> list[str]:
    """The first n sentences of docs/data, the file repeated as often as needed."""
    lines = [line.strip() for line in SENTENCES.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    return (lines * (n // len(lines) + 1))[:n]


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def explain_passes(model: Any, texts: list[str], batch_size: int) -> None:
    """What ``multihead explain --corpus`` computes: the head map, then the statistics."""
    head_distances(model, texts, batch_size=batch_size)
    corpus_statistics(model, texts, batch_size=batch_size)


def _rank(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    try:
        torch.set_num_threads(args["threads"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
        model = minilm()
        texts = corpus(args["n"])
        explain_passes(model, texts[: 2 * world * args["batch_size"]], args["batch_size"])
        seconds = []
        for _ in range(args["rounds"]):
            dist.barrier()
            start = time.perf_counter()
            explain_passes(model, texts, args["batch_size"])
            seconds.append(time.perf_counter() - start)
        queue.put((rank, {"seconds": seconds}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise


def on_ranks(world: int, threads: int, n: int, batch_size: int, rounds: int) -> list[float]:
    """Per round, the slowest rank's seconds for the explain passes on ``world`` ranks."""
    args = {"threads": threads, "n": n, "batch_size": batch_size, "rounds": rounds}
    env = {"OMP_NUM_THREADS": str(threads)}
    results = [r["seconds"] for r in spawn(_rank, (world, free_port(), args), world, env)]
    return [max(seconds[i] for seconds in results) for i in range(rounds)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="sentences (default 2000)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (in all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=0, help="also time W data-parallel ranks")
    parser.add_argument("--quick", action="store_true", help="64 sentences, one round")
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args()
    n, rounds = (64, 1) if args.quick else (args.n, args.rounds)
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    texts = corpus(n)
    model = minilm()
    reference = SentenceTransformer(str(minilm_directory()), device="cpu")
    bs = args.batch_size
    contenders: dict[str, Callable[[list[str]], object]] = {
        "sentence-transformers encode": lambda t: reference.encode(
            t, batch_size=bs, show_progress_bar=False
        ),
        "multihead encode (the forward)": lambda t: model.encode(t, batch_size=bs),
        "corpus_statistics": lambda t: corpus_statistics(model, t, batch_size=bs),
        "head_distances": lambda t: head_distances(model, t, batch_size=bs),
    }
    for fn in contenders.values():  # warm-up: allocator, oneDNN primitives
        fn(texts[: 2 * bs])
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for _ in range(rounds):  # interleaved, so that a busy moment hits every contender
        for name, fn in contenders.items():
            times[name].append(timed(lambda fn=fn: fn(texts)))  # type: ignore[misc]
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    base = wall["sentence-transformers encode"]
    rows = [
        [name, f"{wall[name]:.2f}", f"{cpu[name]:.2f}", f"{wall[name] / base:.2f}x"]
        for name in contenders
    ]
    print(format_table(["measure", "wall s", "CPU s", "÷ sentence-transformers"], rows))
    ratio = wall["corpus_statistics"] / base
    print(f"\ncorpus_statistics ÷ sentence-transformers encode: {ratio:.2f}x (target <= 1.5x)")
    payload: dict[str, Any] = {
        "n": n,
        "batch_size": bs,
        "threads": args.threads,
        "rounds": rounds,
        "seconds": {k: [list(t) for t in v] for k, v in times.items()},
        "ratio_corpus_statistics_to_encode": ratio,
        "targets": TARGETS,
    }
    if args.ranks > 1:
        # the same threads in all: W ranks of T // W threads against one process of T
        total = max(args.threads, args.ranks) // args.ranks * args.ranks
        per_rank = total // args.ranks
        torch.set_num_threads(total)
        one = [timed(lambda: explain_passes(model, texts, bs))[0] for _ in range(rounds)]
        many = on_ranks(args.ranks, per_rank, n, bs, rounds)
        speedup = statistics.median(one) / statistics.median(many)
        print(
            f"explain --corpus passes: 1 process × {total} threads "
            f"{statistics.median(one):.2f} s, {args.ranks} ranks × {per_rank} threads "
            f"{statistics.median(many):.2f} s: {speedup:.2f}x faster (target >= 1.6x with 2)"
        )
        payload["ranks"] = {
            "world": args.ranks,
            "threads_one_process": total,
            "threads_per_rank": per_rank,
            "one_process_seconds": one,
            "ranks_seconds": many,
            "speedup": speedup,
        }
    info = machine_info()
    print(f"{info['cpu']}, {args.threads} threads, torch {info['torch']}; {rounds} rounds (median)")
    payload["machine"] = info
    path = write_json(
        "corpus_quick" if args.quick else "corpus",
        payload,
        directory=None if args.results_dir is None else Path(args.results_dir),
        report={
            "title": "Corpus statistics and data parallelism (issue 22): "
            "`benchmarks/bench_corpus.py`",
            "tables": [
                {
                    "caption": f"{n} sentences, batch {bs}, {args.threads} threads, medians of "
                    f"{rounds} interleaved rounds:",
                    "header": ["measure", "wall s", "CPU s", "÷ sentence-transformers"],
                    "rows": rows,
                },
                *(
                    [
                        {
                            "caption": "`explain --corpus`'s two passes:",
                            "header": ["run", "wall s", "speed-up"],
                            "rows": [
                                [
                                    f"1 process × {payload['ranks']['threads_one_process']} "
                                    "threads",
                                    f"{statistics.median(payload['ranks']['one_process_seconds']):.2f}",
                                    "",
                                ],
                                [
                                    f"{payload['ranks']['world']} ranks × "
                                    f"{payload['ranks']['threads_per_rank']} threads (gloo)",
                                    f"{statistics.median(payload['ranks']['ranks_seconds']):.2f}",
                                    f"{payload['ranks']['speedup']:.2f}x",
                                ],
                            ],
                        }
                    ]
                    if "ranks" in payload
                    else []
                ),
            ],
            "packages": ["sentence-transformers", "transformers"],
            "load_after": info["load_average"],
            "notes": [
                f"corpus_statistics ÷ sentence-transformers encode: {ratio:.2f}x (target ≤ "
                f"{TARGETS['corpus_statistics / sentence-transformers encode']}x)"
                + (
                    f"; speed-up on {payload['ranks']['world']} ranks "
                    f"{payload['ranks']['speedup']:.2f}x (target ≥ "
                    f"{TARGETS['speed-up on 2 ranks']}x with 2)"
                    if "ranks" in payload
                    else ""
                )
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
