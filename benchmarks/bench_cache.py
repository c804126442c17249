"""The activation cache against the plain forward it rides on: memory and streaming throughput.

All-MiniLM-L6-v2 (multihead's own BERT) on the CPU:

- **memory**: the peak resident memory of a process that runs one forward of a batch (B texts
  of T tokens) and then ``multihead.cache`` of the same batch with a ``names`` filter, less the
  peak of a process that runs the forward twice; beside it the bytes the filter asks for
  (``ActivationCache.nbytes``). Target: extra ≤ 1.1 × asked (+ nothing else: the forward's
  own peak is the baseline). Each case in a fresh process, three times; the median.
- **throughput**: ``multihead.cache_corpus`` of N sentences (every layer's ``resid_post``,
  float16 checksummed shards written and fsynced to a temporary directory) ÷ a plain loop over
  the same batches (tokenize, forward), side by side in rounds, median. Target ≥ 0.8× the
  loop's texts per second.

Run:  python benchmarks/bench_cache.py [--n 512] [--batch-size 32] [--tokens 256]
      [--threads 2] [--rounds 3] [--quick] [--results-dir DIR]
Writes benchmarks/results/cache.json (cache_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import format_table, machine_info, write_json

import multihead
from multihead.pretrained import load_text_model, minilm

SENTENCES = Path(__file__).resolve().parent.parent / "docs" / "data" / "sentences.txt"
TARGETS = {"memory": 1.1, "throughput": 0.8}
CASES = {  # what cache keeps in each memory case
    "resid_post, one layer": [("resid_post", 5)],
    "resid_post, every layer": ["resid_post"],
    "z, every layer": ["z"],
}


def corpus(n: int) -> list[str]:
    lines = [line.strip() for line in SENTENCES.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    return (lines * (n // len(lines) + 1))[:n]


def _batch(model: Any, b: int, t: int) -> dict[str, torch.Tensor]:
    """B texts of exactly T tokens, no padding (the forward's and the cache's peaks are those
    of dense (B, T) activations)."""
    ids = torch.randint(1000, 20000, (b, t))
    return {"input_ids": ids, "attention_mask": torch.ones(b, t, dtype=torch.long)}


def child(case: str, b: int, t: int, threads: int) -> None:
    """One memory case in this (fresh) process: print the peak RSS in bytes and what was kept."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = minilm()
    inputs = _batch(model, b, t)
    with torch.no_grad():
        model(**inputs)
        kept = 0
        if case == "forward":
            model(**inputs)
        else:
            kept = multihead.cache(model, inputs, names=CASES[case]).nbytes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"peak": peak, "kept": kept}))


