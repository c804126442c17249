"""multihead.pretrained.cached_directory: model directories made once and kept.

A directory is made by a function of the test's own; the cache is a temporary folder (or off).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from multihead.pretrained.cached_directory import CACHE_ENV, cached_directory

SOURCE = {"file": "/some/source", "size": 3}


def _maker(calls: list[Path]):  # type: ignore[no-untyped-def]
    def make(folder: Path) -> None:
        calls.append(folder)
        (folder / "config.json").write_text("{}")
        (folder / "sub").mkdir()
        (folder / "sub" / "weights.bin").write_bytes(b"\x00" * 10)

    return make


def _use(make, **kw: str):  # type: ignore[no-untyped-def]
    return cached_directory(
        "kind", "name", dict(SOURCE), make, given="model", made="made", making="making it", **kw
    )


def test_an_entry_is_made_once_then_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    with _use(_maker(calls)) as first:
        assert (first / "sub" / "weights.bin").read_bytes() == b"\x00" * 10
    with _use(_maker(calls)) as second:
        assert second == first
    assert len(calls) == 1
    listed = json.loads((first / "source.json").read_text())["files"]
    assert sorted(listed) == ["config.json", "sub/weights.bin"]
    (first / "sub" / "weights.bin").write_bytes(b"\x01" * 10)  # damaged: made again, one warning
    with pytest.warns(UserWarning, match="is damaged"), _use(_maker(calls)) as third:
        assert (third / "sub" / "weights.bin").read_bytes() == b"\x00" * 10
    assert len(calls) == 2


def test_an_error_inside_the_block_is_the_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an OSError of the caller's own (a file its load lacks) is raised as it is: no warning
    # about the cache, no second directory made
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FileNotFoundError, match="the caller's"), _use(_maker(calls)):
            raise FileNotFoundError("the caller's")
    assert len(calls) == 1


def test_an_error_of_make_is_raised_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    def unreadable(folder: Path) -> None:
        raise PermissionError("the source cannot be read")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(PermissionError, match="the source cannot be read"), _use(unreadable):
            pass
    assert not [p for p in (tmp_path / "cache" / "kind").iterdir()]  # no entry, no leftovers


def test_an_unwritable_cache_makes_a_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    calls: list[Path] = []
    with pytest.warns(UserWarning, match="cannot be written"), _use(_maker(calls)) as folder:
        assert (folder / "config.json").is_file()
    assert not folder.exists() and len(calls) == 1
