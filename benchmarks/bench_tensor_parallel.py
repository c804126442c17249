"""Heads of a tensor-parallel model: peak memory per rank and time of ``capture``, against the plain
tensor-parallel forward and against capture in one process.

A Llama-shaped model whose weights dominate memory (default: 8 layers, width 2048, 16 query / 4
key-value heads, intermediate 5632, vocabulary 32000: about 2.3 GB in float32) is built with
random weights and saved once (``--model-dir`` keeps it between runs). Each configuration then runs
in fresh spawned processes (gloo on 127.0.0.1):

- ``tp forward``: W ranks load it with ``tp_plan="auto"`` and run a plain forward;
- ``tp capture``: the same, inside ``multihead.capture(model, rows=[-1])`` (one query row of every
  head of every layer, gathered on every rank);
- ``1 process capture`` (and ``1 process forward``): one process loads the whole model.

Every forward keeps only the last position's logits (``logits_to_keep=1``): a capture needs no
(T, vocabulary) logits, and they would be the same in every configuration. A process loads the
model, warms up on 16 tokens, then resets its peak resident memory (``echo 5 >
/proc/self/clear_refs`` sets VmHWM to VmRSS) and runs ``--repeat`` forwards at ``--seq-len``
tokens; "peak RSS" is VmHWM after them: the weights it holds plus everything the forwards needed.
RSS counts every page a process maps, also the pages of the model file (transformers maps the
safetensors file and a rank's shards are views into it) that the other ranks map too: a row-wise
shard, half of each row, touches every page of its whole matrix, so both ranks count those pages.
"peak PSS" counts each shared page once over the processes sharing it (its proportional share,
``Pss`` of /proc/self/smaps_rollup, after the forwards) plus what the forwards held above that
at their peak (VmHWM - VmRSS then: activations, which no one shares): what the machine really
spends per rank. Time is the wall time of one forward between barriers, the slowest rank's, the
median over the repeats. Ranks run ``--threads`` threads each, the single process W times as
many (the same total).

Rank 0's captured weights are compared with the single process's (the largest difference is
printed and saved): the tensor-parallel capture must be the same capture.

Run from the repository root (needs transformers and accelerate; the full size takes minutes and
about 2.3 GB of disk and 4 GB of memory at once)::

    python benchmarks/bench_tensor_parallel.py            # the Llama shape above, T=2048
    python benchmarks/bench_tensor_parallel.py --quick    # tiny sizes, seconds: a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import (
    format_table,
    machine_info,
    reset_peak,
    rollup_kib,
    spawn,
    status_kib,
    write_json,
)


@dataclass(frozen=True)
class Shape:
    layers: int
    width: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


FULL = Shape(layers=8, width=2048, heads=16, kv_heads=4, intermediate=5632, vocab=32000)
QUICK = Shape(layers=2, width=64, heads=4, kv_heads=2, intermediate=128, vocab=256)


@dataclass(frozen=True)
class Run:
    world: int  # 0: one process, no process group
    capture: bool
    threads: int
    seq_len: int
    repeat: int
    model_dir: str
    rendezvous: str  # a file for the group's rendezvous (unused by one process)
    weights_out: str  # where rank 0 saves its captured weights ("" for none)


def _save_model(shape: Shape, path: str) -> None:
    """Build the model with random weights and save it (in its own process: it holds them all)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.width,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def _load(run: Run) -> Any:
    import transformers

    if run.world == 0:
        return transformers.AutoModelForCausalLM.from_pretrained(run.model_dir)
    # tp_plan="auto" in the form every transformers >= 5.15 takes: the model's own plan
    from transformers.distributed import DistributedConfig

    return transformers.AutoModelForCausalLM.from_pretrained(
        run.model_dir, distributed_config=DistributedConfig(tp_size=run.world)
    )


def _barrier(run: Run) -> None:
    if run.world > 0:
        dist.barrier()


