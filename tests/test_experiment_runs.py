"""Each input runs unpatched at most once: the experiment records its runs for every function
on the pair (multihead.Experiment).

Runs are counted with forward pre-hooks: a module-global one sees every top-level forward and
its input; a run *of* an input is a top-level forward whose input equals that input whole (its
(B, T) ids, value for value) and in which the first attention module actually ran. Patched runs
stack their variants along the batch (n·B rows) or run a later position on (fewer than T), so
they are not runs of either input; the prefix cache's check (a replay of the recorded run with
every block but the last handed back, so the first attention does not run) is counted apart,
as a replay, and is at most one per input whose blocks are reused.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import multihead
from multihead.models import TransformerLM

V, E, HEADS, LAYERS = 13, 16, 2, 3


class Runs:
    """Counts of the runs of named inputs (module docstring)."""

    def __init__(self, inputs: dict[str, Tensor]) -> None:
        self.inputs = inputs
        self.ran: Counter[str] = Counter()
        self.replays: Counter[str] = Counter()
        self.first: nn.Module | None = None  # the first attention of the model run
        self.depth = 0
        self.current: str | None = None
        self.first_ran = False

    def _which(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        given = args[0] if args else kwargs.get("input_ids")
        if not isinstance(given, Tensor):
            return None
        for name, value in self.inputs.items():
            if given.shape == value.shape and torch.equal(given, value):
                return name
        return None

    @contextlib.contextmanager
    def counting(self) -> Iterator[Runs]:
        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self.depth == 0:
                self.current, self.first_ran = self._which(args, {}), False
                if self.current is not None:
                    self.first = multihead.model_map(module).sites[0].module
            if module is self.first:
                self.first_ran = True
            self.depth += 1

        def post(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            self.depth -= 1
            if self.depth == 0 and self.current is not None:
                (self.ran if self.first_ran else self.replays)[self.current] += 1

        handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def _lm(device: torch.device) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(V, E, HEADS, LAYERS, 32, max_len=16).to(device).eval()


def _pair(device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(V, (2, 6), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 1) % V
    return clean.to(device), corrupt.to(device)


def _metric(logits: Tensor) -> Tensor:
    return logits[:, -1].log_softmax(-1)[:, 3].mean()


def test_patch_resid_pre_per_position_runs_each_input_once(device: torch.device) -> None:
    lm = _lm(device)
    clean, corrupt = _pair(device)
    with Runs({"clean": clean, "corrupt": corrupt}).counting() as runs:
        result = multihead.patch(lm, clean, corrupt, _metric, site="resid_pre", per_position=True)
    assert runs.ran == {"clean": 1, "corrupt": 1}
    assert runs.replays["clean"] == 0 and runs.replays["corrupt"] <= 1
    # a cell by hand: the corrupt run with block 1's input at position 2 the clean run's
    with torch.no_grad():
        entering: list[Tensor] = []
        grab = lm.blocks[1].register_forward_pre_hook(lambda m, a: entering.append(a[0]))
        lm(clean)
        grab.remove()

        def put(m: nn.Module, a: tuple[Any, ...]) -> tuple[Any, ...]:
            x = a[0].clone()
            x[:, 2] = entering[0][:, 2]
            return (x, *a[1:])

        hook = lm.blocks[1].register_forward_pre_hook(put)
        patched = _metric(lm(corrupt))
        hook.remove()
        by_hand = patched - _metric(lm(corrupt))
    assert float(result.values[1, 2]) == pytest.approx(float(by_hand), abs=1e-5)
    assert float(by_hand) != 0.0


@pytest.mark.parametrize("per_position", [False, True])
def test_patch_heads_runs_each_input_once(device: torch.device, per_position: bool) -> None:
    lm = _lm(device)
    clean, corrupt = _pair(device)
    with Runs({"clean": clean, "corrupt": corrupt}).counting() as runs:
        multihead.patch(lm, clean, corrupt, _metric, per_position=per_position)
    assert runs.ran == {"clean": 1, "corrupt": 1}
    assert runs.replays["clean"] == 0 and runs.replays["corrupt"] <= 1


def test_functions_on_one_experiment_share_its_runs(device: torch.device) -> None:
    """The command line's sequence: patch, attribution patching and a per-position patch of
    the top heads, on one experiment whose two runs were recorded first with what all three
    read; each function's result equals its own call on (model, clean, corrupt, metric)."""
    lm = _lm(device)
    clean, corrupt = _pair(device)
    with Runs({"clean": clean, "corrupt": corrupt}).counting() as runs:
        experiment = multihead.Experiment.of(lm, clean, corrupt, _metric)
        layers = range(LAYERS)
        heads = [("z", layer) for layer in layers]
        keys = [(s, layer) for layer in layers for s in ("k", "v")]
        experiment.run("clean", sites=heads)
        experiment.run("corrupt", sites=[*heads, *keys], prefix=True, gradients=True)
        effects = multihead.patch(experiment)
        estimates = multihead.attribution_patching(experiment)
        top = [(0, 1), (2, 0)]
        positions = multihead.patch(experiment, per_position=True, heads=top)
    assert runs.ran == {"clean": 1, "corrupt": 1}
    assert runs.replays["clean"] == 0 and runs.replays["corrupt"] <= 1
    # each equals the function on its own (the reference: a fresh experiment each)
    alone = multihead.patch(lm, clean, corrupt, _metric)
    torch.testing.assert_close(effects.values, alone.values, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        estimates.values,
        multihead.attribution_patching(lm, clean, corrupt, _metric).values,
        rtol=0,
        atol=1e-6,
    )
    torch.testing.assert_close(
        positions.values,
        multihead.patch(lm, clean, corrupt, _metric, per_position=True, heads=top).values,
        rtol=0,
        atol=1e-6,
        equal_nan=True,
    )
    assert (effects.clean, effects.corrupt) == (alone.clean, alone.corrupt)


