"""``multihead explain --corpus FILE``: what every head does over many texts, and the head map.

Reads one text a line (blank lines skipped; ``-`` reads standard input), loads the model as the
single-text command does (:func:`multihead.cli.common.load_model`), runs
:func:`multihead.text.corpus_statistics` and :func:`multihead.text.head_distances`, prints the
heads of each role and a per-layer summary, and writes ``heads_map.png``/``.svg`` and
``head_statistics.json``. Every check (flags, the file, the output directory) runs before
anything is written.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank joins one process group (gloo on CPUs, nccl on
GPUs, each rank on its local GPU), runs its share of the texts, and rank 0 prints and writes the
files, which equal one process's (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import unicodedata
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch.distributed as dist

from multihead.cli.common import (
    CLIError,
    load_model,
    print_split,
    print_warnings,
    printable,
    progress,
    status,
    torchrun_world,
)
from multihead.heads import head_label
from multihead.memory_budget import format_bytes
from multihead.observe.head_distance import HeadMap
from multihead.observe.head_metrics import BROAD, OTHER, ROLES
from multihead.observe.head_summary import HeadStatistics
from multihead.text.corpus import Progress, corpus_statistics, head_distances
from multihead.training.ddp import World, world_size
from multihead.viz.formats import FIGURE_FORMATS, FORMATS, check_formats, check_output_dir
from multihead.viz.heads_map import heads_map_figure, save_heads_map

__all__ = [
    "run_corpus",
    "read_corpus",
    "read_corpus_lines",
    "STATISTICS_FILE",
    "MAX_LINE_BYTES",
    "MAX_CORPUS_BYTES",
    "MAX_TEXTS",
]

STATISTICS_FILE = "head_statistics.json"
# The bounds of --corpus: far above a real corpus of texts one a line (a model reads at most a
# few hundred KB of one text; 20,000 lines take minutes), far below what exhausts memory.
MAX_LINE_BYTES = 4 * 2**20
MAX_CORPUS_BYTES = 256 * 2**20
MAX_TEXTS = 1_000_000
_TEXT_AT = re.compile(r"texts\[(\d+)\] \(line \d+\)")
_LINES = re.compile(r"lines \[(\d+(?:, \d+)*)")
# The flags that are about one text; --corpus refuses them rather than ignoring them.
_SINGLE_TEXT = (("text", "TEXT"), ("focus", "--focus"), ("focus_index", "--focus-index"))
# Heads printed per role (the strongest); the rest are counted.
_SHOWN = 16
# Per layer, the mean of these (metric, column) in the printed summary.
_SUMMARY = (
    ("entropy", "entropy"),
    ("identity", "self"),
    ("previous_token", "prev"),
    ("next_token", "next"),
    ("first_token", "first"),
    ("to_cls", "[CLS]"),
    ("to_sep", "[SEP]"),
    ("to_punctuation", "punct"),
)


def read_corpus(path: str) -> list[str]:
    """The texts of a file (or ``-``: standard input), one a line, blank lines skipped
    (:func:`read_corpus_lines` without the line numbers)."""
    return read_corpus_lines(path)[0]


def read_corpus_lines(path: str) -> tuple[list[str], list[int]]:
    """The texts of a file (or ``-``: standard input), one a line, blank lines skipped, and
    each text's line number in the file (1-based).

    Read a line at a time, within bounds (:data:`MAX_LINE_BYTES` a line,
    :data:`MAX_CORPUS_BYTES` and :data:`MAX_TEXTS` in all), so that ``/dev/zero`` or an endless
    pipe is refused rather than read until memory runs out. Lines with no visible character
    (only zero-width, control or space characters) are skipped, with one note on stderr.

    Raises:
        CLIError: the file is missing, unreadable, not UTF-8 (naming the line), over a bound,
            or holds no text.
    """
    shown = "standard input" if path == "-" else repr(printable(path))
    texts: list[str] = []
    lines: list[int] = []
    invisible: list[int] = []
    try:
        with contextlib.nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb") as f:
            _read_lines(f, shown, texts, lines, invisible)
    except FileNotFoundError:
        raise CLIError(f"--corpus {shown}: no such file") from None
    except IsADirectoryError:
        raise CLIError(f"--corpus {shown} is a directory, expected a file of texts") from None
    except OSError as e:
        raise CLIError(f"--corpus {shown} cannot be read: {e.strerror or e}") from None
    if invisible:
        listed = ", ".join(map(str, invisible[:10])) + (", …" if len(invisible) > 10 else "")
        print(
            f"note: --corpus skipped {len(invisible)} line{'s' if len(invisible) > 1 else ''} "
            f"with no visible character, only zero-width or control characters (line "
            f"{listed})",
            file=sys.stderr,
        )
    if not texts:
        raise CLIError(f"--corpus {shown} holds no text (one text a line; blank lines skipped)")
    return texts, lines


def _read_lines(
    f: BinaryIO, shown: str, texts: list[str], lines: list[int], invisible: list[int]
) -> None:
    """Append ``f``'s texts to ``texts``, their line numbers to ``lines`` and the numbers of
    its invisible lines to ``invisible``."""
    number = 0
    total = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise CLIError(
                f"--corpus {shown}: line {number + 1} is longer than "
                f"{format_bytes(MAX_LINE_BYTES)} (no line break): expected one text a line"
            )
        total += len(raw)
        if total > MAX_CORPUS_BYTES:
            raise CLIError(
                f"--corpus {shown} holds more than {format_bytes(MAX_CORPUS_BYTES)}: split it "
                f"into smaller files"
            )
        for part in raw.splitlines():  # "\r" ends a line too
            number += 1
            try:
                line = part.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CLIError(
                    f"--corpus {shown}: line {number} is not UTF-8 text (byte {e.start + 1} of "
                    f"the line)"
                ) from None
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark is not part of the text
            line = line.strip()
            if not line:
                continue
            if not any(unicodedata.category(ch)[0] not in "CZ" for ch in line):
                invisible.append(number)
                continue
            if len(texts) == MAX_TEXTS:
                raise CLIError(
                    f"--corpus {shown} holds more than {MAX_TEXTS:,} texts: split it into "
                    f"smaller files"
                )
            texts.append(line)
            lines.append(number)


def _check_flags(args: argparse.Namespace) -> None:
    for attr, flag in _SINGLE_TEXT:
        if getattr(args, attr, None) is not None:
            raise CLIError(f"--corpus cannot be combined with {flag}: it explains one text")
    if getattr(args, "ablate", None):
        raise CLIError("--corpus cannot be combined with --ablate: it explains one text")
    if args.layer is not None and args.head is not None:
        raise CLIError("--corpus maps heads against each other: give --layer or --head, not both")


def run_corpus(args: argparse.Namespace) -> int:
    """Run ``multihead explain --corpus``; returns the exit code."""
    _check_flags(args)
    asked = check_formats("--format", args.format)
    formats = [f for f in asked if f in FIGURE_FORMATS]
    if not formats:  # the page is one text's; over a corpus the map is the picture
        raise CLIError(
            f"--corpus draws the head map as {' or '.join(FIGURE_FORMATS)}: --format must name "
            f"one of them, got {','.join(asked)!r}"
        )
    if "html" in asked and args.format != ",".join(FORMATS):  # asked for, not the default
        print("note: --corpus writes no page (html): the page shows one text", file=sys.stderr)
    files = [f"heads_map.{f}" for f in formats] + [STATISTICS_FILE]
    out = check_output_dir("--out", args.out, files)
    if args.corpus == "-" and world_size() > 1:
        raise CLIError(
            "--corpus - reads standard input, which one process alone has: under torchrun "
            "give the corpus as a file every rank reads"
        )
    texts, lines = read_corpus_lines(args.corpus)
    with torchrun_world(args.device) as world:
        try:
            return _explain_corpus(args, texts, lines, formats, out, world)
        except ValueError as e:  # the library names texts by index: name them by file lines
            raise CLIError(_file_lines(str(e), lines, args.corpus)) from None


def _file_lines(message: str, lines: list[int], path: str) -> str:
    """``message`` with the library's "texts[i] (line i+1)" and "lines [i+1, ...]" (numbered
    among the texts) as the file's own line numbers."""
    shown = "standard input" if path == "-" else repr(printable(path))
    message = _TEXT_AT.sub(lambda m: f"--corpus {shown} line {lines[int(m[1])]}", message)
    return _LINES.sub(
        lambda m: "lines [" + ", ".join(str(lines[int(n) - 1]) for n in m[1].split(", ")),
        message,
    )


