"""Shared helpers for the benchmark scripts in this directory.

Every benchmark script follows the same shape: time a grid of callables with
:func:`median_time` (``torch.utils.benchmark.Timer``: warm-up, ``blocked_autorange``, median),
measure the machine's GEMM peak in the same run with :func:`gemm_peak` (the roofline that
achieved GFLOP/s are compared against), print an aligned table with :func:`format_table`, and
write everything, together with :func:`machine_info`, to ``benchmarks/results/<name>.json`` with
:func:`write_json` (that directory is git-ignored).

Scripts import this module as ``from common import ...``: Python puts the script's own
directory on ``sys.path`` when it runs ``python benchmarks/<script>.py``.

Example::

    from common import format_table, gemm_peak, machine_info, median_time, write_json

    peak = gemm_peak(torch.float32)
    seconds = median_time(lambda: model(x), min_run_time=1.0)
    print(format_table(["impl", "ms"], [["ours", f"{seconds * 1e3:.2f}"]]))
    write_json("my_bench", {"machine": machine_info(), "peak": peak, "rows": [...]})
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.benchmark import Timer

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median_time(
    fn: Callable[[], object],
    *,
    min_run_time: float = 1.0,
    warmup: int = 2,
    timer: Callable[[], float] | None = None,
) -> float:
    """Median time of one call of ``fn``, in seconds.

    Calls ``fn`` ``warmup`` times first (allocator, lazy initialisation, oneDNN primitive
    caches), then lets ``Timer.blocked_autorange`` pick a block size and run blocks for at least
    ``min_run_time`` seconds, and returns the median over blocks (robust to the odd slow block
    on a shared machine).

    Args:
        fn: The zero-argument callable to time. Its result is discarded.
        min_run_time: Seconds of measurement after warm-up (at least one block always runs).
        warmup: Untimed calls before measuring.
        timer: The clock; default wall time (``timeit.default_timer``). ``time.process_time``
            counts this process's CPU time instead, which other work on a shared machine
            disturbs much less (with one thread; several threads add their spin-waits).

    Returns:
        The median seconds per call.
    """
    for _ in range(warmup):
        fn()
    measure = Timer(
        stmt="fn()",
        globals={"fn": fn},
        num_threads=torch.get_num_threads(),
        timer=timeit.default_timer if timer is None else timer,
    )
    return float(measure.blocked_autorange(min_run_time=min_run_time).median)


def cuda_time(
    fn: Callable[[], object],
    *,
    min_run_time: float = 0.5,
    warmup: int = 3,
    max_repeats: int = 200,
) -> float:
    """Median time of one call of ``fn`` on the current CUDA device, in seconds.

    Calls ``fn`` ``warmup`` times (kernel compilation, cuBLAS handles, allocator), then times
    each call between two CUDA events until ``min_run_time`` seconds of GPU time or
    ``max_repeats`` calls have passed, and returns the median. Events time the device's work,
    not the host's queueing of it; the host waits once per call (``synchronize``), so calls do
    not overlap.

    Args:
        fn: The zero-argument callable to time.
        min_run_time: Seconds of measurement after warm-up (at least 5 calls always run).
        warmup: Untimed calls before measuring.
        max_repeats: The most timed calls.

    Returns:
        The median seconds per call.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < max_repeats and (len(times) < 5 or sum(times) < min_run_time):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def cuda_peak_memory(fn: Callable[[], object]) -> int:
    """Bytes of CUDA memory that one call of ``fn`` allocates at its peak, beyond what was
    allocated before it (``torch.cuda.max_memory_allocated``)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def gemm_peak(
    dtype: torch.dtype,
    *,
    n: int = 2048,
    min_run_time: float = 1.0,
    timer: Callable[[], float] | None = None,
) -> float:
    """Achieved GFLOP/s of one square ``n × n @ n × n`` matmul: the roofline of this run.

    Measured, not looked up, because the number that matters is what torch's BLAS reaches on
    this machine with this many threads right now.

    Args:
        dtype: Element type, e.g. ``torch.float32`` or ``torch.bfloat16``.
        n: Matrix side; 2048 is large enough to saturate a few CPU cores.
        min_run_time: Seconds of measurement, see :func:`median_time`.
        timer: The clock, see :func:`median_time`.

    Returns:
        GFLOP/s, counting ``2·n³`` floating-point operations per matmul.
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    seconds = median_time(lambda: torch.mm(a, b), min_run_time=min_run_time, timer=timer)
    return 2 * n**3 / seconds / 1e9


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or ``platform.processor()`` where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The CPU flags that change which kernels torch runs (and so every ratio): vector widths, the
# bfloat16/int8 dot products and AMX tiles.
_SPEED_FLAGS = ("avx", "fma", "avx2", "avx512", "avx_vnni", "amx")


