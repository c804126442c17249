"""Pruning a circuit of its inert edges (``EdgeScores.inert``, ``circuit(n, prune=...)``,
``faithfulness_curve(prune=...)``): which edges are inert on hand-built graphs, where the
reference is worked out in each test by hand, and that pruning leaves faithfulness as it was on
a tiny model, where it must (the module docstring of ``inert``'s argument: an unreached component
writes what it writes in the corrupt run; what a dead one writes no kept edge reads)."""

from __future__ import annotations

import re

import pytest
import torch
from test_edge_attribution import _lm, _metric

import multihead
from multihead.circuits.edges.edge_attribution import edge_attribution
from multihead.circuits.edges.edge_scores import EdgeScores
from multihead.circuits.edges.faithfulness import faithfulness
from multihead.circuits.graph import Graph, Receiver, Sender


def _reads(receiver: str) -> int:
    """When a receiver reads: layer l's heads at 2l + 1, its MLP at 2l + 2, the logits last."""
    if receiver == "logits":
        return 99
    layer = int(re.match(r"(?:L|MLP)(\d+)", receiver)[1])  # type: ignore[index]
    return 2 * layer + (2 if receiver.startswith("MLP") else 1)


def _writes(sender: str) -> int:
    if sender == "embed":
        return 0
    return _reads(sender) if sender.startswith("MLP") else _reads(sender + ".q")


def _scores(senders: list[str], receivers: list[str], kinds: tuple[str, ...], top: list[str],
            kv: str = "query_head") -> EdgeScores:  # fmt: skip
    """A score table: NaN where the sender writes after the receiver reads; ``top``'s edges
    scored 10, 9, 8, … in order (signs alternating, so |score| ranks them), the others 0.01."""
    values = torch.full((len(senders), len(receivers)), float("nan"), dtype=torch.float64)
    for i, s in enumerate(senders):
        for j, r in enumerate(receivers):
            if _writes(s) < _reads(r):
                values[i, j] = 0.01
    for k, edge in enumerate(top):
        s, r = edge.split(" -> ")
        assert not values[senders.index(s), receivers.index(r)].isnan(), edge
        values[senders.index(s), receivers.index(r)] = (10.0 - k) * (-1) ** k
    graph = Graph(
        tuple(_sender(s) for s in senders), tuple(_receiver(r) for r in receivers), kinds, kv,
        _head_counts([*senders, *receivers]),
    )  # fmt: skip
    return EdgeScores(graph, values, 1.0, 0.0, 1)


def _sender(label: str) -> Sender:
    if label == "embed":
        return Sender("embed")
    if label.startswith("MLP"):
        return Sender("mlp", int(label[3:]))
    layer, head = re.fullmatch(r"L(\d+)H(\d+)", label).groups()  # type: ignore[union-attr]
    return Sender("head", int(layer), int(head))


def _receiver(label: str) -> Receiver:
    if label == "logits":
        return Receiver("logits", 2)
    if label.startswith("MLP"):
        return Receiver("mlp", int(label[3:]))
    layer, shared, head, kind = re.fullmatch(r"L(\d+)(H|KV)(\d+)\.([qkv])", label).groups()  # type: ignore[union-attr]
    return Receiver(kind, int(layer), int(head), shared == "KV")


def _head_counts(labels: list[str]) -> tuple[tuple[int, int], ...]:
    """(query heads, key/value heads) of the two layers the labels name."""
    counts = []
    for layer in (0, 1):
        heads = {int(m[1]) for x in labels if (m := re.fullmatch(rf"L{layer}H(\d+).*", x))}
        kv = {int(m[1]) for x in labels if (m := re.fullmatch(rf"L{layer}KV(\d+).*", x))}
        counts.append((len(heads), len(kv) or len(heads)))
    return tuple(counts)


SENDERS = ["embed", "L0H0", "L0H1", "MLP0", "L1H0", "L1H1", "MLP1"]
HEADS = [f"L{layer}H{h}.{k}" for layer in (0, 1) for h in (0, 1) for k in "qkv"]
EVERY = [*HEADS[:6], "MLP0", *HEADS[6:], "MLP1", "logits"]  # receivers of q, k, v, mlp, logits

# L0H0 -> L1H0 -> logits is a whole path; L0H1 and MLP1 write into nothing kept; MLP0 receives
# nothing, so L1H1 (fed only by it) is never reached either
CIRCUIT = [
    "embed -> L0H0.v", "L0H0 -> L1H0.k", "L1H0 -> logits", "embed -> L0H1.q",
    "MLP0 -> L1H1.v", "L1H1 -> logits", "embed -> MLP1", "L0H0 -> MLP1",
]  # fmt: skip
INERT = [
    "embed -> L0H1.q", "MLP0 -> L1H1.v", "L1H1 -> logits", "embed -> MLP1", "L0H0 -> MLP1",
]  # fmt: skip


