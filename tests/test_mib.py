"""MIB's formats and measures (the Mechanistic Interpretability Benchmark, circuit track):
``EdgeScores.to_mib`` / ``from_mib`` and ``Circuit.from_mib`` against MIB's naming rules (EAP-IG's
``Graph.from_model`` and ``get_dst_nodes`` written out here), CPR and CMD against a line-by-line
copy of MIB's ``evaluate_area_under_curve``, ``Circuit.compare`` against counts and an AUROC
taken over every (reference, other) pair, and on the trained induction model the known circuit
ranked by EAP-IG's scores."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from induction_patterns import head_patterns
from test_edge_attribution import _lm, _metric

from multihead.circuits.edges.edge_attribution import edge_attribution
from multihead.circuits.edges.edge_scores import Circuit, EdgeScores
from multihead.circuits.edges.faithfulness import faithfulness
from multihead.circuits.edges.faithfulness_curve import (
    FaithfulnessCurve,
    faithfulness_curve,
    mib_sizes,
)

ALL = ("q", "k", "v", "mlp", "logits")
transformers = pytest.importorskip("transformers", minversion="5")


def _gpt2(layers: int = 12, heads: int = 12) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=20, n_embd=24, n_layer=layers, n_head=heads, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _llama(kv_heads: int = 2) -> Any:
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=20, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _pair(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (2, 8), generator=g), torch.randint(0, 20, (2, 8), generator=g)


def _mib_graph(n_layers: int, n_heads: int) -> tuple[list[str], list[str]]:
    """Node and edge names in the order EAP-IG's ``Graph.from_model`` makes them (sequential
    attention and MLP): per layer, every node before it into each head's q, k, v, then every node
    before the MLP (the layer's heads too) into it; at the end every node into the logits."""
    nodes, edges, stream = ["input"], [], ["input"]
    for layer in range(n_layers):
        heads = [f"a{layer}.h{h}" for h in range(n_heads)]
        nodes += [*heads, f"m{layer}"]
        for node in stream:
            for head in heads:
                edges += [f"{node}->{head}<{x}>" for x in "qkv"]
        stream += heads
        edges += [f"{node}->m{layer}" for node in stream]
        stream.append(f"m{layer}")
    edges += [f"{node}->logits" for node in stream]
    return [*nodes, "logits"], edges


def _mib_dst(n_layers: int, n_heads: int) -> list[str]:
    """EAP-IG's ``get_dst_nodes``: per layer the heads' q inputs, k inputs, v inputs, the MLP."""
    out = []
    for layer in range(n_layers):
        for x in "qkv":
            out += [f"a{layer}.h{h}<{x}>" for h in range(n_heads)]
        out.append(f"m{layer}")
    return [*out, "logits"]


def _ours(name: str) -> str:
    """MIB's edge name as multihead labels it (``"input->a1.h3<k>"`` -> ``"embed -> L1H3.k"``)."""

    def node(n: str) -> str:
        if n == "input":
            return "embed"
        if n.startswith("m"):
            return f"MLP{n[1:]}"
        if n == "logits":
            return n
        layer, head = re.fullmatch(r"a(\d+)\.h(\d+)", n).groups()  # type: ignore[union-attr]
        return f"L{layer}H{head}"

    sender, receiver = name.split("->")
    kind = re.search(r"<([qkv])>$", receiver)
    if kind:
        return f"{node(sender)} -> {node(receiver[:-3])}.{kind[1]}"
    return f"{node(sender)} -> {node(receiver)}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN."""
    return (
        a.dtype == b.dtype
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


@pytest.fixture(scope="module")
def gpt2_scores() -> tuple[Any, EdgeScores]:
    model = _gpt2()
    clean, corrupt = _pair()
    return model, edge_attribution(model, clean, corrupt, _metric, receivers=ALL)


def test_gpt2_small_shape_writes_mibs_names_and_reads_back_bit_for_bit(
    gpt2_scores: tuple[Any, EdgeScores], tmp_path: Path
) -> None:
    model, scores = gpt2_scores
    nodes, edges = _mib_graph(12, 12)
    assert (len(nodes), len(edges)) == (158, 32491)
    circuit = scores.circuit(40)
    path = scores.to_mib(tmp_path / "importances.json", circuit)
    data = json.loads(path.read_text())
    assert data["cfg"] == {"n_layers": 12, "n_heads": 12, "parallel_attn_mlp": False, "d_model": 24}
    assert list(data["nodes"]) == nodes
    assert list(data["edges"]) == edges  # MIB's order, name for name
    for name in (edges[0], edges[5000], edges[-1], "a3.h7->m5", "m2->a4.h0<v>"):
        assert data["edges"][name]["score"] == scores.score(*_ours(name).split(" -> "))
    chosen = {_ours(n) for n, e in data["edges"].items() if e["in_graph"]}
    assert chosen == set(circuit.edges)
    # MIB's rule: a node is in the circuit when it sends a circuit edge and is the input or
    # receives one; the logits always
    sends = {e.split(" -> ")[0] for e in circuit.edges}
    receives = {re.sub(r"\.[qkv]$", "", e.split(" -> ")[1]) for e in circuit.edges}
    for name, node in data["nodes"].items():
        label = _ours(f"{name}->logits").split(" -> ")[0]
        want = name == "logits" or (label in sends and (name == "input" or label in receives))
        assert node["in_graph"] == want, name
    back = EdgeScores.from_mib(path, model)
    assert back.graph == scores.graph and _same(back.values, scores.values)
    assert (back.clean, back.corrupt, back.ig_steps) == (scores.clean, scores.corrupt, 1)
    read = Circuit.from_mib(path, model)
    assert read.indices == tuple(sorted(circuit.indices))  # in the graph's edge order
    assert _same(read.values, scores.values)  # type: ignore[arg-type]


def test_the_pt_twin_holds_mibs_matrix(gpt2_scores: tuple[Any, EdgeScores], tmp_path: Path) -> None:
    model, scores = gpt2_scores
    circuit = scores.circuit(25)
    path = scores.to_mib(tmp_path / "importances.pt", circuit)
    data = torch.load(path, weights_only=True)
    nodes, edges = _mib_graph(12, 12)
    assert data["src_nodes"] == nodes[:-1] and data["dst_nodes"] == _mib_dst(12, 12)
    assert data["edges_scores"].shape == (1 + 12 * 13, 12 * 37 + 1)
    matrix, in_graph = data["edges_scores"], data["edges_in_graph"]
    real = {n: None for n in edges}
    for i, src in enumerate(data["src_nodes"]):
        for j, dst in enumerate(data["dst_nodes"]):
            name = f"{src}->{dst}"
            if name in real:
                assert float(matrix[i, j]) == scores.score(*_ours(name).split(" -> "))
                assert bool(in_graph[i, j]) == (_ours(name) in circuit.edges)
            else:
                assert float(matrix[i, j]) == 0 and not in_graph[i, j]
    back = EdgeScores.from_mib(path, model)
    assert back.graph == scores.graph and _same(back.values, scores.values)
    assert set(Circuit.from_mib(path, model).edges) == set(circuit.edges)


def test_grouped_query_heads_export_each_query_heads_keys_and_values(tmp_path: Path) -> None:
    model = _llama(kv_heads=2)
    clean, corrupt = _pair()
    scores = edge_attribution(model, clean, corrupt, _metric, receivers=ALL)
    path = scores.to_mib(tmp_path / "c.json")
    data = json.loads(path.read_text())
    assert list(data["edges"]) == _mib_graph(2, 4)[1]  # a0.h3<k>: the query head's own keys
    assert _same(EdgeScores.from_mib(path, model).values, scores.values)
    shared = edge_attribution(model, clean, corrupt, _metric, receivers=ALL, kv="shared")
    with pytest.raises(ValueError, match="kv='shared'.*score with kv='query_head'"):
        shared.to_mib(tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()


def test_an_attention_only_model_writes_mibs_whole_graph(tmp_path: Path) -> None:
    """MIB's graph always has its MLP nodes: an attention-only model's are written, scored 0 and
    not in the circuit, so that MIB's ``from_pt`` (which builds the whole graph) reads the
    matrix; both files read back onto the model."""
    from multihead.models import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(20, 24, 4, 2, 32, max_len=16, attn_only=True).eval()
    clean, corrupt = _pair()
    scores = edge_attribution(model, clean, corrupt, _metric)
    nodes, edges = _mib_graph(2, 4)
    path = scores.to_mib(tmp_path / "a.json", scores.circuit(6))
    data = json.loads(path.read_text())
    assert list(data["nodes"]) == nodes and list(data["edges"]) == edges
    for name in edges:
        if re.search(r"(^|->)m\d", name):
            assert data["edges"][name] == {"score": 0.0, "in_graph": False}, name
        else:
            assert data["edges"][name]["score"] == scores.score(*_ours(name).split(" -> "))
    assert not data["nodes"]["m0"]["in_graph"]
    pt = torch.load(scores.to_mib(tmp_path / "a.pt"), weights_only=True)
    assert pt["src_nodes"] == nodes[:-1] and pt["dst_nodes"] == _mib_dst(2, 4)
    assert pt["edges_scores"].shape == (1 + 2 * 5, 2 * 13 + 1)
    for name in ("a.json", "a.pt"):
        back = EdgeScores.from_mib(tmp_path / name, model)
        assert _same(back.values, scores.values) and back.labels == scores.labels
    data["edges"]["m0->logits"]["score"] = 0.5  # a feed-forward edge the model lacks, scored
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"has 1 edges the model lacks \(m0->logits\)"):
        EdgeScores.from_mib(tmp_path / "b.json", model)


def test_a_file_another_tool_wrote_reads_by_name(tmp_path: Path) -> None:
    model = _gpt2(layers=2, heads=3)
    nodes, edges = _mib_graph(2, 3)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(len(edges), generator=g).tolist()
    picked = set(edges[::7])
    data = {
        "cfg": {"n_layers": 2, "n_heads": 3, "parallel_attn_mlp": False, "d_model": 24},
        "nodes": {n: {"in_graph": True} for n in nodes},
        # MIB's order does not matter to a reader: reversed here
        "edges": {n: {"score": v, "in_graph": n in picked} for n, v in reversed(list(zip(
            edges, values, strict=True)))},
    }  # fmt: skip
    (tmp_path / "a.json").write_text(json.dumps(data))
    scores = EdgeScores.from_mib(tmp_path / "a.json", model)
    assert math.isnan(scores.clean) and math.isnan(scores.corrupt)
    assert len(scores) == len(edges)
    for name, value in zip(edges, values, strict=True):
        assert scores.score(*_ours(name).split(" -> ")) == pytest.approx(value, rel=1e-7)
    assert set(Circuit.from_mib(tmp_path / "a.json", model).edges) == {_ours(n) for n in picked}


def test_files_that_do_not_fit_are_refused_in_one_line(tmp_path: Path) -> None:
    model = _gpt2(layers=2, heads=3)
    nodes, edges = _mib_graph(2, 3)
    cfg = {"n_layers": 2, "n_heads": 3, "parallel_attn_mlp": False, "d_model": 24}

    def write(name: str, data: Any) -> Path:
        (tmp_path / name).write_text(json.dumps(data))
        return tmp_path / name

    every = {n: {"score": 1.0, "in_graph": False} for n in edges}
    cases = [
        (write("other.json", {"cfg": {**cfg, "n_layers": 12}, "nodes": {}, "edges": every}),
         "n_layers, n_heads = 12, 3; the model has 2, 3"),
        (write("few.json", {"cfg": cfg, "nodes": {}, "edges": dict(list(every.items())[1:])}),
         "lacks 1 of the model's edges (input->a0.h0<q>)"),
        (write("more.json", {"cfg": cfg, "nodes": {}, "edges": {**every, "m1->a0.h0<q>": {
            "score": 1.0, "in_graph": False}}}), "has 1 edges the model lacks (m1->a0.h0<q>)"),
        (write("list.json", [1, 2]), "not a MIB circuit file: expected a JSON object"),
        (write("bad.json", {"cfg": cfg, "nodes": {}, "edges": {edges[0]: {"score": "x"}}}),
         "must hold a number 'score'"),
    ]  # fmt: skip
    for path, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            EdgeScores.from_mib(path, model)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="must end in .json or .pt"):
        EdgeScores.from_mib(tmp_path / "c.txt", model)
    with pytest.raises(FileNotFoundError):
        EdgeScores.from_mib(tmp_path / "missing.json", model)


class _Code:
    """Anything pickled that is not a tensor or a container of them."""


def test_a_pt_file_holding_code_is_refused(tmp_path: Path) -> None:
    model = _gpt2(layers=2, heads=3)
    torch.save({"cfg": _Code()}, tmp_path / "code.pt")
    with pytest.raises(ValueError, match="weights_only=True") as info:
        EdgeScores.from_mib(tmp_path / "code.pt", model)
    assert "\n" not in str(info.value)
    torch.save({"cfg": {}}, tmp_path / "keys.pt")
    with pytest.raises(ValueError, match="expected the keys cfg, src_nodes"):
        EdgeScores.from_mib(tmp_path / "keys.pt", model)


def test_to_mib_names_what_the_scores_lack(
    gpt2_scores: tuple[Any, EdgeScores], tmp_path: Path
) -> None:
    model, _ = gpt2_scores
    clean, corrupt = _pair()
    default = edge_attribution(model, clean, corrupt, _metric)  # no feed-forward receivers
    with pytest.raises(ValueError, match=r"receivers lack mlp: score with receivers="):
        default.to_mib(tmp_path / "a.json")
    some = edge_attribution(model, clean, corrupt, _metric, receivers=ALL, senders=["L3H1"])
    with pytest.raises(ValueError, match="only some senders"):
        some.to_mib(tmp_path / "b.json")
    other = Circuit.of(["embed -> L0H0.q"], default.graph)
    with pytest.raises(ValueError, match="circuit must be a circuit of these scores' graph"):
        gpt2_scores[1].to_mib(tmp_path / "c.json", other)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gpt2_scores[1].to_mib(tmp_path / "no" / "c.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# -- CPR and CMD ------------------------------------------------------------------------------


def _mib_areas(faithfulnesses: list[float]) -> tuple[float, float]:
    """MIB's ``evaluate_area_under_curve`` after its faithfulness loop (``log_scale=False``),
    line by line."""
    percentages = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)
    area_under = 0.0
    area_from_1 = 0.0
    for i in range(len(faithfulnesses) - 1):
        i_1, i_2 = i, i + 1
        x_1 = percentages[i_1]
        x_2 = percentages[i_2]
        trapezoidal = (x_2 - x_1) * (
            ((abs(1.0 - faithfulnesses[i_1])) + (abs(1.0 - faithfulnesses[i_2]))) / 2
        )
        area_from_1 += trapezoidal
        trapezoidal = (x_2 - x_1) * ((faithfulnesses[i_1] + faithfulnesses[i_2]) / 2)
        area_under += trapezoidal
    return area_under, area_from_1


@pytest.mark.parametrize("total", [32491, 81])
def test_cpr_and_cmd_are_mibs_areas(total: int) -> None:
    percentages = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)
    sizes = [int(p * total) for p in percentages]  # MIB's curr_num_items
    assert mib_sizes(total) == sizes
    g = torch.Generator().manual_seed(total)
    by_size = {n: float(v) for n, v in zip(sorted(set(sizes)), torch.randn(len(set(sizes)),
               generator=g, dtype=torch.float64) * 0.6 + 0.5, strict=True)}  # fmt: skip
    f = [by_size[n] for n in sizes]  # a small graph repeats sizes (81: 0 four times)
    chosen = tuple(sorted(by_size))
    curve = FaithfulnessCurve(
        chosen, tuple(by_size[n] for n in chosen), chosen, (), (), total, 1.0, 0.0
    )
    cpr, cmd = _mib_areas(f)
    assert abs(curve.cpr - cpr) <= 1e-12 and abs(curve.cmd - cmd) <= 1e-12
    assert cpr != cmd