def _process(rank: int, run: Run, queue: Any) -> None:
    try:
        torch.set_num_threads(run.threads)
        if run.world > 0:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(run.world),
                LOCAL_WORLD_SIZE=str(run.world),
            )
            dist.init_process_group(
                "gloo",
                init_method=f"file://{run.rendezvous}",
                rank=rank,
                world_size=run.world,
                timeout=datetime.timedelta(minutes=30),
            )
        import multihead

        model = _load(run).eval()
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, run.seq_len), generator=torch.Generator().manual_seed(0))

        def forward(tokens: torch.Tensor) -> Any:
            if not run.capture:
                model(tokens, logits_to_keep=1)
                return None
            with multihead.capture(model, rows=[-1]) as rec:
                model(tokens, logits_to_keep=1)
            return rec.stack()  # (L, B, H, 1, S)

        with torch.no_grad():
            forward(ids[:, :16])  # warm-up: kernels, thread pools, the group's connections
        gc.collect()
        _barrier(run)
        resident = status_kib("VmRSS")
        reset = reset_peak()
        times, cpu_times, weights = [], [], None
        for _ in range(run.repeat):
            _barrier(run)
            start, cpu_start = time.perf_counter(), time.process_time()
            with torch.no_grad():
                weights = forward(ids)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        peak = status_kib("VmHWM")
        now, pss, file_backed = status_kib("VmRSS"), rollup_kib("Pss"), status_kib("RssFile")
        if rank == 0 and run.weights_out and weights is not None:
            torch.save(weights, run.weights_out)
        queue.put(
            (
                rank,
                {
                    "resident_mib": resident / 1024,
                    "peak_mib": peak / 1024,
                    # the shared pages in proportion, plus the forwards' transient peak
                    "peak_pss_mib": None if pss is None else (pss + peak - now) / 1024,
                    "file_backed_mib": file_backed / 1024,
                    "peak_reset": reset,
                    "times_s": times,
                    "cpu_times_s": cpu_times,
                },
            )
        )
        if run.world > 0:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as e:
        queue.put((rank, {"error": repr(e)}))
        raise


def _save_in_process(rank: int, shape: Shape, path: str, queue: Any) -> None:
    try:
        _save_model(shape, path)
        queue.put((rank, {}))
    except BaseException as e:
        queue.put((rank, {"error": repr(e)}))
        raise


