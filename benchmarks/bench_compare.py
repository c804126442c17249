"""Two checkouts of multihead side by side: the figures a refactor must not slow down.

Each measure runs in a fresh child process per checkout (``PYTHONPATH`` points at that
checkout's ``src``), the checkouts alternating within each round, so that a slow spell of the
machine hits both alike. Measures (float32, CPU unless ``--device``):

- ``mha``: ``MultiHeadAttention`` forward, B=4, T=512, E=512, 8 heads (no grad);
- ``mha_weights``: the same with ``need_weights=True``;
- ``minilm_dense``: MiniLM forward of 32 texts padded to one length (64 tokens);
- ``minilm_ragged``: MiniLM forward of 32 texts of 8 to 64 tokens (the packed path);
- ``capture_hf``: ``capture(rows=[-1])`` around a random 4-layer Llama (width 512, 8/2 heads),
  T=1024, on ``attn_implementation="multihead"``;
- ``intervene``: MiniLM forward of the 32 ragged texts with one head zeroed by ``intervene``;
- ``patch``: ``patch_heads`` over every head of a random 4-layer ``LlamaForCausalLM`` (width 256,
  8/2 heads), 2 clean/corrupt pairs of 32 tokens, metric: the last position's logit difference;
- ``patch_resid_pre``, ``patch_z``, ``attribution``, ``edge_attribution``: on the same model and
  pairs, ``patch(site="resid_pre", per_position=True)``, ``patch(site="z")``,
  ``attribution_patching`` and ``edge_attribution`` (slow: one warm-up call, then three);
- ``cli_patch_smollm2``, ``cli_circuit_smollm2``: ``multihead patch`` and ``multihead circuit``
  with ``--model smollm2`` on the IOI pair, default flags, each a whole process (one per round).

Reported per measure: the median over rounds of each checkout's median time, and after ÷ before.

Usage::

    python benchmarks/bench_compare.py BEFORE_SRC AFTER_SRC [--rounds 5] [--threads 2]

(``git worktree add /tmp/before COMMIT`` gives a checkout of an earlier commit.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import format_table, machine_info, write_json

MEASURES = (
    "mha",
    "mha_weights",
    "minilm_dense",
    "minilm_ragged",
    "capture_hf",
    "intervene",
    "patch",
    "patch_resid_pre",
    "patch_z",
    "attribution",
    "edge_attribution",
    "cli_patch_smollm2",
    "cli_circuit_smollm2",
)
IOI = ("When Mary and John went to the store, John gave a drink to",
       "When Mary and John went to the store, Mary gave a drink to")  # fmt: skip

# The child: builds what a measure needs with whichever multihead is on the path, times it and
# prints the median seconds. Written against the public names both checkouts have.
CHILD = r"""
import json, statistics, sys, time
import torch
import multihead

measure, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)


def text_parts():
    from multihead.pretrained import minilm

    model = minilm()
    net = getattr(model, "model", model)  # a text model holds the module; a BertModel is one
    words = "the quick brown fox jumps over the lazy dog while heads attend to every token".split()
    if measure == "minilm_dense":
        texts = [" ".join(words[(i + j) % 15] for j in range(60)) for i in range(32)]
    else:
        lengths = [4 + (i * 7) % 56 for i in range(32)]
        texts = [" ".join(words[(i + j) % 15] for j in range(n)) for i, n in enumerate(lengths)]
    batch = model.tokenize(texts)
    return net, batch


if measure in ("mha", "mha_weights"):
    mha = multihead.MultiHeadAttention(512, 8).eval()
    x = torch.randn(4, 512, 512)
    weights = measure == "mha_weights"
    fn = lambda: mha(x, need_weights=weights)
elif measure in ("minilm_dense", "minilm_ragged", "intervene"):
    net, batch = text_parts()
    net.eval()
    run = lambda: net(batch.input_ids, batch.attention_mask)
    if measure == "intervene":
        def fn():
            with multihead.intervene(net, {(2, 3): 0.0}):
                run()
    else:
        fn = run
