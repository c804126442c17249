"""Speed and memory of multihead.MultiHeadAttention against torch and the floor it builds on.

The grid of issue 2: float32, E=512, H=8 (D=64), B=4, T in {128, 512, 2048}. Every
implementation gets the same weights (copied from one torch.nn.MultiheadAttention):

- ``multihead``: ``multihead.MultiHeadAttention`` (packed q/k/v projection, fused SDPA kernel).
- ``torch``: ``torch.nn.MultiheadAttention(batch_first=True)``, called with
  ``need_weights=False`` (its native fast path in eval mode under no_grad).
- ``floor``: the bare floor: three ``nn.Linear``, ``F.scaled_dot_product_attention`` and the
  output projection, nothing else. No layer that calls the fused kernel can beat it by much.
- ``naive``: the seeds' formulation, ``softmax(q kᵀ / sqrt(D)) v`` spelled out (seed 002's
  batched MultiHeadAttention with its bug fixed).

Sections: forward (eval mode, under ``torch.no_grad``), forward+backward (train mode, dropout 0,
gradients of ``output.sum()`` w.r.t. the input and every parameter), and both again with
per-head weights (``need_weights=True``; torch with ``average_attn_weights=False``; the floor
cannot return weights and sits out). Each forward row shows the achieved GFLOP/s, counting the
four projections (2·B·T·E² each) and attention (4·B·H·T²·D), beside a float32 GEMM peak
measured in the same run. Ratios are ``multihead ÷ other`` times: lower is better.

Peak memory: one eval forward at T=16384 (B=1), each implementation in a fresh process
(``--memory-child NAME``), measured first while the parent is small. The figure is the process's
peak RSS: VmHWM from /proc/self/status where there is one (``getrusage``'s ``ru_maxrss``, also
recorded, is inherited across exec from the parent on Linux), else ``ru_maxrss``. A child whose
predicted footprint exceeds the memory available is skipped, not run (so it cannot take the
machine down).

On a GPU (``--device cuda``; ``--dtype`` default bfloat16 there) the grid is issue 23's:
E=1024, H=16 (D=64), (B, T) in {(8, 1024), (4, 4096)}, with three sections: forward (eval,
no_grad), causal forward+backward (train), and forward with per-head weights. Times come from
CUDA events (median per call), memory from ``torch.cuda.max_memory_allocated`` (the peak of one
call above what was allocated before it). The weights rows also show the rate at which the
B·H·T² weights were written, against the device's memory bandwidth (the limit when nothing but
the weights is written). torch's causal rows pass the causal mask with ``is_causal=True``.

Usage::

    python benchmarks/bench_attention.py            # full run, several minutes on 2 cores
    python benchmarks/bench_attention.py --quick    # smoke run, seconds
    python benchmarks/bench_attention.py --device cuda [--dtype bfloat16] [--quick]

Results: printed tables and ``benchmarks/results/attention.json`` (``attention_gpu.json`` on a
GPU; ``_quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    cuda_peak_memory,
    cuda_time,
    device_argument,
    format_table,
    gemm_peak,
    machine_info,
    median_time,
    write_json,
)
from torch import Tensor, nn

from multihead import MultiHeadAttention

E, H, B = 512, 8, 4
D = E // H
FULL_T = (128, 512, 2048)
QUICK_T = (64,)
MEMORY_T, QUICK_MEMORY_T = 16384, 1024
IMPLS = ("multihead", "torch", "floor", "naive")
WEIGHT_IMPLS = ("multihead", "torch", "naive")

GPU_E, GPU_H = 1024, 16
GPU_SHAPES = ((8, 1024), (4, 4096))  # (B, T)
QUICK_GPU_SHAPES = ((2, 256),)
GPU_SECTIONS = (
    # (title, need_weights, train, is_causal, implementations)
    ("forward", False, False, False, ("multihead", "torch", "floor")),
    ("forward+backward, causal", False, True, True, ("multihead", "torch", "floor")),
    ("forward, need_weights", True, False, False, ("multihead", "torch")),
)

# Targets of issue 2 (ratios are multihead ÷ other).
TARGET_VS_TORCH = 1.0
TARGET_VS_TORCH_T2048_FORWARD = 0.8
TARGET_VS_FLOOR = 1.05
TARGET_ROOFLINE = 0.85
TARGET_MEMORY_VS_TORCH = 0.1


class BareFloor(nn.Module):
    """Three projections, torch's fused kernel, the output projection: nothing else."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, is_causal: bool = False) -> Tensor:
        b, t, e = x.shape
        h = self.num_heads
        q = self.q_proj(x).view(b, t, h, e // h).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, h, e // h).transpose(1, 2)
        v = self.v_proj(x).view(b, t, h, e // h).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (B, H, T, D)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, e))


class Naive(BareFloor):
    """The seeds' formulation: the explicit softmax(q kᵀ / sqrt(D)) v (seed 002, fixed)."""

    def forward_with_weights(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, t, e = x.shape
        h = self.num_heads
        q = self.q_proj(x).view(b, t, h, e // h).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, h, e // h).transpose(1, 2)
        v = self.v_proj(x).view(b, t, h, e // h).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(e // h)  # (B, H, T, T)
        weights = torch.softmax(scores, dim=-1)
        out = weights @ v  # (B, H, T, T) x (B, H, T, D) -> (B, H, T, D)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, e)), weights

    def forward(self, x: Tensor, is_causal: bool = False) -> Tensor:
        assert not is_causal, "the naive formulation has no causal mask"
        return self.forward_with_weights(x)[0]


def build(name: str, reference: nn.MultiheadAttention) -> nn.Module:
    """The implementation ``name`` with ``reference``'s weights."""
    if name == "torch":
        return reference
    if name == "multihead":
        return MultiHeadAttention.from_torch(reference)
    e, h = reference.embed_dim, reference.num_heads
    model = BareFloor(e, h) if name == "floor" else Naive(e, h)
    model.to(device=reference.out_proj.weight.device, dtype=reference.out_proj.weight.dtype)
    assert reference.in_proj_weight is not None and reference.in_proj_bias is not None
    with torch.no_grad():
        weights = reference.in_proj_weight.chunk(3)
        biases = reference.in_proj_bias.chunk(3)
        for proj, w, b in zip(
            (model.q_proj, model.k_proj, model.v_proj), weights, biases, strict=True
        ):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        model.out_proj.load_state_dict(reference.out_proj.state_dict())
    return model


def call(
    name: str, model: nn.Module, x: Tensor, need_weights: bool, is_causal: bool = False
) -> Any:
    """One forward of ``model`` on ``x``: the output, or (output, per-head weights)."""
    if name == "torch":
        if is_causal:  # torch takes the causal flag only as a hint beside the mask
            mask = nn.Transformer.generate_square_subsequent_mask(
                x.shape[1], device=x.device, dtype=x.dtype
            )
            return model(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
        if need_weights:
            return model(x, x, x, need_weights=True, average_attn_weights=False)
        return model(x, x, x, need_weights=False)[0]
    if name == "multihead":
        return model(x, need_weights=need_weights, is_causal=is_causal)
    if need_weights:
        assert isinstance(model, Naive)
        return model.forward_with_weights(x)
    return model(x, is_causal=is_causal)


def forward_flops(batch: int, length: int) -> float:
    """Projections (4 × 2·B·T·E²) plus attention (q kᵀ and weights·v: 4·B·H·T²·D)."""
    return 4 * 2 * batch * length * E * E + 4 * batch * H * length**2 * D


def make_fn(
    name: str,
    model: nn.Module,
    x: Tensor,
    need_weights: bool,
    train: bool,
    is_causal: bool = False,
) -> Callable:
    """The zero-argument callable that is timed."""
    if not train:
        model.eval()

        def forward() -> None:
            with torch.no_grad():
                call(name, model, x, need_weights, is_causal)

        return forward

    model.train()
    inputs = [x, *model.parameters()]

    def forward_backward() -> None:
        result = call(name, model, x, need_weights, is_causal)
        out = result[0] if isinstance(result, tuple) else result
        torch.autograd.grad(out.sum(), inputs)

    return forward_backward


def check_agreement(lengths: tuple[int, ...]) -> float:
    """Largest difference of any implementation's output (and weights) from multihead's."""
    worst = 0.0
    reference = nn.MultiheadAttention(E, H, batch_first=True).eval()
    models = {name: build(name, reference).eval() for name in IMPLS}
    x = torch.randn(2, min(lengths), E)
    with torch.no_grad():
        ours, ours_w = call("multihead", models["multihead"], x, True)
        for name in IMPLS:
            out = call(name, models[name], x, False)
            worst = max(worst, (out - ours).abs().max().item())
            if name in WEIGHT_IMPLS:
                out, w = call(name, models[name], x, True)
                worst = max(worst, (out - ours).abs().max().item(), (w - ours_w).abs().max().item())
    if worst > 1e-4:
        raise RuntimeError(f"implementations disagree: max abs difference {worst:.2e} > 1e-4")
    return worst


SECTIONS = (
    # (title, need_weights, train, implementations)
    ("forward", False, False, IMPLS),
    ("forward+backward", False, True, IMPLS),
    ("forward, need_weights", True, False, WEIGHT_IMPLS),
    ("forward+backward, need_weights", True, True, WEIGHT_IMPLS),
)


def run_timing(
    lengths: tuple[int, ...],
    min_run_time: float,
    rounds: int,
    peak_fp32: float,
    timer: Callable[[], float] | None = None,
) -> list[dict[str, Any]]:
    """Time every (section, T, implementation). Rounds alternate implementations, so slow drift
    of a shared machine hits all of them alike; each figure is the median of the round medians.
    """
    rows: list[dict[str, Any]] = []
    for title, need_weights, train, impls in SECTIONS:
        for length in lengths:
            torch.manual_seed(0)
            reference = nn.MultiheadAttention(E, H, batch_first=True, dropout=0.0)
            models = {name: build(name, reference) for name in impls}
            x = torch.randn(B, length, E, requires_grad=train)
            fns = {name: make_fn(name, models[name], x, need_weights, train) for name in impls}
            samples: dict[str, list[float]] = {name: [] for name in impls}
            for _ in range(rounds):
                for name in impls:
                    seconds = median_time(fns[name], min_run_time=min_run_time, timer=timer)
                    samples[name].append(seconds)
            for name in impls:
                seconds = statistics.median(samples[name])
                row: dict[str, Any] = {
                    "section": title,
                    "T": length,
                    "impl": name,
                    "seconds": seconds,
                    "round_seconds": samples[name],
                }
                if not train:
                    gflops = forward_flops(B, length) / seconds / 1e9
                    row["gflops"] = gflops
                    row["fraction_of_fp32_peak"] = gflops / peak_fp32
                rows.append(row)
            print(f"  timed {title:32s} T={length:5d}", file=sys.stderr, flush=True)
    for row in rows:
        ours = next(
            r["seconds"]
            for r in rows
            if (r["section"], r["T"], r["impl"]) == (row["section"], row["T"], "multihead")
        )
        row["ours_over_this"] = ours / row["seconds"]
    return rows


def timing_tables(rows: list[dict[str, Any]]) -> str:
    """One aligned table per section."""
    parts = []
    for title, _, train, _ in SECTIONS:
        table = []
        for row in (r for r in rows if r["section"] == title):
            table.append(
                [
                    row["T"],
                    row["impl"],
                    f"{row['seconds'] * 1e3:.2f}",
                    "-" if train else f"{row['gflops']:.1f}",
                    "-" if train else f"{100 * row['fraction_of_fp32_peak']:.0f}%",
                    "-" if row["impl"] == "multihead" else f"{row['ours_over_this']:.3f}x",
                ]
            )
        headers = ["T", "impl", "ms", "GFLOP/s", "of fp32 peak", "multihead ÷ impl"]
        parts.append(f"{title} ({'train' if train else 'eval, no_grad'}), B={B}, E={E}, H={H}")
        parts.append(format_table(headers, table))
        parts.append("")
    return "\n".join(parts)


# -- memory --------------------------------------------------------------------------------------


def _peak_rss_bytes() -> tuple[int, int | None]:
    """This process's peak RSS: ``(ru_maxrss, VmHWM)`` in bytes (VmHWM None where unknown).

    Linux carries ``ru_maxrss`` over ``execve``, so a child started by a large parent begins
    with the parent's resident size as its "peak". VmHWM (/proc/self/status) is the peak of the
    process's own address space only, so it is the figure reported when there is one.
    """
    # Linux reports kilobytes, macOS bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return maxrss, int(line.split()[1]) * 1024
    except OSError:
        pass
    return maxrss, None


def memory_child(name: str, length: int) -> None:
    """Run one eval forward of ``name`` at (B=1, T=length) and print peak RSS as JSON."""
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(E, H, batch_first=True)
    model = build(name, reference).eval()
    x = torch.randn(1, length, E)
    maxrss_before, hwm_before = _peak_rss_bytes()
    with torch.no_grad():
        out = call(name, model, x, False)
    maxrss, hwm = _peak_rss_bytes()
    assert out.shape == x.shape
    row = {
        "impl": name,
        "T": length,
        "peak_rss": hwm if hwm is not None else maxrss,
        "rss_before": hwm_before if hwm_before is not None else maxrss_before,
        "ru_maxrss": maxrss,
        "vm_hwm": hwm,
    }
    print(json.dumps(row))


def predicted_bytes(name: str, length: int) -> int:
    """A generous guess at a child's peak: T×T float32 matrices per head, plus 1 GB of torch."""
    square = H * length * length * 4
    extra = {"torch": 1, "naive": 2}.get(name, 0) * square
    return extra + 2**30


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_memory(
    length: int, impls: tuple[str, ...] = IMPLS, *, parallel: bool = False
) -> list[dict[str, Any]]:
    """Each implementation's peak RSS for one eval forward, each in a fresh process.

    Children run one after the other (their peaks must not add up on the machine), except with
    ``parallel`` (the smoke run, where every peak is small).
    """
    rows: list[dict[str, Any]] = []
    children: dict[str, subprocess.Popen[str]] = {}
    for name in impls:
        available = mem_available()
        need = predicted_bytes(name, length)
        if available is not None and need > 0.9 * available:
            rows.append(
                {
                    "impl": name,
                    "T": length,
                    "skipped": f"predicted {need / 2**30:.1f} GiB > 90% of MemAvailable "
                    f"{available / 2**30:.1f} GiB",
                }
            )
            continue
        command = [sys.executable, __file__, "--memory-child", name, "--memory-length", str(length)]
        children[name] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        if not parallel:
            rows.append(_collect(name, length, children.pop(name)))
    rows.extend(_collect(name, length, child) for name, child in children.items())
    ours = next((r for r in rows if r["impl"] == "multihead" and "peak_rss" in r), None)
    for row in rows:
        if ours is not None and "peak_rss" in row:
            row["ours_over_this"] = ours["peak_rss"] / row["peak_rss"]
    return rows


def _collect(name: str, length: int, child: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, stderr = child.communicate()
    print(f"  memory {name:10s} T={length}", file=sys.stderr, flush=True)
    if child.returncode != 0:
        return {"impl": name, "T": length, "failed": f"exit {child.returncode}: {stderr[-300:]}"}
    row: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return row


def memory_table(rows: list[dict[str, Any]]) -> str:
    table = []
    for row in rows:
        if "peak_rss" not in row:
            table.append([row["impl"], "-", "-", row.get("skipped") or row.get("failed")])
            continue
        ratio = row.get("ours_over_this")
        table.append(
            [
                row["impl"],
                f"{row['peak_rss'] / 2**30:.2f}",
                f"{row['rss_before'] / 2**30:.2f}",
                "-" if row["impl"] == "multihead" or ratio is None else f"{ratio:.3f}x",
            ]
        )
    headers = ["impl", "peak RSS GiB", "RSS before forward GiB", "multihead ÷ impl"]
    return format_table(headers, table)


# -- targets -------------------------------------------------------------------------------------


def check_targets(
    rows: list[dict[str, Any]], memory: list[dict[str, Any]], lengths: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Each target of issue 2 with the measured value and whether it is met."""
    targets = []

    def add(what: str, value: float, limit: float, higher_is_better: bool = False) -> None:
        met = value >= limit if higher_is_better else value <= limit
        targets.append({"target": what, "value": value, "limit": limit, "met": met})

    for row in rows:
        where = f"{row['section']}, T={row['T']}"
        if row["impl"] == "torch":
            add(f"multihead ÷ torch ≤ {TARGET_VS_TORCH} ({where})", row["ours_over_this"], 1.0)
            if row["section"] == "forward" and row["T"] == 2048:
                add(
                    f"multihead ÷ torch ≤ {TARGET_VS_TORCH_T2048_FORWARD} ({where})",
                    row["ours_over_this"],
                    TARGET_VS_TORCH_T2048_FORWARD,
                )
        if row["impl"] == "floor":
            add(f"multihead ÷ floor ≤ {TARGET_VS_FLOOR} ({where})", row["ours_over_this"], 1.05)
        if row["impl"] == "multihead" and row["section"] == "forward" and row["T"] == max(lengths):
            add(
                f"multihead ≥ {TARGET_ROOFLINE:.0%} of fp32 GEMM peak ({where})",
                row["fraction_of_fp32_peak"],
                TARGET_ROOFLINE,
                higher_is_better=True,
            )
    torch_row = next((r for r in memory if r["impl"] == "torch"), None)
    if torch_row is not None and "ours_over_this" in torch_row:
        add(
            f"multihead peak RSS ≤ {TARGET_MEMORY_VS_TORCH} × torch's (T={torch_row['T']})",
            torch_row["ours_over_this"],
            TARGET_MEMORY_VS_TORCH,
        )
    return targets


# -- on a GPU ------------------------------------------------------------------------------------


def write_bandwidth(device: torch.device) -> float:
    """Bytes per second the device writes (``fill_`` of a 1 GiB buffer): the limit for a kernel
    whose only large traffic is writing its result."""
    buffer = torch.empty(2**30, dtype=torch.uint8, device=device)
    seconds = cuda_time(lambda: buffer.fill_(1), min_run_time=0.2)
    return 2**30 / seconds


def gpu_agreement(device: torch.device, dtype: torch.dtype) -> float:
    """Largest difference of torch's and the floor's output (and torch's weights) from
    multihead's, at B=2, T=128, in ``dtype``."""
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(GPU_E, GPU_H, batch_first=True, device=device, dtype=dtype)
    models = {name: build(name, reference).eval() for name in ("multihead", "torch", "floor")}
    x = torch.randn(2, 128, GPU_E, device=device, dtype=dtype)
    worst = 0.0
    with torch.no_grad():
        ours, ours_w = call("multihead", models["multihead"], x, True)
        for name in ("torch", "floor"):
            out = call(name, models[name], x, False)
            worst = max(worst, (out - ours).abs().max().item())
        out, weights = call("torch", models["torch"], x, True)
        worst = max(worst, (out - ours).abs().max().item(), (weights - ours_w).abs().max().item())
    limit = 1e-4 if dtype == torch.float32 else 5e-2
    if worst > limit:
        raise RuntimeError(f"implementations disagree: max abs difference {worst:.2e} > {limit}")
    return worst


def run_gpu(
    device: torch.device, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], quick: bool
) -> dict[str, Any]:
    """Every GPU (section, shape, implementation): median time and peak memory."""
    min_run_time = 0.05 if quick else 0.3
    bandwidth = write_bandwidth(device)
    payload: dict[str, Any] = {
        "config": {"E": GPU_E, "H": GPU_H, "dtype": str(dtype), "shapes": shapes},
        "write_bandwidth_bytes_per_s": bandwidth,
        "max_abs_difference": gpu_agreement(device, dtype),
    }
    rows: list[dict[str, Any]] = []
    for title, need_weights, train, is_causal, impls in GPU_SECTIONS:
        for batch, length in shapes:
            torch.manual_seed(0)
            reference = nn.MultiheadAttention(
                GPU_E, GPU_H, batch_first=True, device=device, dtype=dtype
            )
            models = {name: build(name, reference) for name in impls}
            x = torch.randn(batch, length, GPU_E, device=device, dtype=dtype, requires_grad=train)
            fns = {
                name: make_fn(name, models[name], x, need_weights, train, is_causal)
                for name in impls
            }
            samples: dict[str, list[float]] = {name: [] for name in impls}
            for _ in range(1 if quick else 3):  # rounds alternate the implementations
                for name in impls:
                    samples[name].append(cuda_time(fns[name], min_run_time=min_run_time))
            for name in impls:
                row: dict[str, Any] = {
                    "section": title,
                    "B": batch,
                    "T": length,
                    "impl": name,
                    "seconds": statistics.median(samples[name]),
                    "round_seconds": samples[name],
                    "peak_bytes": cuda_peak_memory(fns[name]),
                }
                if need_weights:
                    written = batch * GPU_H * length * length * x.element_size()
                    row["weights_bytes"] = written
                    row["weights_bytes_per_s"] = written / row["seconds"]
                    row["write_limit_seconds"] = written / bandwidth
                rows.append(row)
            del models, fns, x, reference
            torch.cuda.empty_cache()
            print(f"  timed {title:28s} B={batch} T={length:5d}", file=sys.stderr, flush=True)
    for row in rows:
        ours = next(
            r["seconds"]
            for r in rows
            if (r["section"], r["B"], r["T"], r["impl"])
            == (row["section"], row["B"], row["T"], "multihead")
        )
        row["ours_over_this"] = ours / row["seconds"]
    payload["rows"] = rows
    return payload


def gpu_table(payload: dict[str, Any]) -> str:
    table = []
    for row in payload["rows"]:
        weights = "-"
        if "weights_bytes_per_s" in row:
            weights = (
                f"{row['weights_bytes_per_s'] / 1e12:.2f} TB/s "
                f"({row['write_limit_seconds'] / row['seconds']:.0%} of the limit)"
            )
        table.append(
            [
                row["section"],
                row["B"],
                row["T"],
                row["impl"],
                f"{row['seconds'] * 1e3:.3f}",
                f"{row['peak_bytes'] / 2**20:.0f}",
                "-" if row["impl"] == "multihead" else f"{row['ours_over_this']:.3f}x",
                weights,
            ]
        )
    headers = ["section", "B", "T", "impl", "ms", "peak MiB", "multihead ÷ impl", "weights written"]
    return format_table(headers, table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: one short T, short runs")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--memory-only", action="store_true", help="only the peak-memory part")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 3)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this process's CPU time instead of wall time: steadier on a busy "
        "machine; use with --threads 1",
    )
    parser.add_argument(
        "--results-dir", default=None, help="where to write the JSON (default benchmarks/results)"
    )
    parser.add_argument(
        "--device",
        type=device_argument,
        default="cpu",
        help="cpu (issue 2's grid) or cuda (issue 23's grid)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="on cuda (default bfloat16); the CPU grid runs float32",
    )
    parser.add_argument("--memory-child", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--memory-length", type=int, default=MEMORY_T, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.memory_child:
        memory_child(args.memory_child, args.memory_length)
        return 0

    device = args.device
    if device.type == "cuda":
        return main_gpu(device, getattr(torch, args.dtype or "bfloat16"), args)
    if args.dtype not in (None, "float32"):
        parser.error(f"--dtype {args.dtype} needs --device cuda: the CPU grid runs float32")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    timer = time.process_time if args.cpu_time else None
    lengths = QUICK_T if args.quick else FULL_T
    min_run_time = 0.05 if args.quick else 1.0
    rounds = args.rounds or (1 if args.quick else 3)
    info = machine_info()
    if args.quick:
        print("quick smoke run: the numbers below are not meaningful\n")
    print(
        f"{info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads, "
        f"torch {info['torch']}, load average {info['load_average'][0]:.1f}\n"
        f"command: {info['command']}\n"
        f"clock: {'process CPU time' if args.cpu_time else 'wall time'}, "
        f"{torch.get_num_threads()} torch threads\n"
    )

    payload: dict[str, Any] = {"machine": info, "config": {"E": E, "H": H, "B": B}}
    # Memory first, while this process is small: see _peak_rss_bytes.
    memory: list[dict[str, Any]] = []
    if not args.no_memory:
        length = QUICK_MEMORY_T if args.quick else MEMORY_T
        # The smoke run only checks that the children work: two are enough.
        impls = ("multihead", "torch") if args.quick else IMPLS
        memory = run_memory(length, impls, parallel=args.quick)
        payload["memory"] = memory
        print(f"peak memory, one eval forward, B=1, T={length}, each in its own process")
        print(memory_table(memory) + "\n")

    rows: list[dict[str, Any]] = []
    if not args.memory_only:
        gemm_n = 512 if args.quick else 2048
        peaks = {
            "float32": gemm_peak(torch.float32, n=gemm_n, min_run_time=min_run_time, timer=timer),
            "bfloat16": gemm_peak(torch.bfloat16, n=gemm_n, min_run_time=min_run_time, timer=timer),
        }
        print(
            f"GEMM peak ({gemm_n}² matmul): float32 {peaks['float32']:.1f} GFLOP/s, "
            f"bfloat16 {peaks['bfloat16']:.1f} GFLOP/s\n"
        )
        payload["max_abs_difference"] = check_agreement(lengths)
        rows = run_timing(lengths, min_run_time, rounds, peaks["float32"], timer)
        # Measured again at the end: if it moved much, the machine was busy during the run.
        peaks["float32_at_end"] = gemm_peak(
            torch.float32, n=gemm_n, min_run_time=min_run_time, timer=timer
        )
        payload.update(
            gemm_peak_gflops=peaks,
            gemm_n=gemm_n,
            lengths=list(lengths),
            rounds=rounds,
            clock="process CPU time" if args.cpu_time else "wall time",
            rows=rows,
        )
        print(timing_tables(rows))
        print(f"float32 GEMM peak at the end of the run: {peaks['float32_at_end']:.1f} GFLOP/s\n")

    payload["load_average_at_end"] = list(os.getloadavg())
    targets = check_targets(rows, memory, lengths)
    payload["targets"] = targets
    if targets:
        print("targets (issue 2)")
        print(
            format_table(
                ["target", "measured", "met"],
                [[t["target"], f"{t['value']:.3f}", "yes" if t["met"] else "NO"] for t in targets],
            )
        )
    directory = None if args.results_dir is None else Path(args.results_dir)
    name = "attention_quick" if args.quick else "attention"
    if args.cpu_time or args.threads is not None:
        name += f"_{'cpu' if args.cpu_time else 'wall'}_t{torch.get_num_threads()}"
    path = write_json(
        name,
        payload,
        directory=directory,
        report={
            "title": "Attention (issue 2): `benchmarks/bench_attention.py`",
            "tables": (
                [
                    {
                        "caption": f"fp32, E={E}, H={H}, B={B}; {torch.get_num_threads()} "
                        f"threads, {payload['clock']}, {rounds} rounds. Multihead ÷ the others:",
                        "header": ["section", *(f"T={t}" for t in lengths)],
                        "rows": [
                            [
                                f"{title} ÷ {impl}",
                                *(
                                    f"{r['ours_over_this']:.3f}"
                                    for t in lengths
                                    for r in rows
                                    if (r["section"], r["T"], r["impl"]) == (title, t, impl)
                                ),
                            ]
                            for title, _, _, impls in SECTIONS
                            for impl in ("torch", "floor")
                            if impl in impls
                        ],
                    }
                ]
                if rows
                else []
            )
            + (
                [
                    {
                        "caption": f"Targets of issue 2 ({sum(t['met'] for t in targets)} of "
                        f"{len(targets)} met): the missed ones, and those not in a table above:",
                        "header": ["target", "measured", "met"],
                        "rows": [
                            [t["target"], f"{t['value']:.3f}", "yes" if t["met"] else "**no**"]
                            for t in targets
                            if not t["met"]
                            or not t["target"].startswith(
                                (f"multihead ÷ torch ≤ {TARGET_VS_TORCH} ", "multihead ÷ floor")
                            )
                        ],
                        "target_column": "target",
                    }
                ]
                if targets
                else []
            ),
            "load_before": info["load_average"],
            "load_after": payload["load_average_at_end"],
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")
    return 0


def main_gpu(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> int:
    if device.index is not None:
        torch.cuda.set_device(device)
    info = machine_info()
    gpu = info["gpu"]
    if args.quick:
        print("quick smoke run: the numbers below are not meaningful\n")
    print(
        f"{gpu['name']} ({gpu['memory_gib']} GiB), torch {info['torch']} (CUDA {gpu['cuda']}), "
        f"triton {gpu['triton']}, {dtype}\ncommand: {info['command']}\n"
    )
    shapes = QUICK_GPU_SHAPES if args.quick else GPU_SHAPES
    payload = {"machine": info, **run_gpu(device, dtype, shapes, args.quick)}
    print(
        f"write bandwidth (fill_ of 1 GiB): {payload['write_bandwidth_bytes_per_s'] / 1e12:.2f} "
        f"TB/s; max abs difference from torch: {payload['max_abs_difference']:.2e}\n"
    )
    print(gpu_table(payload))
    directory = None if args.results_dir is None else Path(args.results_dir)
    path = write_json(
        "attention_gpu_quick" if args.quick else "attention_gpu",
        payload,
        directory=directory,
        report={
            "title": "need_weights on the GPU (issue 23): `bench_attention.py --device cuda`",
            "gpu": True,
            "load_before": info["load_average"],
            "tables": [
                {
                    "caption": f"E = {GPU_E}, {GPU_H} heads, {str(dtype).removeprefix('torch.')}; "
                    f"write bandwidth {payload['write_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; "
                    f"largest difference from torch {payload['max_abs_difference']:.1e}:",
                    "header": [
                        "section",
                        "B",
                        "T",
                        "multihead (ms)",
                        "torch (ms)",
                        "multihead ÷ torch",
                        "peak MiB, multihead / torch",
                        "weights written by multihead",
                    ],
                    "rows": [
                        [
                            m["section"],
                            m["B"],
                            m["T"],
                            f"{m['seconds'] * 1e3:.3f}",
                            f"{o['seconds'] * 1e3:.3f}",
                            f"{o['ours_over_this']:.2f}",
                            f"{m['peak_bytes'] / 2**20:.0f} / {o['peak_bytes'] / 2**20:.0f}",
                            f"{m['weights_bytes_per_s'] / 1e12:.2f} TB/s "
                            f"({m['write_limit_seconds'] / m['seconds']:.0%} of the write limit)"
                            if "weights_bytes_per_s" in m
                            else "—",
                        ]
                        for m in payload["rows"]
                        for o in payload["rows"]
                        if m["impl"] == "multihead"
                        and (o["section"], o["B"], o["T"], o["impl"])
                        == (m["section"], m["B"], m["T"], "torch")
                    ],
                }
            ],
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