def measure(run: Run) -> dict[str, Any]:
    """Run one configuration in fresh processes; every rank's numbers and the summary."""
    ranks = spawn(_process, (run,), max(run.world, 1))
    times = [max(r["times_s"][i] for r in ranks) for i in range(run.repeat)]
    return {
        "config": asdict(run),
        "ranks": ranks,
        "peak_mib": max(r["peak_mib"] for r in ranks),
        "peak_pss_mib": max((r["peak_pss_mib"] or float("nan")) for r in ranks),
        "file_backed_mib": max(r["file_backed_mib"] for r in ranks),
        "resident_mib": max(r["resident_mib"] for r in ranks),
        "time_s": statistics.median(times),
        "cpu_s": max(statistics.median(r["cpu_times_s"]) for r in ranks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="T, tokens per forward")
    parser.add_argument("--world", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--repeat", type=int, default=2, help="timed forwards per configuration")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the model is saved (made once, kept); default a temporary directory",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: a 2-layer width-64 model, T=64"
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where to write the JSON (benchmarks/results)",
    )
    args = parser.parse_args(argv)
    for name in ("transformers", "accelerate"):
        if importlib.util.find_spec(name) is None:
            print(f"bench_tensor_parallel: needs {name} (pip install {name})", file=sys.stderr)
            return 2
    shape = QUICK if args.quick else FULL
    if args.quick:
        args.seq_len, args.repeat = 64, 1
    if args.world < 2 or shape.heads % args.world or shape.kv_heads % args.world:
        parser.error(
            f"--world must be >= 2 and divide {shape.heads} heads and {shape.kv_heads} key/value "
            f"heads, got {args.world}"
        )
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or Path(scratch, "model")
        if not (model_dir / "config.json").is_file():
            print(f"building and saving the model in {model_dir}...")
            sys.stdout.flush()
            spawn(_save_in_process, (shape, str(model_dir)), 1)

        def run(world: int, capture: bool) -> Run:
            tag = f"{world}-{int(capture)}"
            return Run(
                world=world,
                capture=capture,
                threads=args.threads * (args.world if world == 0 else 1),
                seq_len=args.seq_len,
                repeat=args.repeat,
                model_dir=str(model_dir),
                rendezvous=str(Path(scratch, f"rendezvous-{tag}")),
                weights_out=str(Path(scratch, f"weights-{tag}.pt")) if capture else "",
            )

        plan = {
            "tp forward": run(args.world, False),
            "tp capture": run(args.world, True),
            "1 process forward": run(0, False),
            "1 process capture": run(0, True),
        }
        results = {}
        for label, cfg in plan.items():
            print(f"running {label} ({max(cfg.world, 1)} process(es), {cfg.threads} thread(s))...")
            sys.stdout.flush()
            results[label] = measure(cfg)
        tp_weights = torch.load(plan["tp capture"].weights_out, weights_only=True)
        one_weights = torch.load(plan["1 process capture"].weights_out, weights_only=True)
        difference = float((tp_weights - one_weights).abs().max())

    base_tp, base_one = results["tp forward"], results["1 process capture"]
    rows = []
    for label, r in results.items():
        rows.append(
            [
                label,
                f"{max(r['config']['world'], 1)}×{r['config']['threads']}",
                f"{r['resident_mib']:.0f}",
                f"{r['peak_mib']:.0f}",
                f"{r['peak_mib'] / base_tp['peak_mib']:.2f}x",
                f"{r['peak_mib'] / base_one['peak_mib']:.2f}x",
                f"{r['file_backed_mib']:.0f}",
                f"{r['peak_pss_mib']:.0f}",
                f"{r['peak_pss_mib'] / base_one['peak_pss_mib']:.2f}x",
                f"{r['time_s']:.3g}",
                f"{r['time_s'] / base_tp['time_s']:.2f}x",
                f"{r['cpu_s']:.3g}",
            ]
        )
    headers = [
        "run",
        "procs×threads",
        "resident MiB/rank",
        "peak RSS MiB/rank",
        "vs tp forward",
        "vs 1 proc capture",
        "of it file-backed MiB",
        "peak PSS MiB/rank",
        "PSS vs 1 proc capture",
        "time s",
        "vs tp forward",
        "CPU s busiest",
    ]
    info = machine_info()
    print()
    print(
        f"Llama-shaped: {shape.layers} layers, width {shape.width}, {shape.heads}/{shape.kv_heads} "
        f"heads, intermediate {shape.intermediate}, vocabulary {shape.vocab}, fp32; T="
        f"{args.seq_len}, one captured row per head; {info['cpu']}, {info['cores']} cores, "
        f"torch {info['torch']}"
    )
    print(format_table(headers, rows))
    if not all(rank["peak_reset"] for r in results.values() for rank in r["ranks"]):
        print("note: /proc/self/clear_refs was not writable: peaks count from process start")
    print(f"largest difference, tp capture vs 1 process capture: {difference:.2e}")
    tp = results["tp capture"]
    targets = [
        ("peak RSS per rank ≤ 1.1× the tp forward's", tp["peak_mib"] / base_tp["peak_mib"], 1.1),
        (
            "peak RSS per rank ≤ 0.7× 1 process capture's",
            tp["peak_mib"] / base_one["peak_mib"],
            0.7,
        ),
        (
            "peak PSS per rank (shared pages in proportion) ≤ 0.7× 1 process capture's",
            tp["peak_pss_mib"] / base_one["peak_pss_mib"],
            0.7,
        ),
        ("capture time ≤ 1.15× the tp forward's", tp["time_s"] / base_tp["time_s"], 1.15),
    ]
    for text, ratio, limit in targets:
        print(f"target {text}: {ratio:.2f}× ({'met' if ratio <= limit else 'MISSED'})")
    path = write_json(
        "tensor_parallel_quick" if args.quick else "tensor_parallel",
        {
            "machine": info,
            "shape": asdict(shape),
            "seq_len": args.seq_len,
            "headers": headers,
            "rows": rows,
            "results": results,
            "max_abs_difference": difference,
            "targets": [
                {"target": text, "ratio": ratio, "limit": limit} for text, ratio, limit in targets
            ],
        },
        directory=args.results_dir,
        report={
            "title": "Tensor-parallel capture (issue 22): `benchmarks/bench_tensor_parallel.py`",
            "tables": [
                {
                    "caption": f"Llama-shaped: {shape.layers} layers, width {shape.width}, "
                    f"{shape.heads}/{shape.kv_heads} heads, intermediate {shape.intermediate}, "
                    f"vocabulary {shape.vocab}, fp32; T = {args.seq_len}, one captured row per "
                    "head; per rank, the busier rank's figure:",
                    "header": headers,
                    "rows": rows,
                },
                {
                    "header": ["target", "measured", "met"],
                    "rows": [
                        [text, f"{ratio:.2f}×", "yes" if ratio <= limit else "**no**"]
                        for text, ratio, limit in targets
                    ],
                    "target_column": "target",
                },
            ],
            "packages": ["transformers", "accelerate"],
            "load_after": info["load_average"],
            "notes": [f"Largest difference, tp capture vs 1 process capture: {difference:.2e}."],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
