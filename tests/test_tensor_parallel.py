"""Heads of tensor-parallel transformers models on real process groups: gloo on the CPU, 2 and 3
spawned ranks, each loading a tiny random model saved to tmp_path with ``tp_plan="auto"``,
against the same cases run here in one process on the same weights.

Spawning costs seconds (every rank imports torch and transformers), so each world size is
spawned once: every rank runs every case of every model and saves what it got; the tests below
compare them one case at a time. A group's collectives time out (``GROUP_TIMEOUT_S``) and the
parent kills the ranks at ``TIMEOUT_S``, so a rank that raises alone fails a test, never hangs it.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import io
import json
import os
import re
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from spawned_group import run_spawned  # noqa: E402

from multihead import (  # noqa: E402
    attribution_patching,
    capture,
    hf,
    logit_attribution,
    patch_heads,
    path_patching,
)
from multihead.circuits.importance import head_importance  # noqa: E402
from multihead.circuits.steering import intervene, record_heads  # noqa: E402
from multihead.cli import main  # noqa: E402
from multihead.head_shard import HeadShard, held_heads  # noqa: E402
from multihead.observe.statistics import head_statistics  # noqa: E402

pytestmark = pytest.mark.cpu_only  # gloo process groups on the CPU

NO_ACCELERATE = (
    "transformers loads a model with tp_plan only when accelerate is installed "
    "(pip install accelerate, in multihead's test extra)"
)

TIMEOUT_S = 180.0  # for one spawned group, start-up included
GROUP_TIMEOUT_S = 30.0  # a collective a rank waits in for longer raises there
OUT_ATOL = 1e-5  # outputs (logits, per-head outputs, importance): the ranks' sums differ in order
WEIGHT_ATOL = 1e-6  # attention weights and statistics

# (family, config class, config keywords): tiny random models, 2 layers, vocabulary 96 (which
# older transformers shard only when it divides by the ranks)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # grouped-query heads: 4 query heads over 2 key/value heads
    "llama": (
        "LlamaConfig",
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
    ),
    # 3 query heads per key/value head, biased q/k/v projections
    "qwen2": (
        "Qwen2Config",
        {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8},
    ),
    # 6 heads over 3 key/value heads: 2 and 1 on each of 3 ranks
    "mistral": (
        "MistralConfig",
        {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8},
    ),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 32}),
}
COMMON = {"vocab_size": 96, "intermediate_size": 96, "num_hidden_layers": 2}


def _has_tp_plan(family: str) -> bool:
    """Whether the installed transformers has a tensor-parallel plan for this family."""
    config_class = getattr(transformers, MODELS[family][0])
    return bool(getattr(config_class, "base_model_tp_plan", None))


# what each world size runs: (family, whether its heads can be mapped on that many ranks)
GROUPS: dict[int, list[tuple[str, bool]]] = {
    2: [("llama", True), ("qwen2", True)] + ([("gpt2", True)] if _has_tp_plan("gpt2") else []),
    # 4 heads do not split over 3 ranks: refused; 6 heads over 3 ranks are mapped
    3: [("mistral", True), ("llama", False)],
}


def _save_model(family: str, path: Path) -> None:
    config_name, keywords = MODELS[family]
    config_class = getattr(transformers, config_name)
    extra = {} if family == "gpt2" else COMMON
    config = config_class(**{**extra, **keywords})
    if family == "gpt2":
        config.vocab_size = COMMON["vocab_size"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _num_heads(family: str) -> int:
    keywords = MODELS[family][1]
    return int(keywords.get("num_attention_heads", keywords.get("n_head", 0)))


def _load(path: Path, tensor_parallel: bool) -> Any:
    if not tensor_parallel:
        return transformers.AutoModelForCausalLM.from_pretrained(path)
    # tp_plan="auto" in the form every transformers >= 5.15 takes: the model's own plan, split
    # over every rank of the group
    from transformers.distributed import DistributedConfig

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=dist.get_world_size())
    )


# -- the cases, run on every rank and in one process --------------------------------------------


def _ids(seed: int) -> torch.Tensor:
    # repeated tokens give the induction and duplicate-token statistics something to find
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(0, COMMON["vocab_size"], (2, 4), generator=g)
    return torch.cat([half, half], dim=1)  # (B, T) = (2, 8)


def _triple_values(head: int) -> Callable[[Any], Any]:
    """A q/k/v editor tripling the values global query head ``head`` reads (values per query
    head: its key/value siblings keep theirs), on the rank that holds it."""

    def editor(call: Any) -> Any:
        site = call.module
        held = held_heads(site.num_heads, site.head_shard)  # the global heads call.q holds
        if head not in held:
            return None
        group = call.q.shape[1] // call.v.shape[1]
        v = call.v.repeat_interleave(group, dim=1)  # (B, heads held, S, Dv), a copy
        v[:, head - held.start] *= 3.0
        return call.q, call.k, v

    return editor


def _cases(model: Any) -> dict[str, Any]:
    """Everything the tests compare, keyed by case: tensors, the same on every rank."""
    sites = hf.attention_sites(model)
    last = sites[0][1].num_heads - 1  # held by the last rank
    ids, other = _ids(1), _ids(2)
    out: dict[str, Any] = {
        "shards": [None if s.head_shard is None else tuple(s.head_shard.heads) for _, s in sites],
    }
    with torch.no_grad():
        out["logits"] = model(ids).logits
        with capture(model, rows=[-1]) as rec:
            model(ids)
        out["capture"] = rec.stack()  # (L, B, H, 1, S)
        with capture(model, layers=[1], heads=[last, 0, 2], rows=[0, -1]) as rec:
            model(ids)
        out["capture_chosen"] = rec.stack()  # heads of several ranks, out of order
        with capture(model, heads=[last], rows=None) as rec:
            model(ids)
        out["capture_one_rank"] = rec.stack()  # a head only the last rank holds
        with intervene(model, {(0, last): 0.0}):
            out["ablate_last"] = model(ids).logits
        with intervene(model, {(0, last): 0.0, (1, 1): 2.0, (1, 0): "mean"}):
            out["intervene"] = model(ids).logits
        keys = [(0, 2), (1, 0), (0, last)]
        with record_heads(model, keys) as recording:
            model(other)
        out["record"] = torch.stack([recording[k] for k in keys])
        with intervene(model, {(1, last): recording[(0, last)], (0, 0): recording[(1, 0)]}):
            out["patch"] = model(ids).logits
        with sites[0][1].register_qkv_editor(_triple_values(last)):
            out["qkv_editor"] = model(ids).logits
        stats = head_statistics(model, ids)
        for metric in ("entropy", "previous_token", "induction"):
            out[f"statistics_{metric}"] = getattr(stats, metric)
        try:  # a patch of the wrong (B, T): every rank refuses at the same call
            with intervene(model, {(0, last): torch.zeros(1, 3, sites[0][1].head_dim)}):
                model(ids)
        except ValueError as error:
            out["wrong_patch"] = str(error)

    def metric() -> torch.Tensor:
        return model(ids).logits[0, -1, 5]

    out["importance_ablation"] = head_importance(model, metric)
    out["importance_gradient"] = head_importance(model, metric, method="gradient")
    out.update(_circuits(model, ids, other, last))
    return out


def _circuits(model: Any, clean: torch.Tensor, corrupt: torch.Tensor, last: int) -> dict[str, Any]:
    """The circuit functions, with heads on every rank (``last`` on the last rank only)."""

    def logit_diff(logits: torch.Tensor) -> torch.Tensor:  # (B,): differentiable, for attribution
        return logits[:, -1, 5] - logits[:, -1, 7]

    out: dict[str, Any] = {}
    out["patch_denoise"] = patch_heads(model, clean, corrupt, logit_diff).values  # (L, H)
    out["patch_noise_per_position"] = patch_heads(
        model, clean, corrupt, logit_diff, direction="noise", per_position=True,
        heads=[(1, last), (1, 0), (0, 1)], batch_size=3,
    ).values  # fmt: skip
    out["attribution"] = attribution_patching(
        model, clean, corrupt, logit_diff, per_position=True
    ).values
    out["paths"] = path_patching(
        model, clean, corrupt, logit_diff, senders=[(0, last), (0, 0)],
        receivers=[(1, 1), (1, last)], batch_size=3,
    ).values  # fmt: skip
    out["paths_kv"] = path_patching(
        model, clean, corrupt, logit_diff, senders=[(0, 0)], receivers=[(1, last)],
        via=("v", "k"),
    ).values  # fmt: skip
    # Wang et al.'s other cases: a receiver at one position, a set of heads on two ranks, the
    # logits; denoising; the key/value head shared by its query heads
    out["paths_whole"] = path_patching(
        model, clean, corrupt, logit_diff, senders=[(0, last), (0, 0)],
        receivers=[(1, last, -1), [(1, 0), (1, last)], "logits"], direction="denoise",
        kv="shared", batch_size=4,
    ).values  # fmt: skip
    parts = logit_attribution(model, clean, answer=5, wrong=7)
    out["logit_attribution_heads"] = parts.heads  # (L, H, T)
    out["logit_attribution_rest"] = torch.stack(
        [parts.attention_bias.sum(0), parts.mlp.sum(0), parts.embeddings, parts.logit]
    )
    out["logit_attribution_total"] = parts.total() - parts.logit  # ~0: the parts add up
    return out


def _sharded_as_dtensors(model: Any) -> bool:
    """Whether transformers sharded the model's weights as DTensors (the layout multihead reads:
    each knows its device mesh and global shape)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _refusal(model: Any) -> str:
    """The error entering a capture block raises (every rank must raise it alike)."""
    try:
        with capture(model, rows=[-1]):
            pass
    except ValueError as error:
        return str(error)
    return "not refused"


