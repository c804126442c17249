"""Edge attribution's cost: EAP and EAP-IG against one forward and backward of the same batch.

On two models, the metric the mean log-probability of the last position's token 3:

- the induction model's shape: a random attention-only ``TransformerLM`` (2 layers, width
  128, 4 heads, vocabulary 64; B = 64 sequences of T = 32, what ``induction_pair(32)`` holds);
- a random grouped-query ``LlamaForCausalLM`` through the bridge (4 layers, width 256, 8
  query heads on 2 key/value heads, vocabulary 1,000; B = 4, T = 64).

Measures (wall clock; on a GPU synchronised), interleaved: each of ``--rounds`` rounds times
every call once in turn, and a ratio is the median over rounds of the call's time ÷ the same
round's forward and backward (the times shown are each call's median); on the CPU the rounds
run again on one thread in the process's CPU time (``time.process_time``), which a busy machine
disturbs less and in which the small operations' share is not inflated by threads the large
ones use (a target is met when both ratios are within it):
``edge_attribution(ig_steps=1)`` (EAP) ÷ one forward and backward (the metric's gradient for
every parameter, ``torch.autograd.grad``), target ≤ 3×; ``edge_attribution(ig_steps=k)``
(EAP-IG, ``--ig-steps``, default 8) ÷ the same, target ≤ k + 2; the node version,
``attribution_patching(ig_steps=k)`` ÷ the same, target ≤ k + 2 (not an issue target: shown
beside). On the grouped-query model, peak memory: EAP's ÷ one forward and backward's of the same
batch, target ≤ 1 + Hk/H + 10 % (each the median of three processes, alternating), in tensors
(what the allocator holds, as the target counts it): on a GPU ``torch.cuda.max_memory_allocated``
less the memory allocated before; on the CPU the highest "Total Allocated" of torch.profiler's
memory events (``profile_memory=True``) over a second call. Beside it on the CPU, not a target:
the first call's peak resident memory (the process's, reset through ``/proc/self/clear_refs``
after the model and inputs are built, less the resident memory then), which also counts code
loaded on first use and what the C allocator keeps, and moves by megabytes between processes.
``--quick`` runs tiny models in seconds for the smoke test.

Run:  python benchmarks/bench_edge_attribution.py [--rounds 3] [--ig-steps 8] [--device cuda]
      [--quick] [--results-dir DIR]   (--memory-probe eap|fwdbwd: a child's peaks, printed)
Writes benchmarks/results/edge_attribution.json (_gpu on a GPU; _quick with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import (
    device_argument,
    format_table,
    interleaved_rounds,
    machine_info,
    peak_bytes,
    probe_peaks,
    write_json,
)

import multihead
from multihead.models import TransformerLM

INDUCTION = {"layers": 2, "width": 128, "heads": 4, "vocab": 64, "T": 32, "B": 64}
LLAMA = {"layers": 4, "width": 256, "heads": 8, "kv_heads": 2, "vocab": 1000, "T": 64, "B": 4}
QUICK_INDUCTION = {"layers": 2, "width": 32, "heads": 4, "vocab": 64, "T": 12, "B": 4}
QUICK_LLAMA = {"layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "vocab": 100, "T": 12, "B": 2}


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].float().log_softmax(-1)[:, 3]


def _models(quick: bool, device: torch.device) -> list[tuple[str, Any, dict[str, int]]]:
    shape = QUICK_INDUCTION if quick else INDUCTION
    torch.manual_seed(0)
    lm = TransformerLM(
        shape["vocab"], shape["width"], shape["heads"], shape["layers"], 4 * shape["width"],
        max_len=shape["T"], attn_only=True,
    ).to(device).eval()  # fmt: skip
    models: list[tuple[str, Any, dict[str, int]]] = [("induction TransformerLM", lm, shape)]
    try:
        import transformers
    except ImportError:  # pragma: no cover - the hf extra
        return models
    shape = QUICK_LLAMA if quick else LLAMA
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["width"],
        intermediate_size=4 * shape["width"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=2 * shape["T"], attn_implementation="multihead",
    )  # fmt: skip
    import multihead.hf  # noqa: F401  (registers "multihead")

    llama = transformers.LlamaForCausalLM(config).to(device).eval()
    models.append(("grouped-query Llama (bridge)", llama, shape))
    return models


def _workloads(model: Any, shape: dict[str, int], device: torch.device) -> dict[str, Any]:
    """The measured calls on one model: "fwdbwd", "eap" (``steps``), "nodes" (``steps``)."""
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(shape["vocab"], (shape["B"], shape["T"]), generator=generator)
    corrupt = torch.randint(shape["vocab"], (shape["B"], shape["T"]), generator=generator)
    clean, corrupt = clean.to(device), corrupt.to(device)
    params = [p for p in model.parameters() if p.requires_grad]

    def forward_backward() -> None:
        out = model(clean)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        torch.autograd.grad(_metric(logits).mean(), params)

    def eap(steps: int = 1) -> Any:
        return multihead.edge_attribution(model, clean, corrupt, _metric, ig_steps=steps)

    def nodes(steps: int = 1) -> Any:
        return multihead.attribution_patching(model, clean, corrupt, _metric, ig_steps=steps)

    return {"fwdbwd": forward_backward, "eap": eap, "nodes": nodes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ig-steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--device", type=device_argument, default=torch.device("cpu"))
    parser.add_argument("--memory-probe", choices=("eap", "fwdbwd"), default=None)
    args = parser.parse_args(argv)
    device = args.device
    if args.memory_probe:
        _, model, shape = _models(args.quick, device)[-1]
        fn = _workloads(model, shape, device)[args.memory_probe]
        print(json.dumps(peak_bytes(fn, device)))
        return 0
    load_before = list(os.getloadavg())
    rounds = 1 if args.quick else args.rounds
    k = 2 if args.quick else args.ig_steps
    rows, payload_rows = [], []
    memory_rows: list[list[str]] = []
    payload_memory: list[dict[str, Any]] = []
    for name, model, shape in _models(args.quick, device):
        work = _workloads(model, shape, device)
        calls = {
            "fwdbwd": work["fwdbwd"],
            "eap": work["eap"],
            "eap_ig": lambda work=work: work["eap"](k),
            "nodes": lambda work=work: work["nodes"](k),
        }
        seconds_of, ratio_of = interleaved_rounds(calls, rounds, device)
        cpu_ratio_of: dict[str, float] = {}
        if device.type == "cpu":  # again on one thread, in CPU time (module docstring)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                _, cpu_ratio_of = interleaved_rounds(calls, rounds, device, time.process_time)
            finally:
                torch.set_num_threads(threads)
        base = seconds_of["fwdbwd"]
        edges = len(work["eap"]())
        for measure, key, target in (
            ("EAP (ig_steps=1)", "eap", 3.0),
            (f"EAP-IG (ig_steps={k})", "eap_ig", k + 2.0),
            (f"attribution_patching (ig_steps={k}, nodes)", "nodes", k + 2.0),
        ):
            seconds, ratio = seconds_of[key], ratio_of[key]
            cpu_ratio = cpu_ratio_of.get(key)
            missed = [
                label for label, r in (("wall", ratio), ("CPU", cpu_ratio))
                if r is not None and r > target
            ]  # fmt: skip
            verdict = (
                "met"
                if not missed
                else "NOT met"
                + (f" ({missed[0]})" if len(missed) == 1 and cpu_ratio is not None else "")
            )
            rows.append(
                [f"{measure}, {name}", f"{seconds * 1e3:.0f}", f"{base * 1e3:.1f}", f"{ratio:.1f}x",
                 "" if cpu_ratio is None else f"{cpu_ratio:.1f}x", f"<= {target:.0f}x", verdict]
            )  # fmt: skip
            payload_rows.append(
                {"model": name, "measure": measure, "seconds": seconds,
                 "forward_backward_seconds": base, "ratio": ratio,
                 "cpu_time_ratio_one_thread": cpu_ratio, "target": target,
                 "edges": edges, "shape": shape}
            )  # fmt: skip
        if "kv_heads" in shape:
            # the median of a few fresh processes each, alternating
            runs: dict[str, list[dict[str, int]]] = {"eap": [], "fwdbwd": []}
            for _ in range(1 if args.quick else 3):
                for what, found in runs.items():
                    found.append(probe_peaks(__file__, what, args.quick, device))
            target = (1 + shape["kv_heads"] / shape["heads"]) * 1.1
            for kind, label in (("tensors", "tensors"), ("resident", "resident, first call")):
                if kind not in runs["eap"][0]:
                    continue
                peaks = {
                    what: int(statistics.median(p[kind] for p in found))
                    for what, found in runs.items()
                }
                ratio = peaks["eap"] / peaks["fwdbwd"]
                aimed = kind == "tensors"  # the target counts tensors, as on a GPU
                memory_rows.append(
                    [f"EAP (ig_steps=1), {name}: {label}", f"{peaks['eap'] / 2**20:.1f}",
                     f"{peaks['fwdbwd'] / 2**20:.1f}", f"{ratio:.2f}x",
                     f"<= {target:.2f}x" if aimed else "",
                     ("met" if ratio <= target else "NOT met") if aimed else ""]
                )  # fmt: skip
                payload_memory.append(
                    {"model": name, "kind": kind, "peak_bytes": peaks["eap"],
                     "forward_backward_peak_bytes": peaks["fwdbwd"], "ratio": ratio,
                     "target": target if aimed else None, "shape": shape}
                )  # fmt: skip
    headers = ["measure", "ms", "fwd+bwd ms", "ratio", "CPU time ratio, 1 thread", "target", ""]
    print(format_table(headers, rows))
    memory_headers = ["peak memory", "MiB", "fwd+bwd MiB", "ratio", "target", ""]
    if memory_rows:
        print(format_table(memory_headers, memory_rows))
    info = machine_info()
    gpu = device.type == "cuda"
    where = info["gpu"]["name"] if gpu else f"{info['cpu']}, {torch.get_num_threads()} threads"
    print(f"{where}, torch {info['torch']}; {rounds} interleaved rounds (medians)")
    name = ("edge_attribution_gpu" if gpu else "edge_attribution") + (
        "_quick" if args.quick else ""
    )
    path = write_json(
        name,
        {
            "machine": info,
            "rounds": rounds,
            "ig_steps": k,
            "rows": payload_rows,
            "memory": payload_memory,
        },
        directory=args.results_dir,
        report={
            "title": "Edge attribution (issue 32): `benchmarks/bench_edge_attribution.py`",
            "tables": [
                {
                    "caption": f"EAP, EAP-IG ({k} steps) and node attribution patching ({k} "
                    f"steps) against one forward and backward of the same batch; {rounds} "
                    "interleaved rounds (each ratio the median of the rounds' ratios; times "
                    "the medians):",
                    "header": headers,
                    "rows": rows,
                    "target_column": "target",
                },
                {
                    "caption": "Peak memory of EAP on the grouped-query model against one "
                    "forward and backward of the same batch (target 1 + Hk/H, + 10 %, in "
                    "tensors; the first call's resident memory beside it, not a target):",
                    "header": memory_headers,
                    "rows": memory_rows,
                    "target_column": "target",
                },
            ],
            "packages": ["transformers"],
            "gpu": gpu,
            "load_before": load_before,
            "load_after": list(os.getloadavg()),
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
