"""The numbers of docs/heads.md: what each head of all-MiniLM-L6-v2 does over a corpus.

Runs :func:`multihead.corpus_statistics` and :func:`multihead.head_distances` over
docs/data/sentences.txt (one sentence a line, written for this report), prints Markdown tables
(the dominant role of every layer × head, the strongest heads per metric, per-layer means, how
many heads pass Clark et al.'s thresholds) and draws the head map.

Run:  python benchmarks/heads_report.py [--corpus docs/data/sentences.txt] [--threads 1]
Writes docs/images/heads_map_minilm.png and benchmarks/results/heads_minilm.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from multihead import corpus_statistics, head_distances
from multihead.cli.explain_corpus import read_corpus, role_members
from multihead.pretrained import minilm
from multihead.viz.heads_map import heads_map_figure
from multihead.viz.plots import save_figure

ROOT = Path(__file__).resolve().parent.parent
TOP_METRICS = (
    "previous_token",
    "next_token",
    "identity",
    "to_cls",
    "to_sep",
    "sep_to_sep",
    "to_punctuation",
    "induction",
    "duplicate_token",
    "entropy",
)
LAYER_METRICS = (
    "entropy",
    "identity",
    "previous_token",
    "next_token",
    "to_cls",
    "to_sep",
    "sep_to_sep",
    "to_punctuation",
    "cls_entropy",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(ROOT / "docs/data/sentences.txt"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--image", default=str(ROOT / "docs/images/heads_map_minilm.png"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    texts = read_corpus(args.corpus)
    model = minilm()
    start = time.perf_counter()
    stats = corpus_statistics(model, texts)
    stats_s = time.perf_counter() - start
    start = time.perf_counter()
    head_map = head_distances(model, texts)
    map_s = time.perf_counter() - start

    roles = stats.roles()
    print(f"{len(texts)} texts, {stats.num_queries} tokens; torch threads {args.threads}")
    print(f"corpus_statistics {stats_s:.1f} s, head_distances {map_s:.1f} s")
    print()
    print("| layer | " + " | ".join(f"H{h}" for h in stats.heads) + " |")
    print("|---" * (len(stats.heads) + 1) + "|")
    for i, layer in enumerate(stats.layers):
        print(f"| L{layer} | " + " | ".join(roles[i]) + " |")
    print()
    print("| role | heads (strongest first) |")
    print("|---|---|")
    for role, members in role_members(stats).items():
        cells = ", ".join(f"L{la}H{h} {s:.2f}" for la, h, s in members)
        print(f"| {role} ({len(members)}) | {cells} |")
    print()
    print("| metric | top 5 heads | heads ≥ 0.5 |")
    print("|---|---|---|")
    for metric in TOP_METRICS:
        top = ", ".join(f"L{la}H{h} {v:.2f}" for la, h, v in stats.top(metric, 5))
        values = getattr(stats, metric)
        over = "" if metric == "entropy" else str(int((values >= 0.5).sum()))
        print(f"| {metric} | {top} | {over} |")
    print()
    print("| layer | " + " | ".join(LAYER_METRICS) + " |")
    print("|---" * (len(LAYER_METRICS) + 1) + "|")
    for i, layer in enumerate(stats.layers):
        means = [float(getattr(stats, m)[i].nanmean()) for m in LAYER_METRICS]
        print(f"| L{layer} | " + " | ".join(f"{v:.2f}" for v in means) + " |")

    # nearest neighbours in the map of the heads that stand out
    names = head_map.names()
    d = head_map.distances
    print()
    print(
        "mean JS distance between heads: "
        f"{float(d[~torch.eye(len(d), dtype=torch.bool)].mean()):.3f}"
    )
    h = len(head_map.heads)
    layer_of = torch.arange(len(d)) // h
    same = (layer_of[:, None] == layer_of[None, :]) & ~torch.eye(len(d), dtype=torch.bool)
    across = layer_of[:, None] != layer_of[None, :]
    print(
        f"within a layer: {float(d[same].mean()):.3f}; across layers: {float(d[across].mean()):.3f}"
    )
    for i, layer in enumerate(head_map.layers):
        block = d[i * h : (i + 1) * h, i * h : (i + 1) * h]
        print(
            f"  layer {layer}: mean distance between its heads "
            f"{float(block.sum() / (h * h - h)):.3f}"
        )
    # how faithful the 2-D picture is: its distances against D, over all pairs
    upper = torch.triu(torch.ones_like(d, dtype=torch.bool), diagonal=1)
    flat = torch.cdist(head_map.positions, head_map.positions)[upper]
    r = torch.corrcoef(torch.stack([flat, d[upper]]))[0, 1]
    print(f"2-D layout: correlation of its distances with D over all pairs {float(r):.3f}")
    for name in ("L0H2", "L1H8", "L3H11", "L0H0"):
        n = names.index(name)
        order = d[n].argsort()[1:4].tolist()
        near = ", ".join(f"{names[k]} {float(d[n, k]):.2f}" for k in order)
        print(f"nearest to {name}: {near}")

    fig = heads_map_figure(
        head_map.positions,
        head_map.layers,
        head_map.heads,
        roles,
        title=f"all-MiniLM-L6-v2: heads placed by Jensen–Shannon distance over {len(texts)} "
        "sentences (classical MDS)",
    )
    Path(args.image).parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, args.image, dpi=110)
    out = ROOT / "benchmarks/results/heads_minilm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = stats.to_dict()
    del data["most_attended"], data["most_attended_weight"]
    data.update(
        num_texts=len(texts),
        seconds={"corpus_statistics": round(stats_s, 2), "head_distances": round(map_s, 2)},
        threads=args.threads,
        torch=torch.__version__,
        positions={
            n: [round(float(v), 5) for v in xy]
            for n, xy in zip(names, head_map.positions, strict=True)
        },
    )
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"\nwrote {args.image} and {out}")


if __name__ == "__main__":
    main()
