"""What ``multihead patch`` patches: a model, a clean and a corrupt input of the same length, a
metric of the model's output, and how to show them; built from a training run (``--checkpoint``:
the built-in induction pair, or prompts of its task) or from a Hugging Face causal LM directory
(``--model``, its tokenizer, optionally split over torchrun's ranks with ``--tensor-parallel``;
one pair or many, :mod:`multihead.cli.text_pairs`). Errors a user can fix are
:class:`~multihead.cli.common.CLIError`.
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
from multihead.cli.text_pairs import TextPair
from multihead.devices import DTYPES
from multihead.models import TransformerLM
from multihead.pretrained.text_loader import check_text_model_files
from multihead.text.tokenization import TokenBatch, TruncationWarning
from multihead.training import load_run
from multihead.training.induction import MIN_SEQ_LEN
from multihead.training.induction_pair import induction_pair

__all__ = ["PatchExperiment", "SPACED_GAP"]

# An answer (or wrong token) written without a leading space is warned about when its
# log-probability after the clean text is more than this many nats (55x) below that of the
# same word with the space: a word after a space is its own token with the space (" Mary"), and
# "Mary" alone measures a token the model hardly predicts there.
SPACED_GAP = 4.0


@dataclass
class PatchExperiment:
    """What :func:`multihead.patch_heads` needs, and how to show it.

    Attributes:
        model: the model, in eval mode.
        name: how reports and titles name it.
        clean, corrupt: token ids (B, T) on the model's device (B = 1 for prompts; the number
            of pairs for ``--pairs``).
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

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the flags :func:`~multihead.cli.text_pairs.chosen_pairs` and :meth:`from_args`
        read: ``--checkpoint`` or ``--model`` (one required), ``--clean``, ``--corrupt``,
        ``--answer``, ``--wrong`` and ``--pairs``."""
        where = parser.add_mutually_exclusive_group(required=True)
        where.add_argument(
            "--checkpoint",
            metavar="RUN",
            help="a run of 'multihead train' (its directory or a checkpoints/step-N directory)",
        )
        where.add_argument(
            "--model",
            metavar="DIR_OR_NAME",
            help="a Hugging Face causal LM directory (config.json, weights, tokenizer.json), a "
            "GGUF file, a name in the local Hugging Face cache (local files only, extra hf) or "
            "smollm2 (extra gguf)",
        )
        parser.add_argument("--clean", metavar="TEXT", help="the input on which the model does it")
        parser.add_argument(
            "--corrupt", metavar="TEXT", help="the input on which it does not (as many tokens)"
        )
        parser.add_argument(
            "--answer", metavar="TOKEN", help="the token the clean input should predict"
        )
        parser.add_argument(
            "--wrong",
            metavar="TOKEN",
            help="the token the corrupt input predicts (logit difference)",
        )
        parser.add_argument(
            "--pairs",
            metavar="FILE",
            help='many clean/corrupt pairs for --model, one JSON object a line: {"clean": ..., '
            '"corrupt": ..., "answer": " Mary", "wrong": " John"} ("wrong" on every line or '
            "none); every text as many tokens; run together, the metric their mean",
        )

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, device: Any, pairs: list[TextPair] | None = None
    ) -> PatchExperiment:
        """From ``multihead patch``'s flags: ``--checkpoint`` (its texts from the flags) or
        ``--model`` (its texts: ``pairs``), ``--dtype`` and ``--tensor-parallel``, on
        ``device``.

        Raises:
            CLIError: texts that are not the task's tokens, of different lengths, an answer
                that is not one token; the built-in pair on a run of another task.
            ValueError, OSError: the loaders' refusals (the command prints them in one line).

        Warns:
            UserWarning: an answer or wrong token without a leading space far less likely
                after the clean text than the same word with one (:data:`SPACED_GAP`).
        """
        if args.checkpoint:
            return _from_checkpoint(args, device)
        return _from_model_dir(args, device, pairs or [])

    @staticmethod
    def check(args: argparse.Namespace, pairs: list[TextPair] | None = None) -> None:
        """Check what a process can alone before :meth:`from_args` builds the model: for
        ``--model``, its directory, tokenizer, config and weights' sizes and the texts' tokens.
        Under ``--tensor-parallel`` the build is collective: every rank checks this first and
        the ranks agree before any builds.

        Raises:
            as :meth:`from_args` for these.
        """
        if args.model:
            _check_model_dir(args, pairs or [])

    def run(self, inputs: Any) -> Any:
        """The model's output on ``inputs`` (ids, or a dict of keyword arguments)."""
        return self.model(**inputs) if isinstance(inputs, dict) else self.model(inputs)