def test_a_curve_without_mibs_sizes_has_no_cpr() -> None:
    curve = FaithfulnessCurve((0, 5, 10), (0.0, 0.5, 1.0), (0, 5, 10), (), (), 10, 1.0, 0.0)
    with pytest.raises(ValueError, match="sizes='mib'"):
        _ = curve.cpr


def test_faithfulness_curve_at_mibs_sizes() -> None:
    lm = _lm(torch.float64)
    g = torch.Generator().manual_seed(5)
    clean, corrupt = (torch.randint(0, 20, (2, 6), generator=g) for _ in range(2))
    scores = edge_attribution(lm, clean, corrupt, _metric, receivers=ALL)
    curve = faithfulness_curve(lm, clean, corrupt, _metric, scores, sizes="mib", draws=0)
    total = len(scores)
    assert curve.sizes == tuple(sorted({int(p * total) for p in (0.001, 0.002, 0.005, 0.01,
                                        0.02, 0.05, 0.1, 0.2, 0.5, 1)}))  # fmt: skip
    assert curve.random == () and curve.random_edges == ()
    for n, value in zip(curve.sizes, curve.values, strict=True):
        want = faithfulness(lm, clean, corrupt, _metric, scores.circuit(n))
        assert value == pytest.approx(want, abs=1e-9)
    f = [dict(zip(curve.sizes, curve.values, strict=True))[n] for n in mib_sizes(total)]
    assert curve.cpr == pytest.approx(_mib_areas(f)[0], abs=1e-12)
    assert curve.values[0] == pytest.approx(0, abs=1e-9)  # the empty circuit: 0
    with pytest.raises(ValueError, match="sizes must be circuit sizes or 'mib'"):
        faithfulness_curve(lm, clean, corrupt, _metric, scores, sizes="MIB")
    assert curve.plot() is not None  # no random curve drawn


