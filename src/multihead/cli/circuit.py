"""``multihead circuit``: find a circuit of edges (EAP-IG), check it (faithfulness) and say why
its top heads attend where they do (QK attribution).

    multihead circuit --checkpoint runs/induction        # the built-in induction pair
    multihead circuit --model smollm2                    # its built-in IOI pair
    multihead circuit --model DIR --clean "When Mary and John went to the store, John gave a \\
        drink to" --corrupt "When Mary and John went to the store, Mary gave a drink to" \\
        --answer " Mary" --wrong " John"

It scores every edge (:func:`multihead.edge_attribution`, ``--ig-steps``), prints the top
edges, the faithfulness curve of the top edges (or, with ``--method greedy``, of circuits grown
from the logits: ``EdgeScores.circuit``) against random circuits
(:func:`multihead.faithfulness_curve`; every circuit pruned of its inert edges and counted by
the edges it keeps) and the smallest circuit that reaches ``--reach``, MIB's CPR and CMD (the
curve read at the benchmark's ten edge fractions), and writes ``faithfulness.png`` (the curves)
and ``circuit.png`` (the circuit's graph: its first ``--graph-edges`` edges). ``--mib-out DIR``
scores MIB's graph (the feed-forward networks' inputs too) and writes it in MIB's folder layout,
``DIR/<method>_patching_edge/<task>_<model>/importances.json`` (``EdgeScores.to_mib``; the
reported circuit's edges ``in_graph``). Errors are one line and exit code 2
(``multihead.cli.main``).
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import multihead
from multihead.circuits.edges.edge_scores import METHODS, Circuit, EdgeScores
from multihead.circuits.edges.faithfulness_curve import default_sizes, mib_sizes
from multihead.circuits.edges.mib_file import MIBFile
from multihead.circuits.graph import RECEIVER_KINDS, Graph
from multihead.cli.common import (
    CLIError,
    add_device_arguments,
    on_rank_zero,
    print_warnings,
    status,
    torchrun_world,
)
from multihead.cli.patch_experiment import PatchExperiment
from multihead.cli.text_pairs import TextPair, built_in_note, chosen_pairs
from multihead.cli.threads import add_threads_argument, torch_threads
from multihead.mapping import model_map
from multihead.training.ddp import World
from multihead.viz.formats import check_output_dir
from multihead.viz.plots import save_figure

__all__ = ["register", "run"]

_PICTURES = ("png", "svg")


def register(subparsers: Any) -> None:
    """Add the ``circuit`` subcommand."""
    p = subparsers.add_parser(
        "circuit",
        help="find the circuit of edges that carries a behaviour (EAP-IG) and check it",
        description=(
            "Score every edge between heads, feed-forward networks, the embeddings and the "
            "logits by edge attribution patching with integrated gradients (docs/circuits.md), "
            "print the top edges and the faithfulness of the top-n edges against random "
            "circuits, and write the faithfulness curve and the circuit's graph. Inputs and "
            "the metric as for 'multihead patch'."
        ),
    )
    PatchExperiment.add_arguments(p)
    p.add_argument(
        "--ig-steps",
        type=int,
        default=16,
        metavar="K",
        help="integrated-gradient points (default 16; 1 is plain EAP)",
    )
    p.add_argument("--top", type=int, default=10, metavar="N", help="edges to list (default 10)")
    p.add_argument(
        "--method",
        choices=METHODS,
        default="top",
        help="how a circuit of n edges is chosen: top, the n edges of largest |score| (the "
        "default), or greedy, grown from the logits one connected edge at a time",
    )
    p.add_argument(
        "--reach",
        type=float,
        default=0.9,
        metavar="F",
        help="the faithfulness the reported circuit must reach (default 0.9)",
    )
    p.add_argument(
        "--query",
        type=int,
        default=-1,
        metavar="POS",
        help="the query position whose attention the QK attribution of the circuit's top heads "
        "explains, in the clean input's first sequence (default -1, the last)",
    )
    p.add_argument(
        "--draws", type=int, default=3, metavar="N", help="random circuits per size (default 3)"
    )
    p.add_argument(
        "--graph-edges",
        type=int,
        default=30,
        metavar="N",
        help="the most edges circuit.png shows: the reported circuit's first N by --method "
        "(default 30; a large model's circuit holds hundreds)",
    )
    add_device_arguments(p)
    add_threads_argument(p)
    p.add_argument(
        "--out", default="circuit", metavar="DIR", help="where to write (default ./circuit/)"
    )
    p.add_argument(
        "--format",
        default="png",
        metavar="LIST",
        help="comma-separated, any of png, svg (default png)",
    )
    p.add_argument(
        "--mib-out",
        metavar="DIR",
        help="score MIB's graph (every head's q, k, v, every feed-forward network and the "
        "logits) and write it for the MIB benchmark: DIR/<method>_patching_edge/<task>_<model>/"
        "importances.json, the reported circuit's edges in_graph",
    )
    p.add_argument(
        "--mib-task",
        default="circuit",
        metavar="NAME",
        help="the task's name in --mib-out's folder (MIB's: ioi, mcqa, arithmetic-addition, "
        "arc-easy, ...; default circuit)",
    )
    p.set_defaults(func=run, tensor_parallel=False)


def run(args: argparse.Namespace) -> int:
    """Run ``multihead circuit``; returns the exit code."""
    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in _PICTURES]
    if not formats or bad:
        raise CLIError(f"--format must list png or svg, got {args.format!r}")
    names = [f"{stem}.{f}" for stem in ("faithfulness", "circuit") for f in formats]
    out = check_output_dir("--out", args.out, names)
    if args.mib_out is not None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.mib_task):
            raise CLIError(
                f"--mib-task must be a name of letters, digits, '.', '_' and '-', got "
                f"{args.mib_task!r}"
            )
        check_output_dir("--mib-out", args.mib_out)
    for flag, value in (
        ("--ig-steps", args.ig_steps),
        ("--top", args.top),
        ("--draws", args.draws),
        ("--graph-edges", args.graph_edges),
    ):
        if value < 1:
            raise CLIError(f"{flag} must be a positive number, got {value}")
    if not 0 < args.reach <= 1:
        raise CLIError(f"--reach must be in (0, 1], got {args.reach}")
    pairs = chosen_pairs(args)
    with torch_threads(args.threads), torchrun_world(args.device) as world:
        # nothing here is shared over ranks: rank 0 loads, scores, prints and writes; an error
        # there stops every rank
        code = on_rank_zero(world.rank, lambda: _load_and_circuit(args, world, pairs, out, formats))
        return 0 if code is None else code


def _load_and_circuit(
    args: argparse.Namespace,
    world: World,
    pairs: list[TextPair] | None,
    out: Path,
    formats: list[str],
) -> int:
    note = built_in_note(args, pairs)
    if note:
        print(note, file=sys.stderr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with status("loading the model"):
            experiment = PatchExperiment.from_args(args, world.device, pairs)
        _check_query(args.query, experiment)
        code = _circuit(args, experiment, out, formats)
    print_warnings(caught)
    return code


def _check_query(query: int, experiment: PatchExperiment) -> None:
    """``--query`` is a position of the clean input (checked before any scoring)."""
    clean = experiment.clean
    ids = clean["input_ids"] if isinstance(clean, dict) else clean
    t = ids.shape[-1]
    if not -t <= query < t:
        raise CLIError(
            f"--query must be a position of the {t}-token inputs in [{-t}, {t}), got {query}"
        )


def _circuit(
    args: argparse.Namespace, experiment: PatchExperiment, out: Path, formats: list[str]
) -> int:
    # one experiment: the graph is probed once, each input runs once, for both functions
    runs = multihead.Experiment.of(
        experiment.model, experiment.clean, experiment.corrupt, experiment.metric
    )
    method = "EAP" if args.ig_steps == 1 else f"EAP-IG, {args.ig_steps} steps"
    # MIB's graph reads the feed-forward networks' inputs too
    receivers = RECEIVER_KINDS if args.mib_out is not None else ("q", "k", "v", "logits")
    folder = None
    if args.mib_out is not None:  # checked before any scoring: the graph, then the folder
        MIBFile.check(
            Graph.of(model_map(experiment.model), RECEIVER_KINDS, "query_head", caller="--mib-out")
        )
        named = "EAP" if args.ig_steps == 1 else "EAP-IG-inputs"  # MIB's names of the methods
        folder = check_output_dir(
            "--mib-out",
            Path(args.mib_out)
            / f"{named}_patching_edge"
            / f"{args.mib_task}_{_mib_model(experiment.name)}",
            ["importances.json"],
        )
    with status(f"scoring every edge ({method})"):
        scores = multihead.edge_attribution(runs, ig_steps=args.ig_steps, receivers=receivers)
    chosen = "the top edges" if args.method == "top" else "the greedy circuits"
    # the default sizes and MIB's, which its CPR and CMD read
    sizes = sorted({*default_sizes(len(scores)), *mib_sizes(len(scores))})
    with status(f"faithfulness of {chosen} and of random circuits"):
        curve = multihead.faithfulness_curve(
            runs, scores=scores, sizes=sizes, draws=args.draws, method=args.method
        )
    print(f"{experiment.name}: {len(scores)} edges; metric: {experiment.describe}")
    print(f"  clean {scores.clean:.3f}   corrupt {scores.corrupt:.3f}")
    print(f"\nTop edges ({method}: corrupt - clean write times the gradient at the receiver):")
    width = max(len(label) for label, _ in scores.top(args.top))
    for label, value in scores.top(args.top):
        print(f"  {label:<{width}}  {value:9.3f}")
    what = "the top-n edges" if args.method == "top" else "the greedy circuits of n edges"
    print(
        f"\nFaithfulness of {what}, each circuit pruned of its inert edges (those off "
        "every path from the embeddings to the logits inside it; 1: the clean run, 0: the "
        "corrupt run):"
    )
    size, value = f"{args.method} n", f"{args.method} edges"  # the rows align under them
    print(f"  {size:>8}   edges kept   {value:>12}   random circuits")
    for n, e, v, r in zip(curve.sizes, curve.edges, curve.values, curve.random, strict=True):
        print(f"  {n:8d}   {e:10d}   {v:12.3f}   {r:15.3f}")
    ratio = curve.area / curve.random_area if curve.random_area > 0 else float("inf")
    print(
        f"  area over the pruned sizes {curve.area:.3f}, random circuits' (n random edges, "
        f"pruned likewise) {curve.random_area:.3f} ({ratio:.1f}x)"
    )
    whose = (
        "MIB's graph"
        if args.mib_out is not None
        else f"this graph of {curve.total} edges (MIB's adds the feed-forward inputs: --mib-out)"
    )
    print(
        f"  MIB's areas at 0.1 % ... 100 % of {whose}, {args.method} circuits: "
        f"CPR {curve.cpr:.3f} (higher is better), CMD {curve.cmd:.3f} (lower is better)"
    )
    kept = curve.smallest(args.reach)
    if kept is None:
        print(f"  no circuit of these sizes reaches {args.reach}")
        shown = min(args.top, len(scores))
    else:
        shown = curve.sizes[curve.edges.index(kept)]
        share = 100 * kept / curve.total
        print(
            f"  the {_named(args.method, shown)}, {kept} once pruned ({share:.2g}% of "
            f"{curve.total}), reach {args.reach}"
        )
    circuit = scores.circuit(max(shown, 1), method=args.method)
    _print_qk(experiment, _top_heads(scores, circuit), args.query)
    drawn = min(max(shown, 1), args.graph_edges)
    title = f"{experiment.name}: the {_named(args.method, drawn)}"
    title += f", {len(scores.circuit(drawn, method=args.method))} once pruned"
    if drawn < max(shown, 1):
        whole = f"{len(circuit)} that reach {args.reach}" if kept is not None else f"{shown}"
        title += f" (of the {whole})"
        print(f"\ncircuit.png shows the circuit's first {drawn} edges (--graph-edges)")
    figures = {
        "faithfulness": curve.plot(title=f"Faithfulness of {chosen} ({method}), pruned"),
        "circuit": scores.plot(drawn, method=args.method, title=title),
    }
    out.mkdir(parents=True, exist_ok=True)
    written = [
        save_figure(fig, out / f"{stem}.{fmt}") for stem, fig in figures.items() for fmt in formats
    ]
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        written.append(scores.to_mib(folder / "importances.json", circuit))
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _mib_model(name: str) -> str:
    """A model's name as a folder name's part: what is not a letter, digit, '.' or '-' as '-'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "-", name).strip("-") or "model"


