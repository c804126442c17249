"""Continuing prompts with a model trained by :func:`~multihead.training.train`
(``multihead generate``).

A trained model answers prompts of the one shape it was trained on (L digits and ``=``, or
``a + b =`` for add); anything else is refused with the shape it expects, never answered with
garbage.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from multihead._checks import check_finite_float, check_optional_positive_int, describe
from multihead.models.lm import TransformerLM
from multihead.models.lm_io import CONFIG_NAME
from multihead.training.config import check_seed
from multihead.training.tasks import EOS, VOCAB, Task

__all__ = ["load_run", "complete_prompts"]


def load_run(directory: str | os.PathLike[str]) -> tuple[TransformerLM, Task]:
    """The model and task saved by ``multihead train``: a run directory or one of its
    ``checkpoints/step-N`` directories.

    Raises:
        FileNotFoundError: the directory or one of its files is missing.
        ValueError: a damaged file, or a model not trained by ``multihead train`` (names the
            file).
    """
    path = Path(directory)
    config = TransformerLM.read_config(path)
    file = path / CONFIG_NAME
    info = config.get("task")
    if not isinstance(info, dict) or "name" not in info or "seq_len" not in info:
        raise ValueError(
            f"{str(file)!r} has no task: generate needs a model trained by 'multihead train'"
        )
    if info["name"] == "induction":
        raise ValueError(
            f"{str(file)!r} is an induction run: generate answers the prompts of copy, reverse, "
            f"sort and add; load an induction model with TransformerLM.load (docs/induction.md)"
        )
    try:
        task = Task(info["name"], info["seq_len"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{str(file)!r}: {e}") from None
    if info.get("vocab", list(VOCAB)) != list(VOCAB):
        raise ValueError(f"{str(file)!r}: its vocabulary is not this version's {list(VOCAB)}")
    model = TransformerLM.load(path)
    if model.config.vocab_size != len(VOCAB) or model.max_len != task.total_len:
        raise ValueError(
            f"{str(file)!r}: the model (vocab_size {model.config.vocab_size}, max_len "
            f"{model.max_len}) does not fit its task, which needs vocab_size {len(VOCAB)} and "
            f"max_len {task.total_len}"
        )
    return model, task


def complete_prompts(
    model: TransformerLM,
    task: Task,
    prompts: Sequence[str],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[str]:
    """Continue each prompt; return the answers (up to ``<eos>``), one string per prompt.

    Args:
        model, task: from :func:`load_run`.
        prompts: space-separated prompts such as ``"5 2 9 1 ="``, each of the task's shape.
        max_new_tokens: N, at most the task's answer length (the default).
        temperature: 0 picks the most likely token (greedy); > 0 samples.
        top_k: when sampling, only from the k most likely tokens.
        seed: seeds the sampling; an int in [0, 2**64).

    Raises:
        ValueError: a prompt of another shape or vocabulary (the message shows the expected
            shape), or a bad argument.
        TypeError: prompts is not a sequence of strings.
    """
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompts must be a sequence of strings, got {describe(prompts)}")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got none")
    room = model.max_len - task.prompt_len
    new = check_optional_positive_int("max_new_tokens", max_new_tokens) or task.answer_len
    if new > room:
        raise ValueError(
            f"max_new_tokens must be at most {room} (the model's max_len {model.max_len} minus "
            f"the prompt's {task.prompt_len} tokens), got {new}"
        )
    temperature = check_finite_float("temperature", temperature, minimum=0.0)
    top_k = check_optional_positive_int("top_k", top_k)
    device = model.head.weight.device
    generator = torch.Generator(device=device).manual_seed(check_seed("seed", seed))
    ids = torch.tensor([task.parse_prompt(text) for text in prompts])  # (B, prompt_len)
    out = model.generate(
        ids.to(device),
        new,
        temperature=temperature,
        top_k=top_k,
        eos_id=EOS,
        generator=generator,
    )
    return [Task.decode(row) for row in out[:, task.prompt_len :]]