def test_a_need_not_recorded_reruns_once_and_merges(device: torch.device) -> None:
    lm = _lm(device)
    clean, corrupt = _pair(device)
    experiment = multihead.Experiment.of(lm, clean, corrupt, _metric)
    with Runs({"clean": clean, "corrupt": corrupt}).counting() as runs:
        first = experiment.run("clean", sites=[("z", 0)])
        again = experiment.run("clean", sites=[("z", 0)])
        more = experiment.run("clean", sites=[("z", 0), ("resid_post", 1)])
    assert runs.ran == {"clean": 2}
    assert first is again is more
    assert set(more.sites) == {("z", 0), ("resid_post", 1)}
    reference = multihead.cache(lm, clean, names=[("z", 0), ("resid_post", 1)])
    torch.testing.assert_close(more.sites["z", 0], reference["z", 0], rtol=0, atol=0)
    torch.testing.assert_close(
        more.sites["resid_post", 1], reference["resid_post", 1], rtol=0, atol=0
    )


def test_an_experiment_is_given_alone(device: torch.device) -> None:
    lm = _lm(device)
    clean, corrupt = _pair(device)
    experiment = multihead.Experiment.of(lm, clean, corrupt, _metric)
    with pytest.raises(TypeError, match="give it alone, got clean, metric beside it"):
        multihead.patch(experiment, clean, metric=_metric)
    with pytest.raises(ValueError, match="metric_input='output'"):
        multihead.patch(experiment, metric_input="output")
    with pytest.raises(TypeError, match="corrupt is required"):
        multihead.patch(lm, clean, None, _metric)


@pytest.mark.cpu_only  # a CLI
def test_the_patch_command_runs_each_input_once(induction_run: Path, tmp_path: Path) -> None:
    """``multihead patch`` with its default flags: patch, attribution patching and the top
    heads per position, all on one experiment (the page's picture of the first clean sequence
    runs that sequence alone: another input)."""
    pytest.importorskip("matplotlib")
    from multihead.cli import main
    from multihead.training.induction_pair import induction_pair

    pair = induction_pair(16)
    argv = ["patch", "--checkpoint", str(induction_run), "--out", str(tmp_path / "out")]
    with Runs({"clean": pair.clean, "corrupt": pair.corrupt}).counting() as runs:
        assert main(argv) == 0
    assert runs.ran == {"clean": 1, "corrupt": 1}
    assert runs.replays["clean"] == 0 and runs.replays["corrupt"] <= 1
