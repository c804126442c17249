"""The fused weights kernel alone on a GPU, against its limits and the math path.

Per (B, T) of issue 23 (H=16, D=64, bfloat16 by default; q, k, v split off one packed
projection, as MultiHeadAttention makes them), one call of each:

- ``fused``: :func:`multihead.fused_weights.fused_attention` (output and weights);
- ``math``: the math backend (float32 scores and softmax, weights cast to the dtype);
- ``sdpa``: ``F.scaled_dot_product_attention``, the output alone (no weights);
- ``write``: ``fill_`` of a buffer the size of the weights: writing them once, the memory limit.

With ``--sweep`` the fused kernel also runs under each tile configuration of ``SWEEP`` (for
choosing :func:`multihead.fused_weights.default_blocks` on a new GPU). Times are medians of
CUDA-event timings; the fused kernel's output is checked against sdpa's.

Usage::

    python benchmarks/bench_gpu_weights.py [--dtype bfloat16] [--sweep] [--causal] [--quick]

Writes ``benchmarks/results/gpu_weights.json`` (``gpu_weights_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import cuda_peak_memory, cuda_time, format_table, machine_info, write_json

from multihead import fused_weights
from multihead.functional import attention

H, D = 16, 64
SHAPES = ((8, 1024), (4, 4096))
QUICK_SHAPES = ((2, 256),)
SWEEP = [
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
    for m, n, w, s in (
        (128, 64, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 3),
        (128, 32, 4, 3),
        (64, 64, 4, 3),
        (64, 128, 4, 3),
        (128, 64, 8, 2),
        (64, 32, 4, 2),
    )
]


def measure(
    batch: int,
    length: int,
    dtype: torch.dtype,
    causal: bool,
    sweep: bool,
    min_run_time: float,
    device: str = "cuda",
) -> list[dict[str, Any]]:
    """One row per implementation (and tile configuration with ``sweep``) at (B, T)."""
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(batch, length, 3, H, D, generator=g, device=device).to(dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    written = batch * H * length * length * qkv.element_size()
    fill = torch.empty(written, dtype=torch.uint8, device=device)
    calls: dict[str, Callable[[], Any]] = {
        "fused": lambda: fused_weights.fused_attention(q, k, v, is_causal=causal),
        "math": lambda: attention(q, k, v, is_causal=causal, need_weights=True, backend="math"),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "write": lambda: fill.fill_(1),
    }
    if sweep:
        for blocks in SWEEP:
            name = "fused " + "/".join(str(x) for x in blocks.values())
            calls[name] = lambda blocks=blocks: fused_weights.fused_attention(
                q, k, v, is_causal=causal, blocks=blocks
            )
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for name, fn in calls.items():
            try:
                result = fn()
            except Exception as e:  # a configuration that does not fit this GPU
                rows.append({"B": batch, "T": length, "impl": name, "error": repr(e)[:200]})
                continue
            error = None
            if name.startswith("fused"):
                error = (result[0].float() - reference.float()).abs().max().item()
            del result
            rows.append(
                {
                    "B": batch,
                    "T": length,
                    "impl": name,
                    "seconds": cuda_time(fn, min_run_time=min_run_time),
                    "peak_bytes": cuda_peak_memory(fn),
                    "max_abs_difference_from_sdpa": error,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="time every tile configuration")
    parser.add_argument("--causal", action="store_true", help="causal masking")
    parser.add_argument("--quick", action="store_true", help="one small shape: a smoke run")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_weights needs CUDA", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    min_run_time = 0.05 if args.quick else 0.3
    rows: list[dict[str, Any]] = []
    for batch, length in QUICK_SHAPES if args.quick else SHAPES:
        rows += measure(batch, length, dtype, args.causal, args.sweep, min_run_time)
        torch.cuda.empty_cache()
    info = machine_info()
    gpu = info["gpu"]
    if args.quick:
        print("quick smoke run: the numbers below are not meaningful\n")
    print(
        f"{gpu['name']}, torch {info['torch']}, triton {gpu['triton']}, {dtype}, H={H}, D={D}"
        f"{', causal' if args.causal else ''}\n"
    )
    table = []
    for row in rows:
        if "error" in row:
            table.append([row["B"], row["T"], row["impl"], "-", "-", "-", row["error"]])
            continue
        write = next(
            r["seconds"]
            for r in rows
            if (r["B"], r["T"], r["impl"]) == (row["B"], row["T"], "write")
        )
        diff = row["max_abs_difference_from_sdpa"]
        table.append(
            [
                row["B"],
                row["T"],
                row["impl"],
                f"{row['seconds'] * 1e3:.3f}",
                f"{row['seconds'] / write:.2f}x",
                f"{row['peak_bytes'] / 2**20:.0f}",
                "-" if diff is None else f"{diff:.1e}",
            ]
        )
    headers = ["B", "T", "impl", "ms", "÷ write", "peak MiB", "out vs sdpa"]
    print(format_table(headers, table))
    name = "gpu_weights_quick" if args.quick else "gpu_weights"
    payload = {"machine": info, "dtype": str(dtype), "causal": args.causal, "rows": rows}
    path = write_json(
        name,
        payload,
        directory=args.results_dir,
        report={
            "title": "The fused weights kernel alone: `benchmarks/bench_gpu_weights.py`",
            "tables": [
                {
                    "caption": f"{str(dtype).removeprefix('torch.')}, H={H}, D={D}"
                    f"{', causal' if args.causal else ''}:",
                    "header": headers,
                    "rows": table,
                }
            ],
            "gpu": True,
            "load_after": info["load_average"],
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
