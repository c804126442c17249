"""``multihead patch``: which heads carry a behaviour? Activation patching from the command line.

    multihead patch --checkpoint runs/induction          # the built-in induction pair
    multihead patch --checkpoint runs/induction --senders L0H1 --receivers L1H0 L1H1
    multihead patch --model DIR --clean "The Eiffel Tower is in" \\
        --corrupt "The Colosseum is in" --answer " Paris" --wrong " Rome"
    multihead patch --model DIR --pairs ioi.jsonl        # many pairs, batched (text_pairs.py)
    multihead patch --model smollm2                      # its built-in IOI pair

The command parses, builds the inputs and the metric, calls :func:`multihead.patch` (and
:func:`multihead.attribution_patching` beside it), prints the heads that matter most and writes
the results' pictures (:meth:`multihead.PatchResult.plot`: an (L × H) heatmap, a heads ×
positions map of the top heads) and a page (the clean text's
attention, with each head's patching effect in the table's importance column). With
``--senders`` and ``--receivers`` it also prints :func:`multihead.path_patching`'s table (each
sender through each receiver's q, k and v). Errors are one line and exit code 2
(``multihead.cli.main``). Under ``torchrun`` every rank joins one process group and loads the
model, :func:`multihead.patch_heads` shares its patched forwards out over the ranks, and rank 0
alone prints and writes.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

import multihead
from multihead.circuits.runs.input_pair import DIRECTIONS
from multihead.circuits.runs.site_names import LAYER_SITES, MODEL_SITES, SITES
from multihead.cli.common import (
    CLIError,
    add_device_arguments,
    add_tensor_parallel_argument,
    check_tensor_parallel,
    load_on_every_rank,
    print_split,
    print_warnings,
    printable,
    status,
    torchrun_world,
)
from multihead.cli.patch_experiment import PatchExperiment
from multihead.cli.text_pairs import BUILT_IN_PAIRS, TextPair, built_in_note, chosen_pairs
from multihead.cli.threads import add_threads_argument, torch_threads
from multihead.heads import head_label, parse_head
from multihead.training.ddp import World
from multihead.viz.formats import FORMATS, check_formats, check_output_dir
from multihead.viz.page import write_page
from multihead.viz.plots import save_figure

__all__ = ["register", "run"]

_DEFAULT_FORMATS = ",".join(FORMATS)


def register(subparsers: Any) -> None:
    """Add the ``patch`` subcommand."""
    p = subparsers.add_parser(
        "patch",
        help="find the heads that carry a behaviour by activation patching",
        description=(
            "Run a clean and a corrupt input through a causal LM, patch each head's output "
            "from one run into the other (activation patching, docs/circuits.md), print the "
            "heads whose patch moves the metric most and write an (L x H) heatmap, a heads x "
            "positions map of the top heads and a page. The metric is the answer's logit minus "
            "the wrong token's at the last position (its log-probability without --wrong), the "
            "mean over the pairs of --pairs; for an induction run without texts, the mean "
            "log-probability of the repeated tokens on a built-in pair (the repeat's first "
            f"occurrence resampled); for --model {' or '.join(BUILT_IN_PAIRS)} without texts, "
            "an indirect-object identification (IOI) pair."
        ),
    )
    PatchExperiment.add_arguments(p)
    p.add_argument(
        "--direction",
        choices=DIRECTIONS,
        default="denoise",
        help="denoise (default): run corrupt with one head from clean (is the head enough?); "
        "noise: run clean with one head from corrupt (is the head needed?)",
    )
    p.add_argument(
        "--top", type=int, default=5, metavar="K", help="heads to list and map (default 5)"
    )
    p.add_argument(
        "--site",
        choices=SITES,
        default="z",
        help="what to patch (docs/circuits.md): z (default), each head's output; result, q, "
        "pattern per head; k, v per key/value head; resid_pre, attn_out, resid_mid, mlp_out, "
        "resid_post per layer and position (a layer x position map)",
    )
    p.add_argument(
        "--senders",
        nargs="+",
        metavar="HEAD",
        help="path patching: heads such as L0H1 (layer 0, head 1) whose output is taken from the "
        "corrupt run; with --receivers, prints how much each changes the metric through each "
        "receiver's queries, keys and values alone (docs/circuits.md)",
    )
    p.add_argument(
        "--receivers",
        nargs="+",
        metavar="HEAD",
        help="path patching: heads in later layers than every sender, such as L1H1",
    )
    add_device_arguments(p)
    add_threads_argument(p)
    add_tensor_parallel_argument(p)
    p.add_argument(
        "--out", default="patching", metavar="DIR", help="where to write (default ./patching/)"
    )
    p.add_argument(
        "--format",
        default=_DEFAULT_FORMATS,
        metavar="LIST",
        help=f"comma-separated, any of {', '.join(FORMATS)} (default: {_DEFAULT_FORMATS})",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``multihead patch``; returns the exit code."""
    formats = check_formats("--format", args.format)
    if "html" in formats and args.site != "z" and args.format != _DEFAULT_FORMATS:
        raise CLIError(
            f"--format html: the page shows the heads' outputs (--site z); --site {args.site} "
            f"writes {', '.join(f for f in FORMATS if f != 'html')}"
        )
    stems = (args.site,) if args.site in LAYER_SITES else ("heads", "positions")
    names = [f"{stem}.{f}" for stem in stems for f in formats if f != "html"]
    page = "html" in formats and args.site == "z"  # the page's column is the heads' output's
    out = check_output_dir("--out", args.out, [*names, *(["patching.html"] * page)])
    if args.top < 1:
        raise CLIError(f"--top must be a positive number of heads, got {args.top}")
    pairs = chosen_pairs(args)
    if (args.senders is None) != (args.receivers is None):
        raise CLIError("--senders and --receivers go together: give both")
    if args.senders is not None and args.site != "z":
        raise CLIError(
            f"--senders and --receivers patch heads' outputs: give them with --site z, got "
            f"--site {args.site}"
        )
    check_tensor_parallel(args)
    senders = _head_names("--senders", args.senders or [])
    receivers = _head_names("--receivers", args.receivers or [])

    with torch_threads(args.threads), torchrun_world(args.device) as world:
        return _patch(args, world, out, formats, senders, receivers, pairs)


