"""Ring attention: peak memory per rank and time, against one process doing the whole sequence.

Every configuration runs in fresh processes (spawned, gloo on 127.0.0.1), so each one's memory
is its own. A process imports torch and multihead, joins its group, warms up on a tiny input, and
then reads its resident memory (VmRSS) and resets its peak (``echo 5 > /proc/self/clear_refs``
resets VmHWM) *before creating its inputs*; after the forward pass, VmHWM − that baseline is the
memory the attention needed: its inputs, output and everything in between. The single process
does the same with the whole sequence and ``multihead.functional.attention`` (torch's CPU flash
kernel), so "ratio" is a rank's peak over the single process's peak.

Time is the wall time of one forward pass between barriers, the slowest rank's, the median over
``--repeat`` passes (one by default: a pass at T=32768 takes tens of seconds, so
``torch.utils.benchmark.Timer``'s blocked runs would take many minutes). "One process doing the
same total work" is the whole-sequence attention in one process, with 1 thread and with 2.

Run from the repository root (about 5 minutes on 2 cores with the defaults)::

    python benchmarks/bench_ring.py                       # T=32768, B=1, H=8, D=64, fp32
    python benchmarks/bench_ring.py --seq-len 4096 --no-causal   # a quick look

Ranks run one thread each; with more ranks than cores they are oversubscribed (the table says so).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import (
    format_table,
    free_port,
    machine_info,
    reset_peak,
    spawn,
    status_kib,
    write_json,
)

from multihead import functional
from multihead.distributed import ring_attention


@dataclass(frozen=True)
class Config:
    world: int  # 0: one process with the whole sequence, without any process group
    threads: int
    causal: bool
    layout: str
    seq_len: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    repeat: int


def _attend(cfg: Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if cfg.world == 0:
        return functional.attention(q, k, v, is_causal=cfg.causal)
    return ring_attention(q, k, v, is_causal=cfg.causal, layout=cfg.layout)


def _inputs(cfg: Config, length: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    b, h, hk, d = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
    return (
        torch.randn(b, h, length, d, generator=gen),
        torch.randn(b, hk, length, d, generator=gen),
        torch.randn(b, hk, length, d, generator=gen),
    )


def _barrier(cfg: Config) -> None:
    if cfg.world > 0:
        dist.barrier()


def _rank(rank: int, cfg: Config, port: int, queue: Any) -> None:
    try:
        torch.set_num_threads(cfg.threads)
        world = max(cfg.world, 1)
        if cfg.world > 0:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=cfg.world,
                timeout=datetime.timedelta(minutes=30),
            )
        local = cfg.seq_len // world
        with torch.no_grad():
            # Warm-up on a tiny input: kernels, thread pools and the ring's connections.
            _attend(cfg, *_inputs(cfg, 8, seed=rank))
        gc.collect()
        _barrier(cfg)
        baseline = status_kib("VmRSS")
        reset = reset_peak()
        # Each rank creates only its own part, as it would receive it from the layer before.
        q, k, v = _inputs(cfg, local, seed=rank)
        times, cpu_times = [], []
        for _ in range(cfg.repeat):
            _barrier(cfg)
            start, cpu_start = time.perf_counter(), time.process_time()
            with torch.no_grad():
                out = _attend(cfg, q, k, v)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
            del out
        peak = status_kib("VmHWM")
        queue.put(
            (
                rank,
                {
                    "baseline_mib": baseline / 1024,
                    "peak_above_mib": (peak - baseline) / 1024,
                    "peak_reset": reset,
                    "times_s": times,
                    "cpu_times_s": cpu_times,
                },
            )
        )
        if cfg.world > 0:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as e:
        queue.put((rank, {"error": repr(e)}))
        raise


def run(cfg: Config) -> dict[str, Any]:
    """Run one configuration in fresh processes and collect every rank's numbers."""
    ranks = dict(enumerate(spawn(_rank, (cfg, free_port()), max(cfg.world, 1))))
    # A pass is as slow as its slowest rank.
    times = [max(ranks[r]["times_s"][i] for r in ranks) for i in range(cfg.repeat)]
    return {
        "config": asdict(cfg),
        "ranks": [ranks[r] for r in sorted(ranks)],
        "peak_above_mib": max(ranks[r]["peak_above_mib"] for r in ranks),
        "time_s": statistics.median(times),
        # CPU seconds of the busiest rank: the work balance, whatever else runs on the machine
        "cpu_s": max(statistics.median(ranks[r]["cpu_times_s"]) for r in ranks),
        # CPU seconds of all ranks together: the total work, communication included
        "cpu_total_s": sum(statistics.median(ranks[r]["cpu_times_s"]) for r in ranks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768, help="T, the whole sequence")
    parser.add_argument("--batch", type=int, default=1, help="B")
    parser.add_argument("--heads", type=int, default=8, help="H, query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="Hk (default: H)")
    parser.add_argument("--head-dim", type=int, default=64, help="D")
    parser.add_argument("--worlds", default="2,4", help="ring sizes, comma-separated")
    parser.add_argument(
        "--single-threads",
        default="1,2",
        help="thread counts of the whole-sequence single process, comma-separated",
    )
    parser.add_argument("--repeat", type=int, default=1, help="timed passes per configuration")
    parser.add_argument(
        "--no-causal", action="store_true", help="skip the causal rows (contiguous vs zigzag)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: T=1024, rings of 2 and 4, no causal"
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where to write the JSON (benchmarks/results)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.worlds, args.single_threads, args.no_causal = 1024, "2,4", "1", True
    worlds = [int(w) for w in args.worlds.split(",") if w]
    for w in worlds:
        if w < 2 or args.seq_len % (2 * w) != 0:
            parser.error(f"each world must be >= 2 and divide seq-len/2, got {w}")
    cores = os.cpu_count() or 1

    def config(world: int, threads: int, causal: bool, layout: str) -> Config:
        return Config(
            world=world,
            threads=threads,
            causal=causal,
            layout=layout,
            seq_len=args.seq_len,
            batch=args.batch,
            heads=args.heads,
            kv_heads=args.kv_heads or args.heads,
            head_dim=args.head_dim,
            repeat=args.repeat,
        )

    singles = [int(t) for t in args.single_threads.split(",") if t]
    plan = [config(0, t, False, "-") for t in singles]
    plan += [config(w, 1, False, "contiguous") for w in worlds]
    if not args.no_causal:
        plan += [config(0, min(2, cores), True, "-")]
        plan += [config(w, 1, True, layout) for w in worlds for layout in ("contiguous", "zigzag")]

    results = []
    for cfg in plan:
        label = "1 process" if cfg.world == 0 else f"ring of {cfg.world}"
        print(f"running {label}, {cfg.threads} thread(s), causal={cfg.causal}, {cfg.layout}...")
        sys.stdout.flush()
        results.append(run(cfg))

    def single(causal: bool, threads: int) -> dict[str, Any] | None:
        for r in results:
            c = r["config"]
            if c["world"] == 0 and c["causal"] == causal and c["threads"] == threads:
                return r
        return None

    rows = []
    for r in results:
        c = r["config"]
        ref_mem = single(False, singles[0])
        ref_1 = single(c["causal"], 1)
        ref_2 = single(c["causal"], min(2, cores))
        procs = max(c["world"], 1)
        busy = procs * c["threads"]
        rows.append(
            [
                "1 process" if c["world"] == 0 else f"ring {c['world']}",
                "causal" if c["causal"] else "full",
                c["layout"],
                f"{procs}×{c['threads']}" + (" (oversubscribed)" if busy > cores else ""),
                f"{r['peak_above_mib']:.0f}",
                f"{r['peak_above_mib'] / ref_mem['peak_above_mib']:.2f}x" if ref_mem else "-",
                f"{r['time_s']:.3g}",
                f"{r['time_s'] / ref_1['time_s']:.2f}x" if ref_1 else "-",
                f"{r['time_s'] / ref_2['time_s']:.2f}x" if ref_2 else "-",
                f"{r['cpu_s']:.3g}",
                f"{r['cpu_total_s']:.3g}",
            ]
        )
    headers = [
        "run",
        "mask",
        "layout",
        "procs×threads",
        "peak MiB/rank",
        "vs 1 proc",
        "time s",
        "vs 1 proc 1 thr",
        "vs 1 proc 2 thr",
        "CPU s busiest",
        "CPU s total",
    ]
    info = machine_info()
    print()
    print(
        f"T={args.seq_len}, B={args.batch}, H={args.heads}, Hk={args.kv_heads or args.heads}, "
        f"D={args.head_dim}, fp32, forward; {info['cpu']}, {cores} cores, torch {info['torch']}"
    )
    print(format_table(headers, rows))
    if not all(rank["peak_reset"] for r in results for rank in r["ranks"]):
        print("note: /proc/self/clear_refs was not writable: peaks count from process start")
    targets = {2: 0.8, 4: 0.45}
    ref = single(False, singles[0])
    for r in results:
        c = r["config"]
        if ref and not c["causal"] and c["world"] in targets:
            ratio = r["peak_above_mib"] / ref["peak_above_mib"]
            verdict = "met" if ratio <= targets[c["world"]] else "MISSED"
            print(
                f"target peak ≤ {targets[c['world']]}× with {c['world']} ranks: "
                f"{ratio:.2f}× ({verdict})"
            )
    path = write_json(
        "ring_quick" if args.quick else "ring" if args.seq_len == 32768 else f"ring_{args.seq_len}",
        {"machine": info, "headers": headers, "rows": rows, "results": results},
        directory=args.results_dir,
        report={
            "title": "Ring attention (issue 6): `benchmarks/bench_ring.py`"
            if args.seq_len == 32768
            else f"Ring attention at T = {args.seq_len}: `benchmarks/bench_ring.py --seq-len "
            f"{args.seq_len}`",
            "tables": [
                {
                    "caption": f"T = {args.seq_len}, B = {args.batch}, H = {args.heads}, Hk = "
                    f"{args.kv_heads or args.heads}, D = {args.head_dim}, fp32, forward:",
                    "header": headers,
                    "rows": rows,
                }
            ],
            "load_after": info["load_average"],
            "notes": [
                "Peak per rank ÷ one process's: "
                + "; ".join(
                    f"{r['peak_above_mib'] / ref['peak_above_mib']:.2f}× with "
                    f"{r['config']['world']} ranks (target ≤ {limit}×)"
                    for r in results
                    for world, limit in targets.items()
                    if ref and not r["config"]["causal"] and r["config"]["world"] == world
                )
                + "."
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
