"""What the weights-only head analysis costs: every composition score of a GPT-2-small shape.

A random ``GPT2LMHeadModel`` of GPT-2 small's shape (12 layers × 12 heads, width 768, head width
64, vocabulary 50,257; float32, eval), read once by ``multihead.head_circuits(model)`` (the
probe replays of every attention module), then, interleaved over ``--rounds`` rounds (medians):
``composition_scores(kind)`` for q, k and v (9,504 scored pairs each), the k scores with
``baseline="random"``, and ``copying_scores()``. Beside the times, peak memory beyond the
weights of all three composition kinds in one go: the allocator's (the highest "Total
Allocated" of torch.profiler's memory events) and the process's resident memory (VmHWM, reset
through ``/proc/self/clear_refs`` once the model and the circuits are built, less the resident
memory then); and what one (E, E) matrix per pair would have taken. ``--quick`` runs a tiny
shape in seconds for the smoke test.

Run:  python benchmarks/bench_head_circuits.py [--rounds 3] [--quick] [--results-dir DIR]
Writes benchmarks/results/head_circuits.json (_quick with --quick).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    allocated_peak,
    format_table,
    machine_info,
    reset_peak,
    status_kib,
    write_json,
)

import multihead

SMALL = {"layers": 12, "heads": 12, "width": 768, "vocab": 50257}
QUICK = {"layers": 3, "heads": 4, "width": 64, "vocab": 100}


def _model(shape: dict[str, int]) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=shape["vocab"], n_embd=shape["width"], n_layer=shape["layers"],
        n_head=shape["heads"], n_positions=64,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    load_before = list(os.getloadavg())
    shape = QUICK if args.quick else SMALL
    rounds = 1 if args.quick else args.rounds
    with torch.no_grad():
        model = _model(shape)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    start = time.perf_counter()
    circuits = multihead.head_circuits(model)
    read = time.perf_counter() - start
    calls: dict[str, Callable[[], Any]] = {
        f"composition_scores({kind!r})": (lambda kind=kind: circuits.composition_scores(kind))
        for kind in "qkv"
    }
    calls["composition_scores('k', baseline='random')"] = lambda: circuits.composition_scores(
        "k", baseline="random"
    )
    calls["copying_scores()"] = circuits.copying_scores
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds + 1):  # the first round warms up
        for name, fn in calls.items():
            begin = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - begin)

    def every_kind() -> None:
        for kind in "qkv":
            circuits.composition_scores(kind)

    before = status_kib("VmRSS")
    resident = None
    if reset_peak():
        every_kind()
        resident = (status_kib("VmHWM") - before) * 1024
    tensors = allocated_peak(every_kind)
    n, heads, width = shape["layers"], shape["heads"], shape["width"]
    pairs = heads * heads * n * (n - 1) // 2
    dense = pairs * width * width * 4  # one float32 (E, E) matrix per pair

    header = ["measure", "seconds (median)"]
    rows = [["head_circuits(model): read every layer's weights", f"{read:.2f}"]]
    rows += [[name, f"{statistics.median(t):.2f}"] for name, t in times.items()]
    mib = 2**20
    memory_header = ["peak memory of the three kinds", "MiB"]
    memory_rows = [
        ["the model's weights (for scale)", f"{weights / mib:.0f}"],
        ["tensors allocated beyond what was held (profiler)", f"{tensors / mib:.1f}"],
        [
            "resident memory beyond the start (VmHWM)",
            "not measured" if resident is None else f"{resident / mib:.1f}",
        ],
        [f"one float32 (E, E) matrix per pair ({pairs:,} pairs): not made", f"{dense / mib:,.0f}"],
    ]
    print(format_table(header, rows))
    print(format_table(memory_header, memory_rows))
    info = machine_info()
    print(f"{info['cpu']}, {torch.get_num_threads()} threads, torch {info['torch']}")
    name = "head_circuits" + ("_quick" if args.quick else "")
    path = write_json(
        name,
        {
            "machine": info,
            "shape": shape,
            "rounds": rounds,
            "read_seconds": read,
            "seconds": {k: statistics.median(v) for k, v in times.items()},
            "peak_tensor_bytes": tensors,
            "peak_resident_bytes": resident,
            "weight_bytes": weights,
            "dense_pair_bytes": dense,
        },
        directory=args.results_dir,
        report={
            "title": "Heads from their weights (issue 47): `benchmarks/bench_head_circuits.py`",
            "packages": ["transformers"],
            "load_before": load_before,
            "load_after": list(os.getloadavg()),
            "notes": [
                f"The three kinds' {pairs:,} pairs each took {tensors / mib:.1f} MiB of tensors "
                f"at the peak, against {dense / mib:,.0f} MiB for one (E, E) matrix per pair; "
                "the resident figure is measured after the timed rounds, whose freed memory the "
                "allocator reuses (0 here means no new pages were touched)."
            ],
            "tables": [
                {
                    "caption": f"A random GPT-2-small-shaped model ({n} layers × {heads} heads, "
                    f"width {width}, head width {width // heads}), float32, "
                    f"{torch.get_num_threads()} threads; {rounds} interleaved rounds:",
                    "header": header,
                    "rows": rows,
                },
                {
                    "caption": "Peak memory of q, k and v composition scores, one after "
                    "another, beyond what was held before (the model and its circuits):",
                    "header": memory_header,
                    "rows": memory_rows,
                },
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
