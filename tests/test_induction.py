"""The induction task (data, defaults, a few steps of training, CLI flags) and --attn-only.

No full run here: the 1,200-step recipe's numbers are in docs/induction.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from multihead.cli import main
from multihead.models import TransformerLM
from multihead.training import TrainConfig, train
from multihead.training.draws import key
from multihead.training.induction import InductionTask, is_held_out, probe_induction
from multihead.training.induction_pair import induction_pair
from multihead.training.tasks import get_task


def _segment(ids: np.ndarray, repeated: np.ndarray) -> tuple[int, int, int]:
    """(n, s1, s2) of one sequence: the copy starts one before its first repeated token."""
    where = np.flatnonzero(repeated)
    s2, n = int(where[0]) - 1, len(where) + 1
    assert np.array_equal(where, np.arange(s2 + 1, s2 + n))  # one contiguous run
    starts = [s for s in range(s2 - n + 1) if np.array_equal(ids[s : s + n], ids[s2 : s2 + n])]
    assert starts, "the segment must occur earlier, ending before the copy starts"
    return n, starts[0], s2


def test_data_repeats_where_claimed_and_the_layout_varies() -> None:
    task = InductionTask(32)
    batch = task.sample(0, 0, 3, np.arange(200), held_out=False)
    ids, repeated, first = batch.ids.numpy(), batch.repeated.numpy(), batch.first.numpy()
    assert ids.shape == (200, 32) and ids.min() >= 0 and ids.max() < task.vocab_size
    layouts = [_segment(ids[i], repeated[i]) for i in range(200)]
    assert all(4 <= n <= 12 and s2 >= s1 + n and s2 + n <= 32 for n, s1, s2 in layouts)
    # the layout varies: segment lengths, starts and distances all take many values
    assert len({n for n, _, _ in layouts}) == 9
    assert len({s2 for _, _, s2 in layouts}) > 15
    assert len({s2 - s1 for _, s1, s2 in layouts}) > 15
    # first: the segment's first occurrence, the same n - 1 positions as the repeats
    for i, (n, s1, _) in enumerate(layouts):
        assert np.array_equal(np.flatnonzero(first[i]), np.arange(s1 + 1, s1 + n))
        assert np.array_equal(ids[i, s1 + 1 : s1 + n], ids[i, repeated[i]])


def _split(n: int, s1: int, s2: int) -> bool:
    """The held-out tenth as docs/induction.md defines it: the layout's hash is a multiple of 10."""
    return int(key(n, s1, s2)) % 10 == 0


def test_data_is_a_pure_function_and_held_out_layouts_are_never_trained_on() -> None:
    task = InductionTask(32)
    whole = task.batch(7, 5, range(8))
    torch.testing.assert_close(
        torch.cat([task.batch(7, 5, range(4)), task.batch(7, 5, range(4, 8))]), whole
    )
    assert not torch.equal(task.batch(7, 6, range(8)), whole)
    train = task.sample(7, 0, 5, np.arange(300), held_out=False)
    probe = task.probe_batch(7, 300)
    seen_train = {_segment(train.ids[i].numpy(), train.repeated[i].numpy()) for i in range(300)}
    seen_held = {_segment(probe.ids[i].numpy(), probe.repeated[i].numpy()) for i in range(300)}
    assert not any(_split(*layout) for layout in seen_train)
    assert all(_split(*layout) for layout in seen_held)
    assert all(is_held_out(*layout) for layout in seen_held) and len(seen_held) > 40


def test_every_layout_of_a_side_is_drawn_and_no_other() -> None:
    """At L = 16 the placements are few enough to list: 2,000 draws reach every one of a side."""
    task = InductionTask(16)
    every = {
        (n, s1, s2)
        for n in range(4, 7)  # 4 … 3/8 of 16
        for s1 in range(16 - 2 * n + 1)
        for s2 in range(s1 + n, 16 - n + 1)
    }
    for held_out, rows in ((False, 2000), (True, 400)):
        batch = task.sample(3, 0, 0, np.arange(rows), held_out=held_out)
        seen = {_segment(batch.ids[i].numpy(), batch.repeated[i].numpy()) for i in range(rows)}
        assert seen == {layout for layout in every if _split(*layout) == held_out}


@pytest.mark.parametrize("seq_len", range(11, 41))
def test_both_sides_are_drawn_at_every_short_length(seq_len: int) -> None:
    task = InductionTask(seq_len)
    for held_out in (False, True):
        batch = task.sample(0, 1, 0, np.arange(6), held_out=held_out)
        for i in range(6):
            n, s1, s2 = _segment(batch.ids[i].numpy(), batch.repeated[i].numpy())
            assert 4 <= n <= 3 * seq_len // 8 and s2 >= s1 + n and s2 + n <= seq_len
            assert _split(n, s1, s2) == held_out


