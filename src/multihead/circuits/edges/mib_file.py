"""A circuit file as the Mechanistic Interpretability Benchmark (MIB, circuit-localization track)
reads and writes it: EAP-IG's ``Graph.to_json`` / ``to_pt`` layout, by MIB's names.

    nodes   "input"           the embeddings              (multihead: "embed")
            "a0.h1"           layer 0's head 1             ("L0H1")
            "m0"              block 0's feed-forward       ("MLP0")
            "logits"          the final residual stream    ("logits")
    edges   "input->a1.h3<k>" into a head's q, k or v      ("embed -> L1H3.k")
            "a0.h1->m0"       into a feed-forward network  ("L0H1 -> MLP0")
            "m1->logits"      into the logits              ("MLP1 -> logits")

The JSON holds ``cfg`` (``n_layers``, ``n_heads``, ``parallel_attn_mlp``, ``d_model``),
``nodes`` (name -> ``{"in_graph": bool}``) and ``edges`` (name -> ``{"score": float,
"in_graph": bool}``); the ``.pt`` twin (read with ``weights_only=True``) holds ``cfg``,
``src_nodes`` and ``dst_nodes`` (the names of the score matrix's rows and columns: every node
but the logits; per layer the heads' q inputs, k inputs, v inputs, then the MLP; the logits
last), ``edges_scores`` and ``edges_in_graph`` (src × dst) and ``nodes_in_graph``. A key/value
edge is a query head's (TransformerLens's ``ungroup_grouped_query_attention``). multihead adds
one key of its own, ``"multihead"`` (the metric on the two runs, the integrated-gradient
points, the scores' dtype), which MIB's readers ignore, so that a file it wrote reads back as
it was.
"""

from __future__ import annotations

import functools
import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from multihead._checks import describe
from multihead._files import atomic_write, few, json_bytes, read_json, read_torch_weights
from multihead.circuits.graph import EMBED, LOGITS, Graph, Receiver, Sender

__all__ = ["MIBFile", "mib_edge_name", "mib_node_name"]

Edge = tuple[int, int]  # (sender index, receiver index) in a Graph

# a model's whole graph as JSON: Llama-3-8B's 1.6 million edges are about 100 MB
_MAX_BYTES = 4 << 30
_SUFFIXES = (".json", ".pt")
_PT_KEYS = ("cfg", "src_nodes", "dst_nodes", "edges_scores", "edges_in_graph", "nodes_in_graph")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "float64": torch.float64}  # fmt: skip


def mib_node_name(node: Sender | Receiver) -> str:
    """MIB's name of a sender or of the node a receiver reads into: ``"input"``, ``"a0.h1"``,
    ``"m0"``, ``"logits"``."""
    if node.kind == EMBED:
        return "input"
    if node.kind == LOGITS:
        return LOGITS
    if node.kind == "mlp":
        return f"m{node.layer}"
    return f"a{node.layer}.h{node.head}"


def mib_edge_name(sender: Sender, receiver: Receiver) -> str:
    """MIB's name of an edge: ``"input->a1.h3<k>"``, ``"a0.h1->m0"``, ``"m1->logits"``."""
    name = f"{mib_node_name(sender)}->{mib_node_name(receiver)}"
    return f"{name}<{receiver.kind}>" if receiver.kind in ("q", "k", "v") else name


@dataclass(frozen=True)
class _Layout:
    """MIB's graph of a model of ``n_layers`` × ``n_heads`` by name, in the order EAP-IG's
    ``Graph.from_model`` makes it (sequential attention and MLP blocks)."""

    nodes: tuple[str, ...]  # input, per layer its heads and MLP, the logits last
    dst: tuple[str, ...]  # get_dst_nodes: per layer the heads' q, k, v inputs, the MLP; logits
    # every edge: (name, parent node, dst name, child node)
    edges: tuple[tuple[str, str, str, str], ...]
    mlps: frozenset[str]  # the MLP nodes

    @staticmethod
    @functools.cache
    def of(n_layers: int, n_heads: int) -> _Layout:
        nodes, dst, stream = ["input"], [], ["input"]
        edges: list[tuple[str, str, str, str]] = []
        for layer in range(n_layers):
            heads = [f"a{layer}.h{h}" for h in range(n_heads)]
            mlp = f"m{layer}"
            nodes += [*heads, mlp]
            for node in stream:  # every earlier node into each head's q, k and v
                for head in heads:
                    edges += [(f"{node}->{head}<{x}>", node, f"{head}<{x}>", head) for x in "qkv"]
            stream += heads
            edges += [(f"{node}->{mlp}", node, mlp, mlp) for node in stream]  # the heads too
            stream.append(mlp)
            dst += [f"{head}<{x}>" for x in "qkv" for head in heads] + [mlp]
        edges += [(f"{node}->{LOGITS}", node, LOGITS, LOGITS) for node in stream]
        mlps = frozenset(f"m{layer}" for layer in range(n_layers))
        return _Layout((*nodes, LOGITS), (*dst, LOGITS), tuple(edges), mlps)


