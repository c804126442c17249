"""The CLI's one thread policy (``--threads``, ``cli.threads.torch_threads``): ``explain TEXT``,
``explain --corpus`` and ``patch`` each run their model on the threads the policy gives, and
leave the caller's setting as it was. The number is read inside the command, where the library
is called (a wrapper around the function each command runs its model through)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_support import fails

import multihead
import multihead.cli.explain as cli_explain
import multihead.cli.explain_corpus as cli_corpus
from multihead.cli import main
from multihead.cli.threads import DEFAULT_THREADS

pytestmark = pytest.mark.cpu_only  # a CLI
pytest.importorskip("transformers", minversion="5")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")


def _command(name: str, gpt2: Path, tmp_path: Path) -> tuple[list[str], Any, str]:
    """argv, and the (module, attribute) the command runs its model through."""
    out = ["--out", str(tmp_path / "out"), "--device", "cpu", "--format", "png"]
    if name == "explain":
        argv = ["explain", "--model", str(gpt2), "The cat sat on the mat.", "--no-importance"]
        return [*argv, *out], cli_explain, "explain"
    if name == "corpus":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("The cat sat on the mat.\nA dog ran across the road.\n")
        return (
            ["explain", "--model", str(gpt2), "--corpus", str(corpus), *out],
            cli_corpus,
            ("corpus_statistics"),
        )
    texts = ["--clean", "The cat was too tired", "--corrupt", "The animal was tired"]
    argv = ["patch", "--model", str(gpt2), *texts, "--answer", " it", *out]
    return argv, multihead, "patch"


def _threads_inside(monkeypatch: pytest.MonkeyPatch, module: Any, attribute: str) -> list[int]:
    """Record torch's thread count each time the command calls ``module.attribute``."""
    seen: list[int] = []
    original: Callable[..., Any] = getattr(module, attribute)

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, attribute, recording)
    return seen


@pytest.fixture
def caller_threads() -> Any:
    """The test's process runs 3 threads before each command (not the default of 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["explain", "corpus", "patch"])
@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ([], None, DEFAULT_THREADS),  # the default: one thread
        (["--threads", "2"], None, 2),  # asked for
        ([], "3", 3),  # OMP_NUM_THREADS set: torch's count (read from it at start) is kept
        (["--threads", "2"], "3", 2),  # the flag wins over the environment
    ],
)
def test_each_command_runs_its_model_on_the_policys_threads(
    command: str,
    flag: list[str],
    env: str | None,
    expected: int,
    gpt2: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caller_threads: int,
) -> None:
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    argv, module, attribute = _command(command, gpt2, tmp_path)
    seen = _threads_inside(monkeypatch, module, attribute)
    assert main([*argv, *flag]) == 0, capsys.readouterr().err
    assert seen and set(seen) == {expected}
    assert torch.get_num_threads() == caller_threads  # the caller's setting is restored


@pytest.mark.parametrize("command", ["explain", "corpus", "patch"])
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_thread_count_is_one_line(
    command: str,
    value: str,
    gpt2: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caller_threads: int,
) -> None:
    argv, _, _ = _command(command, gpt2, tmp_path)
    err = fails(capsys, [*argv, "--threads", value])
    assert f"argument --threads: expected a number of threads from 1 to 4096, got '{value}'" in err
    assert torch.get_num_threads() == caller_threads
