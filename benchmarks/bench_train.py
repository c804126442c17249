"""Training step time: TransformerLM against the same model built from torch's own layers.

The torch model is the same architecture: token + learned position embeddings,
``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer(batch_first=True, norm_first=True,
activation="gelu", dropout=0)`` run with a causal mask (``is_causal=True``), a final LayerNorm
and a bias-free output head. One step = forward, cross-entropy over every position, backward,
AdamW step (same hyperparameters). Both run in the same process, alternating in rounds so that
a busy machine slows both alike; the table shows the median over rounds of each round's median.

Target: TransformerLM ≤ 1.0× torch's step time.

Usage::

    python benchmarks/bench_train.py [--threads N] [--rounds 3] [--quick]

Writes benchmarks/results/train.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import format_table, machine_info, median_time, write_json
from torch import Tensor, nn

from multihead.models import TransformerLM

# (name, batch, seq_len, embed_dim, heads, layers, ff_dim, vocab)
CONFIGS = [
    ("sort default", 128, 17, 128, 4, 2, 512, 14),
    ("medium", 32, 128, 256, 8, 4, 1024, 256),
    ("long", 8, 512, 256, 8, 4, 1024, 256),
]


class TorchLM(nn.Module):
    """TransformerLM's architecture from torch.nn layers."""

    def __init__(self, vocab: int, e: int, h: int, layers: int, ff: int, max_len: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, e)
        self.position_embedding = nn.Embedding(max_len, e)
        layer = nn.TransformerEncoderLayer(
            e, h, ff, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(
            layer, layers, norm=nn.LayerNorm(e), enable_nested_tensor=False
        )
        self.head = nn.Linear(e, vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        x = self.token_embedding(ids) + self.position_embedding(torch.arange(t, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        return self.head(self.layers(x, mask=mask, is_causal=True))


def _step_fn(model: nn.Module, ids: Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def step() -> None:
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--quick", action="store_true", help="shorter timing windows")
    parser.add_argument("--only", help="run only the config with this name")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    min_run = 0.5 if args.quick else 1.5
    rows, results = [], []
    for name, b, t, e, h, layers, ff, vocab in CONFIGS:
        if args.only and name != args.only:
            continue
        torch.manual_seed(0)
        ours = TransformerLM(vocab, e, h, layers, ff, max_len=t + 1).train()
        ref = TorchLM(vocab, e, h, layers, ff, max_len=t + 1).train()
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
        ids = torch.randint(vocab, (b, t + 1))
        steps = {"multihead": _step_fn(ours, ids), "torch": _step_fn(ref, ids)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(args.rounds):
            for key, fn in steps.items():
                times[key].append(median_time(fn, min_run_time=min_run))
        ours_s = statistics.median(times["multihead"])
        ref_s = statistics.median(times["torch"])
        tokens = b * t
        rows.append(
            [
                name,
                f"B={b} T={t} E={e} H={h} L={layers}",
                f"{ours_s * 1e3:.1f}",
                f"{ref_s * 1e3:.1f}",
                f"{ours_s / ref_s:.2f}x",
                f"{tokens / ours_s / 1e3:.0f}k",
            ]
        )
        results.append(
            {
                "name": name,
                "batch": b,
                "seq_len": t,
                "embed_dim": e,
                "heads": h,
                "layers": layers,
                "ff_dim": ff,
                "vocab": vocab,
                "multihead_s": times["multihead"],
                "torch_s": times["torch"],
                "ratio": ours_s / ref_s,
            }
        )
        print(f"{name}: multihead {ours_s * 1e3:.1f} ms, torch {ref_s * 1e3:.1f} ms", flush=True)

    print()
    print(
        f"training step (forward + backward + AdamW), fp32, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    print(format_table(["config", "shape", "multihead ms", "torch ms", "ratio", "tokens/s"], rows))
    path = write_json(
        "train",
        {"machine": machine_info(), "rounds": args.rounds, "rows": results},
        report={
            "title": "Training step (issue 5): TransformerLM vs the same model from torch.nn "
            "layers, `benchmarks/bench_train.py`",
            "tables": [
                {
                    "caption": f"fp32, {torch.get_num_threads()} threads, {args.rounds} rounds:",
                    "header": ["config", "shape", "multihead ms", "torch ms", "ratio", "tokens/s"],
                    "rows": rows,
                }
            ],
            "load_after": machine_info()["load_average"],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
