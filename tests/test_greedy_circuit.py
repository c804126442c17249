"""Greedy circuits (``EdgeScores.circuit(n, method="greedy")``, EAP-IG's ``apply_greedy``): on
hand-built score tables the edges the search takes, in order, are worked out by hand in each
test (the frontier: edges whose receiver's component has a path to the logits in the circuit so
far; the largest ``|score|`` of it taken next); on a tiny model, the curve passes the method
through, pruning a greedy circuit keeps its faithfulness, and random circuits do not change."""

from __future__ import annotations

import pytest
import torch
from test_circuit_pruning import EVERY, SENDERS, _scores
from test_edge_attribution import _lm, _metric

import multihead
from multihead.circuits.edges.edge_attribution import edge_attribution
from multihead.circuits.edges.faithfulness import faithfulness

ALL = ("q", "k", "v", "mlp", "logits")

# scores 10, -9, 8, -7, 6, -5 in this order, every other edge 0.01: the strongest edge feeds
# L0H1, which reaches the logits only once L1H1 does, through the fifth and sixth edges
RANKED = [
    "embed -> L0H1.q", "L1H0 -> logits", "L0H0 -> L1H0.k", "embed -> L0H0.v",
    "L0H1 -> L1H1.v", "L1H1 -> logits",
]  # fmt: skip
# by hand: the frontier starts as the edges into the logits (-9 and -5 the largest); L1H0 ->
# logits brings in L1H0's inputs (8), L0H0 -> L1H0.k L0H0's (7); then -5 is the largest left,
# L1H1 -> logits, which brings in L0H1 -> L1H1.v (6), which brings in embed -> L0H1.q (10)
GREEDY = [
    "L1H0 -> logits", "L0H0 -> L1H0.k", "embed -> L0H0.v",
    "L1H1 -> logits", "L0H1 -> L1H1.v", "embed -> L0H1.q",
]  # fmt: skip


def test_an_edge_off_the_circuit_waits() -> None:
    scores = _scores(SENDERS, EVERY, ALL, RANKED)
    for n in range(len(GREEDY) + 1):
        assert scores.circuit(n, prune=False, method="greedy").edges == tuple(GREEDY[:n])
    # the top 3 are all inert (L0H1 reaches no logits, L0H0 nothing reaches), the greedy 3 a path
    top = scores.circuit(3)
    assert top.edges == () and top.inert == tuple(RANKED[:3])
    greedy = scores.circuit(3, method="greedy")
    assert greedy.edges == tuple(GREEDY[:3]) and greedy.inert == ()
    # pruned, the greedy 4 lose L1H1 -> logits: nothing reaches L1H1 yet
    four = scores.circuit(4, method="greedy")
    assert four.edges == tuple(GREEDY[:3]) and four.inert == ("L1H1 -> logits",)
    assert "3 edges, 1 inert pruned" in repr(four)
    assert scores.circuit(6, method="greedy").edges == tuple(GREEDY)
    # every edge, each once: the frontier reaches the whole graph
    every = scores.circuit(len(scores), prune=False, method="greedy").edges
    assert sorted(every) == sorted(scores.labels) and every[:6] == tuple(GREEDY)


def test_a_circuit_no_top_n_prunes_to() -> None:
    """The logits edge scored below the edges it connects: every top n prunes to nothing until
    all four are in (then 4 edges), while the greedy search takes it first and has a circuit of
    2 (L1H0 -> logits, embed -> L1H0.q) after two steps."""
    ranked = ["embed -> L1H0.q", "L0H0 -> L1H0.k", "embed -> L0H0.v", "L1H0 -> logits"]
    scores = _scores(SENDERS, EVERY, ALL, ranked)
    assert [len(scores.circuit(n)) for n in range(5)] == [0, 0, 0, 0, 4]
    greedy = [scores.circuit(n, method="greedy").edges for n in range(5)]
    assert greedy[2] == ("L1H0 -> logits", "embed -> L1H0.q")
    assert [len(c) for c in greedy] == [0, 0, 2, 2, 4]  # the third edge waits for L0H0's input


