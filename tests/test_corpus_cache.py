"""multihead.cache_corpus: a corpus' activations streamed to safetensors shards, each equal to
multihead.cache of its batch and, at real positions, of each text alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny_bert import write_dir  # noqa: E402

import multihead  # noqa: E402
from multihead.pretrained import load_text_model  # noqa: E402
from multihead.text.corpus_cache import MANIFEST, cache_corpus  # noqa: E402

TEXTS = ["the cat sat on the mat .", "a dog sat .", "cat", "the mat the mat .", "dog . dog ."]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.manual_seed(0)
    return load_text_model(write_dir(tmp_path_factory.mktemp("tiny") / "m", tokenizer=True))


def test_shards_hold_each_batch_and_each_text_alone(model: Any, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    paths = cache_corpus(
        model, TEXTS, tmp_path / "acts", names=["resid_post", ("z", 1), ("result", 0)],
        batch_size=2,
        progress=lambda done, total: seen.append((done, total)),
    )  # fmt: skip
    assert [p.name for p in paths] == [
        "texts-0000000-0000002.safetensors",
        "texts-0000002-0000004.safetensors",
        "texts-0000004-0000005.safetensors",
    ]
    assert seen == [(2, 5), (4, 5), (5, 5)]
    manifest = json.loads((tmp_path / "acts" / MANIFEST).read_text())
    assert manifest["texts"] == 5 and manifest["shards"] == [p.name for p in paths]
    layers = model.num_layers
    names = sorted([f"blocks.{i}.hook_resid_post" for i in range(layers)])
    assert manifest["names"] == sorted(
        [*names, "blocks.1.attn.hook_z", "blocks.0.attn.hook_result"]
    )
    for path in paths:
        shard = load_file(path)
        for row, index in enumerate(shard["text_index"].tolist()):
            ids = model.tokenize(TEXTS[index]).input_ids
            alone = multihead.cache(model, ids, names=["resid_post", ("z", 1), ("result", 0)])
            n = ids.shape[1]
            assert int(shard["attention_mask"][row].sum()) == n
            for i in range(layers):
                torch.testing.assert_close(
                    shard[f"blocks.{i}.hook_resid_post"][row, :n], alone["resid_post", i][0].cpu(),
                    rtol=1e-5, atol=1e-5,
                )  # fmt: skip
            for name, key in (
                ("blocks.1.attn.hook_z", ("z", 1)),
                ("blocks.0.attn.hook_result", ("result", 0)),
            ):
                torch.testing.assert_close(
                    shard[name][row, :n], alone[key][0].cpu(), rtol=1e-5, atol=1e-5
                )
    assert multihead.cache_corpus is cache_corpus


def test_dtype_and_refusals_write_nothing(model: Any, tmp_path: Path) -> None:
    half = cache_corpus(model, TEXTS[:2], tmp_path / "half", dtype=torch.float16)
    assert load_file(half[0])["blocks.0.hook_resid_post"].dtype == torch.float16
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="out_dir must be a new or empty directory, got a dir"):
        cache_corpus(model, TEXTS, taken)
    assert sorted(p.name for p in taken.iterdir()) == ["mine.txt"]
    with pytest.raises(ValueError, match="names items must be one of"):
        cache_corpus(model, TEXTS, tmp_path / "bad", names=["nothing"])
    with pytest.raises(ValueError, match=r"texts\[1\] .*empty|texts"):
        cache_corpus(model, ["a cat", ""], tmp_path / "empty")
    with pytest.raises(TypeError, match="model must be a multihead.TextModel"):
        cache_corpus(torch.nn.Linear(2, 2), TEXTS, tmp_path / "x")  # type: ignore[arg-type]
    assert not any((tmp_path / d).exists() for d in ("bad", "empty", "x"))