def _named(method: str, n: int) -> str:
    """A circuit of ``n`` edges chosen by ``method``, in words."""
    return f"top {n} edges" if method == "top" else f"greedy circuit of {n} edges"


def _top_heads(scores: EdgeScores, circuit: Circuit, most: int = 3) -> list[tuple[int, int]]:
    """The heads of ``circuit`` whose edges, in or out, weigh most (the sum of their scores'
    sizes in ``scores``), at most ``most``, heaviest first: (layer, head). A shared key/value
    receiver is no one head's and counts for none."""
    weight: dict[tuple[int, int], float] = {}
    for edge, (sender, receiver) in zip(circuit.indices, circuit.nodes, strict=True):
        size = abs(float(scores.values[edge]))
        ends = [(sender.layer, sender.head)] if sender.kind == "head" else []
        if receiver.via and not (receiver.shared and receiver.via != "q"):
            ends.append((receiver.layer, receiver.head))
        for key in ends:
            weight[key] = weight.get(key, 0.0) + size
    return sorted(weight, key=lambda k: -weight[k])[:most]


def _print_qk(experiment: PatchExperiment, heads: list[tuple[int, int]], query: int) -> None:
    """The QK attribution of ``heads`` (the circuit's top heads: :func:`top_heads`): at
    ``query`` of the clean input's first sequence, the key the head scores highest and the
    (query side, key side) pairs that make its score, and the key-side components that lift
    that key above the others."""
    if not heads:
        return
    clean = experiment.clean
    first = {k: v[:1] for k, v in clean.items()} if isinstance(clean, dict) else clean[:1]
    print(f"\nQK attribution of the circuit's top heads (query position {query}):")
    for layer, head in heads:
        # one forward splits every key: by default the key the head scores highest
        qk = multihead.qk_attribution(experiment.model, first, layer=layer, head=head, query=query)
        key = qk.key
        print(
            f"  L{layer}H{head}: key {key} scores {qk.total():.2f}; "
            f"top pairs (query side, key side):"
        )
        for a, b, v in qk.top(3):
            print(f"    {a:<10} {b:<10} {v:8.2f}")
        rise = qk.key_rise() if int(qk.visible.sum()) > 1 else []
        if rise:
            lifts = ", ".join(f"{label} {value:+.2f}" for label, value in rise[:3])
            print(f"    key side lifting key {key} over the others: {lifts}")