def test_a_head_is_one_node_for_its_q_k_v() -> None:
    """L1H1 in the circuit (through its write to the logits) opens its q, k and v alike; the
    scores of L1H0's inputs, larger, wait, since L1H0 reaches no logits."""
    ranked = [
        "embed -> L1H0.q", "L1H1 -> logits", "embed -> L1H1.v", "L0H0 -> L1H1.q",
        "L0H1 -> L1H1.k", "MLP0 -> L1H1.k",
    ]  # fmt: skip
    scores = _scores(SENDERS, EVERY, ALL, ranked)
    assert scores.circuit(5, prune=False, method="greedy").edges == tuple(ranked[1:6])
    # L0H0, L0H1 and MLP0 are senders of the circuit now: their own inputs come next (0.01,
    # ties in the score table's order, sender-major: embed -> L0H0.q first)
    assert scores.circuit(6, prune=False, method="greedy").edges[5] == "embed -> L0H0.q"


def test_unscored_receivers_read_every_earlier_write() -> None:
    """Without MLP receivers an MLP reads the run's stream: once MLP0 is in the circuit every
    earlier component is (embed, the layer-0 heads), not the later L1H0; without a logits
    receiver every component is, and the greedy circuit is the top n."""
    heads_only = [r for r in EVERY if not r.startswith("MLP")]
    ranked = ["embed -> L1H0.q", "MLP0 -> logits", "embed -> L0H1.k", "L0H0 -> L1H1.v"]
    scores = _scores(SENDERS, heads_only, ("q", "k", "v", "logits"), ranked)
    assert scores.circuit(2, prune=False, method="greedy").edges == (
        "MLP0 -> logits", "embed -> L0H1.k",
    )  # fmt: skip
    # MLP1 reads after layer 1: it opens L1H0 and L1H1 too
    ranked = ["embed -> L1H0.q", "MLP1 -> logits", "L0H0 -> L1H1.v"]
    scores = _scores(SENDERS, heads_only, ("q", "k", "v", "logits"), ranked)
    assert scores.circuit(3, prune=False, method="greedy").edges == (
        "MLP1 -> logits", "embed -> L1H0.q", "L0H0 -> L1H1.v",
    )  # fmt: skip
    into_components = [e for e in RANKED if not e.endswith("logits")]
    no_logits = _scores(SENDERS, EVERY[:-1], ("q", "k", "v", "mlp"), into_components)
    for n in (1, 3, 6, len(no_logits)):
        want = tuple(label for label, _ in no_logits.top(n))
        assert no_logits.circuit(n, prune=False, method="greedy").edges == want


def test_shared_key_value_heads_open_with_any_query_head() -> None:
    """kv="shared", 4 query heads on 2 key/value heads a layer: L1KV1 feeds L1H2 and L1H3, so
    its edge (the largest) waits for L1H3 -> logits; L1KV0's comes in with L1H0."""
    senders = ["embed", *(f"L{layer}H{h}" for layer in (0, 1) for h in range(4))]
    receivers = [
        *(f"L0H{h}.q" for h in range(4)),
        *(f"L0KV{g}.{k}" for g in (0, 1) for k in "kv"),
        *(f"L1H{h}.q" for h in range(4)),
        *(f"L1KV{g}.{k}" for g in (0, 1) for k in "kv"),
        "logits",
    ]
    ranked = ["L0H0 -> L1KV1.k", "L1H0 -> logits", "L0H1 -> L1KV0.v", "L1H3 -> logits"]
    scores = _scores(senders, receivers, ("q", "k", "v", "logits"), ranked, kv="shared")
    assert scores.circuit(4, prune=False, method="greedy").edges == (
        "L1H0 -> logits", "L0H1 -> L1KV0.v", "L1H3 -> logits", "L0H0 -> L1KV1.k",
    )  # fmt: skip
    # L1KV0's edges wait on L1H0 and on L1H1: each is taken once all the same
    every = scores.circuit(len(scores), prune=False, method="greedy").edges
    assert len(every) == len(set(every)) == len(scores)