def measure_cuda_memory(b: int, t: int, directory: str | None) -> list[dict[str, Any]]:
    """The same cases on a GPU, from the caching allocator's exact peaks (one process)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = (
        minilm(device=device) if directory is None else load_text_model(directory, device=device)
    )
    inputs = {k: v.to(device) for k, v in _batch(model, b, t).items()}
    rows = []
    with torch.no_grad():
        model(**inputs)  # warm-up
        for case in CASES:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            model(**inputs)
            torch.cuda.synchronize()
            forward = torch.cuda.max_memory_allocated() - start
            torch.cuda.reset_peak_memory_stats()
            kept = multihead.cache(model, inputs, names=CASES[case])
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
            rows.append(
                {"case": case, "asked_mib": kept.nbytes / 2**20,
                 "extra_mib": (peak - forward) / 2**20, "ratio": (peak - forward) / kept.nbytes,
                 "forward_peak_mib": forward / 2**20}
            )  # fmt: skip
            del kept
    return rows


def measure_memory(b: int, t: int, threads: int, rounds: int) -> list[dict[str, Any]]:
    def run(case: str) -> dict[str, int]:
        out = subprocess.run(
            [sys.executable, __file__, "--child", case, "--batch-size", str(b), "--tokens",
             str(t), "--threads", str(threads)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = []
    for case in CASES:
        base, peaks, kept = [], [], 0
        for _ in range(rounds):
            base.append(run("forward")["peak"])
            got = run(case)
            peaks.append(got["peak"])
            kept = got["kept"]
        forward = statistics.median(base)
        extra = statistics.median(peaks) - forward
        rows.append(
            {"case": case, "asked_mib": kept / 2**20, "extra_mib": extra / 2**20,
             "ratio": extra / kept, "forward_peak_mib": forward / 2**20}
        )  # fmt: skip
    return rows


def measure_throughput(n: int, batch_size: int, threads: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model = minilm()
    texts = corpus(n)
    spans = [texts[s : s + batch_size] for s in range(0, n, batch_size)]

    def plain() -> None:  # what a loop over the corpus does: tokenize, then the forward
        with torch.no_grad():
            for span in spans:
                batch = model.tokenize(span)
                model(batch.input_ids, batch.attention_mask)

    def cached() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            multihead.cache_corpus(
                model, texts, Path(tmp) / "acts", batch_size=batch_size, dtype=torch.float16
            )

    plain()  # warm-up
    times: dict[str, list[float]] = {"forward": [], "cache_corpus": []}
    for _ in range(rounds):
        for name, fn in (("forward", plain), ("cache_corpus", cached)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    forward, cache = statistics.median(times["forward"]), statistics.median(times["cache_corpus"])
    return {"forward_s": forward, "cache_corpus_s": cache, "ratio": forward / cache,
            "texts_per_s_forward": n / forward, "texts_per_s_cache": n / cache}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None, help="MiniLM's files (a directory) on the GPU")
    p.add_argument("--results-dir", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child, args.batch_size, args.tokens, args.threads)
        return
    if args.quick:
        args.n, args.batch_size, args.tokens, args.rounds = 64, 16, 32, 1
    info = machine_info()
    if args.device == "cuda":  # the allocator's exact peaks; throughput is the CPU's question
        rows = measure_cuda_memory(args.batch_size, args.tokens, args.model)
        table = [[r["case"], f"{r['asked_mib']:.1f}", f"{r['extra_mib']:.1f}",
                  f"{r['ratio']:.2f}", f"≤ {TARGETS['memory']}"] for r in rows]  # fmt: skip
        header = ["kept", "asked MiB", "extra peak MiB", "extra / asked", "target"]
        print(format_table(header, table))
        write_json(
            "cache_gpu_quick" if args.quick else "cache_gpu",
            {"machine": info, "memory": rows, "args": {k: str(v) for k, v in vars(args).items()}},
            directory=args.results_dir,
            report={
                "title": "The activation cache on a GPU: memory with a names filter",
                "tables": [
                    {
                        "header": header,
                        "rows": table,
                        "target_column": "target",
                        "caption": f"Peak allocated beyond a forward's (B={args.batch_size}, "
                        f"T={args.tokens}), MiniLM, torch.cuda.max_memory_allocated",
                    }
                ],
                "gpu": True,
                "load_before": info["load_average"],
                "load_after": list(os.getloadavg()),
                "notes": [f"forward's own peak {rows[0]['forward_peak_mib']:.0f} MiB"],
            },  # fmt: skip
        )
        return
    memory = measure_memory(args.batch_size, args.tokens, args.threads, args.rounds)
    through = measure_throughput(args.n, args.batch_size, args.threads, args.rounds)
    mem_rows = [
        [r["case"], f"{r['asked_mib']:.1f}", f"{r['extra_mib']:.1f}", f"{r['ratio']:.2f}",
         f"≤ {TARGETS['memory']}"]
        for r in memory
    ]  # fmt: skip
    print(
        format_table(["kept", "asked MiB", "extra peak MiB", "extra / asked", "target"], mem_rows)
    )
    thr_rows = [[f"{through['texts_per_s_forward']:.1f}", f"{through['texts_per_s_cache']:.1f}",
                 f"{through['ratio']:.2f}", f"≥ {TARGETS['throughput']}"]]  # fmt: skip
    print(format_table(["forward texts/s", "cache_corpus texts/s", "ratio", "target"], thr_rows))
    # The resident-set peaks stay in the JSON: they move by tens of MiB between runs of one
    # case, so the section shows the throughput, and `--device cuda` the exact memory.
    notes = [
        "memory: RSS peaks move by tens of MiB between runs; "
        "the GPU allocator's peaks below are exact"
    ]
    write_json(
        "cache_quick" if args.quick else "cache",
        {
            "machine": info,
            "memory": memory,
            "throughput": through,
            "args": {k: str(v) for k, v in vars(args).items()},
        },
        directory=args.results_dir,
        report={
            "title": "The activation cache: streaming throughput",
            "tables": [
                {
                    "header": ["forward texts/s", "cache_corpus texts/s", "ratio", "target"],
                    "rows": thr_rows,
                    "target_column": "target",
                    "caption": f"cache_corpus of {args.n} sentences (resid_post, every layer) ÷ "
                    f"the plain forwards, {args.threads} threads",
                },
            ],  # fmt: skip
            "load_before": info["load_average"],
            "load_after": list(os.getloadavg()),
            "notes": notes,
        },
    )


if __name__ == "__main__":
    main()
