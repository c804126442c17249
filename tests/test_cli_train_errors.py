"""Every flag of ``multihead train`` and ``multihead generate`` against bad values.

The contract: exit code 2, exactly one line on stderr (naming the flag or file, what it got and
what it expected), no traceback, and nothing on disk created, changed or deleted. Each bad
training flag is tried with ``--overwrite`` on a real run (the old run must survive) and with a
fresh ``--out`` (which must not appear). In-process (``main(argv)``): no training happens.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_support import copy_run, fails, snapshot, train_tiny

from multihead.cli import main

pytestmark = pytest.mark.cpu_only  # the training CLI's errors and files

TINY = ["--embed-dim", "32", "--num-heads", "2", "--ff-dim", "48", "--threads", "1"]
SMALL = ["--task", "sort", "--seq-len", "4", "--steps", "2", "--batch-size", "8", *TINY]
QUIET = ["--quiet", "--no-plots", "--eval-size", "0"]


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A case that wrongly fell back to the default --out (runs/TASK) lands in tmp_path.
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny finished run, trained once per module."""
    return train_tiny(tmp_path_factory.mktemp("trained") / "run")


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    return copy_run(trained, tmp_path)


# (flags, what the one line must say)
BAD_TRAIN = [
    (["--steps", "0"], "--steps must be a positive int, got 0"),
    (["--steps", "-3"], "--steps must be a positive int, got -3"),
    (["--steps", "1.5"], "argument --steps: invalid int value: '1.5'"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["--seq-len", "0"], "--seq-len must be a positive int, got 0"),
    (["--task", "add", "--seq-len", "18"], "--seq-len must be at most 17 for the add task"),
    (["--task", "mul"], "argument --task: invalid choice: 'mul'"),
    (["--batch-size", "0"], "--batch-size must be a positive int, got 0"),
    (["--batch-size", str(10**12)], "the run needs at least"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--lr=-1e-3"], "--lr must be > 0, got -0.001"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr", "1e400"], "--lr must be a finite number, got inf"),
    (["--seed", "-1"], "--seed must be an int in [0, 2**64), got -1"),
    (["--seed", str(2**64)], f"--seed must be an int in [0, 2**64), got {2**64}"),
    (["--embed-dim", "0"], "--embed-dim must be a positive int, got 0"),
    # 2**45 × 14 float32 embeddings do not fit any address space: refused before allocating.
    (["--embed-dim", str(2**45)], "the run needs at least"),
    (["--num-heads", "3"], "--embed-dim (32) must be divisible by --num-heads (3)"),
    (["--num-heads", "0"], "--num-heads must be a positive int, got 0"),
    (["--num-layers", "0"], "--num-layers must be a positive int, got 0"),
    (["--num-layers", str(10**9)], "the run needs at least"),
    (["--ff-dim", "-1"], "--ff-dim must be a positive int, got -1"),
    (["--num-kv-heads", "3"], "--num-heads (2) must be a multiple of --num-kv-heads (3)"),
    (["--num-kv-heads", "0"], "--num-kv-heads must be a positive int or None, got 0"),
    (["--dropout", "2"], "--dropout must be a float in [0, 1), got 2.0"),
    (["--dropout", "1"], "--dropout must be a float in [0, 1), got 1.0"),
    (["--dropout", "-0.1"], "--dropout must be a float in [0, 1), got -0.1"),
    (["--dropout", "nan"], "--dropout must be a float in [0, 1), got nan"),
    (["--warmup-steps", "-1"], "--warmup-steps must be an int >= 0, got -1"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number, got nan"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number, got inf"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0.0, got -1.0"),
    (["--save-every", "-1"], "--save-every must be an int >= 0, got -1"),
    (["--eval-size", "-1"], "--eval-size must be an int >= 0, got -1"),
    # sort at --seq-len 4 holds out about 10**4 / 10 inputs: 10**12 would evaluate for weeks
    (["--eval-size", str(10**12)], "--eval-size must be at most 1000 (the sort task at --seq-len"),
    (["--eval-size", "1001"], "--eval-size must be at most 1000 (the sort task at --seq-len 4"),
    (["--threads", "0"], "--threads must be a positive int or None, got 0"),
    (["--threads", str(10**6)], "--threads must be at most the"),
    (["--device", "bogus"], "--device must be 'auto' or a torch device"),
    (["--device", ""], "--device must be 'auto' or a torch device"),
    (["--device", "meta"], "--device must be one of the types cpu, cuda, mps, xpu"),
    (["--device", "cuda:99"], "--device 'cuda:99' "),  # "is not available" or "does not exist"
    (["--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_TRAIN, ids=[" ".join(f) for f, _ in BAD_TRAIN])
def test_bad_train_flags_change_nothing(
    flags: list[str], message: str, run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(tmp_path)
    # Over an existing run with --overwrite: the old run must survive a failed start.
    overwrite = [] if "--overwrite" in flags else ["--overwrite"]
    err = fails(capsys, ["train", *SMALL, *QUIET, "--out", str(run), *overwrite, *flags])
    assert message in err
    # Into a new directory: it must not be created.
    fresh = tmp_path / "fresh" / "run"
    err = fails(capsys, ["train", *SMALL, *QUIET, "--out", str(fresh), *flags])
    assert message in err
    assert snapshot(tmp_path) == before


def test_out_paths(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"my": "settings"}')
    (foreign / "loss.png").write_bytes(b"my plot")
    model_only = tmp_path / "model-only"
    shutil.copytree(run, model_only, ignore=shutil.ignore_patterns("checkpoints"))
    own_checkpoints = tmp_path / "own-checkpoints"
    (own_checkpoints / "checkpoints").mkdir(parents=True)
    (own_checkpoints / "checkpoints" / "best.pt").write_bytes(b"mine")
    before = snapshot(tmp_path)
    cases = [
        (["--out", str(file)], f"--out {str(file)!r} is a file, not a directory"),
        (["--out", str(file / "sub")], f"cannot be created: {str(file)!r} is not a directory"),
        (["--out", str(file), "--overwrite"], "is a file, not a directory"),
        (["--out", str(run)], "already holds a training run (its newest checkpoint is step-"),
        (["--out", str(foreign)], "holds config.json, loss.png, which 'multihead train' did not"),
        (["--out", str(foreign), "--overwrite"], "did not write: choose another --out"),
        (["--out", str(model_only)], "holds a trained model but no checkpoint to resume: pass"),
        (["--out", ""], "--out must name a directory, got ''"),
        (["--out", str(own_checkpoints), "--overwrite"], "holds checkpoints, which 'multihead"),
    ]
    for flags, message in cases:
        assert message in fails(capsys, ["train", *SMALL, *QUIET, *flags]), flags
    assert snapshot(tmp_path) == before


def test_flag_names_inside_a_quoted_path_stay_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # repr writes this path in single quotes with the inner one escaped: 'it\'s "a" seq_len'
    odd = tmp_path / 'it\'s "a" seq_len'
    odd.write_text("")
    err = fails(capsys, ["train", *SMALL, *QUIET, "--out", str(odd)])
    assert err.endswith(f"error: --out {str(odd)!r} is a file, not a directory\n"), err


def test_an_apostrophe_is_no_quote() -> None:
    from multihead.cli.train import _in_flags

    assert _in_flags("the model's eval_size and the run's save_every differ") == (
        "the model's --eval-size and the run's --save-every differ"
    )
    assert _in_flags("the runs' num_heads and 'x_y num_heads'") == (
        "the runs' --num-heads and 'x_y num_heads'"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        err = fails(capsys, ["train", *SMALL, *QUIET, "--out", str(locked / "run")])
    finally:
        locked.chmod(0o755)
    assert f"{str(locked)!r} is not writable" in err
    assert not (locked / "run").exists()


def test_bad_resume_flags(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(tmp_path)
    missing = tmp_path / "missing"
    cases = [
        (["--resume"], "--resume needs --out DIR"),
        (["--resume", "--out", ""], "--out must name a directory, got ''"),
        (["--resume", "--out", str(run / "config.json")], "config.json' is a file, not a"),
        (["--resume", "--out", str(missing)], "--resume: there is no checkpoint in"),
        (
            ["--resume", "--out", str(run), "--batch-size", "16"],
            "trained with --batch-size=8, got 16",
        ),
        (["--resume", "--out", str(run), "--task", "copy"], "trained with task='sort', got 'copy'"),
        (["--resume", "--out", str(run), "--steps", "1"], "--steps must be at least the"),
        (["--resume", "--out", str(run), "--steps", "0"], "--steps must be a positive int, got 0"),
        (["--resume", "--out", str(run), "--device", "meta"], "--device must be one of the types"),
        (["--resume", "--out", str(run), "--threads", "-1"], "--threads must be a positive int"),
    ]
    for flags, message in cases:
        assert message in fails(capsys, ["train", *flags, *QUIET]), flags
    assert snapshot(tmp_path) == before


BAD_GENERATE = [
    (["1 2 ="], "prompt '1 2 =' does not fit the model: it was trained on sort prompts of 4 "),
    (["1 2"], "prompt '1 2' does not fit the model"),
    (["1 2 3 4"], "prompt '1 2 3 4' does not fit the model"),  # the '=' missing
    (["1 2 3 4 5 ="], "prompt '1 2 3 4 5 =' does not fit the model"),
    (["= 1 2 3 4"], "prompt '= 1 2 3 4' does not fit the model"),
    (["1 2 3 4 =", "1 2 ="], "prompt '1 2 =' does not fit the model"),
    (["1 + 2 3 ="], "prompt token '+' is not in the sort task's vocabulary"),
    (["a b c d ="], "prompt token 'a' is not in the sort task's vocabulary"),
    ([""], "the prompt is empty"),
    ([], "the following arguments are required: PROMPT"),
    (["--max-new-tokens", "0", "1 2 3 4 ="], "--max-new-tokens must be a positive int or None"),
    (["--max-new-tokens", "-1", "1 2 3 4 ="], "--max-new-tokens must be a positive int or None"),
    (["--max-new-tokens", "99", "1 2 3 4 ="], "--max-new-tokens must be at most 5 (the model's"),
    (["--temperature", "nan", "1 2 3 4 ="], "--temperature must be a finite number, got nan"),
    (["--temperature", "inf", "1 2 3 4 ="], "--temperature must be a finite number, got inf"),
    (["--temperature", "-1", "1 2 3 4 ="], "--temperature must be >= 0.0, got -1.0"),
    (["--temperature", "hot", "1 2 3 4 ="], "argument --temperature: invalid float value"),
    (["--top-k", "0", "1 2 3 4 ="], "--top-k must be a positive int or None, got 0"),
    (["--top-k", "-2", "1 2 3 4 ="], "--top-k must be a positive int or None, got -2"),
    (["--seed", "-1", "1 2 3 4 ="], "--seed must be an int in [0, 2**64), got -1"),
    (["--seed", str(2**64), "1 2 3 4 ="], "--seed must be an int in [0, 2**64)"),
]


@pytest.mark.parametrize(
    ("args", "message"), BAD_GENERATE, ids=["|".join(a) for a, _ in BAD_GENERATE]
)
def test_bad_generate_flags(
    args: list[str], message: str, run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(tmp_path)
    for where in (run, run / "checkpoints" / "step-00000002"):
        assert message in fails(capsys, ["generate", "--checkpoint", str(where), *args])
    assert snapshot(tmp_path) == before


def test_bad_generate_checkpoints(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    before = snapshot(tmp_path)
    cases = [
        (tmp_path / "missing", "does not exist"),
        (file, f"checkpoint directory {str(file)!r} is not a directory"),
        (empty, f"{str(empty / 'config.json')!r} is missing: not a saved TransformerLM"),
        (other, "is not a TransformerLM config (model_type must be 'multihead.TransformerLM')"),
    ]
    for where, message in cases:
        assert message in fails(capsys, ["generate", "--checkpoint", str(where), "1 2 3 4 ="])
    assert snapshot(tmp_path) == before


def test_good_values_still_run(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The table above is not passing because everything fails: the same command with good
    # values works (resume from step 2 to 3, then generate).
    argv = ["train", "--out", str(run), "--resume", "--steps", "3", *QUIET]
    assert main(argv) == 0, capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(run), "--top-k", "3", "1 2 3 4 ="]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("training sort (L=4) for 3 steps") and len(out[-1].split()) <= 5


def test_overwrite_deletes_only_what_a_run_wrote(run: Path, capsys) -> None:
    mine = [run / "notes.txt", run / "checkpoints" / "best.pt"]
    for file in mine:
        file.write_text("mine")
    argv = ["train", *SMALL, *QUIET, "--steps", "1", "--out", str(run), "--overwrite"]
    assert main(argv) == 0, capsys.readouterr().err
    assert all(file.read_text() == "mine" for file in mine)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "step-00000001"]
