"""Damaged checkpoints: every file truncated, emptied, corrupted, edited and deleted in turn.

``--resume`` and ``generate`` must exit 2 with one line that names the damaged file, and leave
every file as it was: the last good checkpoint is never lost (repairing the file makes the
same ``--resume`` work). One run is trained per module; each test damages a copy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_support import copy_run, fails, snapshot, train_tiny

from multihead.cli import main
from multihead.models import TransformerLM
from multihead.training import load_checkpoint

pytestmark = pytest.mark.cpu_only  # the training CLI's checkpoints

STEP = "step-00000002"
FILES = ("config.json", "model.safetensors", "optimizer.safetensors", "state.json")
QUIET = ["--quiet", "--no-plots", "--eval-size", "0"]


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny finished run, trained once per module."""
    return train_tiny(
        tmp_path_factory.mktemp("trained") / "run",
        task="reverse",
        seq_len=3,
        embed_dim=16,
        ff_dim=24,
    )


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    return copy_run(trained, tmp_path)


def _flip(data: bytes) -> bytes:
    """Invert 16 bytes in the middle: garbage inside a JSON text or a tensor."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 16]) + data[middle + 16 :]


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
    "emptied": lambda f: f.write_bytes(b""),
    "corrupted": lambda f: f.write_bytes(_flip(f.read_bytes())),
    "deleted": lambda f: f.unlink(),
}


def resume(run: Path) -> list[str]:
    return ["train", "--out", str(run), "--resume", "--steps", "4", *QUIET]


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_resume_names_the_damaged_file(
    name: str, kind: str, run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = run / "checkpoints" / STEP / name
    good = file.read_bytes()
    DAMAGE[kind](file)
    before = snapshot(tmp_path)
    err = fails(capsys, resume(run))
    assert str(file) in err
    assert snapshot(tmp_path) == before  # nothing deleted, nothing written
    # The checkpoint is not lost: with the file repaired, the same command resumes it.
    file.write_bytes(good)
    assert main(resume(run)) == 0, capsys.readouterr().err
    assert load_checkpoint(run / "checkpoints" / "step-00000004")["state"]["step"] == 4


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
@pytest.mark.parametrize("where", ["run", "checkpoint"])
def test_generate_names_the_damaged_file(
    where: str,
    name: str,
    kind: str,
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory = run if where == "run" else run / "checkpoints" / STEP
    DAMAGE[kind](directory / name)
    before = snapshot(tmp_path)
    err = fails(capsys, ["generate", "--checkpoint", str(directory), "1 2 3 ="])
    assert str(directory / name) in err
    assert snapshot(tmp_path) == before


def test_generate_reads_only_the_model_files(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A checkpoint's optimizer and trainer state are not needed to continue prompts.
    step = run / "checkpoints" / STEP
    (step / "optimizer.safetensors").write_bytes(b"")
    (step / "state.json").unlink()
    assert main(["generate", "--checkpoint", str(step), "1 2 3 ="]) == 0
    assert len(capsys.readouterr().out.split()) <= 4


def _rewrite_json(file: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(file.read_text())
    file.write_text(json.dumps(edit(data)))


def _set(data: dict, path: str, value: object) -> dict:
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return data


_DELETE = object()

# Edits that keep the file valid JSON (state.json vouches for config.json by its SHA-256, so a
# config.json edit is caught there first; the _resealed cases below get past that check).
EDITS = [
    ("state.json", lambda d: _set(d, "step", "two"), "step must be an int >= 0, got 'two'"),
    ("state.json", lambda d: _set(d, "step", -1), "step must be an int >= 0, got -1"),
    ("state.json", lambda d: _set(d, "step", 10**30), f"but state.json says step {10**30}"),
    ("state.json", lambda d: _set(d, "step", 1), "holds step 2, but state.json says step 1"),
    ("state.json", lambda d: _set(d, "optimizer", _DELETE), "'optimizer' and 'files' must be"),
    ("state.json", lambda d: _set(d, "optimizer.param_groups", 3), "param_groups are malformed"),
    ("state.json", lambda d: _set(d, "history", [[1, 0.5]]), "history must list [step, loss"),
    ("state.json", lambda d: _set(d, "history", _DELETE), "history must list [step, loss"),
    ("state.json", lambda d: [d], "must hold a JSON object, got [{"),
    ("state.json", lambda d: None, "must hold a JSON object, got None"),
    ("config.json", lambda d: _set(d, "training.lr", 1.0), "was changed after it was saved"),
    ("config.json", lambda d: [], "was changed after it was saved"),
]


@pytest.mark.parametrize(("name", "edit", "message"), EDITS, ids=range(len(EDITS)))
def test_resume_refuses_edited_files(
    name: str,
    edit: Callable[[dict], object],
    message: str,
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    file = run / "checkpoints" / STEP / name
    _rewrite_json(file, edit)
    before = snapshot(tmp_path)
    err = fails(capsys, resume(run))
    assert name in err and message in err
    assert snapshot(tmp_path) == before


def _resealed(run: Path, edit: Callable[[dict], object]) -> None:
    """Edit the checkpoint's config.json and record its new SHA-256, as a deliberate edit would."""
    step = run / "checkpoints" / STEP
    _rewrite_json(step / "config.json", edit)
    digest = hashlib.sha256((step / "config.json").read_bytes()).hexdigest()
    _rewrite_json(step / "state.json", lambda d: {**d, "files": {"config.json": digest}})


