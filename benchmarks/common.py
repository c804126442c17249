"""Shared helpers for the benchmark scripts in this directory.

Every benchmark script follows the same shape: time a grid of callables with
:func:`median_time` (``torch.utils.benchmark.Timer``: warm-up, ``blocked_autorange``, median),
measure the machine's GEMM peak in the same run with :func:`gemm_peak` (the roofline that
achieved GFLOP/s are compared against), print an aligned table with :func:`format_table`, and
write everything, together with :func:`machine_info`, to ``benchmarks/results/<name>.json`` with
:func:`write_json`. Its ``report`` (the table the script prints, as :func:`report_block` makes
it) is the section ``benchmarks/report.py`` renders into BENCHMARKS.md; the files of the current
figures are committed (tests and smoke runs write elsewhere: ``--results-dir``).

Scripts import this module as ``from common import ...``: Python puts the script's own
directory on ``sys.path`` when it runs ``python benchmarks/<script>.py``.

Example::

    from common import format_table, gemm_peak, machine_info, median_time, write_json

    peak = gemm_peak(torch.float32)
    seconds = median_time(lambda: model(x), min_run_time=1.0)
    rows = [["ours", f"{seconds * 1e3:.2f}"]]
    print(format_table(["impl", "ms"], rows))
    write_json(
        "my_bench",
        {"machine": machine_info(), "peak": peak},
        report={"title": "My benchmark", "tables": [{"header": ["impl", "ms"], "rows": rows}]},
    )
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
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


def interleaved_rounds(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
    base: str = "fwdbwd",
) -> tuple[dict[str, float], dict[str, float]]:
    """Time every call once per round, in turn (the first round is a warm-up; on a GPU each call
    synchronised): the median seconds of each, and the median over rounds of each one's time ÷
    the same round's ``base`` call's (a machine whose speed drifts moves both sides of a round's
    ratio together).

    Args:
        fns: name -> zero-argument callable; ``base`` among them.
        rounds: Measured rounds (after the warm-up round).
        device: Where the calls run (a CUDA device is synchronised around each).
        clock: The clock; ``time.process_time`` counts this process's CPU time instead.
        base: The call the ratios divide by.

    Returns:
        (median seconds, median ratio to ``base``), each keyed by name.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(rounds + 1):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:
                times[name].append(clock() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratios = {
        name: statistics.median(a / b for a, b in zip(t, times[base], strict=True))
        for name, t in times.items()
    }
    return medians, ratios


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


def allocated_peak(fn: Callable[[], object]) -> int:
    """The CPU allocator's peak bytes during ``fn()`` beyond what was held before it: the
    highest "Total Allocated" of torch.profiler's memory events (``profile_memory=True``)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text(encoding="utf-8"))["traceEvents"]
    # each allocation and free is an event carrying the bytes allocated since the start
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max([0, *totals])


def peak_bytes(fn: Callable[[], object], device: torch.device) -> dict[str, int]:
    """The memory ``fn()`` needs at its peak beyond what is held before it: "tensors" (the
    allocator's: on a GPU :func:`cuda_peak_memory`, on the CPU :func:`allocated_peak` of a
    second call) and on the CPU "resident" (the process's VmHWM over the first call, which also
    counts code loaded on first use and what the C allocator keeps)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return {"tensors": cuda_peak_memory(fn)}
    before = status_kib("VmRSS")
    if not reset_peak():  # the peak resident set restarts from the current one
        raise RuntimeError("peak_bytes: /proc/self/clear_refs is not writable: no resident peak")
    fn()
    resident = (status_kib("VmHWM") - before) * 1024
    return {"tensors": allocated_peak(fn), "resident": resident}


def probe_peaks(script: str, what: str, quick: bool, device: torch.device) -> dict[str, int]:
    """The peaks a fresh process of ``script`` prints for ``--memory-probe what`` (the last line
    of its output, JSON: :func:`peak_bytes`), on ``device``, ``--quick`` when asked."""
    command = [sys.executable, script, "--memory-probe", what, "--device", str(device)]
    done = subprocess.run(
        command + (["--quick"] if quick else []),
        capture_output=True, text=True, check=True, env=dict(os.environ),
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


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


def write_json(
    name: str,
    payload: dict[str, Any],
    *,
    directory: Path | None = None,
    report: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``payload`` as indented JSON to ``<directory>/<name>.json``.

    Args:
        name: File stem, usually the script's name without ``bench_``.
        payload: JSON-serialisable results (machine info, peaks, rows).
        directory: Where to write; defaults to ``benchmarks/results`` (created if missing).
        report: Keyword arguments of :func:`report_block`, its ``tables`` those of
            :func:`report_table` (``header``, ``rows``, ``caption``, ``target_column``): the
            payload gets the block as ``"report"``, BENCHMARKS.md's section. Left out where
            ``tables`` is empty (a run that measured nothing to show).

    Returns:
        The path written.
    """
    if report is not None and report.get("tables"):
        tables = [report_table(**table) for table in report["tables"]]
        payload = {**payload, "report": report_block(**{**report, "tables": tables})}
    directory = RESULTS_DIR if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


# -- report blocks: what BENCHMARKS.md shows ------------------------------------------------------
#
# A results file's "report" key holds one section of BENCHMARKS.md, which benchmarks/report.py
# renders (it reads nothing else of the file):
#
#   title     the section's heading
#   source    "measured" (written by a script), or where the figures were copied from
#   commands  the command line(s) that produced the figures
#   machine   {"cpu", "cores", "cpu_flags" (the REPORT_FLAGS present; None: not recorded),
#             "cpu_lacks" (["AVX-512", "AMX"] where absent), "gpu", "gpu_memory_gib"; "note"}
#   versions  {"python", "torch", and "transformers" and the like where the run used them}
#   date      YYYY-MM-DD
#   load      the load average before the run (and at its end where known), or "not recorded"
#   commit    the checkout measured (optional)
#   tables    [{"caption", "header", "rows" (strings), "target_column"}], at least one
#   notes     findings of this run, with their figures (optional)

# The CPU flags named beside a timing (lscpu's spelling): vector widths, the bfloat16/int8 dot
# products and AMX tiles.
REPORT_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def parse_lscpu(text: str) -> dict[str, str]:
    """``lscpu``'s ``Key: value`` lines as a dict (the first of a repeated key wins)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            fields.setdefault(key.strip(), value.strip())
    return fields


def lscpu() -> dict[str, str]:
    """:func:`parse_lscpu` of this machine's ``lscpu``; empty where there is none."""
    try:
        done = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_lscpu(done.stdout)


def report_machine(*, gpu: bool = False, fields: dict[str, str] | None = None) -> dict[str, Any]:
    """The report block's ``machine``: CPU model, cores and flags from ``lscpu`` (``fields``,
    default this machine's; /proc/cpuinfo where lscpu is missing), and with ``gpu`` the CUDA
    device's name and memory."""
    fields = lscpu() if fields is None else fields
    flags = fields["Flags"].split() if "Flags" in fields else cpu_flags()
    cores = fields.get("CPU(s)", "")
    machine: dict[str, Any] = {
        "cpu": fields.get("Model name") or cpu_model(),
        "cores": int(cores) if cores.isdigit() else os.cpu_count(),
        "cpu_flags": [f for f in REPORT_FLAGS if f in flags] if flags else None,
        "cpu_lacks": [
            name
            for name, prefix in (("AVX-512", "avx512"), ("AMX", "amx"))
            if not any(f.startswith(prefix) for f in flags)
        ]
        if flags
        else [],
        "gpu": None,
    }
    info = gpu_info() if gpu else None
    if info is not None:
        machine["gpu"] = info["name"]
        machine["gpu_memory_gib"] = info["memory_gib"]
    return machine


def report_versions(packages: Sequence[str] = (), *, gpu: bool = False) -> dict[str, str]:
    """Python's and torch's versions, and each of ``packages`` that is installed (with ``gpu``,
    triton's too)."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in [*packages, *(["triton"] if gpu else [])]:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def report_commit() -> str | None:
    """The checkout this file is in, ``git rev-parse --short HEAD`` (``"... with uncommitted
    changes"`` when tracked files differ from it); None outside a git checkout."""
    here = str(Path(__file__).resolve().parent)
    try:
        sha = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha} with uncommitted changes" if dirty else sha


def report_command() -> str:
    """This process's command line, the script named relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parent.parent
    name = str(script.relative_to(root)) if script.is_relative_to(root) else sys.argv[0]
    return " ".join(["python", name, *sys.argv[1:]])


def report_load(before: Sequence[float] | None = None, after: Sequence[float] | None = None) -> str:
    """The one-minute load averages ``before`` and ``after`` the run, as the report shows them."""
    parts = []
    if before:
        parts.append(f"{before[0]:.1f} before the run")
    if after:
        parts.append(f"{after[0]:.1f} at its end")
    return ", ".join(parts) or "not recorded"


def report_table(
    header: Sequence[object],
    rows: Sequence[Sequence[object]],
    *,
    caption: str | None = None,
    target_column: str | None = None,
) -> dict[str, Any]:
    """One table of a report block: every cell a string (``str``; format floats first), every
    row as long as ``header``; ``target_column`` names the column holding the targets."""
    head = [str(c) for c in header]
    body = [[str(c) for c in row] for row in rows]
    for row in body:
        if len(row) != len(head):
            raise ValueError(f"a row of {len(row)} cells under {len(head)} headers: {row}")
    if target_column is not None and target_column not in head:
        raise ValueError(f"target column {target_column!r} is not a header: {head}")
    return {"caption": caption, "header": head, "rows": body, "target_column": target_column}


def report_block(
    title: str,
    tables: Sequence[dict[str, Any]],
    *,
    commands: Sequence[str] | None = None,
    packages: Sequence[str] = (),
    gpu: bool = False,
    load_before: Sequence[float] | None = None,
    load_after: Sequence[float] | None = None,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``"report"`` of a results file: one section of BENCHMARKS.md (benchmarks/report.py).

    Machine, versions, date, commit and command are read from this process; the script passes
    what it measured.

    Args:
        title: The section's heading.
        tables: :func:`report_table` results, at least one: the table the script prints.
        commands: The command lines; default this process's (:func:`report_command`).
        packages: Distributions besides Python and torch whose versions matter (transformers).
        gpu: The run timed a CUDA device: name it (and triton's version).
        load_before: ``os.getloadavg()`` before the run (``machine_info()["load_average"]``
            taken at the start), where the script recorded it.
        load_after: ``os.getloadavg()`` at the end.
        notes: Findings of this run, with their figures (targets met or missed, say).

    Returns:
        The block, JSON-serialisable.
    """
    if not tables:
        raise ValueError("a report block needs at least one table")
    block: dict[str, Any] = {
        "title": title,
        "source": "measured",
        "commands": list(commands) if commands is not None else [report_command()],
        "machine": report_machine(gpu=gpu),
        "versions": report_versions(packages, gpu=gpu),
        "date": datetime.date.today().isoformat(),
        "load": report_load(load_before, load_after),
    }
    commit = report_commit()
    if commit is not None:
        block["commit"] = commit
    block["tables"] = list(tables)
    if notes:
        block["notes"] = list(notes)
    return block


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


def interleaved_children(
    script: str,
    modes: Callable[[int], Sequence[str]],
    lengths: Sequence[int],
    rounds: int,
    extra: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Run ``script --child MODE T *extra`` in a fresh process for every length, round and mode
    (``modes(T)``), the modes rotated by one each round so that none always runs first; each
    child prints one JSON object last. Returns those objects, each with its ``round``.

    Raises:
        RuntimeError: a child failed (the end of its stderr in the message).
    """
    runs: list[dict[str, Any]] = []
    for length in lengths:
        chosen = list(modes(length))
        for r in range(rounds):
            for mode in chosen[r % len(chosen) :] + chosen[: r % len(chosen)]:
                command = [sys.executable, script, "--child", mode, str(length), *extra]
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"{mode} at T={length} failed:\n{done.stderr[-3000:]}")
                runs.append({**json.loads(done.stdout.strip().splitlines()[-1]), "round": r})
    return runs


def timed_forwards(model: Any, mode: str, length: int, repeats: int) -> dict[str, Any]:
    """A benchmark child's figures: ``repeats`` timed forwards (one untimed first) of ``model``
    on one sequence of ``length`` random ids (from 0 to 999), inside
    ``multihead.capture(model, rows=[-1])`` when ``mode`` is ``"capture"``; the seconds, the
    process's peak RSS and the elements the capture recorded."""
    import resource
    import time

    import multihead

    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(1))
    times, recorded = [], 0
    with torch.no_grad():
        for i in range(repeats + 1):
            start = time.perf_counter()
            if mode == "capture":
                with multihead.capture(model, rows=[-1]) as rec:
                    model(input_ids=ids, use_cache=False)
                recorded = sum(w.numel() for w in rec.weights)
            else:
                model(input_ids=ids, use_cache=False)
            if i > 0:
                times.append(time.perf_counter() - start)
    return {
        "mode": mode,
        "T": length,
        "times": times,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "recorded_elements": recorded,
    }