def cpu_flags() -> list[str]:
    """The speed-relevant flags of /proc/cpuinfo (``_SPEED_FLAGS`` prefixes), sorted."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted(x for x in flags if x.startswith(_SPEED_FLAGS))
    except OSError:
        pass
    return []


def device_argument(value: str) -> torch.device:
    """``--device`` for argparse (``type=``): cpu, cuda or cuda:N, on a machine that has it."""
    try:
        device = torch.device(value)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{value}: this machine has no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{value}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return device


def minilm_argument(value: str) -> Path:
    """``--model`` for argparse (``type=``): a directory of all-MiniLM-L6-v2's files."""
    path = Path(value)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{value!r} holds no config.json (scripts/minilm_files.py writes MiniLM's files)"
        )
    return path


def gpu_info() -> dict[str, Any] | None:
    """The CUDA device's name, memory and compute capability, and torch's CUDA version; None
    without CUDA."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info: dict[str, Any] = {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def machine_info() -> dict[str, Any]:
    """What to print beside any published number: machine, software, threads and command."""
    return {
        "gpu": gpu_info(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "command": " ".join(["python", *sys.argv]),
        # Other work on the machine skews timings: record how busy it was.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An aligned plain-text table: text columns left-aligned, numeric columns right-aligned.

    Args:
        headers: Column titles.
        rows: One sequence of cells per row, each as long as ``headers``. Cells are formatted
            with ``str``; format floats before passing them to choose their precision.

    Returns:
        The table as one string, header and a dashed rule first, without a trailing newline.
    """
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def numeric(i: int) -> bool:
        values = [row[i] for row in cells[1:] if row[i] not in ("", "-")]
        try:
            [float(v.rstrip("x%")) for v in values]
        except ValueError:
            return False
        return bool(values)

    right = [numeric(i) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def write_json(name: str, payload: dict[str, Any], *, directory: Path | None = None) -> Path:
    """Write ``payload`` as indented JSON to ``<directory>/<name>.json``.

    Args:
        name: File stem, usually the script's name without ``bench_``.
        payload: JSON-serialisable results (machine info, peaks, rows).
        directory: Where to write; defaults to ``benchmarks/results`` (created if missing).

    Returns:
        The path written.
    """
    directory = RESULTS_DIR if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


# -- spawned processes and their memory ------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, RssFile, ...); Linux only."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def rollup_kib(field: str) -> int | None:
    """A field of /proc/self/smaps_rollup (e.g. Pss), or None where the kernel has none."""
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset VmHWM to the current VmRSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def spawn(
    target: Callable[..., None],
    args: tuple[Any, ...],
    count: int,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``target(rank, *args, queue)`` in ``count`` spawned processes (``env`` set while they
    start); each puts ``(rank, payload)`` once, a dict, ``{"error": ...}`` when it failed.
    Returns the payloads in rank order; a failure raises a RuntimeError naming the rank, and
    the processes still running are killed."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(count)]
        for p in procs:
            p.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    got: dict[int, dict[str, Any]] = {}
    try:
        while len(got) < count:
            rank, payload = queue.get()
            if "error" in payload:
                raise RuntimeError(f"rank {rank} failed: {payload['error']}")
            got[rank] = payload
    finally:
        for p in procs:
            if got.keys() != set(range(count)):
                p.kill()
            p.join()
    return [got[r] for r in range(count)]