def test_inert_edges_by_hand() -> None:
    scores = _scores(SENDERS, EVERY, ("q", "k", "v", "mlp", "logits"), CIRCUIT)
    assert scores.inert(CIRCUIT) == tuple(INERT)
    # one more edge, L0H1 -> L1H1.q, makes L0H1 send into a head that reaches the logits, and
    # L1H1 reached from the embeddings: three edges come alive
    revived = scores.inert([*CIRCUIT, "L0H1 -> L1H1.q"])
    assert revived == ("MLP0 -> L1H1.v", "embed -> MLP1", "L0H0 -> MLP1")
    circuit = scores.circuit(len(CIRCUIT))
    assert set(circuit.edges) == set(CIRCUIT) - set(INERT) and len(circuit) == 3
    assert circuit.inert == tuple(INERT)
    assert "3 edges, 5 inert pruned" in repr(circuit)
    unpruned = scores.circuit(len(CIRCUIT), prune=False)
    assert unpruned.edges == tuple(CIRCUIT) and unpruned.inert == ()
    assert scores.circuit(3).edges == ("embed -> L0H0.v", "L0H0 -> L1H0.k", "L1H0 -> logits")
    assert scores.circuit(2).edges == () and len(scores.circuit(2).inert) == 2  # no logits yet


def test_unscored_receivers_read_every_sender() -> None:
    """Without MLP receivers the MLPs read the run's stream unchanged: MLP0 is always reached,
    and L0H1's write reaches L1H1 through it, so nothing is inert; scored, three edges are."""
    edges = ["embed -> L0H1.q", "MLP0 -> L1H1.v", "L1H1 -> logits"]
    scored = _scores(SENDERS, EVERY, ("q", "k", "v", "mlp", "logits"), edges)
    assert scored.inert(edges) == tuple(edges)
    heads_only = [r for r in EVERY if not r.startswith("MLP")]
    unscored = _scores(SENDERS, heads_only, ("q", "k", "v", "logits"), edges)
    assert unscored.inert(edges) == ()
    # with no logits receiver every sender reaches the logits: only unreached senders are inert
    no_logits = _scores(SENDERS, EVERY[:-1], ("q", "k", "v", "mlp"), ["MLP0 -> L1H1.v"])
    assert no_logits.inert(["MLP0 -> L1H1.v", "embed -> L0H1.q"]) == ("MLP0 -> L1H1.v",)


def test_shared_key_value_heads_feed_their_group() -> None:
    """kv="shared", 4 query heads and 2 key/value heads: L1KV1 feeds L1H2 and L1H3 only."""
    senders = ["embed", *(f"L{layer}H{h}" for layer in (0, 1) for h in range(4))]
    receivers = [
        *(f"L{layer}H{h}.q" for h in range(4) for layer in (0,)),
        *(f"L0KV{g}.{k}" for g in (0, 1) for k in "kv"),
        *(f"L1H{h}.q" for h in range(4)),
        *(f"L1KV{g}.{k}" for g in (0, 1) for k in "kv"),
        "logits",
    ]
    alive = ["embed -> L0KV0.v", "L0H0 -> L1KV1.k", "L1H3 -> logits"]
    scores = _scores(senders, receivers, ("q", "k", "v", "logits"), alive, kv="shared")
    assert scores.inert(alive) == ()
    dead = ["embed -> L0KV0.v", "L0H0 -> L1KV0.k", "L1H3 -> logits"]
    assert scores.inert(dead) == tuple(dead)  # L1KV0 feeds L1H0, L1H1: neither reaches logits


def test_shared_key_value_heads_feed_their_group_without_query_receivers() -> None:
    """kv="shared" with no q receivers: the graph's head counts (4 query heads, 2 key/value
    heads) still say L1KV0 feeds L1H0 and L1H1 only, so an edge into it is inert when only
    L1H3 reaches the logits (L1H3 reads its queries unscored: it reaches every earlier writer,
    but not its own layer's heads)."""
    senders = ["embed", *(f"L{layer}H{h}" for layer in (0, 1) for h in range(4))]
    receivers = [
        *(f"L{layer}KV{g}.{k}" for layer in (0, 1) for g in (0, 1) for k in "kv"),
        "logits",
    ]
    edge, into_l1h1 = "L0H0 -> L1KV0.k", "L1H1 -> logits"
    scores = _scores(senders, receivers, ("k", "v", "logits"), [edge], kv="shared")
    assert scores.inert([edge, "L1H3 -> logits"]) == (edge,)
    assert scores.inert([edge, into_l1h1]) == ()