# -- Circuit.compare ---------------------------------------------------------------------------


def _pairwise_auroc(scores: list[float], truth: list[bool]) -> float:
    """Over every (reference edge, other edge) pair: 1 when the reference edge's score is
    larger, 1/2 on a tie."""
    pos = [s for s, t in zip(scores, truth, strict=True) if t]
    neg = [s for s, t in zip(scores, truth, strict=True) if not t]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_compare_counts_edges_and_ranks_the_scores() -> None:
    lm = _lm(torch.float64)
    g = torch.Generator().manual_seed(2)
    clean, corrupt = (torch.randint(0, 20, (2, 6), generator=g) for _ in range(2))
    scores = edge_attribution(lm, clean, corrupt, _metric)
    labels = scores.labels
    reference = [labels[i] for i in (0, 3, 4, 9, 17, 30)]
    circuit = scores.circuit(8, prune=False)
    result = circuit.compare(reference)
    mine, truth = set(circuit.edges), set(reference)
    assert result.true_positives == len(mine & truth)
    assert result.false_positives == len(mine - truth)
    assert result.false_negatives == len(truth - mine)
    assert result.true_negatives == len(labels) - len(mine | truth)
    assert result.precision == len(mine & truth) / len(mine)
    assert result.recall == len(mine & truth) / len(truth)
    size = [abs(scores.score(*e.split(" -> "))) for e in labels]
    assert result.auroc == pytest.approx(
        _pairwise_auroc(size, [e in truth for e in labels]), abs=1e-12
    )
    # ties count half: every edge scored alike
    flat = EdgeScores(scores.graph, scores.values.nan_to_num(0).sign().abs() * 2.0, 1.0, 0.0)
    flat = EdgeScores(flat.graph, flat.values.masked_fill(scores.values.isnan(), math.nan), 1, 0)
    assert flat.circuit(3).compare(reference).auroc == pytest.approx(0.5, abs=1e-12)
    # a reference on a graph with other receiver kinds is matched edge by edge
    wider = edge_attribution(lm, clean, corrupt, _metric, receivers=ALL)
    assert wider.circuit(5).compare(Circuit.of(reference, scores.graph)).true_negatives == (
        len(wider) - len(set(wider.circuit(5).edges) | truth)
    )
    with pytest.raises(ValueError, match="reference's edges must be edges"):
        circuit.compare(Circuit.of(["L0H0 -> MLP0"], wider.graph))
    assert Circuit.of(reference, scores.graph).compare(reference).auroc is None