elif measure == "capture_hf":
    import multihead.hf  # noqa: F401
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    model = LlamaModel(config).eval()
    model.set_attn_implementation("multihead")
    ids = torch.randint(0, 1000, (1, 1024))

    def fn():
        with multihead.capture(model, rows=[-1]):
            model(input_ids=ids, use_cache=False)
elif measure in ("patch", "patch_resid_pre", "patch_z", "attribution", "edge_attribution"):
    import multihead.hf  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    clean = torch.randint(0, 1000, (2, 32))
    corrupt = clean.clone()
    corrupt[:, 5] = (corrupt[:, 5] + 1) % 1000

    def metric(out):  # the logits since 0.3 (the whole output before): either works
        logits = getattr(out, "logits", out)
        return logits[:, -1, 1] - logits[:, -1, 2]

    def fn():
        if measure == "patch":
            multihead.patch_heads(model, clean, corrupt, metric)
        elif measure == "patch_resid_pre":
            multihead.patch(model, clean, corrupt, metric, site="resid_pre", per_position=True)
        elif measure == "patch_z":
            multihead.patch(model, clean, corrupt, metric, site="z")
        elif measure == "attribution":
            multihead.attribution_patching(model, clean, corrupt, metric)
        else:
            with torch.enable_grad():
                multihead.edge_attribution(model, clean, corrupt, lambda out: metric(out).sum())
else:
    raise SystemExit(f"unknown measure {measure}")

times = []
slow = measure in ("patch_resid_pre", "patch_z", "attribution", "edge_attribution")
with torch.no_grad():
    for _ in range(1 if slow else 3):
        fn()
    deadline = time.perf_counter() + (0.0 if slow else 2.0)
    while time.perf_counter() < deadline or len(times) < (3 if slow else 5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
print(json.dumps(statistics.median(times)))
"""


def child(src: str, measure: str, threads: int) -> float:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": str(threads)}
    if measure.startswith("cli_"):  # a whole command, start to exit
        command = measure.split("_")[1]
        with tempfile.TemporaryDirectory() as out:
            argv = [sys.executable, "-m", "multihead", command, "--model", "smollm2",
                    "--clean", IOI[0], "--corrupt", IOI[1], "--answer", " Mary", "--wrong", " John",
                    "--out", out]  # fmt: skip
            start = time.perf_counter()
            done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
            took = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{measure} with {src} failed:\n{done.stderr[-3000:]}")
        return took
    done = subprocess.run(
        [sys.executable, "-c", CHILD, measure, str(threads)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{measure} with {src} failed:\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", help="the earlier checkout's src directory")
    parser.add_argument("after", help="the later checkout's src directory")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measures", nargs="+", choices=MEASURES, default=list(MEASURES))
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    sources = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    times: dict[str, dict[str, list[float]]] = {
        m: {"before": [], "after": []} for m in args.measures
    }
    for r in range(args.rounds):
        for measure in args.measures:
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for side in order:
                times[measure][side].append(child(sources[side], measure, args.threads))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows, payload = [], {"machine": machine_info(), "sources": sources, "rows": []}
    for measure in args.measures:
        before = statistics.median(times[measure]["before"])
        after = statistics.median(times[measure]["after"])
        rows.append([measure, f"{before * 1e3:.2f}", f"{after * 1e3:.2f}", f"{after / before:.3f}"])
        payload["rows"].append(
            {"measure": measure, "before_s": before, "after_s": after, "rounds": times[measure]}
        )
    print(format_table(["measure", "before ms", "after ms", "after ÷ before"], rows))
    path = write_json(
        "compare",
        payload,
        directory=args.results_dir,
        report={
            "title": "Before and after a refactor: `benchmarks/bench_compare.py`",
            "tables": [
                {
                    "caption": f"{args.threads} threads, {args.rounds} rounds:",
                    "header": ["measure", "before ms", "after ms", "after ÷ before"],
                    "rows": rows,
                }
            ],
            "packages": ["transformers"],
            "load_after": os.getloadavg(),
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