def test_bad_method_and_unreachable_edges() -> None:
    scores = _scores(SENDERS, EVERY, ALL, RANKED)
    with pytest.raises(ValueError, match=r"method must be one of 'top', 'greedy', got 'best'"):
        scores.circuit(3, method="best")
    with pytest.raises(ValueError, match=r"method must be one of 'top', 'greedy', got 'best'"):
        scores.plot(3, method="best")
    # one sender, L0H0: once L0H0 -> logits is taken nothing feeds it, and the layer-1 heads,
    # which send nothing, never reach the logits
    receivers = ["L1H0.q", "L1H0.k", "L1H1.v", "logits"]
    few = _scores(["L0H0"], receivers, ("q", "k", "v", "logits"), [])
    assert few.circuit(1, prune=False, method="greedy").edges == ("L0H0 -> logits",)
    with pytest.raises(ValueError, match=r"n must be at most 1 with method='greedy'.* got 2"):
        few.circuit(2, method="greedy")
    assert len(few.circuit(2, prune=False)) == 2  # the top n has no such bound


def test_plot_draws_the_greedy_circuit() -> None:
    pytest.importorskip("matplotlib")
    scores = _scores(SENDERS, EVERY, ALL, RANKED)
    fig = scores.plot(3, method="greedy")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(fig.axes[0].patches) == 3  # the arrows
    assert sorted(texts) == sorted(["embed", "L0H0", "L1H0", "logits", "v", "k"])
    assert fig.axes[0].get_title() == "Circuit: grown greedily from the logits"
    fig = scores.plot(3)  # the top 3: all inert
    assert [t.get_text() for t in fig.axes[0].texts] == [] and not fig.axes[0].patches
    assert fig.axes[0].get_title() == "Circuit: the top edges"


def test_greedy_curve_on_a_model() -> None:
    """float64 TransformerLM with MLP receivers: the greedy curve's values are the greedy
    circuits' faithfulness, pruning them changes no faithfulness, the random circuits are the
    top curve's, and at some size the greedy circuit differs from the top n."""
    model = _lm(torch.float64)
    torch.manual_seed(5)
    clean, corrupt = torch.randint(20, (3, 7)), torch.randint(20, (3, 7))
    scores = edge_attribution(model, clean, corrupt, _metric, receivers=ALL)
    sizes = [0, 3, 8, 20, len(scores)]
    greedy = multihead.faithfulness_curve(
        model, clean, corrupt, _metric, scores, sizes=sizes, draws=2, method="greedy"
    )
    top = multihead.faithfulness_curve(model, clean, corrupt, _metric, scores, sizes=sizes, draws=2)
    assert greedy.method == "greedy" and top.method == "top"
    assert greedy.random == top.random and greedy.random_edges == top.random_edges
    assert greedy.values[0] == pytest.approx(0, abs=1e-10)
    assert greedy.values[-1] == pytest.approx(1, abs=1e-10)
    differs = 0
    for i, n in enumerate(sizes[1:-1], 1):
        circuit = scores.circuit(n, method="greedy")
        whole = scores.circuit(n, prune=False, method="greedy")
        assert greedy.edges[i] == len(circuit)
        value = faithfulness(model, clean, corrupt, _metric, whole)
        assert greedy.values[i] == pytest.approx(value, abs=1e-10)
        differs += set(whole.edges) != {label for label, _ in scores.top(n)}
    assert differs >= 1
    with pytest.raises(ValueError, match=r"method must be one of 'top', 'greedy', got 'all'"):
        multihead.faithfulness_curve(model, clean, corrupt, _metric, scores, method="all")