@pytest.mark.slow
def test_eap_ig_ranks_the_induction_circuit(induction_model: Any) -> None:
    """The known circuit, found from the attention patterns: the embeddings into the
    previous-token heads' values, those heads into the induction heads' keys, the embeddings
    into the induction heads' values, the induction heads into the logits."""
    from multihead.training.induction_pair import induction_pair

    model = copy.deepcopy(induction_model).cpu()  # the session's model left where it was
    pair = induction_pair(32, batch=16)
    previous, induction = head_patterns(model, pair)
    prev_heads = [h for h in range(4) if previous[h] > 0.3]
    ind_heads = [h for h in range(4) if induction[h] > 0.3]
    assert prev_heads and ind_heads, (previous, induction)
    reference = [f"embed -> L0H{p}.v" for p in prev_heads]
    reference += [f"L0H{p} -> L1H{i}.k" for p in prev_heads for i in ind_heads]
    reference += [f"embed -> L1H{i}.v" for i in ind_heads]
    reference += [f"L1H{i} -> logits" for i in ind_heads]
    with torch.enable_grad():
        scores = edge_attribution(model, pair.clean, pair.corrupt, pair.metric, ig_steps=8)
    result = scores.circuit(len(reference)).compare(reference)
    assert result.auroc is not None and result.auroc >= 0.95, (result, reference)