def _logits(output: Any) -> Any:
    return output if not hasattr(output, "logits") else output.logits


def _last_token_metric(
    answer: int | list[int], wrong: int | list[int] | None
) -> Callable[[Any], Any]:
    """``metric(output) -> (B,)`` at the last position: the answer's logit minus the wrong
    token's, or without ``wrong`` the answer's log-probability; one token for every sequence,
    or one per sequence (lists of B ids, the pairs of ``--pairs``)."""

    def metric(output: Any) -> Any:
        logits = _logits(output)[:, -1].float()  # (B, V) at the last position
        a = _per_row(answer, logits)
        if wrong is None:
            return logits.log_softmax(-1).gather(-1, a)[:, 0]
        return (logits.gather(-1, a) - logits.gather(-1, _per_row(wrong, logits)))[:, 0]

    return metric


def _per_row(ids: int | list[int], logits: Any) -> Any:
    """(B, 1) int64 ids on the logits' device: one id for every row, or one each."""
    b = logits.shape[0]
    column = torch.tensor(ids if isinstance(ids, list) else [ids], device=logits.device)
    if column.numel() not in (1, b):
        raise ValueError(f"the metric reads {column.numel()} pairs' tokens, got {b} sequences")
    return column.expand(b)[:, None]


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


def _check_model_dir(args: argparse.Namespace, pairs: list[TextPair]) -> None:
    """Everything about ``--model`` a process can check before the model is built: the texts
    are given, and the directory's files (tokenizer, config, the weights' sizes)."""
    if not pairs:
        raise CLIError(_NO_TEXTS)
    check_text_model_files(args.model)


_NO_TEXTS = "--model needs --clean, --corrupt and --answer (the texts to compare), or --pairs FILE"


def _from_model_dir(
    args: argparse.Namespace, device: Any, pairs: list[TextPair]
) -> PatchExperiment:
    if not pairs:  # the texts are asked for before the model is loaded
        raise CLIError(_NO_TEXTS)
    # the one loader: its tokenizer (padding and truncation neutralised, every id checked
    # against the embedding), the model's position limit, its language-model head
    text_model = load_model(
        args.model, head="lm", device=device, dtype=args.dtype,
        tensor_parallel=args.tensor_parallel,
    )  # fmt: skip
    limit = text_model.max_seq_length
    cleans: list[TokenBatch] = []
    corrupts: list[TokenBatch] = []
    answers: list[int] = []
    wrongs: list[int] = []
    for pair in pairs:
        batches = []
        for key, text in (("clean", pair.clean), ("corrupt", pair.corrupt)):
            flag = pair.flag(key)
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
        _same_length(
            int(clean.attention_mask.sum()), int(corrupt.attention_mask.sum()), pair.source
        )
        if cleans and clean.input_ids.shape != cleans[0].input_ids.shape:
            raise CLIError(
                f"{pair.source}: its texts have {clean.input_ids.shape[1]} tokens, the first "
                f"pair's {cleans[0].input_ids.shape[1]}: every pair must have as many (patching "
                f"compares the pairs position by position)"
            )
        cleans.append(clean)
        corrupts.append(corrupt)
        answers.append(_one_token(text_model, pair.flag("answer"), pair.answer))
        if pair.wrong is not None:
            wrongs.append(_one_token(text_model, pair.flag("wrong"), pair.wrong))
    ids = {
        "clean": torch.cat([b.input_ids for b in cleans]),  # (B, T)
        "corrupt": torch.cat([b.input_ids for b in corrupts]),
    }
    masks = {
        "clean": torch.cat([b.attention_mask for b in cleans]),
        "corrupt": torch.cat([b.attention_mask for b in corrupts]),
    }
    experiment = PatchExperiment(
        text_model,
        printable(text_model.name),
        {"input_ids": ids["clean"], "attention_mask": masks["clean"]},
        {"input_ids": ids["corrupt"], "attention_mask": masks["corrupt"]},
        _last_token_metric(answers, wrongs or None),
        _describe(pairs),
        [printable(t) for t in cleans[0].tokens[0]],
    )
    _warn_unspaced(experiment, pairs, answers, wrongs)
    return experiment


