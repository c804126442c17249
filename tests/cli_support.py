"""Shared by the CLI error tests: a tiny trained run, a snapshot of a tree, and the one-line
error contract."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from multihead.cli import main
from multihead.training import TrainConfig, train


def train_tiny(out: Path, **overrides: object) -> Path:
    """A tiny finished run (2 steps, a checkpoint at each) in ``out``; returns ``out``."""
    config = {
        "task": "sort",
        "seq_len": 4,
        "steps": 2,
        "batch_size": 8,
        "embed_dim": 32,
        "num_heads": 2,
        "ff_dim": 48,
        "threads": 1,
        "out": str(out),
        "save_every": 1,
        "eval_size": 0,
        "plots": False,
        **overrides,
    }
    train(TrainConfig(**config))  # type: ignore[arg-type]
    return out


def copy_run(trained: Path, tmp_path: Path) -> Path:
    """A private copy of a trained run."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with its contents (None for directories)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def fails(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI in-process; it must exit 2 with one line on stderr. Returns that line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors (a value that is not a number) exit here
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    return err
