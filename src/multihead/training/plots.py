"""The training run's figures: the loss curve and each head's learned attention.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch), so
it works headless and leaves an interactive session's backend alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from multihead.models.lm import TransformerLM
from multihead.observe.recorder import capture
from multihead.training.tasks import TaskLike

if TYPE_CHECKING:
    from multihead.training.induction import InductionProbe

__all__ = ["plot_loss", "plot_attention", "plot_induction"]


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'multihead[viz]'") from e
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    # Write aside and rename, like every file of a run: a reader never sees half a PNG.
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    os.replace(tmp, path)
    return path


def plot_loss(
    history: Sequence[tuple[int, float, float]], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """The training loss (log scale) and token accuracy per step.

    Args:
        history: (step, loss, accuracy) per step.
        path: the PNG to write.
        title: the figure's title.
    """
    fig = _figure(7.0, 3.6)
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
    return _save(fig, path)


@torch.no_grad()
def plot_attention(
    model: TransformerLM, task: TaskLike, example: Tensor, path: str | os.PathLike[str]
) -> Path:
    """Every head's attention on one example: a grid of layers × heads, queries down, keys across.

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
        with torch.no_grad(), capture(model) as rec:
            model(ids)
        weights = rec.weights  # L × (1, H, T, T)
    finally:
        model.train(was_training)
    labels = [task.label(int(i)) for i in ids[0]]
    rows, cols = len(weights), weights[0].shape[1]
    fig = _figure(2.6 * cols + 0.6, 2.6 * rows + 0.6)
    axes = fig.subplots(rows, cols, squeeze=False)
    for layer, w in enumerate(weights):
        for head in range(cols):
            ax = axes[layer][head]
            ax.imshow(w[0, head].float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            ax.set_xticks(range(len(labels)), labels, fontsize=5)
            ax.set_yticks(range(len(labels)), labels, fontsize=5)
    fig.suptitle(f"{task.name}: {task.decode(example, stop_at_eos=False)}", fontsize=9)
    return _save(fig, path)


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
    fig = _figure(10.0, 3.8)
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
                label=f"L{layer} H{head}",
            )
    scores.set_xlabel("step")
    scores.set_ylabel("induction score")
    scores.set_ylim(0, 1)
    scores.grid(True, alpha=0.3)
    scores.legend(fontsize=7, ncol=max(1, layers))
    fig.suptitle(title or "induction heads")
    return _save(fig, path)