def _explain_corpus(
    args: argparse.Namespace,
    texts: list[str],
    lines: list[int],
    formats: list[str],
    out: Path,
    world: World,
) -> int:
    chosen = {"layers": args.layer, "heads": args.head, "memory_limit": args.memory_limit}
    # Under torchrun every rank runs its share of the texts (the library splits them over the
    # process group) and gets the whole result; rank 0 alone shows progress and writes.
    shown = not dist.is_initialized() or dist.get_rank() == 0
    device = str(world.device) if world.size > 1 else args.device  # the local rank's GPU
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with status("Loading the model…", shown):
            model = load_model(
                args.model, device=device, dtype=args.dtype,
                tensor_parallel=args.tensor_parallel, together=world.size > 1,
            )  # fmt: skip
        if shown:
            print_split(model)
        name = printable(model.name)
        # The distances first: the heavier pass, and the one a text too long for the memory
        # limit is refused by, before any forward.
        with _progress("Distances between heads", len(texts), shown) as told:
            head_map = head_distances(model, texts, progress=told, **chosen)
        with _progress("Head statistics", len(texts), shown) as told:
            stats = corpus_statistics(model, texts, progress=told, **chosen)
        if not shown:
            return 0
        with status("Drawing the head map…"):
            title = f"{name}: heads placed by Jensen–Shannon distance over {len(texts)} texts"
            fig = heads_map_figure(
                head_map.positions, head_map.layers, head_map.heads, stats.roles(), title=title
            )
            out.mkdir(parents=True, exist_ok=True)
            paths = save_heads_map(fig, out, formats)
    # once each, not per batch; texts named by the file's lines
    print_warnings(caught, lambda m: _file_lines(m, lines, args.corpus))
    json_path = out / STATISTICS_FILE
    json_path.write_text(json.dumps(_report(stats, head_map, name, len(texts)), indent=1) + "\n")
    paths.append(json_path)
    _print_summary(stats, name, len(texts), paths, causal=model.causal)
    return 0


