"""Each input runs unpatched at most once: the experiment records its runs for every function
on the pair (multihead.Experiment).

Runs are counted with forward pre-hooks: a module-global one sees every forward of the model and
its input; a run *of* an input is a forward of the model whose input equals that input whole
(its (B, T) ids, value for value) and in which the first attention module actually ran. Patched
runs stack their variants along the batch (n·B rows) or run a later position on (fewer than T),
so they are not runs of either input; a forward whose first blocks hand back their recorded
outputs (the prefix cache's check of its record, a patched variant of a later layer alone)
computes nothing of the input before its patch, and is counted apart, as a replay.
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

    def __init__(self, inputs: dict[str, Tensor], *, until_partial: bool = False) -> None:
        self.inputs = inputs
        # stop counting at the first forward of the model on anything but an input whole
        self.until_partial = until_partial
        self.stopped = False
        self.ran: Counter[str] = Counter()
        self.replays: Counter[str] = Counter()
        self.model: nn.Module | None = None  # the first module given one of the inputs
        self.first: nn.Module | None = None  # its first attention
        self.current: str | None = None
        self.first_ran = False

    def _which(self, args: tuple[Any, ...]) -> str | None:
        given = args[0] if args else None
        if not isinstance(given, Tensor):
            return None
        for name, value in self.inputs.items():
            if given.shape == value.shape and torch.equal(given, value):
                return name
        return None

    def _end(self) -> None:
        """Count the forward that ran (its module hook, or the next forward: a forward that
        raised, as a run stopped early does, calls no forward hook)."""
        if self.current is not None:
            (self.ran if self.first_ran else self.replays)[self.current] += 1
        self.current = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[Runs]:
        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self.model is None and self._which(args) is not None:
                self.model = module  # a model's pre-hook runs before its modules'
                self.first = multihead.model_map(module).sites[0].module
            if module is self.model:
                self._end()
                self.current, self.first_ran = self._which(args), False
                self.stopped |= self.until_partial and self.current is None
                if self.stopped:
                    self.current = None
            elif module is self.first:
                self.first_ran = True

        def post(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if module is self.model:
                self._end()

        handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        try:
            yield self
        finally:
            self._end()
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
    # per position, a patch of block 0's input at position 0 runs the whole corrupt ids again
    # (one variant): count until the first run of a later position on, where patches begin
    with Runs({"clean": clean, "corrupt": corrupt}, until_partial=True).counting() as runs:
        result = multihead.patch(lm, clean, corrupt, _metric, site="resid_pre", per_position=True)
    assert runs.ran == {"clean": 1, "corrupt": 1}
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


def test_the_readme_sequence_runs_each_input_once(device: torch.device) -> None:
    """README's example: the corrupt run recorded up front with the blocks and the heads'
    gradients, then patch and attribution patching: one run of each input in all."""
    lm = _lm(device)
    clean, corrupt = _pair(device)
    with Runs({"clean": clean, "corrupt": corrupt}).counting() as runs:
        experiment = multihead.Experiment.of(lm, clean, corrupt, _metric)
        experiment.run("corrupt", prefix=True, gradients=True)
        effects = multihead.patch(experiment)
        estimates = multihead.attribution_patching(experiment)
    assert runs.ran == {"clean": 1, "corrupt": 1}
    alone = multihead.attribution_patching(lm, clean, corrupt, _metric)
    torch.testing.assert_close(estimates.values, alone.values, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        effects.values, multihead.patch(lm, clean, corrupt, _metric).values, rtol=0, atol=1e-6
    )


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


@pytest.mark.parametrize("ig_steps", [1, 2])
def test_edge_attribution_and_its_curve_probe_the_graph_once(
    device: torch.device, ig_steps: int
) -> None:
    """``multihead circuit``'s sequence on one experiment: edge attribution and the
    faithfulness curve of its scores. The graph is probed once (the corrupt run, the only run
    of the corrupt input); every other forward is one of edge attribution's gradient runs (of
    the clean ids, α = 1 the clean run itself) or one circuit run (the clean ids patched) per
    faithfulness of the curve; the numbers equal each function called alone."""
    lm = _lm(device)
    clean, corrupt = _pair(device)
    draws = 2
    with Runs({"clean": clean, "corrupt": corrupt}).counting() as runs:
        experiment = multihead.Experiment.of(lm, clean, corrupt, _metric)
        scores = multihead.edge_attribution(experiment, ig_steps=ig_steps)
        curve = multihead.faithfulness_curve(experiment, scores=scores, draws=draws)
    assert runs.ran["corrupt"] + runs.replays["corrupt"] == 1
    circuit_runs = len(curve.sizes) * (1 + draws)
    assert runs.ran["clean"] + runs.replays["clean"] == ig_steps + circuit_runs
    alone = multihead.edge_attribution(lm, clean, corrupt, _metric, ig_steps=ig_steps)
    torch.testing.assert_close(scores.values, alone.values, rtol=0, atol=1e-6, equal_nan=True)
    assert (scores.clean, scores.corrupt) == (alone.clean, alone.corrupt)
    reference = multihead.faithfulness_curve(lm, clean, corrupt, _metric, alone, draws=draws)
    assert curve.values == pytest.approx(reference.values, abs=1e-6)
    assert curve.random == pytest.approx(reference.random, abs=1e-6)
    assert (curve.clean, curve.corrupt) == pytest.approx((reference.clean, reference.corrupt))
