"""Training a :class:`~multihead.models.TransformerLM` on synthetic tasks (``multihead train``).

- :mod:`~multihead.training.tasks`: copy, reverse, sort and add, framed as continuation
  (``3 1 2 =`` → ``1 2 3``), data made on the fly as a pure function of (seed, step, row).
- :mod:`~multihead.training.induction`: the induction task (random tokens, a copied segment)
  and its probe (losses on first and repeated tokens, each head's induction score).
- :mod:`~multihead.training.draws`: the counter-based random numbers both kinds of task draw
  from, and the held-out tenth.
- :mod:`~multihead.training.config`: :class:`TrainConfig` (every field checked), the schedule
  and what the loop reports.
- :mod:`~multihead.training.loop`: :func:`train` (AdamW, warmup + cosine, Ctrl-C, resume,
  divergence) and :func:`evaluate` (held-out exact match).
- :mod:`~multihead.training.ddp`: devices and data-parallel process groups (torchrun).
- :mod:`~multihead.training.rundir`: what a run may do with its directory; restoring a checkpoint.
- :mod:`~multihead.training.checkpoint`: atomic, checksummed checkpoints in safetensors and JSON.
- :mod:`~multihead.training.generation`: continuing prompts with a trained model.
- :mod:`~multihead.training.stopping`: Ctrl-C and SIGTERM between steps.
- :mod:`~multihead.training.plots`: loss.png, attention.png and induction.png.
"""

from multihead.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from multihead.training.config import (
    TASK_DEFAULTS,
    DivergenceError,
    StartInfo,
    StepInfo,
    TrainConfig,
    TrainResult,
    lr_at,
)
from multihead.training.generation import complete_prompts, load_run
from multihead.training.induction import InductionProbe, InductionTask, probe_induction
from multihead.training.loop import evaluate, train
from multihead.training.rundir import resume_config
from multihead.training.tasks import ALL_TASKS, EOS, PAD, TASKS, VOCAB, Task, get_task

__all__ = [
    "TASKS",
    "ALL_TASKS",
    "TASK_DEFAULTS",
    "VOCAB",
    "EOS",
    "PAD",
    "Task",
    "get_task",
    "InductionTask",
    "InductionProbe",
    "probe_induction",
    "TrainConfig",
    "StartInfo",
    "StepInfo",
    "TrainResult",
    "DivergenceError",
    "train",
    "resume_config",
    "evaluate",
    "lr_at",
    "load_run",
    "complete_prompts",
    "save_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
]
