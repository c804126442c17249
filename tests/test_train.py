"""multihead train / generate: tasks, the loop, resume bit-identity, Ctrl-C, atomic checkpoints,
and the CLI's errors. Runs are short and the models tiny; the real benchmark is in the notes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from multihead.cli import main
from multihead.models import TransformerLM
from multihead.training import (
    DivergenceError,
    Task,
    TrainConfig,
    latest_checkpoint,
    load_checkpoint,
    lr_at,
    train,
)
from multihead.training import checkpoint as checkpoint_module
from multihead.training.tasks import EOS, EQUALS, PLUS

pytestmark = pytest.mark.cpu_only  # the training CLI, its tasks and checkpoints

TINY = {"embed_dim": 32, "num_heads": 2, "num_layers": 2, "ff_dim": 48, "threads": 1}
TINY_FLAGS = ["--embed-dim", "32", "--num-heads", "2", "--ff-dim", "48", "--threads", "1"]


def _config(tmp_path: Path, **kwargs) -> TrainConfig:
    base = {
        "task": "reverse",
        "seq_len": 4,
        "steps": 8,
        "batch_size": 16,
        "out": str(tmp_path / "run"),
        "save_every": 0,
        "eval_size": 0,
        "plots": False,
        **TINY,
    }
    base.update(kwargs)
    return TrainConfig(**base)


# -- tasks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["copy", "reverse", "sort", "add"])
def test_task_examples_are_right(name: str) -> None:
    task = Task(name, 3)
    batch = task.batch(seed=5, step=2, rows=range(64))
    assert batch.shape == (64, task.total_len)
    for row in batch.tolist():
        prompt, answer = row[: task.prompt_len], row[task.prompt_len :]
        assert prompt[-1] == EQUALS and answer[-1] == EOS
        digits, answer = prompt[:-1], answer[:-1]
        if name == "copy":
            assert answer == digits
        elif name == "reverse":
            assert answer == digits[::-1]
        elif name == "sort":
            assert answer == sorted(digits)
        else:
            assert digits[3] == PLUS
            a, b = (int("".join(map(str, d))) for d in (digits[:3], digits[4:]))
            assert int("".join(map(str, answer))) == a + b and len(answer) == 4


def test_data_is_a_function_of_seed_step_and_row() -> None:
    task = Task("sort", 8)
    whole = task.batch(0, 7, range(12))
    assert torch.equal(whole, task.batch(0, 7, range(12)))
    # Shards drawn separately (as data-parallel ranks draw them) are the global batch.
    assert torch.equal(
        whole, torch.cat([task.batch(0, 7, range(6)), task.batch(0, 7, range(6, 12))])
    )
    assert not torch.equal(whole, task.batch(0, 8, range(12)))
    assert not torch.equal(whole, task.batch(1, 7, range(12)))


def test_held_out_inputs_are_never_trained_on() -> None:
    task = Task("copy", 2)  # only 100 inputs: collisions would show
    train_inputs = {tuple(r) for r in task.batch(0, 0, range(3000))[:, :2].tolist()}
    held = {tuple(r) for r in task.held_out(0, 500)[:, :2].tolist()}
    assert held and train_inputs and not held & train_inputs
    assert 5 <= len(held) <= 20 and len(train_inputs) >= 80  # about a tenth held out


def test_encode_decode() -> None:
    task = Task("add", 2)
    ids = task.encode("1 2 + 3 4 =")
    assert task.decode(ids) == "1 2 + 3 4 ="
    assert Task.decode([1, 2, EOS, 3]) == "1 2"
    with pytest.raises(ValueError, match=r"prompt token '\+' is not in the sort task's vocabulary"):
        Task("sort", 2).encode("1 + 2 =")
    with pytest.raises(ValueError, match="prompt token '12' is not in"):
        task.encode("12 + 3 =")
    with pytest.raises(
        ValueError, match="task must be one of 'copy', 'reverse', 'sort', 'add', got 'mul'"
    ):
        Task("mul", 2)


def test_learning_rate_schedule() -> None:
    config = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(config, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


# -- the loop ---------------------------------------------------------------------------------


def test_short_run_writes_everything_and_learns(tmp_path: Path) -> None:
    config = _config(tmp_path, task="copy", seq_len=3, steps=40, lr=3e-3, plots=True, eval_size=50)
    seen = []
    result = train(config, on_step=seen.append)
    out = tmp_path / "run"
    for name in ("config.json", "model.safetensors", "loss.png", "attention.png"):
        assert (out / name).is_file(), name
    assert [s.step for s in seen] == list(range(1, 41))
    assert seen[-1].loss < seen[0].loss / 2
    assert result.accuracy is not None and 0.0 <= result.accuracy <= 1.0
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    model = TransformerLM.load(out)
    assert torch.equal(model.head.weight, result.model.head.weight)
    assert json.loads((out / "config.json").read_text())["task"]["name"] == "copy"


def test_resume_after_interrupt_is_bit_identical(tmp_path: Path) -> None:
    # dropout > 0 so that the random generator's state matters too
    straight = train(_config(tmp_path / "a", dropout=0.1, save_every=3))

    def interrupt_at_5(info) -> None:
        if info.step == 5:
            raise KeyboardInterrupt

    first = train(_config(tmp_path / "b", dropout=0.1, save_every=3), on_step=interrupt_at_5)
    assert first.interrupted and first.step == 5
    assert latest_checkpoint(tmp_path / "b" / "run").name == "step-00000005"
    resumed = train(_config(tmp_path / "b", dropout=0.1, save_every=3, resume=True))
    assert not resumed.interrupted and resumed.step == 8
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed.history == straight.history  # losses of all 8 steps, exactly
    on_disk = TransformerLM.load(tmp_path / "b" / "run").state_dict()
    assert all(torch.equal(on_disk[k], a[k]) for k in a)


def test_resume_refuses_a_different_configuration(tmp_path: Path) -> None:
    train(_config(tmp_path, steps=2))
    with pytest.raises(ValueError, match="was trained with batch_size=16, got 32"):
        train(_config(tmp_path, steps=4, batch_size=32, resume=True))
    with pytest.raises(
        ValueError,
        match=r"already holds a training run \(its newest checkpoint is step-00000002\): pass "
        "--resume",
    ):
        train(_config(tmp_path, steps=4))
    assert train(_config(tmp_path, steps=3, overwrite=True)).step == 3


# -- atomic checkpoints -----------------------------------------------------------------------


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path: Path, monkeypatch) -> None:
    train(_config(tmp_path, steps=2))
    run = tmp_path / "run"
    before = load_checkpoint(latest_checkpoint(run))
    real_write = checkpoint_module.write_synced

    def crash_on_optimizer(path: Path, data: bytes) -> None:
        real_write(path, data[: len(data) // 2])  # half a file, then the "crash"
        if path.name == "optimizer.safetensors":
            raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "write_synced", crash_on_optimizer)
    with pytest.raises(OSError, match="disk full"):
        train(_config(tmp_path, steps=4, resume=True))
    monkeypatch.undo()
    checkpoints = run / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step-00000002"]  # no partial step-4
    after = load_checkpoint(latest_checkpoint(run))
    assert after["state"] == before["state"]
    # A crash's leftover (a hidden .tmp directory) is ignored, then cleaned by the next save.
    leftover = checkpoints / ".step-00000003.abc.tmp"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(run).name == "step-00000002"
    train(_config(tmp_path, steps=4, resume=True))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004"]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "multihead", *args]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared: {proc.communicate()}")
        time.sleep(0.05)


def _subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_sigint_saves_and_stops_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", "--task", "sort", "--seq-len", "3", "--steps", "100000", "--out", str(out)]
    proc = subprocess.Popen(
        _cli(*args, "--save-every", "5", "--quiet", *TINY_FLAGS),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_subprocess_env(),
    )
    _wait_for(out / "checkpoints", proc)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "interrupted at step" in stdout and "--resume" in stdout
    ckpt = latest_checkpoint(out)
    state = load_checkpoint(ckpt)["state"]
    assert 5 <= state["step"] < 100000
    assert state["step"] == len(state["history"])
    assert TransformerLM.load(out).num_parameters() > 0


def test_ctrl_c_held_down_ends_quietly_with_a_whole_checkpoint(tmp_path: Path) -> None:
    # Ctrl-C pressed again and again (as an impatient user does): every press lands somewhere
    # else (a step, the save, the last lines, the interpreter's shutdown), and none may print a
    # traceback or leave no checkpoint.
    out = tmp_path / "run"
    args = ["train", "--task", "sort", "--seq-len", "3", "--steps", "100000", "--out", str(out)]
    proc = subprocess.Popen(
        _cli(*args, "--save-every", "5", *TINY_FLAGS),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_subprocess_env(),
    )
    _wait_for(out / "checkpoints", proc)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.005)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "checkpoint saved in None" not in stdout
    state = load_checkpoint(latest_checkpoint(out))["state"]
    assert state["step"] == len(state["history"]) >= 5


def test_sigkill_never_leaves_a_half_written_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["train", "--task", "copy", "--seq-len", "3", "--steps", "100000", "--out", str(out)]
    proc = subprocess.Popen(
        _cli(*args, "--save-every", "1", "--quiet", *TINY_FLAGS),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_subprocess_env(),
    )
    _wait_for(out / "checkpoints", proc)
    time.sleep(1.0)  # saving every step: the kill lands in or near a save
    proc.kill()
    proc.wait(timeout=30)
    visible = [p for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")]
    assert visible
    for path in visible:  # every visible checkpoint is complete and loadable
        ckpt = load_checkpoint(path)
        assert f"step-{ckpt['state']['step']:08d}" == path.name
    TransformerLM.load(out)  # the run directory's model files are whole too


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_train_then_generate(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "run")
    flags = ["--steps", "30", "--batch-size", "16", "--seq-len", "4", "--out", out, "--quiet"]
    assert main(["train", "--task", "reverse", *flags, "--eval-size", "20", *TINY_FLAGS]) == 0
    printed = capsys.readouterr().out
    assert "held-out exact match:" in printed and "of 20 sequences" in printed
    assert main(["generate", "--checkpoint", out, "1 2 3 4 =", "5 6 7 8 ="]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert all(set(line.split()) <= set("0123456789") for line in lines)
    assert all(len(line.split()) <= 4 for line in lines)
    # --resume picks the flags up from the checkpoint and continues to the new --steps
    assert main(["train", "--out", out, "--resume", "--steps", "35", "--quiet", "--no-plots"]) == 0
    assert load_checkpoint(latest_checkpoint(out))["state"]["step"] == 35


def _error(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors (bad flag values) exit directly
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_cli_errors(tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "missing")
    assert "does not exist" in _error(capsys, ["generate", "--checkpoint", missing, "1 ="])
    assert "--steps must be a positive int, got 0" in _error(capsys, ["train", "--steps", "0"])
    assert "--steps must be a positive int, got -3" in _error(capsys, ["train", "--steps", "-3"])
    assert "there is no checkpoint in" in _error(capsys, ["train", "--out", missing, "--resume"])

    out = tmp_path / "run"
    train(_config(tmp_path, task="sort", seq_len=3, steps=2))
    assert "already holds a training run" in _error(
        capsys, ["train", "--task", "sort", "--out", str(out), "--steps", "2"]
    )
    err = _error(capsys, ["generate", "--checkpoint", str(out), "1 + 2 ="])
    assert "prompt token '+' is not in the sort task's vocabulary" in err
    err = _error(capsys, ["generate", "--checkpoint", str(out), "1 2 3 4 5 6 7 ="])
    assert "does not fit the model: it was trained on sort prompts of 3 digits and '='" in err

    config = json.loads((out / "config.json").read_text())
    config["model"]["num_layers"] = 3
    (out / "config.json").write_text(json.dumps(config))
    assert "don't match its config" in _error(
        capsys, ["generate", "--checkpoint", str(out), "1 2 3 ="]
    )
    config["model"]["num_layers"] = 2
    (out / "config.json").write_text(json.dumps(config))
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    err = _error(capsys, ["generate", "--checkpoint", str(out), "1 2 3 ="])
    assert "could not be read as safetensors" in err
    (out / "config.json").write_text("{")
    assert "is not valid JSON" in _error(capsys, ["generate", "--checkpoint", str(out), "1 2 3 ="])


def test_batch_size_must_split_across_ranks(tmp_path: Path, monkeypatch) -> None:
    from multihead.training import ddp, loop

    monkeypatch.setattr(loop, "setup_world", lambda device: ddp.World(rank=0, size=3))
    with pytest.raises(ValueError, match="batch_size 16 .* must be divisible by the world size 3"):
        train(_config(tmp_path))


def test_numpy_hash_does_not_warn() -> None:
    with np.errstate(all="raise"):
        Task("add", 5).batch(2**40, 10**6, range(4))


# -- divergence -------------------------------------------------------------------------------


def test_a_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    # lr 1e6 blows the weights up in one step; the loss of step 2 is nan.
    with pytest.raises(DivergenceError, match=r"the loss is nan at step 2 \(lr 1e\+06\)") as info:
        train(_config(tmp_path, lr=1e6, steps=10, save_every=1))
    run = tmp_path / "run"
    assert info.value.step == 2 and math.isnan(info.value.loss)
    assert info.value.checkpoint == run / "checkpoints" / "step-00000001"
    assert latest_checkpoint(run) == info.value.checkpoint  # step 2 was never saved
    ckpt = load_checkpoint(info.value.checkpoint)
    assert all(bool(torch.isfinite(t).all()) for t in ckpt["model_state"].values())
    TransformerLM.load(run)  # the run's own model files are step 1's, finite


def test_nan_weights_never_replace_a_good_checkpoint(tmp_path: Path, monkeypatch) -> None:
    train(_config(tmp_path, steps=2, save_every=1))
    run = tmp_path / "run"
    good = {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    real_step = torch.optim.AdamW.step

    def poisoned_step(self, *args, **kwargs):  # the update of step 3 leaves a nan weight
        out = real_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_step)
    # The loss of step 3 was computed before the update: finite. The save after it must refuse.
    with pytest.raises(DivergenceError, match="the weights hold nan or inf after step 3") as info:
        train(_config(tmp_path, steps=4, save_every=1, resume=True))
    assert info.value.checkpoint == run / "checkpoints" / "step-00000002"
    assert {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == good


def test_cli_divergence_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["train", "--task", "sort", "--seq-len", "3", "--steps", "10", "--batch-size", "8"]
    err = _error(capsys, [*argv, "--lr", "1e6", "--out", str(out), "--quiet", *TINY_FLAGS])
    assert "training diverged: the loss is nan at step 2" in err
    assert "a lower --lr may help" in err


# -- Ctrl-C, in process -----------------------------------------------------------------------


def _two_sigints() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("where", ["forward", "optimizer step"])
def test_a_second_ctrl_c_never_saves_half_a_step(where: str, tmp_path: Path, monkeypatch) -> None:
    # Ctrl-C twice during step 3 (0-based 2): in the forward pass the step is abandoned and
    # step 2 is saved; inside the update the update finishes and step 3 is saved. Either way the
    # run resumes to exactly the weights of a run never interrupted.
    straight = train(_config(tmp_path / "a", dropout=0.1))
    calls = {"n": 0}
    if where == "forward":
        target, name = TransformerLM, "forward"
    else:
        target, name = torch.optim.AdamW, "step"
    real = getattr(target, name)

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            if where == "forward":
                _two_sigints()  # the handler raises here, before the update
            else:
                out = real(self, *args, **kwargs)
                _two_sigints()  # noted only: the update is done
                return out
        return real(self, *args, **kwargs)

    monkeypatch.setattr(target, name, interrupted)
    first = train(_config(tmp_path / "b", dropout=0.1))
    monkeypatch.undo()
    expected_step = 2 if where == "forward" else 3
    assert first.interrupted and first.step == expected_step
    assert first.checkpoint is not None
    assert first.checkpoint.name == f"step-{expected_step:08d}"
    resumed = train(_config(tmp_path / "b", dropout=0.1, resume=True))
    assert resumed.history == straight.history
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- a run that stopped before its first checkpoint -------------------------------------------


def test_before_the_first_checkpoint_train_and_resume_agree(tmp_path: Path, capsys) -> None:
    # What a kill during the first save leaves: checkpoints/ with a hidden half-written step.
    out = tmp_path / "run"
    leftover = out / "checkpoints" / ".step-00000005.x1.tmp"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    argv = ["train", "--task", "sort", "--seq-len", "3", "--steps", "2", "--batch-size", "8"]
    argv += ["--out", str(out), "--quiet", "--no-plots", "--eval-size", "0", *TINY_FLAGS]
    err = _error(capsys, [*argv, "--resume"])
    assert "its run stopped before saving the first one, so start it afresh" in err
    assert "without --resume" in err
    assert main(argv) == 0  # ... and starting afresh works, and cleans the leftover
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]


# -- smaller pieces ---------------------------------------------------------------------------


def test_prompts_must_have_the_trained_shape() -> None:
    sort4, add2 = Task("sort", 4), Task("add", 2)
    assert sort4.parse_prompt("5 2 9 1 =") == [5, 2, 9, 1, EQUALS]
    assert add2.parse_prompt("1 2 + 3 4 =") == [1, 2, PLUS, 3, 4, EQUALS]
    for bad in ("5 2 =", "5 2 9 1", "5 2 9 1 0 =", "= 5 2 9 1", "5 2 = 9 1"):
        with pytest.raises(ValueError, match=r"of 4 digits and '=', such as '5 2 9 6 ='"):
            sort4.parse_prompt(bad)
    for bad in ("1 2 3 4 =", "1 + 2 3 4 =", "1 2 + 3 4"):
        with pytest.raises(ValueError, match=r"of 2 digits, '\+', 2 digits and '='"):
            add2.parse_prompt(bad)
    assert add2.parse_prompt(add2.example_prompt()) and sort4.parse_prompt(sort4.example_prompt())


def test_held_out_chunks_are_the_whole_set() -> None:
    task = Task("sort", 5)
    whole = task.held_out(3, 10)
    parts = [task.held_out(3, 4), task.held_out(3, 4, start=4), task.held_out(3, 2, start=8)]
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int8, torch.float32])
def test_lm_takes_int64_and_int32_ids_only(dtype: torch.dtype) -> None:
    lm = TransformerLM(14, 16, 2, 1, 24, max_len=8)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(lm(ids), lm(ids.to(torch.int32)))  # the two allowed dtypes agree
    with pytest.raises(TypeError, match=f"dtype torch.int64 or torch.int32, got dtype {dtype}"):
        lm(ids.to(dtype))


def test_config_fields_are_checked() -> None:
    with pytest.raises(TypeError, match="resume must be a bool, got 'yes'"):
        TrainConfig(resume="yes")
    with pytest.raises(ValueError, match="resume and overwrite exclude each other"):
        TrainConfig(resume=True, overwrite=True)
    with pytest.raises(ValueError, match=r"min_lr_ratio must be in \[0, 1\], got 2.0"):
        TrainConfig(min_lr_ratio=2.0)
    with pytest.raises(ValueError, match="grad_clip must be a finite number, got nan"):
        TrainConfig(grad_clip=float("nan"))
    with pytest.raises(ValueError, match="a TrainConfig must be a JSON object, got"):
        TrainConfig.from_dict([1, 2])
    config = TrainConfig()
    config.seed = -1  # a dataclass can be changed after it was checked: train() checks again
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\), got -1"):
        train(config)


def test_a_checkpoint_under_the_old_encoder_names_resumes(tmp_path: Path) -> None:
    """Checkpoints written when the LM's stack was a TransformerEncoder named 'layers'
    (``layers.layers.{i}.…``, ``layers.norm.…``) resume under today's ``blocks``/``norm``."""
    from multihead._files import checksummed_safetensors, read_header, read_tensors

    config = _config(tmp_path, steps=2, save_every=1)
    whole = train(_config(tmp_path / "whole", steps=3))
    train(config)
    last = latest_checkpoint(config.out)
    assert last is not None
    file = last / "model.safetensors"
    tensors, meta = read_tensors(file), read_header(file).metadata
    old = {}
    for name, value in tensors.items():
        if name.startswith("blocks."):
            name = "layers.layers." + name[len("blocks.") :]
        elif name.startswith("norm."):
            name = "layers." + name
        old[name] = value
    assert "layers.layers.0.self_attn.out_proj.weight" in old
    meta = {k: v for k, v in meta.items() if k != "sha256"}
    file.write_bytes(checksummed_safetensors(old, meta))
    resumed = train(_config(tmp_path, steps=3, save_every=1, resume=True))
    assert resumed.model is not None and whole.model is not None
    for (name, a), b in zip(
        whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_the_progress_lines_of_a_resumed_run_estimate_from_its_own_steps(
    monkeypatch, capsys
) -> None:
    from multihead.cli import common

    with contextlib.suppress(ImportError):
        import rich.console  # noqa: F401  (imported before the clock is faked: rich keeps it)
    clock = iter([100.0, 106.0, 112.0])
    monkeypatch.setattr(common.time, "monotonic", lambda: next(clock))
    with common.progress("sort L=8", 250, "steps", start=200) as update:
        update(225, "loss 0.1")  # 25 steps in 6 s, 25 to go
        update(250, "loss 0.05")
    assert capsys.readouterr().err.splitlines() == [
        "sort L=8: 225/250 steps, loss 0.1, 0:00:06 elapsed, about 0:00:06 left",
        "sort L=8: 250/250 steps, loss 0.05, 0:00:12 elapsed, done",
    ]


def test_setup_world_alone_on_cuda_without_an_index_keeps_the_current_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "--device cuda" in one process: no index to switch to (set_device would refuse one)
    from multihead.training import ddp

    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world = ddp.setup_world(torch.device("cuda"))
    assert (world.size, world.device, chosen) == (1, torch.device("cuda"), [])
    ddp.setup_world(torch.device("cuda", 1))
    assert chosen == [torch.device("cuda", 1)]