RESEALED = [
    (lambda d: _set(d, "training.steps", "abc"), "'training' entry: steps must be a positive int"),
    (lambda d: _set(d, "training", _DELETE), "has no 'training' entry"),
    (lambda d: _set(d, "training.embed_dim", 32), "its 'model' entry does not match"),
    (lambda d: _set(d, "model.embed_dim", 2**45), "don't match its config.json"),
    (lambda d: _set(d, "task.seq_len", 4), "its 'task' entry does not match"),
    (lambda d: _set(d, "training.seed", -5), "seed must be an int in [0, 2**64), got -5"),
]


@pytest.mark.parametrize(("edit", "message"), RESEALED, ids=range(len(RESEALED)))
def test_resume_checks_config_contents(
    edit: Callable[[dict], object],
    message: str,
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _resealed(run, edit)
    before = snapshot(tmp_path)
    err = fails(capsys, resume(run))
    assert "config.json" in err and message in err
    assert snapshot(tmp_path) == before


def test_checksums_catch_a_flipped_bit(run: Path) -> None:
    # One bit of one weight: still a valid safetensors file, only the checksum can tell.
    for file in (run / "model.safetensors", run / "checkpoints" / STEP / "model.safetensors"):
        good = file.read_bytes()
        bad = bytearray(good)
        bad[-3] ^= 0x01
        file.write_bytes(bytes(bad))
        with pytest.raises(ValueError, match="is corrupt: its tensors do not match the checksum"):
            TransformerLM.load(file.parent)
        file.write_bytes(good)
        TransformerLM.load(file.parent)  # the reference: intact, it loads


def test_nan_weights_are_refused(run: Path, tmp_path: Path) -> None:
    # A model saved with nan weights (as a diverged run of an older version could) is refused.
    model = TransformerLM.load(run)
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    model.save(tmp_path / "nan", extra={"task": {"name": "reverse", "seq_len": 3}})
    with pytest.raises(ValueError, match=r"are not finite \(nan or inf in \['head.weight'\]\)"):
        TransformerLM.load(tmp_path / "nan")


def test_library_errors_are_typed(run: Path) -> None:
    step = run / "checkpoints" / STEP
    (step / "state.json").write_text("{")
    with pytest.raises(ValueError, match=r"state\.json' is not valid JSON"):
        load_checkpoint(step)
    (step / "optimizer.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"optimizer\.safetensors' is missing"):
        load_checkpoint(step)


def test_a_checkpoint_from_a_bigger_machine_resumes_with_fewer_threads(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _resealed(run, lambda d: _set(d, "training.threads", 4096))
    assert "--threads must be at most the" in fails(capsys, resume(run))
    assert main([*resume(run), "--threads", "1"]) == 0, capsys.readouterr().err
