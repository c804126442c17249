"""Where ``capture(rows=[-1])``'s extra time goes on a GPU: kernels and CPU time per forward.

The Llama-shaped model of ``bench_hf.py --device cuda`` (hidden 2048, 16 layers, 16/4 heads) runs
one forward of T tokens plainly (``attn_implementation="multihead"``, no observer) and inside
``capture``. Printed: wall time of each (CUDA events), the host's time to enter and leave the
``capture`` block with no forward, and, from ``torch.profiler``, every GPU kernel that the
captured forward launches beyond the plain one (name, launches per layer, GPU time), so the
observer's cost can be read kernel by kernel.

Usage::

    python benchmarks/profile_capture.py [--length 4096] [--dtype bfloat16] [--quick]

Writes ``benchmarks/results/profile_capture.json`` (``--results-dir`` to choose the folder).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_hf import build_gpu
from common import cuda_time, format_table, machine_info, write_json

import multihead
import multihead.hf  # noqa: F401  (registers attn_implementation="multihead")


def _kernels(run: Any) -> dict[str, tuple[int, float]]:
    """GPU kernels launched by one call of ``run``: name -> (launches, GPU microseconds)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    found: dict[str, tuple[int, float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            count, micros = found.get(event.name, (0, 0.0))
            found[event.name] = (count + 1, micros + event.device_time)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a tiny model at T=256")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_capture: needs a CUDA device", file=sys.stderr)
        return 2
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build_gpu(args.quick, device, dtype)
    model.set_attn_implementation("multihead")
    length = 256 if args.quick else args.length
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 1000, (1, length), device=device)

    def plain() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    def captured() -> None:
        with torch.no_grad(), multihead.capture(model, rows=[-1]):
            model(input_ids=ids, use_cache=False)

    def enter_exit() -> None:
        with multihead.capture(model, rows=[-1]):
            pass

    seconds = {
        name: cuda_time(fn, min_run_time=0.3)
        for name, fn in (("plain", plain), ("capture", captured))
    }
    for _ in range(3):
        enter_exit()
    start = time.perf_counter()
    for _ in range(20):
        enter_exit()
    block_seconds = (time.perf_counter() - start) / 20
    start = time.perf_counter()
    for _ in range(5):
        plain()
    host_plain = (time.perf_counter() - start) / 5  # the host's queueing time, GPU running behind
    torch.cuda.synchronize()

    base, more = _kernels(plain), _kernels(captured)
    extra = []
    for name, (count, micros) in more.items():
        count0, micros0 = base.get(name, (0, 0))
        if count > count0:
            extra.append(
                [name[:70], f"{(count - count0) / layers:.1f}", f"{(micros - micros0) / 1e3:.3f}"]
            )
    extra.sort(key=lambda row: -float(row[2]))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {dtype}, T={length}\n")
    print(
        f"plain {seconds['plain'] * 1e3:.2f} ms, capture {seconds['capture'] * 1e3:.2f} ms "
        f"(÷ {seconds['capture'] / seconds['plain']:.3f}); entering+leaving capture alone "
        f"{block_seconds * 1e3:.3f} ms on the host; the plain forward's host time "
        f"{host_plain * 1e3:.2f} ms\n"
    )
    print("kernels the captured forward launches beyond the plain one:")
    print(format_table(["kernel", "launches per layer", "GPU ms per forward"], extra))
    payload = {
        "machine": machine_info(),
        "T": length,
        "seconds": seconds,
        "block_seconds": block_seconds,
        "host_plain_seconds": host_plain,
        "extra_kernels": extra,
    }
    directory = None if args.results_dir is None else Path(args.results_dir)
    path = write_json("profile_capture", payload, directory=directory)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
