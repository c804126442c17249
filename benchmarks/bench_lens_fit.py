"""The Jacobian lens's fit cost: ``JacobianLens.fit`` against one forward and backward of the same
inputs.

The fit is one forward per prompt and one backward per output coordinate of the last block's
output (E of them, ``dim_batch`` at a time, vmapped through one backward), so its cost is
about E backward passes: a ratio near E × (a backward's share of a forward and backward) is
the estimator's own, anything above it overhead. On two random models (nothing downloaded):

- a grouped-query ``LlamaForCausalLM`` through the bridge (4 layers, width 128, 8 query heads
  on 2 key/value heads, vocabulary 1,000);
- a ``GPT2LMHeadModel`` (4 layers, width 128, 4 heads, vocabulary 1,000);

each on B = 4 prompts of T = 64 random tokens, every layer below the last fitted, the
reference's default ``skip_first_positions=16``, at ``dim_batch`` 8, 32 and 128 (memory grows
with it, the work does not). The baseline is one forward of the batch and the backward of the
mean log-probability to every parameter (``torch.autograd.grad``). Interleaved rounds: each
round times every call once in turn (the first a warm-up), a ratio is the median over rounds of
the call's time ÷ the same round's baseline. Wall clock; on a GPU synchronised. ``--quick`` runs
tiny models in seconds for the smoke test.

Run:  python benchmarks/bench_lens_fit.py [--rounds 3] [--device cuda] [--quick]
      [--results-dir DIR]
Writes benchmarks/results/lens_fit.json (_gpu on a GPU; _quick with --quick).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import device_argument, format_table, interleaved_rounds, machine_info, write_json

import multihead

SHAPE = {"layers": 4, "width": 128, "heads": 8, "kv_heads": 2, "vocab": 1000, "T": 64, "B": 4}
QUICK = {"layers": 2, "width": 32, "heads": 4, "kv_heads": 2, "vocab": 100, "T": 20, "B": 2}
DIM_BATCHES = (8, 32, 128)
QUICK_DIM_BATCHES = (8, 32)


def _models(shape: dict[str, int], device: torch.device) -> list[tuple[str, Any]]:
    import transformers

    import multihead.hf  # noqa: F401  (registers "multihead")

    torch.manual_seed(0)
    llama = transformers.LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["width"],
        intermediate_size=4 * shape["width"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=2 * shape["T"], attn_implementation="multihead",
    )  # fmt: skip
    gpt2 = transformers.GPT2Config(
        vocab_size=shape["vocab"], n_embd=shape["width"], n_layer=shape["layers"],
        n_head=shape["heads"] // 2, n_positions=2 * shape["T"], bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return [
        ("grouped-query Llama", transformers.LlamaForCausalLM(llama).to(device).eval()),
        ("GPT-2", transformers.GPT2LMHeadModel(gpt2).to(device).eval()),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--device", type=device_argument, default=torch.device("cpu"))
    args = parser.parse_args(argv)
    device = args.device
    load_before = list(os.getloadavg())
    shape = QUICK if args.quick else SHAPE
    rounds = 1 if args.quick else args.rounds
    chunks = QUICK_DIM_BATCHES if args.quick else DIM_BATCHES
    skip = 4 if args.quick else 16
    rows, payload_rows = [], []
    for name, model in _models(shape, device):
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(shape["vocab"], (shape["B"], shape["T"]), generator=generator)
        ids = ids.to(device)
        params = [p for p in model.parameters() if p.requires_grad]

        def forward_backward(
            model: Any = model, ids: torch.Tensor = ids, params: list[Any] = params
        ) -> None:
            loss = model(ids).logits.float().log_softmax(-1).mean()
            torch.autograd.grad(loss, params)

        calls: dict[str, Callable[[], Any]] = {"fwdbwd": forward_backward}
        for chunk in chunks:
            calls[f"fit {chunk}"] = lambda chunk=chunk, model=model, ids=ids: (
                multihead.JacobianLens.fit(model, ids, skip_first_positions=skip, dim_batch=chunk)
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seconds_of, ratio_of = interleaved_rounds(calls, rounds, device)
        width = shape["width"]
        base = seconds_of["fwdbwd"]
        for chunk in chunks:
            key = f"fit {chunk}"
            seconds, ratio = seconds_of[key], ratio_of[key]
            rows.append(
                [f"{name}, dim_batch={chunk}", f"{seconds * 1e3:.0f}", f"{base * 1e3:.1f}",
                 f"{ratio:.0f}x", str(width), f"{ratio / width:.2f}x"]
            )  # fmt: skip
            payload_rows.append(
                {"model": name, "dim_batch": chunk, "seconds": seconds,
                 "forward_backward_seconds": base, "ratio": ratio, "width": width,
                 "ratio_per_coordinate": ratio / width, "shape": shape,
                 "skip_first_positions": skip}
            )  # fmt: skip
    headers = ["JacobianLens.fit", "ms", "fwd+bwd ms", "ratio", "E", "ratio ÷ E"]
    print(format_table(headers, rows))
    info = machine_info()
    gpu = device.type == "cuda"
    where = info["gpu"]["name"] if gpu else f"{info['cpu']}, {torch.get_num_threads()} threads"
    print(f"{where}, torch {info['torch']}; {rounds} interleaved rounds (medians)")
    stem = ("lens_fit_gpu" if gpu else "lens_fit") + ("_quick" if args.quick else "")
    path = write_json(
        stem,
        {"machine": info, "rounds": rounds, "rows": payload_rows},
        directory=args.results_dir,
        report={
            "title": "Jacobian lens fit (issue 50): `benchmarks/bench_lens_fit.py`",
            "tables": [
                {
                    "caption": f"`JacobianLens.fit` (every layer below the last, B = "
                    f"{shape['B']} prompts of T = {shape['T']}) against one forward and backward "
                    f"of the same batch; {rounds} interleaved rounds (each ratio the median of "
                    "the rounds' ratios; times the medians). The fit is about E backward "
                    "passes: ratio ÷ E is its cost per output coordinate.",
                    "header": headers,
                    "rows": rows,
                }
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