# -- the spawned groups --------------------------------------------------------------------------


def _worker(rank: int, world: int, root: str, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{root}/rendezvous",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )
        results: dict[str, Any] = {}
        for family, mapped in GROUPS[world]:
            model = _load(Path(root, family), tensor_parallel=True)
            if not _sharded_as_dtensors(model):
                results[family] = {"plain": _refusal(model)}  # mapped or not: refused
            elif mapped:
                results[family] = _cases(model)
            else:
                results[family] = {"refused": _refusal(model)}
        if Path(root, "llama-cli").is_dir():
            results["cli_patch"] = _cli(rank, root, "patch", PATCH)
            results["cli_explain"] = _cli(rank, root, "explain", EXPLAIN)
            # without --tensor-parallel: one process's work, rank 0 alone prints (issue 34 #16)
            results["cli_explain_alone"] = _cli(
                rank, root, "explain-alone", EXPLAIN, tensor_parallel=False
            )
            results["cli_corpus"] = _cli(rank, root, "corpus", CORPUS(root))
            # one process's work too: rank 0 alone scores, prints and writes (issue 46)
            results["cli_circuit"] = _cli(rank, root, "circuit", CIRCUIT, tensor_parallel=False)
            # the model directory missing on rank 1's machine alone: both stop in one line and
            # neither waits (the files are agreed on before the build, which can be collective)
            missing = "llama-cli" if rank == 0 else "not-here"
            results["cli_missing"] = _cli(rank, root, "missing", PATCH, missing)
            results["cli_bad_ids"] = _cli(rank, root, "bad-ids", PATCH, "llama-cli-small")
        torch.save(results, Path(root, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, {}))
    except BaseException:
        queue.put((rank, {"crash": traceback.format_exc()}))
        raise


CLI_TEXTS = ["--clean", "The cat was tired", "--corrupt", "The animal was tired"]
CLI_ANSWER = ["--answer", " it", "--wrong", " the", "--top", "4"]


PATCH = ["patch", *CLI_TEXTS, *CLI_ANSWER, "--format", "png,html"]
EXPLAIN = ["explain", "The cat was tired", "--format", "png"]
CIRCUIT = ["circuit", *CLI_TEXTS, *CLI_ANSWER, "--ig-steps", "2", "--draws", "1", "--format", "png"]
SPLIT = (
    "the model is split over 2 ranks by tensor parallelism: each rank holds 3 of every layer's 6"
)


def CORPUS(root: str) -> list[str]:  # noqa: N802 - the corpus command's arguments
    return ["explain", "--corpus", str(Path(root, "corpus.txt")), "--format", "png"]


def _cli(
    rank: int,
    root: str,
    name: str,
    argv: list[str],
    model_dir: str = "llama-cli",
    *,
    tensor_parallel: bool = True,
) -> dict[str, Any]:
    """``multihead ARGV --model MODEL_DIR --tensor-parallel`` on this rank, writing to
    ``NAME-out<rank>``: its exit code, what it printed and said."""
    out = str(Path(root, f"{name}-out{rank}"))
    split = ["--tensor-parallel"] if tensor_parallel else []
    model = ["--model", str(Path(root, model_dir)), *split, "--out", out]
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        code = main([*argv, *model])
    return {
        "code": code,
        "printed": printed.getvalue(),
        "said": said.getvalue(),
        "model": model[1],
        "out": out,
    }


def run_group(world: int, root: Path, worker: Callable[..., None] = _worker) -> None:
    """Run ``worker(rank, world, root, queue)`` on ``world`` spawned ranks; fail (and kill the
    rest) as soon as one rank reports an error, or when they are not done in ``TIMEOUT_S``."""
    env = {"OMP_NUM_THREADS": "1"}
    run_spawned(worker, world, (world, str(root)), timeout_s=TIMEOUT_S, env=env)


@pytest.fixture(scope="module", params=sorted(GROUPS), ids=lambda w: f"world{w}")
def group(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(world size, each rank's results, the one-process results) for one spawned group."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip(NO_ACCELERATE)
    world = int(request.param)
    root = tmp_path_factory.mktemp(f"world{world}")
    for family, _ in GROUPS[world]:
        _save_model(family, root / family)
    if world == 2:  # the command line on a tensor-parallel Llama with its tokenizer
        from test_hf_explain import BY_NAME, save_family

        save_family(BY_NAME["llama"], root / "llama-cli")
        (root / "corpus.txt").write_text("The cat was tired\nA dog sat on the mat\nIt was\n")
        # its tokenizer over an embedding of fewer rows than the tokenizer's ids (issue 34 #2)
        small = Path(shutil.copytree(root / "llama-cli", root / "llama-cli-small"))
        rows = len(BY_NAME["llama"].tokenizer()) - 8
        torch.manual_seed(0)
        BY_NAME["llama"].build(rows - rows % 2).save_pretrained(small)
    run_group(world, root)
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=True) for r in range(world)]
    single = {
        family: _cases(_load(root / family, tensor_parallel=False))
        for family, mapped in GROUPS[world]
        if mapped
    }
    return world, ranks, single


# -- the verdicts --------------------------------------------------------------------------------

CASES = {
    "logits": OUT_ATOL,
    "capture": WEIGHT_ATOL,
    "capture_chosen": WEIGHT_ATOL,
    "capture_one_rank": WEIGHT_ATOL,
    "ablate_last": OUT_ATOL,
    "intervene": OUT_ATOL,
    "record": OUT_ATOL,
    "patch": OUT_ATOL,
    "qkv_editor": OUT_ATOL,
    "statistics_entropy": WEIGHT_ATOL,
    "statistics_previous_token": WEIGHT_ATOL,
    "statistics_induction": WEIGHT_ATOL,
    "importance_ablation": OUT_ATOL,
    "importance_gradient": OUT_ATOL,
    "patch_denoise": OUT_ATOL,
    "patch_noise_per_position": OUT_ATOL,
    "attribution": OUT_ATOL,
    "paths": OUT_ATOL,
    "paths_kv": OUT_ATOL,
    "paths_whole": OUT_ATOL,
    "logit_attribution_heads": OUT_ATOL,
    "logit_attribution_rest": OUT_ATOL,
    "logit_attribution_total": OUT_ATOL,
}


def _plain(world: int, ranks: list[dict[str, Any]]) -> list[str]:
    """The families this transformers sharded as plain tensors (refused: see below)."""
    return [family for family, _ in GROUPS[world] if "plain" in ranks[0][family]]


def _mapped(world: int, ranks: list[dict[str, Any]]) -> list[str]:
    """The families whose heads the group maps (skips the test when this transformers shards
    as plain tensors, which multihead refuses)."""
    if _plain(world, ranks):
        pytest.skip(
            f"transformers {transformers.__version__} shards weights as plain tensors, not "
            f"DTensors: multihead refuses them (test_plain_tensor_layouts_are_refused_by_name)"
        )
    return [family for family, mapped in GROUPS[world] if mapped]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_gets_the_one_process_result(case: str, group: Any) -> None:
    world, ranks, single = group
    for family in _mapped(world, ranks):
        expected = single[family][case]
        for rank, results in enumerate(ranks):
            got = results[family][case]
            assert got.shape == expected.shape, (family, rank)
            torch.testing.assert_close(
                got, expected, atol=CASES[case], rtol=0, equal_nan=True, msg=f"{family} rank {rank}"
            )


def test_each_rank_holds_its_slice_of_the_heads(group: Any) -> None:
    world, ranks, single = group
    for family in _mapped(world, ranks):
        h = _num_heads(family)
        assert single[family]["shards"] == [None, None]  # one process: every call holds all
        for rank, results in enumerate(ranks):
            per_rank = h // world
            mine = tuple(range(rank * per_rank, (rank + 1) * per_rank))
            assert results[family]["shards"] == [mine, mine], (family, rank)


def test_an_edit_on_another_rank_changes_every_rank_output(group: Any) -> None:
    # head H-1 lives on the last rank only; rank 0's logits move as one process's do
    world, ranks, single = group
    for family in _mapped(world, ranks):
        clean = single[family]["logits"]
        for case in ("ablate_last", "intervene", "patch", "qkv_editor"):
            # each edit is visible at all, so that equal results say something
            assert (single[family][case] - clean).abs().max() > 100 * OUT_ATOL, (family, case)
        got = ranks[0][family]["ablate_last"]
        torch.testing.assert_close(got, single[family]["ablate_last"], atol=OUT_ATOL, rtol=0)
        assert (got - ranks[0][family]["logits"]).abs().max() > 100 * OUT_ATOL


def test_circuits_see_heads_of_every_rank(group: Any) -> None:
    # the heads each rank holds have effects of their own (so that equal results say something):
    # head 0 on rank 0, the last head on the last rank
    world, ranks, single = group
    for family in _mapped(world, ranks):
        got = single[family]
        last = _num_heads(family) - 1
        for case in ("patch_denoise", "attribution", "logit_attribution_heads"):
            per_head = got[case] if got[case].dim() == 2 else got[case].sum(-1)  # (L, H)
            assert per_head[:, 0].abs().max() > 100 * OUT_ATOL, (family, case)
            assert per_head[:, last].abs().max() > 100 * OUT_ATOL, (family, case)
        assert got["paths"][0].abs().max() > 100 * OUT_ATOL, family  # sender (0, last)
        assert got["paths"][:, 1].abs().max() > 100 * OUT_ATOL, family  # receiver (1, last)
        for receiver in range(3):  # each of the new receivers moves the metric
            cells = got["paths_whole"][:, receiver].nan_to_num()
            assert cells.abs().max() > 100 * OUT_ATOL, (family, receiver)
        assert got["logit_attribution_total"].abs().max() < 1e-4, family  # the parts add up


def test_a_wrong_patch_stops_every_rank_at_the_same_call(group: Any) -> None:
    world, ranks, single = group
    for family in _mapped(world, ranks):
        expected = single[family]["wrong_patch"]
        assert "the patch has (B, T) = (1, 3)" in expected
        assert [r[family]["wrong_patch"] for r in ranks] == [expected] * world


def test_uneven_heads_are_refused_by_name_on_every_rank(group: Any) -> None:
    world, ranks, _ = group
    _mapped(world, ranks)
    refused = [family for family, mapped in GROUPS[world] if not mapped]
    if not refused:
        pytest.skip(f"every model's heads split evenly over {world} ranks")
    for family in refused:
        messages = {r[family]["refused"] for r in ranks}
        assert len(messages) == 1, messages  # the same refusal on every rank
        h = _num_heads(family)
        assert messages.pop().startswith(f"{family} ("), f"the refusal names the family: {messages}"
        message = ranks[0][family]["refused"]
        assert f"splits {h} heads over {world} ranks unevenly" in message


def test_plain_tensor_layouts_are_refused_by_name(group: Any) -> None:
    world, ranks, _ = group
    plain = _plain(world, ranks)
    if not plain:
        pytest.skip(f"transformers {transformers.__version__} shards weights as DTensors")
    for family in plain:
        messages = [r[family]["plain"] for r in ranks]
        assert messages == [messages[0]] * world
        assert messages[0].startswith(f"{family} (")
        assert "is sharded as a plain tensor, not a DTensor" in messages[0]


def test_gpt2_runs_where_transformers_has_a_plan_for_it() -> None:
    if _has_tp_plan("gpt2"):
        assert any(family == "gpt2" for family, _ in GROUPS[2])  # run with the others
        return
    pytest.skip(
        f"transformers {transformers.__version__} has no tensor-parallel plan for GPT-2 "
        f"(GPT2Config.base_model_tp_plan is empty): tp_plan='auto' cannot load it"
    )


def _same_report(got: str, want: str, places: float) -> None:
    """Two printed reports: the same words, and numbers equal to the last printed place."""
    number = r"-?\d+\.\d+"
    assert re.sub(number, "#", got) == re.sub(number, "#", want)
    a, b = [float(x) for x in re.findall(number, got)], [float(x) for x in re.findall(number, want)]
    assert a == pytest.approx(b, abs=places)


@pytest.mark.parametrize(
    ("case", "places"), [("cli_patch", 0.00101), ("cli_explain", 0.0101), ("cli_corpus", 0.0101)]
)
def test_cli_on_a_tensor_parallel_model_prints_what_one_process_prints(
    case: str, places: float, group: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``multihead patch`` / ``explain`` / ``explain --corpus`` with ``--tensor-parallel``:
    rank 0 alone prints (numbers to their last printed place: the ranks' sums differ by ~1e-6)
    and writes the files one process writes; rank 1 runs every forward with it."""
    world, ranks, _ = group
    if world != 2:
        pytest.skip("the command line runs on the 2-rank group")
    _mapped(world, ranks)
    first, second = ranks[0][case], ranks[1][case]
    assert (first["code"], second["code"]) == (0, 0), (first["said"], second["said"])
    assert second["printed"] == "" and not os.path.exists(second["out"])
    assert SPLIT in first["said"] and SPLIT not in second["said"]  # split, not whole per rank
    argv = {"cli_patch": PATCH, "cli_explain": EXPLAIN}.get(case) or CORPUS(
        os.path.dirname(first["model"])
    )
    alone = str(tmp_path / "alone")
    assert main([*argv, "--model", first["model"], "--out", alone]) == 0
    printed = capsys.readouterr().out.replace(alone, first["out"])
    assert "llama-cli" in printed and printed.count(".") > 10  # a report with numbers
    _same_report(first["printed"], printed, places)
    assert sorted(os.listdir(first["out"])) == sorted(os.listdir(alone))
    if case == "cli_corpus":  # the statistics as one process writes them, (L, H) to 4 decimals
        got = json.loads(Path(first["out"], "head_statistics.json").read_text())
        want = json.loads(Path(alone, "head_statistics.json").read_text())
        assert got.keys() == want.keys() and got["num_texts"] == want["num_texts"] == 3
        for metric in ("entropy", "previous_token"):
            torch.testing.assert_close(
                torch.tensor(got[metric]), torch.tensor(want[metric]), atol=1.5e-4, rtol=0
            )


def test_row16_explain_under_torchrun_without_tensor_parallel_prints_once(
    group: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34 row 16: ``torchrun … explain TEXT`` on two ranks (was: every rank ran alone
    and printed the report twice): rank 0 prints and writes one process's report."""
    world, ranks, _ = group
    if world != 2:
        pytest.skip("the command line runs on the 2-rank group")
    _mapped(world, ranks)
    first, second = ranks[0]["cli_explain_alone"], ranks[1]["cli_explain_alone"]
    assert (first["code"], second["code"]) == (0, 0), (first["said"], second["said"])
    assert second["printed"] == "" and not os.path.exists(second["out"])
    assert SPLIT not in first["said"]
    alone = str(tmp_path / "alone")
    assert main([*EXPLAIN, "--model", first["model"], "--out", alone]) == 0
    printed = capsys.readouterr().out.replace(alone, first["out"])
    assert first["printed"] == printed
    assert sorted(os.listdir(first["out"])) == sorted(os.listdir(alone))


def test_row9_circuit_under_torchrun_prints_and_writes_once(
    group: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``torchrun … circuit`` on two ranks (was: every rank scored, printed and wrote the same
    files): rank 0 prints and writes what one process does; rank 1 prints nothing."""
    world, ranks, _ = group
    if world != 2:
        pytest.skip("the command line runs on the 2-rank group")
    _mapped(world, ranks)
    first, second = ranks[0]["cli_circuit"], ranks[1]["cli_circuit"]
    assert (first["code"], second["code"]) == (0, 0), (first["said"], second["said"])
    assert second["printed"] == "" and second["said"] == "" and not os.path.exists(second["out"])
    alone = str(tmp_path / "alone")
    assert main([*CIRCUIT, "--model", first["model"], "--out", alone]) == 0
    printed = capsys.readouterr().out.replace(alone, first["out"])
    assert "edges; metric:" in printed
    assert first["printed"] == printed
    assert sorted(os.listdir(first["out"])) == sorted(os.listdir(alone))


def test_row2_patch_refuses_tokenizer_ids_past_the_split_embedding_on_every_rank(
    group: Any,
) -> None:
    """Issue 34 row 2: ``patch --model --tensor-parallel`` with a tokenizer whose ids pass the
    embedding's rows (was: exit 0 and a report of zeros: the split embedding turns unknown ids
    into zero vectors): one line and exit 2 on every rank, nothing written."""
    world, ranks, _ = group
    if world != 2:
        pytest.skip("the command line runs on the 2-rank group")
    _mapped(world, ranks)
    first, second = ranks[0]["cli_bad_ids"], ranks[1]["cli_bad_ids"]
    assert (first["code"], second["code"]) == (2, 2), (first["said"], second["said"])
    for r in (first, second):
        errors = [line for line in r["said"].splitlines() if "error: " in line]
        assert len(errors) == 1 and "Traceback" not in r["said"], r["said"]
        assert r["printed"] == "" and not os.path.exists(r["out"])
    assert "beyond the" in first["said"] and "rows of the model's token embedding" in first["said"]


def test_cli_model_missing_on_one_rank_stops_both_before_the_collective_load(
    group: Any,
) -> None:
    world, ranks, _ = group
    if world != 2:
        pytest.skip("the command line runs on the 2-rank group")
    _mapped(world, ranks)
    first, second = ranks[0]["cli_missing"], ranks[1]["cli_missing"]
    assert (first["code"], second["code"]) == (2, 2)
    errors = [
        [line for line in r["said"].splitlines() if "error: " in line] for r in (first, second)
    ]
    assert [len(e) for e in errors] == [1, 1], errors  # one line each, no traceback
    assert "not-here" in errors[1][0] and "rank 1 of 2 failed (" in errors[0][0]
    assert not os.path.exists(first["out"]) and not os.path.exists(second["out"])


def test_cli_tensor_parallel_needs_torchrun_and_a_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli_support import fails

    argv = ["patch", "--tensor-parallel", "--out", str(tmp_path / "out")]
    err = fails(capsys, [*argv, "--model", str(tmp_path), *CLI_TEXTS, *CLI_ANSWER])
    assert "--tensor-parallel splits the model over torchrun's ranks: run it under torchrun" in err
    err = fails(capsys, [*argv, "--checkpoint", str(tmp_path)])
    assert "--tensor-parallel splits a Hugging Face model over the ranks: give its directory" in err
    err = fails(capsys, ["explain", "some text", "--tensor-parallel", "--out", str(tmp_path)])
    assert "--tensor-parallel splits a Hugging Face model over the ranks: give its directory" in err
    err = fails(
        capsys, [*argv, "--model", str(tmp_path), "--device", "cpu", *CLI_TEXTS, *CLI_ANSWER]
    )
    assert "--tensor-parallel places each rank's slice of the model on the machine's" in err
    assert "leave --device at auto, got 'cpu'" in err
    assert not (tmp_path / "out").exists()


def test_a_family_without_a_plan_is_refused_by_name() -> None:
    config = transformers.LlamaConfig()
    config.base_model_tp_plan = None  # as transformers has it for a family it cannot split
    with pytest.raises(ValueError, match=r"model 'tiny' \(llama\): transformers .* has no "
                       r"tensor-parallel plan for this family"):  # fmt: skip
        hf.loading.tensor_parallel_options(config, "tiny", 2)
    config = transformers.LlamaConfig()
    options = hf.loading.tensor_parallel_options(config, "tiny", 2)
    assert list(options) in (["distributed_config"], ["tp_plan"])


def test_loading_tensor_parallel_alone_is_refused(tmp_path: Path) -> None:
    _save_model("llama", tmp_path)
    with pytest.raises(ValueError, match=r"tensor parallelism splits the model over the ranks "
                       r"of a process group, and this process is alone"):  # fmt: skip
        hf.loading.load_model(tmp_path, given="tiny", causal_lm=True, tensor_parallel=True)


# -- the harness itself: a rank that raises alone ------------------------------------------------


def _one_rank_raises(rank: int, world: int, root: str, queue: Any) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{root}/rendezvous",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )
        if rank == 1:
            raise RuntimeError("rank 1 fails alone")
        dist.barrier()  # rank 0 waits for a rank that is gone
        queue.put((rank, {}))
    except BaseException:
        queue.put((rank, {"crash": traceback.format_exc()}))
        raise


def test_a_rank_that_raises_fails_the_group_without_hanging(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="rank 1 fails alone"):
        run_group(2, tmp_path, _one_rank_raises)


# -- in this process: the shard's own rules, and the check every call makes ---------------------


def test_a_shard_splits_heads_evenly_or_not_at_all() -> None:
    shard = HeadShard(num_heads=6, rank=2, world_size=3)
    assert shard.heads == range(4, 6)
    assert [shard.owner(h) for h in range(6)] == [0, 0, 1, 1, 2, 2]
    assert held_heads(6, shard) == range(4, 6) and held_heads(6, None) == range(6)
    with pytest.raises(ValueError, match="4 heads cannot be split evenly over 3 ranks"):
        HeadShard(num_heads=4, rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        HeadShard(num_heads=4, rank=2, world_size=2)


def test_a_call_holding_other_heads_than_the_shard_says_is_refused(tmp_path: Path) -> None:
    # a site told it holds half the heads, whose calls hold them all: never observed wrongly
    _save_model("llama", tmp_path)
    model = _load(tmp_path, tensor_parallel=False)
    for _, site in hf.attention_sites(model):
        site.head_shard = HeadShard(num_heads=4, rank=0, world_size=2)
    with pytest.raises(
        ValueError,
        match=r"llama \(LlamaAttention\): the attention call has 4 heads of width 16, but the "
        r"module was read as heads 0-1 of 4 \(rank 0 of 2\) of width 16",
    ):
        with torch.no_grad(), capture(model, rows=[-1]):
            model(_ids(1))
