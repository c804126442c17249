"""The training run's figures: the loss curve, each head's learned attention (viz's grid) and
the induction task's phase change.

Drawn and saved as every picture of multihead is (:mod:`multihead.viz`: no pyplot, each file
replaced atomically), so it works headless and leaves an interactive session's backend alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from multihead.heads import head_label
from multihead.models.lm import TransformerLM
from multihead.observe.recorder import capture
from multihead.training.induction import InductionProbe
from multihead.training.tasks import TaskLike
from multihead.viz.figure import new_figure
from multihead.viz.plots import grid_figure, save_figure

__all__ = ["plot_loss", "plot_attention", "plot_induction"]

_DPI = 110


def plot_loss(
    history: Sequence[tuple[int, float, float]], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """The training loss (log scale) and token accuracy per step.

    Args:
        history: (step, loss, accuracy) per step.
        path: the PNG to write.
        title: the figure's title.
    """
    fig = new_figure(7.0, 3.6, layout="constrained")
    ax = fig.add_subplot()
    steps = [h[0] for h in history]
    ax.plot(steps, [h[1] for h in history], color="tab:blue", linewidth=1.0)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (answer tokens)", color="tab:blue")
    ax.grid(True, which="both", alpha=0.3)
    acc = ax.twinx()
    acc.plot(steps, [100 * h[2] for h in history], color="tab:orange", linewidth=1.0)
    acc.set_ylabel("token accuracy (%)", color="tab:orange")
    acc.set_ylim(0, 100)
    ax.set_title(title or "training loss")
    return save_figure(fig, path, dpi=_DPI)


@torch.no_grad()
def plot_attention(
    model: TransformerLM, task: TaskLike, example: Tensor, path: str | os.PathLike[str]
) -> Path:
    """Every head's attention on one example: :func:`~multihead.viz.plots.grid_figure`'s grid of
    layers × heads, queries down, keys across, the future blank.

    Args:
        model: the trained model.
        task: its task (for the token labels).
        example: one example's ids (total_len,), prompt and answer.
        path: the PNG to write.
    """
    ids = example[None, :-1]  # (1, T): the model's input when it produces the answer
    was_training = model.training
    model.eval()
    try:
        with capture(model) as rec:
            model(ids)
    finally:
        model.train(was_training)
    weights = torch.stack([w[0] for w in rec.weights])  # L × (1, H, T, T) -> (L, H, T, T)
    fig = grid_figure(
        weights,
        [task.label(int(i)) for i in ids[0]],
        title=f"{task.name}: {task.decode(example, stop_at_eos=False)}",
        causal=True,
    )
    return save_figure(fig, path, dpi=_DPI)


def plot_induction(
    probes: Sequence[InductionProbe], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """The induction task's phase change: losses and each head's induction score per step.

    Args:
        probes: the measurements, in step order (see
            :class:`~multihead.training.induction.InductionProbe`).
        path: the PNG to write.
        title: the figure's title.
    """
    fig = new_figure(10.0, 3.8, layout="constrained")
    losses, scores = fig.subplots(1, 2)
    steps = [p.step for p in probes]
    losses.plot(steps, [p.first_loss for p in probes], label="first occurrences")
    losses.plot(steps, [p.repeated_loss for p in probes], label="repeated tokens")
    losses.set_xlabel("step")
    losses.set_ylabel("loss (held-out layouts)")
    losses.set_ylim(bottom=0)
    losses.grid(True, alpha=0.3)
    losses.legend(fontsize=8)
    layers = len(probes[0].scores) if probes else 0
    styles = ("-", "--", ":", "-.")
    for layer in range(layers):
        for head in range(len(probes[0].scores[layer])):
            scores.plot(
                steps,
                [p.scores[layer][head] for p in probes],
                linestyle=styles[layer % len(styles)],
                label=head_label(layer, head),
            )
    scores.set_xlabel("step")
    scores.set_ylabel("induction score")
    scores.set_ylim(0, 1)
    scores.grid(True, alpha=0.3)
    scores.legend(fontsize=7, ncol=max(1, layers))
    fig.suptitle(title or "induction heads")
    return save_figure(fig, path, dpi=_DPI)