@dataclass(frozen=True)
class MIBFile:
    """One MIB circuit file's content, by MIB's names.

    Attributes:
        cfg: ``n_layers``, ``n_heads``, ``parallel_attn_mlp``, ``d_model`` (and what else the
            file holds).
        scores: edge name -> score, in MIB's edge order.
        in_graph: the names of the edges in the circuit.
        extra: what multihead wrote beside MIB's keys (``clean``, ``corrupt``, ``ig_steps``,
            ``dtype``); empty for a file another tool wrote.
    """

    cfg: dict[str, Any]
    scores: dict[str, float]
    in_graph: frozenset[str] = frozenset()
    extra: dict[str, Any] = field(default_factory=dict)
    dense: bool = False  # a .pt file's matrix: every (src, dst) pair, 0 where no edge is

    # -- writing ---------------------------------------------------------------------------

    @classmethod
    def of(
        cls,
        graph: Graph,
        values: Tensor,
        circuit: Sequence[Edge] = (),
        extra: Mapping[str, Any] | None = None,
    ) -> MIBFile:
        """The file of ``graph``'s edges scored ``values`` (N, R), ``circuit``'s edges in the
        graph: MIB's whole graph, an attention-only model's MLP edges scored 0 and not in it.

        Raises:
            ValueError: a graph MIB cannot name (:meth:`check`).
        """
        MIBFile.check(graph)
        n_layers, n_heads = len(graph.heads), graph.heads[0][0] if graph.heads else 0
        layout = _Layout.of(n_layers, n_heads)
        listed = values.detach().cpu().tolist()
        ours = {mib_edge_name(*graph.nodes(e)): listed[e[0]][e[1]] for e in graph.edges}
        # an attention-only model's graph is MIB's without its MLPs: their edges score 0
        absent = [
            name
            for name, parent, _, child in layout.edges
            if name not in ours and (graph.mlps or not {parent, child} & layout.mlps)
        ]
        extra_edges = sorted(set(ours) - {name for name, *_ in layout.edges})
        if absent or extra_edges:  # a graph of another shape than MIB's (a parallel block)
            raise ValueError(
                f"the scores cannot be written in MIB's format: MIB's graph of "
                f"{n_layers} x {n_heads} heads has edges the scores lack ({few(absent)}) or "
                f"lacks some of theirs ({few(extra_edges)})"
            )
        scores = {name: ours.get(name, 0.0) for name, *_ in layout.edges}
        chosen = frozenset(mib_edge_name(*graph.nodes(e)) for e in circuit)
        cfg = {
            "n_layers": n_layers,
            "n_heads": n_heads,
            "parallel_attn_mlp": False,
            "d_model": graph.width,
        }
        return cls(cfg, scores, chosen, dict(extra or {}))

    @staticmethod
    def check(graph: Graph) -> None:
        """That MIB's format can name ``graph``'s edges.

        Raises:
            ValueError: shared key/value receivers, not every sender, a receiver kind missing,
                layers with different head counts or only some with a feed-forward network.
        """
        problems = []
        if graph.kv == "shared":
            problems.append(
                "its key/value receivers are shared (kv='shared'); MIB's are each query "
                "head's: score with kv='query_head'"
            )
        if len({h for h, _ in graph.heads}) > 1:
            problems.append("its layers have different numbers of heads")
        if graph.mlps and len(graph.mlps) != len(graph.heads):
            problems.append("only some of its blocks have a feed-forward network")
        wanted = ("q", "k", "v", "mlp", LOGITS) if graph.mlps else ("q", "k", "v", LOGITS)
        missing = [k for k in wanted if k not in graph.kinds]
        if missing:
            problems.append(
                f"its receivers lack {', '.join(missing)}: score with receivers={wanted!r}"
            )
        if not graph.whole:
            problems.append("it scores only some senders: score every sender (senders=None)")
        if problems:
            raise ValueError("the scores cannot be written in MIB's format: " + "; ".join(problems))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the file (``.json``, or its ``.pt`` twin) at ``path``, atomically. Returns the
        path.

        Raises:
            ValueError: another suffix.
            FileNotFoundError: no such directory.
        """
        path = _checked_suffix(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"path's directory {str(path.parent)!r} does not exist")
        layout = _Layout.of(self.cfg["n_layers"], self.cfg["n_heads"])
        # MIB's rule: a node is in the circuit when it sends an edge of it and is the input or
        # receives one; the logits always
        sends = {parent for name, parent, _, _ in layout.edges if name in self.in_graph}
        receives = {child for name, _, _, child in layout.edges if name in self.in_graph}
        node_in = {n for n in sends if n == "input" or n in receives} | {LOGITS}
        if path.suffix == ".json":
            data: dict[str, Any] = {
                "cfg": self.cfg,
                "nodes": {n: {"in_graph": n in node_in} for n in layout.nodes},
                "edges": {
                    name: {"score": self.scores[name], "in_graph": name in self.in_graph}
                    for name, *_ in layout.edges
                },
            }
            if self.extra:
                data["multihead"] = self.extra
            atomic_write(path, json_bytes(data, indent=None))
            return path
        src = list(layout.nodes[:-1])
        row = {name: i for i, name in enumerate(src)}
        col = {name: j for j, name in enumerate(layout.dst)}
        at = [(row[parent], col[dst]) for _, parent, dst, _ in layout.edges]
        index = torch.tensor(at, dtype=torch.long).reshape(-1, 2)
        dtype = _DTYPES.get(str(self.extra.get("dtype")), torch.float32)
        scores = torch.zeros(len(src), len(layout.dst), dtype=dtype)
        scores[index[:, 0], index[:, 1]] = torch.tensor(
            [self.scores[name] for name, *_ in layout.edges], dtype=torch.float64
        ).to(dtype)
        in_graph = torch.zeros(len(src), len(layout.dst), dtype=torch.bool)
        in_graph[index[:, 0], index[:, 1]] = torch.tensor(
            [name in self.in_graph for name, *_ in layout.edges], dtype=torch.bool
        )
        pt: dict[str, Any] = {
            "cfg": self.cfg,
            "src_nodes": src,
            "dst_nodes": list(layout.dst),
            "edges_scores": scores,
            "edges_in_graph": in_graph,
            "nodes_in_graph": torch.tensor([name in node_in for name in src], dtype=torch.bool),
        }
        if self.extra:
            pt["multihead"] = self.extra
        buffer = io.BytesIO()
        torch.save(pt, buffer)
        atomic_write(path, buffer.getvalue())
        return path

    # -- reading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MIBFile:
        """Read a MIB circuit file (``.json`` or ``.pt``).

        Raises:
            FileNotFoundError: no such file.
            ValueError: another suffix, a file that is not one (its keys, their types, the
                score matrix's shape), a ``.pt`` that holds anything but tensors, lists,
                dicts, strings and numbers (``weights_only=True`` refuses it).
        """
        path = _checked_suffix(path)
        if path.suffix == ".json":
            return cls._from_json(path, read_json(path, limit=_MAX_BYTES))
        return cls._from_pt(path)

    @classmethod
    def _from_json(cls, path: Path, data: Any) -> MIBFile:
        where = f"{str(path)!r}"
        if not isinstance(data, dict) or not all(k in data for k in ("cfg", "nodes", "edges")):
            got = sorted(data) if isinstance(data, dict) else describe(data)
            raise ValueError(
                f"{where} is not a MIB circuit file: expected a JSON object with cfg, nodes and "
                f"edges, got {got}"
            )
        cfg, edges = data["cfg"], data["edges"]
        if not isinstance(cfg, dict) or not isinstance(edges, dict):
            raise ValueError(f"{where}: cfg and edges must be JSON objects")
        scores: dict[str, float] = {}
        chosen = []
        for name, info in edges.items():
            if (
                not isinstance(info, dict)
                or not isinstance(info.get("score"), (int, float))
                or isinstance(info.get("score"), bool)
                or not isinstance(info.get("in_graph", False), bool)
            ):
                raise ValueError(
                    f"{where}: edge {name!r} must hold a number 'score' and a bool 'in_graph', "
                    f"got {info!r}"
                )
            scores[name] = float(info["score"])
            if info.get("in_graph", False):
                chosen.append(name)
        extra = data.get("multihead")
        return cls(dict(cfg), scores, frozenset(chosen), dict(extra) if isinstance(extra, dict)
                   else {})  # fmt: skip

    @classmethod
    def _from_pt(cls, path: Path) -> MIBFile:
        where = f"{str(path)!r}"
        data = read_torch_weights(path, "a MIB circuit file")
        if not isinstance(data, dict) or not all(k in data for k in _PT_KEYS):
            got = sorted(map(str, data)) if isinstance(data, dict) else describe(data)
            raise ValueError(
                f"{where} is not a MIB circuit file: expected the keys {', '.join(_PT_KEYS)}, "
                f"got {got}"
            )
        src, dst = data["src_nodes"], data["dst_nodes"]
        scores, in_graph = data["edges_scores"], data["edges_in_graph"]
        if not (
            isinstance(src, list)
            and isinstance(dst, list)
            and all(isinstance(n, str) for n in (*src, *dst))
        ):
            raise ValueError(f"{where}: src_nodes and dst_nodes must be lists of node names")
        shape = (len(src), len(dst))
        for key, tensor in (("edges_scores", scores), ("edges_in_graph", in_graph)):
            if not isinstance(tensor, Tensor) or tuple(tensor.shape) != shape:
                size = str(tuple(tensor.shape)) if isinstance(tensor, Tensor) else describe(tensor)
                raise ValueError(
                    f"{where}: {key} must be a tensor of shape {shape} (src_nodes x dst_nodes), "
                    f"got {size}"
                )
        cfg = data["cfg"]
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: cfg must be a dict, got {describe(cfg)}")
        listed, chosen = scores.double().tolist(), in_graph.bool().tolist()
        found: dict[str, float] = {}
        picked = []
        for i, s in enumerate(src):
            for j, d in enumerate(dst):
                # a head's input names carry the q/k/v after the node: "a1.h3<k>"
                name = f"{s}->{d}"
                found[name] = listed[i][j]
                if chosen[i][j]:
                    picked.append(name)
        extra = data.get("multihead")
        extra = dict(extra) if isinstance(extra, dict) else {}
        extra.setdefault("dtype", str(scores.dtype).removeprefix("torch."))
        return cls(dict(cfg), found, frozenset(picked), extra, dense=True)

    def values_on(self, graph: Graph, where: str) -> tuple[Tensor, tuple[Edge, ...]]:
        """The scores as (N, R) values of ``graph`` (NaN where it has no edge) and the edges in
        the circuit. A ``.pt`` file's matrix holds every (src, dst) pair, so a pair that is no
        edge of the graph is ignored there when its score is 0 (MIB's matrix holds 0).

        Raises:
            ValueError: the file's config or names do not fit the graph (``where`` names it).
        """
        layers = len(graph.heads)
        heads = graph.heads[0][0] if graph.heads else 0
        got = (self.cfg.get("n_layers"), self.cfg.get("n_heads"))
        if got != (layers, heads):
            raise ValueError(
                f"{where} is a circuit of a model with n_layers, n_heads = {got[0]}, {got[1]}; "
                f"the model has {layers}, {heads}"
            )
        dtype = _DTYPES.get(str(self.extra.get("dtype")), torch.float32)
        values = torch.full((len(graph.senders), len(graph.receivers)), math.nan, dtype=dtype)
        names = {mib_edge_name(*graph.nodes(e)): e for e in graph.edges}
        missing = [n for n in names if n not in self.scores]
        # a .pt matrix's pairs that are no edge, and on an attention-only model MIB's MLP
        # edges, are read only where they score 0
        layout = _Layout.of(layers, heads)
        mlp_edges = (
            set()
            if graph.mlps
            else {name for name, parent, _, child in layout.edges if {parent, child} & layout.mlps}
        )
        unknown = [
            n
            for n, v in self.scores.items()
            if n not in names and not ((self.dense or n in mlp_edges) and v == 0)
        ]
        if missing or unknown:
            what = []
            if missing:
                what.append(f"lacks {len(missing)} of the model's edges ({few(missing)})")
            if unknown:
                what.append(f"has {len(unknown)} edges the model lacks ({few(unknown)})")
            raise ValueError(f"{where} does not fit the model: it {' and '.join(what)}")
        for name, (i, j) in names.items():
            values[i, j] = self.scores[name]
        chosen = tuple(e for n, e in names.items() if n in self.in_graph)
        return values, chosen


def _checked_suffix(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a path to a .json or .pt file, got {describe(path)}")
    path = Path(path)
    if path.suffix not in _SUFFIXES:
        raise ValueError(f"path must end in .json or .pt (MIB's circuit files), got {str(path)!r}")
    return path
