"""Training a :class:`~multihead.models.TransformerLM` on synthetic tasks (``multihead train``).

- :mod:`~multihead.training.tasks`: copy, reverse, sort and add, framed as continuation
  (``3 1 2 =`` → ``1 2 3``), data made on the fly as a pure function of (seed, step, row).
- :mod:`~multihead.training.loop`: :func:`train` (AdamW, warmup + cosine, Ctrl-C, resume,
  data-parallel under torchrun) and :func:`evaluate` (held-out exact match).
- :mod:`~multihead.training.checkpoint`: atomic checkpoints in safetensors and JSON.
- :mod:`~multihead.training.plots`: loss.png and attention.png.
"""

from multihead.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from multihead.training.loop import StepInfo, TrainConfig, TrainResult, evaluate, lr_at, train
from multihead.training.tasks import EOS, PAD, TASKS, VOCAB, Task, get_task

__all__ = [
    "TASKS",
    "VOCAB",
    "EOS",
    "PAD",
    "Task",
    "get_task",
    "TrainConfig",
    "StepInfo",
    "TrainResult",
    "train",
    "evaluate",
    "lr_at",
    "save_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
]