def _one_token(text_model: Any, flag: str, text: str) -> int:
    ids = text_model.token_ids(text)
    if len(ids) != 1:
        raise CLIError(
            f"{flag} must be one token of the model's vocabulary, got {text!r}: "
            f"{len(ids)} tokens (a word after a space is often its own token with the "
            f"space: try {' ' + text.strip()!r})"
        )
    return int(ids[0])


def _describe(pairs: list[TextPair]) -> str:
    """The metric, in words: of the one pair's tokens, or a mean over the pairs."""
    if len(pairs) == 1:
        return _last_token_words(pairs[0].answer, pairs[0].wrong)
    if pairs[0].wrong is None:
        return (
            f"log-probability of each pair's answer at the last position, mean over "
            f"{len(pairs)} pairs"
        )
    return (
        f"logit of each pair's answer minus its wrong token at the last position, mean over "
        f"{len(pairs)} pairs"
    )


def _warn_unspaced(
    experiment: PatchExperiment, pairs: list[TextPair], answers: list[int], wrongs: list[int]
) -> None:
    """One warning when an answer or wrong token written without a leading space is more than
    :data:`SPACED_GAP` nats less likely after the clean text than the same word with a space
    (when that is one token too): the first such pair named, and how many more there are."""
    model = experiment.model
    found = []  # (pair, key, text, its log-probability, the spaced form, its log-probability)
    log_probs = None
    for i, pair in enumerate(pairs):
        for key, text, token in (
            ("answer", pair.answer, answers[i]),
            ("wrong", pair.wrong, wrongs[i] if wrongs else None),
        ):
            if text is None or token is None or text[:1].isspace():
                continue
            spaced = model.token_ids(" " + text.strip())
            if len(spaced) != 1 or spaced[0] == token:
                continue
            if log_probs is None:  # one forward of the clean texts, for every pair
                with torch.no_grad():
                    log_probs = _logits(experiment.run(experiment.clean))[:, -1].float()
                    log_probs = log_probs.log_softmax(-1).cpu()  # (B, V)
            lp, spaced_lp = float(log_probs[i, token]), float(log_probs[i, spaced[0]])
            if spaced_lp - lp > SPACED_GAP:
                found.append((pair, key, text, lp, " " + text.strip(), spaced_lp))
    if not found:
        return
    pair, key, text, lp, spaced, spaced_lp = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    warnings.warn(
        f"{pair.flag(key)} {text!r} is far less likely after the clean text than {spaced!r} "
        f"(log-probability {lp:.2f} against {spaced_lp:.2f}){more}: a word after a space is "
        f"its own token with the space, and the metric reads {text!r} as given; did you mean "
        f"{spaced!r}?",
        UserWarning,
        stacklevel=2,
    )


def _same_length(clean: int, corrupt: int, source: str = "") -> None:
    where = f"{source}: clean" if source else "--clean"
    if clean == 0:
        raise CLIError(f"{where} must hold at least one token, got a text that gives none")
    if clean != corrupt:
        both = f"{source}: clean and corrupt" if source else "--clean and --corrupt"
        raise CLIError(
            f"{both} must have as many tokens, got {clean} and {corrupt}: "
            f"patching replaces a head's output position by position"
        )


def _one(ids: list[int], flag: str, text: str) -> int:
    if len(ids) != 1:
        raise CLIError(f"{flag} must be one token, got {text!r} ({len(ids)} tokens)")
    return ids[0]
