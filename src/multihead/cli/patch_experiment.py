"""What ``multihead patch`` patches: a model, a clean and a corrupt input of the same length, a
metric of the model's output, and how to show them; built from a training run (``--checkpoint``:
the built-in induction pair, or prompts of its task) or from a Hugging Face causal LM directory
(``--model``, its tokenizer, optionally split over torchrun's ranks with ``--tensor-parallel``).
Errors a user can fix are :class:`~multihead.cli.common.CLIError`.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from multihead.cli.common import CLIError, load_model, printable
from multihead.devices import DTYPES
from multihead.models import TransformerLM
from multihead.pretrained.text_loader import check_text_model_files
from multihead.text.tokenization import TruncationWarning
from multihead.training import load_run
from multihead.training.induction import MIN_SEQ_LEN
from multihead.training.induction_pair import induction_pair

__all__ = ["PatchExperiment"]


@dataclass
class PatchExperiment:
    """What :func:`multihead.patch_heads` needs, and how to show it.

    Attributes:
        model: the model, in eval mode.
        name: how reports and titles name it.
        clean, corrupt: token ids (B, T) on the model's device (B = 1 for prompts).
        metric: ``metric(output) -> (B,)``.
        describe: the metric, in words.
        tokens: the clean input's first sequence, shown token by token, for labels.
    """

    model: Any
    name: str
    clean: Any
    corrupt: Any
    metric: Callable[[Any], Any]
    describe: str
    tokens: list[str]

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: Any) -> PatchExperiment:
        """From ``multihead patch``'s flags: ``--checkpoint`` or ``--model``, the texts,
        ``--dtype`` and ``--tensor-parallel``, on ``device``.

        Raises:
            CLIError: texts that are not the task's tokens, of different lengths, an answer
                that is not one token; the built-in pair on a run of another task.
            ValueError, OSError: the loaders' refusals (the command prints them in one line).
        """
        return _from_checkpoint(args, device) if args.checkpoint else _from_model_dir(args, device)

    @staticmethod
    def check(args: argparse.Namespace) -> None:
        """Check what a process can alone before :meth:`from_args` builds the model: for
        ``--model``, its directory, tokenizer, config and weights' sizes and the texts' tokens.
        Under ``--tensor-parallel`` the build is collective: every rank checks this first and
        the ranks agree before any builds.

        Raises:
            as :meth:`from_args` for these.
        """
        if args.model:
            _check_model_dir(args)

    def run(self, inputs: Any) -> Any:
        """The model's output on ``inputs`` (ids, or a dict of keyword arguments)."""
        return self.model(**inputs) if isinstance(inputs, dict) else self.model(inputs)


def _logits(output: Any) -> Any:
    return output if not hasattr(output, "logits") else output.logits


def _last_token_metric(answer: int, wrong: int | None) -> Callable[[Any], Any]:
    def metric(output: Any) -> Any:
        logits = _logits(output)[:, -1].float()  # (B, V) at the last position
        if wrong is None:
            return logits.log_softmax(-1)[:, answer]
        return logits[:, answer] - logits[:, wrong]

    return metric


def _last_token_words(answer: str, wrong: str | None) -> str:
    if wrong is None:
        return f"log-probability of {answer!r} at the last position"
    return f"logit of {answer!r} minus {wrong!r} at the last position"