def test_bad_input() -> None:
    scores = _scores(SENDERS, EVERY, ("q", "k", "v", "mlp", "logits"), CIRCUIT)
    with pytest.raises(TypeError, match=r"prune must be True or False, got 'yes'"):
        scores.circuit(3, prune="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="edges must be a sequence of edge labels .* got 'embed"):
        scores.inert("embed -> L0H0.q")
    with pytest.raises(ValueError, match=r"edges must be edges of this graph .* got 'L1H0 -> "):
        scores.inert(["embed -> L0H0.q", "L1H0 -> L0H0.q"])


@pytest.mark.parametrize("kinds", [("q", "k", "v", "logits"), ("q", "k", "v", "mlp", "logits")])
def test_pruning_keeps_faithfulness(kinds: tuple[str, ...]) -> None:
    """On a tiny TransformerLM with MLPs (float64), every top-n circuit pruned has the
    faithfulness of the top n edges, and some are pruned; the curve over pruned sizes counts
    each circuit by its pruned size with the same values."""
    model = _lm(torch.float64)
    torch.manual_seed(5)
    clean, corrupt = torch.randint(20, (3, 7)), torch.randint(20, (3, 7))
    scores = edge_attribution(model, clean, corrupt, _metric, receivers=kinds)
    pruned_any = 0
    for n in range(1, len(scores), 3):
        circuit = scores.circuit(n)
        if not circuit.inert:
            continue
        pruned_any += 1
        whole = faithfulness(model, clean, corrupt, _metric, scores.circuit(n, prune=False))
        assert faithfulness(model, clean, corrupt, _metric, circuit) == pytest.approx(
            whole, abs=1e-10
        )
        if pruned_any == 4:
            break
    assert pruned_any >= 2
    sizes = [0, 4, 12, len(scores)]
    curve = multihead.faithfulness_curve(
        model, clean, corrupt, _metric, scores, sizes=sizes, draws=1
    )
    plain = multihead.faithfulness_curve(
        model, clean, corrupt, _metric, scores, sizes=sizes, draws=1, prune=False
    )
    assert curve.pruned and not plain.pruned
    assert curve.edges == tuple(len(scores.circuit(n)) for n in sizes)
    assert plain.edges == tuple(sizes) and plain.random_edges == tuple(sizes)
    assert curve.values == pytest.approx(plain.values, abs=1e-10)
    assert curve.random == pytest.approx(plain.random, abs=1e-10)
    assert all(r <= n for r, n in zip(curve.random_edges, sizes, strict=True))
    assert curve.edges[-1] == len(scores)  # every edge: nothing is inert
    with pytest.raises(TypeError, match="prune must be True or False, got 1"):
        multihead.faithfulness_curve(model, clean, corrupt, _metric, scores, prune=1)  # type: ignore[arg-type]


def test_plot_draws_the_pruned_circuit() -> None:
    """The pruned circuit's picture: 3 arrows, 4 components (embed, L0H0, L1H0, logits) and 2
    input labels (v, k); unpruned, CIRCUIT's 8 arrows, 8 components and 4 labels (v, k, q, v)."""
    pytest.importorskip("matplotlib")
    scores = _scores(SENDERS, EVERY, ("q", "k", "v", "mlp", "logits"), CIRCUIT)

    def drawn(fig: object) -> tuple[int, list[str]]:
        texts = [t.get_text() for t in fig.axes[0].texts]  # type: ignore[attr-defined]
        return len(fig.axes[0].patches), sorted(texts)  # type: ignore[attr-defined]

    assert drawn(scores.plot(len(CIRCUIT))) == (
        3, sorted(["embed", "L0H0", "L1H0", "logits", "v", "k"])
    )  # fmt: skip
    arrows, labels = drawn(scores.plot(len(CIRCUIT), prune=False))
    assert arrows == 8 and len(labels) == 12
    assert drawn(scores.plot(2)) == (0, [])  # both edges inert: an empty picture


def test_default_sizes_reach_down_to_ten_edges_on_a_large_graph() -> None:
    from multihead.circuits.edges.faithfulness_curve import default_sizes

    assert default_sizes(81) == [0, 1, 2, 4, 8, 12, 16, 24, 40, 61, 81]  # the fractions alone
    big = default_sizes(118_561)
    assert big[:8] == [0, 10, 20, 50, 100, 200, 500, 1000]  # below 1 % (1186)
    assert big[8:] == [
        round(f * 118_561) for f in (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75)
    ] + [118_561]


def test_bad_circuit_is_refused_before_any_run() -> None:
    """A circuit of the wrong type is a TypeError naming it, raised before the model runs."""
    model = _lm(torch.float64)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    ids = torch.randint(20, (2, 5))
    with pytest.raises(TypeError, match=r"circuit must be a Circuit .* got 3"):
        faithfulness(model, ids, ids, _metric, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"circuit's edges must be labels"):
        faithfulness(model, ids, ids, _metric, [("embed", "L0H0.q")])  # type: ignore[list-item]
    assert calls == []