def _patch(
    args: argparse.Namespace,
    world: World,
    out: Path,
    formats: list[str],
    senders: list[tuple[int, int]],
    receivers: list[tuple[int, int]],
    pairs: list[TextPair] | None,
) -> int:
    """Load, patch, report and write. Under torchrun every rank loads the model and runs the
    patching (``patch_heads`` shares its patched forwards out over the ranks); rank 0 alone
    shows progress, prints and writes."""
    shown, tp = world.rank == 0, args.tensor_parallel
    note = built_in_note(args, pairs)
    if shown and note:
        print(note, file=sys.stderr)

    with status("Loading the model…", shown), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if world.size > 1:  # every rank of torchrun's group together
            experiment = load_on_every_rank(
                lambda: PatchExperiment.from_args(args, world.device, pairs),
                check=(lambda: PatchExperiment.check(args, pairs)) if tp else None,
            )
        else:
            experiment = PatchExperiment.from_args(args, world.device, pairs)
    if shown:
        print_warnings(caught)
        print_split(experiment.model)

    runs = multihead.Experiment.of(
        experiment.model, experiment.clean, experiment.corrupt, experiment.metric
    )
    if args.site != "z":
        return _patch_site(args, experiment, runs, shown, out, formats)
    with status("Patching…", shown):
        _record(runs, args.direction, paths=bool(senders))
        paths_table = None
        if senders:  # first: its checks of the heads come before the long runs
            paths_table = multihead.path_patching(
                runs, senders=senders, receivers=receivers, direction="noise"
            )  # (N, R, 3): the clean run, each sender from the corrupt one
        effects = multihead.patch(runs, direction=args.direction)
        estimates = multihead.attribution_patching(runs, direction=args.direction).values
        top = _cells(effects, args.top)
        positions = multihead.patch(
            runs, direction=args.direction, per_position=True, heads=top
        )  # fmt: skip
        # the page's forwards: rank 0's, and every rank's when the model's forward is collective
        page = _page_inputs(experiment) if "html" in formats and (shown or tp) else None
    if not shown:
        return 0
    _report(experiment, args.direction, effects, estimates, top)
    if paths_table is not None:
        _report_paths(paths_table)

    with status("Drawing…"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = _write(experiment, args.direction, effects, positions, top, out, formats, page)
    print_warnings(caught)
    print()
    print("Wrote:")
    for path in paths:
        print(f"  {printable(os.fspath(path))}")
    return 0


def _record(runs: Any, direction: str, *, paths: bool, site: str = "z") -> None:
    """Run the two inputs once, recording what every function the command runs on them reads:
    the patched site on the source (and the heads' outputs); on the target the blocks for
    prefix reuse, its keys and values (per-position runs) and, for ``site`` z, the heads'
    gradients (attribution patching). With ``paths`` (path patching noises, the clean run
    patched), the clean run's blocks too."""
    source, target = runs.ends(direction)
    layers = range(len(runs.found))
    heads = [("z", layer) for layer in layers]
    patched = [(site, layer) for layer in (range(1) if site in MODEL_SITES else layers)]
    keys = [(s, layer) for layer in layers for s in ("k", "v")]
    runs.run(source, sites=[*heads, *patched], prefix=paths and source == "clean")
    runs.run(target, sites=[*heads, *keys], prefix=True, gradients=site == "z")


def _patch_site(
    args: argparse.Namespace,
    experiment: PatchExperiment,
    runs: Any,
    shown: bool,
    out: Path,
    formats: list[str],
) -> int:
    """``--site`` other than z: :func:`multihead.patch` of that site, the cells that move the
    metric most, and a layer x position map (residual sites) or the heads' maps."""
    site, direction = args.site, args.direction
    residual = site in LAYER_SITES
    with status("Patching…", shown):
        _record(runs, direction, paths=False, site=site)
        result = multihead.patch(runs, site=site, direction=direction, per_position=residual)
        top_cells = result.top(args.top)
        positions = None
        if not residual:
            heads = _cells(result, args.top)
            positions = multihead.patch(
                runs, site=site, direction=direction, per_position=True, heads=heads
            )
    if not shown:
        return 0
    layers = len(runs.found)
    print(f"{experiment.name}: {layers} layers; site {site}; metric: {experiment.describe}")
    _print_metrics(result)
    print()
    source = "clean" if direction == "denoise" else "corrupt"
    print(f"What moves the metric most ({direction}: {site} from the {source} run):")
    print(f"  {'patched':22s}{'patched - unpatched':>22s}{'normalised':>14s}")
    normal = _normalised(result)
    for label, value in top_cells:
        share = normal.get(label)
        print(f"  {label:22s}{value:>22.3f}{'' if share is None else f'{share:>14.3f}'}")
    with status("Drawing…"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out.mkdir(parents=True, exist_ok=True)
        if residual:
            figures = {
                site: result.plot(
                    tokens=experiment.tokens,
                    title=f"Patching {site} ({direction}), one layer and position at a time",
                )
            }
        else:
            assert positions is not None
            unit = "key/value head" if site in ("k", "v") else "head"
            figures = {
                "heads": result.plot(title=f"Patching {site} ({direction}): {experiment.name}"),
                "positions": positions.plot(
                    top=args.top, tokens=experiment.tokens,
                    title=f"Top {unit}s' {site}, patched one position at a time ({direction})",
                ),
            }  # fmt: skip
        paths = _save(figures, out, formats)
    print_warnings(caught)
    print()
    print("Wrote:")
    for path in paths:
        print(f"  {printable(os.fspath(path))}")
    return 0


def _cells(result: Any, k: int) -> list[tuple[int, int]]:
    """The (layer, head) of the k largest |effects| of a per-head result."""
    flat = result.values.flatten().nan_to_num(0.0)
    n = result.values.shape[1]
    return [(i // n, i % n) for i in flat.abs().argsort(descending=True)[:k].tolist()]


def _normalised(result: Any) -> dict[str, float]:
    """label -> normalised effect, empty when clean equals corrupt."""
    try:
        normal = result.normalized()
    except ValueError:
        return {}
    return dict(zip(result.labels(), normal.flatten().tolist(), strict=True))


def _head_names(flag: str, names: list[str]) -> list[tuple[int, int]]:
    """Heads written as ``L0H1`` (the one notation) as (layer, head) pairs."""
    heads = []
    for name in names:
        try:
            heads.append(parse_head(flag, name))
        except TypeError:
            raise CLIError(
                f"{flag} takes heads such as L0H1 (layer 0, head 1), got {name!r}"
            ) from None
    return heads


def _print_metrics(result: Any) -> None:
    """The clean and corrupt metrics a result is measured between."""
    clean, corrupt = result.clean, result.corrupt
    print(f"  clean {clean:.3f}   corrupt {corrupt:.3f}   (clean - corrupt {clean - corrupt:.3f})")


def _report(
    experiment: PatchExperiment,
    direction: str,
    effects: Any,
    estimates: Any,
    top: list[tuple[int, int]],
) -> None:
    layers, heads = effects.values.shape
    print(f"{experiment.name}: {layers} layers x {heads} heads; metric: {experiment.describe}")
    _print_metrics(effects)
    print()
    what = (
        "corrupt run, one head's output from the clean run"
        if direction == "denoise"
        else "clean run, one head's output from the corrupt run"
    )
    print(f"Heads that move the metric most ({direction}: {what}):")
    print(f"  {'head':8s}{'patched - unpatched':>22s}{'attribution estimate':>24s}")
    for layer, head in top:
        effect, estimate = float(effects.values[layer, head]), float(estimates[layer, head])
        print(f"  {head_label(layer, head):8s}{effect:>22.3f}{estimate:>24.3f}")


def _report_paths(table: Any) -> None:
    """:func:`multihead.path_patching`'s result, one line per (sender, receiver)."""
    print()
    print("Path patching (clean run, the sender's output from the corrupt run reaching the metric")
    print("only through the receiver's q, k or v; every other head frozen at its clean output):")
    print(f"  {'sender':9s}{'receiver':10s}{'via q':>10s}{'via k':>10s}{'via v':>10s}")
    senders, receivers, _ = table.names
    for i, sender in enumerate(senders):
        for j, receiver in enumerate(receivers):
            q, k, v = (float(x) for x in table.values[i, j])
            print(f"  {sender:9s}{receiver:10s}{q:>10.3f}{k:>10.3f}{v:>10.3f}")


def _write(
    experiment: PatchExperiment,
    direction: str,
    effects: Any,
    positions: Any,
    top: list[tuple[int, int]],
    out: Path,
    formats: list[str],
    page: tuple[Any, Any] | None,
) -> list[Path]:
    """Write the figures of ``formats`` and, with ``page`` (:func:`_page_inputs`), the page."""
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "heads": effects.plot(title=f"Activation patching ({direction}): {experiment.name}"),
        "positions": positions.plot(
            top=len(top),
            tokens=experiment.tokens,
            title=f"Top heads, patched one position at a time ({direction})",
        ),
    }
    paths = _save(figures, out, formats)
    if page is not None:
        paths.append(_page(experiment, direction, effects.values, out / "patching.html", *page))
    return paths


def _save(figures: dict[str, Any], out: Path, formats: list[str]) -> list[Path]:
    """Each figure as ``out/STEM.FORMAT`` for every picture format asked for (html is the page)."""
    return [
        save_figure(fig, out / f"{stem}.{fmt}")
        for stem, fig in figures.items()
        for fmt in formats
        if fmt != "html"
    ]


def _page_inputs(experiment: PatchExperiment) -> tuple[Any, Any]:
    """The weights (L, H, T, T) and statistics of the clean input's first sequence, for the
    page."""
    clean = experiment.clean
    first = (
        {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in clean.items()}
        if isinstance(clean, dict)
        else clean[:1]
    )
    with torch.no_grad(), multihead.capture(experiment.model) as rec:
        experiment.run(first)
    weights = torch.stack([w[0] for w in rec.weights])  # (L, H, T, T)
    if not isinstance(first, dict):
        return weights, multihead.head_statistics(experiment.model, first)
    # keyword inputs (a text model's ids and mask): the ids first, the rest as they are
    rest = {k: v for k, v in first.items() if k != "input_ids"}
    mask = rest.get("attention_mask")
    valid = mask.bool() if isinstance(mask, torch.Tensor) else None
    stats = multihead.head_statistics(
        experiment.model, first["input_ids"], valid_mask=valid, **rest
    )
    return weights, stats


def _page(
    experiment: PatchExperiment, direction: str, effects: Any, path: Path, weights: Any, stats: Any
) -> Path:
    """The page of the clean input's first sequence (weights, roles), each head's patching
    effect in the table's importance column."""
    return write_page(
        path,
        weights.float(),
        experiment.tokens,
        statistics=stats,
        importance=effects.nan_to_num(0.0).float(),
        title=f"Activation patching: {experiment.name}",
        subtitle=f"importance column: {direction} patching effect on the {experiment.describe}",
        causal=True,
    )