@contextlib.contextmanager
def _progress(description: str, total: int, shown: bool) -> Iterator[Progress]:
    """A progress bar over ``total`` texts, told ``(done, of)`` by the library: with several
    ranks, of this rank's share, so the bar shows the corpus done as far as this rank knows."""
    if not shown:
        yield lambda done, of: None
        return
    with progress(description, total) as update:
        yield lambda done, of: update(done * total // max(of, 1))


def _report(stats: HeadStatistics, head_map: HeadMap, name: str, num_texts: int) -> dict[str, Any]:
    data = stats.to_dict()
    # most-attended positions are per text; over a corpus they mean nothing as one table
    del data["most_attended"], data["most_attended_weight"]
    names = head_map.names()
    data.update(
        model=name,
        num_texts=num_texts,
        averaging="each metric: the mean over texts of the per-text mean over its queries",
        positions={
            n: [round(float(v), 5) for v in xy]
            for n, xy in zip(names, head_map.positions, strict=True)
        },
        js_distance={
            "unit": "mean over real queries of the Jensen-Shannon distance, base 2",
            "heads": names,
            "matrix": [[round(float(v), 4) for v in row] for row in head_map.distances],
        },
    )
    return data


def role_members(stats: HeadStatistics) -> dict[str, list[tuple[int, int, float]]]:
    """Per role, the heads whose dominant role it is as (layer, head, score), strongest first
    (score: the role's metric above chance, as roles() chose it; for "broad" and "other"
    heads, their entropy)."""
    roles = stats.roles()
    members: dict[str, list[tuple[int, int, float]]] = {}
    for i, layer in enumerate(stats.layers):
        for j, head in enumerate(stats.heads):
            role = roles[i][j]
            # broad, other: entropy; else the role's score above chance, what it was chosen by
            score = float(
                stats.entropy[i, j]
                if role in (BROAD, OTHER)
                else stats.above_chance(ROLES[role])[i, j]
            )
            members.setdefault(role, []).append((layer, head, score))
    order = [*ROLES, BROAD, OTHER]
    return {
        role: sorted(members[role], key=lambda m: -m[2])
        for role in sorted(members, key=order.index)
    }


def _print_summary(
    stats: HeadStatistics, name: str, num_texts: int, paths: list[Path], *, causal: bool
) -> None:
    print(f"{name}: {num_texts} texts, {stats.num_queries} tokens")
    print()
    print(
        "Heads by dominant role (strongest first; score: the role's weight above chance, "
        "(s - c) / (1 - c); broad, other: entropy in nats):"
    )
    for role, members in role_members(stats).items():
        cells = ", ".join(
            f"{head_label(layer, head)} {score:.2f}" for layer, head, score in members[:_SHOWN]
        )
        if len(members) > _SHOWN:  # the JSON file has them all
            cells += f", … {len(members) - _SHOWN} more"
        print(f"  {role + f' ({len(members)})':22s}{cells}")
    print()
    print("Per layer, mean over heads (entropy in nats; others: mean weight):")
    # a causal model's query never sees the next token: that column would be zeros
    # nor columns the model has nothing for (GPT-2 has no [CLS] or [SEP]: NaN for every head)
    summary = [
        (m, c)
        for m, c in _SUMMARY
        if not (causal and m == "next_token") and not bool(getattr(stats, m).isnan().all())
    ]
    print("  layer " + "".join(f"{column:>9s}" for _, column in summary))
    for i, layer in enumerate(stats.layers):
        means = [getattr(stats, metric)[i].nanmean() for metric, _ in summary]
        print(f"  {layer:5d} " + "".join(f"{float(v):9.2f}" for v in means))
    print()
    print("Wrote:")
    for p in paths:
        print(f"  {printable(os.fspath(p))}")