def _from_checkpoint(args: argparse.Namespace, device: Any) -> PatchExperiment:
    path = Path(args.checkpoint)
    config = TransformerLM.read_config(path)
    info = config.get("task")
    name = printable(path.resolve().name)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if isinstance(info, dict) and info.get("name") == "induction":
        # Sizes first: a pair of seq_len tokens is drawn before the model sees it.
        model_config = config.get("model")
        max_len = model_config.get("max_len") if isinstance(model_config, dict) else None
        seq_len = info.get("seq_len")
        if (
            not isinstance(seq_len, int)
            or isinstance(seq_len, bool)
            or not isinstance(max_len, int)
            or not MIN_SEQ_LEN <= seq_len <= max_len
        ):
            raise CLIError(
                f"{path / 'config.json'}: task.seq_len must be an int from {MIN_SEQ_LEN} "
                f"to the model's max_len={max_len!r}, got {seq_len!r}"
            )
        model = TransformerLM.load(path, device=device).to(dtype=dtype).eval()
        if args.clean is None:
            pair = induction_pair(seq_len)

            def metric(output: Any) -> Any:
                return pair.metric(_logits(output))

            n, s1, s2 = pair.layout
            return PatchExperiment(
                model,
                name,
                pair.clean.to(device),
                pair.corrupt.to(device),
                metric,
                f"mean log-probability of the repeated tokens ({pair.clean.shape[0]} sequences "
                f"of {seq_len} tokens, a segment of {n} at {s1} repeated at {s2}, its first "
                f"occurrence resampled in corrupt)",
                [str(int(i)) for i in pair.clean[0]],
            )
        vocab = model.config.vocab_size

        def encode(flag: str, text: str) -> list[int]:
            try:
                ids = [int(t) for t in text.split()]
            except ValueError:
                ids = []
            if not ids or not all(0 <= i < vocab for i in ids):
                raise CLIError(
                    f"{flag} must be token ids of the induction task (space-separated, 0 to "
                    f"{vocab - 1}), got {text!r}"
                )
            return ids

    else:
        model, task = load_run(path)
        model = model.to(device=device, dtype=dtype).eval()
        if args.clean is None:
            raise CLIError(
                "--clean, --corrupt and --answer are needed: the built-in pair serves induction "
                "runs only"
            )

        def encode(flag: str, text: str) -> list[int]:
            try:
                return task.encode(text)
            except ValueError as e:
                raise CLIError(f"{flag}: {e}") from None

    clean, corrupt = encode("--clean", args.clean), encode("--corrupt", args.corrupt)
    _same_length(len(clean), len(corrupt))
    answer = _one(encode("--answer", args.answer), "--answer", args.answer)
    wrong = None
    if args.wrong is not None:
        wrong = _one(encode("--wrong", args.wrong), "--wrong", args.wrong)
    return PatchExperiment(
        model,
        name,
        torch.tensor([clean], device=device),
        torch.tensor([corrupt], device=device),
        _last_token_metric(answer, wrong),
        _last_token_words(args.answer, args.wrong),
        args.clean.split(),
    )


def _check_model_dir(args: argparse.Namespace) -> None:
    """Everything about ``--model`` a process can check before the model is built: the texts
    are given, and the directory's files (tokenizer, config, the weights' sizes)."""
    if args.clean is None:
        raise CLIError("--model needs --clean, --corrupt and --answer (the texts to compare)")
    check_text_model_files(args.model)


def _from_model_dir(args: argparse.Namespace, device: Any) -> PatchExperiment:
    if args.clean is None:  # the texts are asked for before the model is loaded
        raise CLIError("--model needs --clean, --corrupt and --answer (the texts to compare)")
    # the one loader: its tokenizer (padding and truncation neutralised, every id checked
    # against the embedding), the model's position limit, its language-model head
    text_model = load_model(
        args.model, head="lm", device=device, dtype=args.dtype,
        tensor_parallel=args.tensor_parallel,
    )  # fmt: skip
    limit = text_model.max_seq_length
    batches = []
    for flag, text in (("--clean", args.clean), ("--corrupt", args.corrupt)):
        if not text.strip():
            raise CLIError(f"{flag} must hold at least one token, got a text that gives none")
        with warnings.catch_warnings():
            warnings.simplefilter("error", TruncationWarning)
            try:
                batches.append(text_model.tokenize(text))
            except TruncationWarning:
                raise CLIError(
                    f"{flag} is longer than the {limit} tokens {text_model.name} takes"
                ) from None
    clean, corrupt = batches
    _same_length(int(clean.attention_mask.sum()), int(corrupt.attention_mask.sum()))

    def token(flag: str, text: str) -> int:
        ids = text_model.token_ids(text)
        if len(ids) != 1:
            raise CLIError(
                f"{flag} must be one token of the model's vocabulary, got {text!r}: "
                f"{len(ids)} tokens (a word after a space is often its own token with the "
                f"space: try {' ' + text.strip()!r})"
            )
        return ids[0]

    answer = token("--answer", args.answer)
    wrong = None if args.wrong is None else token("--wrong", args.wrong)
    return PatchExperiment(
        text_model,
        printable(text_model.name),
        {"input_ids": clean.input_ids, "attention_mask": clean.attention_mask},
        {"input_ids": corrupt.input_ids, "attention_mask": corrupt.attention_mask},
        _last_token_metric(answer, wrong),
        _last_token_words(args.answer, args.wrong),
        [printable(t) for t in clean.tokens[0]],
    )


def _same_length(clean: int, corrupt: int) -> None:
    if clean == 0:
        raise CLIError("--clean must hold at least one token, got a text that gives none")
    if clean != corrupt:
        raise CLIError(
            f"--clean and --corrupt must have as many tokens, got {clean} and {corrupt}: "
            f"patching replaces a head's output position by position"
        )


def _one(ids: list[int], flag: str, text: str) -> int:
    if len(ids) != 1:
        raise CLIError(f"{flag} must be one token, got {text!r} ({len(ids)} tokens)")
    return ids[0]