def test_row8_a_long_sequence_draws_its_layouts_without_listing_them() -> None:
    """Issue 34 #8: layouts were listed (O(L²) in Python) before anything was drawn; at a million
    tokens that never ended. Now a draw costs the same at any length."""
    task = InductionTask(1_000_000)
    batch = task.probe_batch(0, 2)
    for i in range(2):
        n, s1, s2 = _segment(batch.ids[i].numpy(), batch.repeated[i].numpy())
        assert 4 <= n <= 12 and _split(n, s1, s2)
    assert abs(induction_pair(1_000_000, 1).layout[2] - 500_000) <= 10  # the middle, or near


def test_task_errors() -> None:
    with pytest.raises(ValueError, match="seq_len must be at least 11 for the induction task"):
        InductionTask(8)
    with pytest.raises(ValueError, match="task must be one of 'copy', .*'induction', got 'knit'"):
        get_task("knit", 8)


def test_defaults_are_the_recipe() -> None:
    config = TrainConfig.for_task("induction", out="x")
    assert (config.seq_len, config.steps, config.batch_size, config.warmup) == (32, 1200, 32, 30)
    assert (config.num_layers, config.embed_dim, config.num_heads) == (2, 128, 4)
    assert config.attn_only and config.embedding_std == 1.0
    assert (config.lr, config.min_lr_ratio) == (3e-3, 0.1)
    model = config.model_config()
    assert model.vocab_size == 64 and model.max_len == 32 and model.attn_only
    # the other tasks keep theirs
    assert TrainConfig.for_task("sort", out="x") == TrainConfig(task="sort", out="x")


def test_attn_only_has_no_feed_forward_parameters() -> None:
    config = TrainConfig.for_task("sort", attn_only=True, out="x")
    lm = TransformerLM.from_config(config.model_config())
    names = [name for name, _ in lm.named_parameters()]
    assert names and not any(".ff." in name or "norm2" in name for name in names)


def test_a_few_steps_write_the_probes_and_induction_png(tmp_path: Path) -> None:
    config = TrainConfig.for_task(
        "induction", steps=4, probe_every=2, out=str(tmp_path / "run"), threads=1, save_every=2
    )
    result = train(config)
    assert [p.step for p in result.probes] == [2, 4]
    probe = result.probes[-1]
    assert len(probe.scores) == 2 and all(len(row) == 4 for row in probe.scores)
    assert all(0.0 <= s <= 1.0 for row in probe.scores for s in row)
    assert 3.0 < probe.first_loss < 6.0 and 3.0 < probe.repeated_loss < 6.0  # untrained: ~log 64
    assert result.accuracy is None  # exact match is for the prompt tasks
    for name in ("induction.png", "loss.png", "attention.png", "model.safetensors"):
        assert (tmp_path / "run" / name).is_file(), name
    # resuming keeps the probes made before the checkpoint
    resumed = train(TrainConfig.for_task(**{**config.to_dict(), "steps": 6, "resume": True}))
    assert [p.step for p in resumed.probes] == [2, 4, 6]


def test_probe_of_a_model_matches_head_statistics() -> None:
    from multihead.observe import head_statistics

    task = InductionTask(16)
    torch.manual_seed(0)
    lm = TransformerLM(64, 32, 2, 2, 8, 16, attn_only=True).eval()
    batch = task.probe_batch(0, 8)
    probe = probe_induction(lm, batch, step=3)
    stats = head_statistics(lm, batch.ids)
    assert probe.step == 3 and probe.scores == [
        [round(float(s), 4) for s in r] for r in stats.induction
    ]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors exit directly
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_cli_flag_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path / "run"), "--quiet"]
    err = _error(capsys, ["train", "--task", "induction", "--seq-len", "8", *out])
    assert "--seq-len must be at least 11 for the induction task" in err
    err = _error(capsys, ["train", "--task", "induction", "--embedding-std", "0", *out])
    assert "--embedding-std must be > 0, got 0.0" in err
    err = _error(capsys, ["train", "--task", "induction", "--probe-every", "0", *out])
    assert "--probe-every must be a positive int, got 0" in err
    err = _error(capsys, ["train", "--attn-only", "yes", *out])
    assert "unrecognized arguments: yes" in err
    assert not (tmp_path / "run").exists()


def test_cli_induction_run_logs_the_probes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--task", "induction", "--steps", "10", "--probe-every", "2", "--quiet"]
    assert main([*argv, "--no-plots", "--out", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("training induction (L=32) for 10 steps, global batch 32")
    probes = [line for line in lines if line.startswith("step ")]
    assert len(probes) == 1 and probes[0].startswith("step    10")  # every 5th and the last
    assert "held-out layouts, step    10" in lines[-2] and "best induction head L" in lines[-2]
    # --no-attn-only turns the recipe's attention-only model back into a full one
    assert main([*argv, "--no-plots", "--no-attn-only", "--out", str(tmp_path / "full")]) == 0
    lm = TransformerLM.load(tmp_path / "full")
    assert not lm.config.attn_only and any(".ff." in n for n, _ in lm.named_parameters())


def test_generate_refuses_an_induction_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train(TrainConfig.for_task("induction", steps=1, out=str(tmp_path / "run"), plots=False))
    err = _error(capsys, ["generate", "--checkpoint", str(tmp_path / "run"), "1 2 ="])
    assert "is an induction run: generate answers the prompts of copy, reverse, sort and add" in err
