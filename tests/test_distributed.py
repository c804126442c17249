"""Ring attention on real process groups: gloo on 127.0.0.1, 2 and 3 spawned processes.

Spawning costs seconds (every process imports torch), so each world size is spawned once: the
workers run every case and send their errors (against single-process attention over the whole
sequence) to the parent, and the parametrized tests below assert on them one case at a time.
The per-block kernels of multihead.kernels that the ring runs are checked in this process, last.
"""

from __future__ import annotations

import datetime
import functools
import math
import socket
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention
from spawned_group import run_spawned

from multihead import MultiHeadAttention, functional, kernels
from multihead.distributed import (
    LAYOUTS,
    RingSelfAttention,
    ring_attention,
    shard_sequence,
    sharding,
    unshard_sequence,
)

pytestmark = pytest.mark.cpu_only  # gloo process groups on the CPU

TIMEOUT_S = 120.0  # for one spawned group, start-up included
# The groups the error cases run on time out this fast, so a case that leaves a rank waiting
# shows up as a RuntimeError in seconds, not as a hung test.
ERRORS_TIMEOUT_S = 10.0
MISSED_BACKWARD_TIMEOUT_S = 3.0
ATOL = 1e-5

# (name, kernel, is_causal, layout, B, H, Hk, C (local length), D, Dv)
CASES: list[tuple[str, str, bool, str, int, int, int, int, int, int]] = []
for _kernel in ("flash", "math"):
    for _causal in (False, True):
        for _layout in ("contiguous", "zigzag"):
            for _h, _hk in ((3, 3), (6, 2)):
                _name = f"{_kernel}-{'causal' if _causal else 'full'}-{_layout}-h{_h}kv{_hk}"
                CASES.append((_name, _kernel, _causal, _layout, 2, _h, _hk, 6, 8, 8))
# multi-query heads, and a value head dim unlike the key's (the explicit formula serves it)
CASES.append(("flash-causal-zigzag-mqa", "flash", True, "zigzag", 1, 4, 1, 4, 8, 8))
CASES.append(("auto-causal-contiguous-dv5", "flash", True, "contiguous", 2, 4, 2, 6, 8, 5))
MODULE_CASES = [(layout, causal) for layout in LAYOUTS for causal in (False, True)]

# Memory layouts a caller may hand in. Each keeps the values of a tensor it is applied to twice
# (the expansions repeat one slice, which the first application already copied everywhere), so
# the whole tensor is given it once for the reference and each rank's part again for the ring.
RELAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "last-dim-transposed": lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2),
    "last-dim-every-other": lambda x: x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])[..., ::2].copy_(
        x
    ),
    "heads-time-transposed": lambda x: x.transpose(1, 2).contiguous().transpose(1, 2),
    "expanded-batch": lambda x: x[:1].expand_as(x),
    "expanded-heads": lambda x: x[:, :1].expand_as(x),
    "one-value-broadcast": lambda x: x.reshape(-1)[:1].view([1] * x.dim()).expand_as(x),
}
LAYOUT_CASES = [f"{name}-{relayout}" for name in ("q", "k", "v", "dout") for relayout in RELAYOUTS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- what each spawned rank runs -------------------------------------------------------------------


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _ring_case(
    rank: int,
    world: int,
    case: tuple[Any, ...],
    group: Any = None,
    relayout: tuple[str, str] | None = None,
) -> dict[str, float]:
    """Errors of the ring's output and gradients against one process over the whole sequence.

    ``relayout`` = (tensor name, RELAYOUTS key): hand that one of q, k, v, dout in that layout.
    """
    _, kernel, causal, layout, b, h, hk, c, d, dv = case
    kernels._USE_CPU_FLASH = kernel == "flash"
    gen = torch.Generator().manual_seed(1234)  # the same whole sequence on every rank
    t = c * world
    whole = {
        "q": torch.randn(b, h, t, d, generator=gen),
        "k": torch.randn(b, hk, t, d, generator=gen),
        "v": torch.randn(b, hk, t, dv, generator=gen),
        "dout": torch.randn(b, h, t, dv, generator=gen),
    }
    odd, change = relayout or (None, None)
    if odd is not None and change is not None:
        whole[odd] = RELAYOUTS[change](whole[odd])
    q, k, v = (whole[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    ref = functional.attention(q, k, v, is_causal=causal, backend="math")
    ref.backward(whole["dout"])
    assert q.grad is not None and k.grad is not None and v.grad is not None

    def part(name: str) -> torch.Tensor:
        x = shard_sequence(whole[name], rank, world, layout).clone()
        if name == odd and change is not None:
            x = RELAYOUTS[change](x)
            assert not x.is_contiguous()
        return x.detach().requires_grad_(name != "dout")

    ql, kl, vl = part("q"), part("k"), part("v")
    out = ring_attention(ql, kl, vl, group=group, is_causal=causal, layout=layout)
    out.backward(part("dout"))
    assert ql.grad is not None and kl.grad is not None and vl.grad is not None
    kernels._USE_CPU_FLASH = True
    return {
        "out": _max_err(out, shard_sequence(ref.detach(), rank, world, layout)),
        "dq": _max_err(ql.grad, shard_sequence(q.grad, rank, world, layout)),
        "dk": _max_err(kl.grad, shard_sequence(k.grad, rank, world, layout)),
        "dv": _max_err(vl.grad, shard_sequence(v.grad, rank, world, layout)),
    }


# causal zigzag with grouped heads: the most slicing on the way to the kernels
_LAYOUT_BASE = ("layouts", "flash", True, "zigzag", 2, 4, 2, 4, 8, 8)


def _module_case(rank: int, world: int, layout: str, causal: bool) -> dict[str, float]:
    torch.manual_seed(99)  # the same module and input on every rank
    mha = MultiHeadAttention(12, 4, num_kv_heads=2)
    x = torch.randn(2, 4 * world, 12, requires_grad=True)
    ref = mha(x, is_causal=causal)
    assert isinstance(ref, torch.Tensor)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in mha.parameters() if p.grad is not None]
    mha.zero_grad()
    ring = RingSelfAttention(mha, layout=layout)
    x_part = shard_sequence(x.detach(), rank, world, layout, dim=1).requires_grad_(True)
    out = ring(x_part, is_causal=causal)
    out.sum().backward()
    # Each rank's parameter gradients cover its part of the sequence: the sum over ranks is
    # the whole sequence's (what DistributedDataParallel's all-reduce would form).
    grads = [p.grad for p in mha.parameters() if p.grad is not None]
    for g in grads:
        dist.all_reduce(g)
    assert x_part.grad is not None and x.grad is not None
    return {
        "out": _max_err(out, shard_sequence(ref.detach(), rank, world, layout, dim=1)),
        "dx": _max_err(x_part.grad, shard_sequence(x.grad, rank, world, layout, dim=1)),
        "dparams": max(_max_err(a, b) for a, b in zip(grads, ref_grads, strict=True)),
        "nparams": float(len(grads)),
    }


def _error_of(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as e:  # a timeout (RuntimeError) too: the test then says which case hung
        return f"{type(e).__name__}: {e}"
    return "no error"


def _observe(mha: MultiHeadAttention) -> MultiHeadAttention:
    """``mha`` with one observer."""

    def observer(*args: Any) -> None:
        return None

    mha.register_observer(observer)
    return mha


ErrorCase = Callable[[Any], object]  # called with the process group to run on


def _error_cases(rank: int, world: int) -> dict[str, ErrorCase]:
    """Calls that differ between ranks: each must raise, on every rank, without hanging."""
    x = torch.randn(1, 2, 4, 8)
    short = torch.randn(1, 2, 2, 8)
    mha = MultiHeadAttention(8, 2)
    wide = torch.randn(1, 4, 8)
    legacy = MultiHeadAttention(8, 2)
    legacy.observer = lambda *args: None

    def no_grad_on_last_rank(group: Any) -> object:
        q = torch.randn(1, 2, 4, 8, requires_grad=True)
        with torch.set_grad_enabled(rank != world - 1):
            return ring_attention(q, q, q, group=group)

    def module(mha: MultiHeadAttention, x: torch.Tensor) -> ErrorCase:
        return lambda group: RingSelfAttention(mha, group=group)(x)

    return {
        # rank 1's sequence part is shorter than the others'
        "length": lambda g: ring_attention(*(short if rank == 1 else x,) * 3, group=g),
        # only the last rank asks for causal attention
        "causal": lambda g: ring_attention(x, x, x, group=g, is_causal=rank == world - 1),
        # rank 0's own input is invalid (head dims of q and k differ)
        "local": lambda g: ring_attention(
            x, x[..., :4] if rank == 0 else x, x[..., :4] if rank == 0 else x, group=g
        ),
        # the module path with a wrong width on rank 1 only
        "module": module(mha, torch.randn(1, 4, 8 if rank != 1 else 6)),
        # is_causal that is no bool (it has no truth value) on rank 0 only
        "causal-tensor": lambda g: ring_attention(
            x, x, x, group=g, is_causal=torch.tensor([True, False]) if rank == 0 else False
        ),
        # a scale that does not even pickle, on the last rank only
        "unpicklable-scale": lambda g: ring_attention(
            x, x, x, group=g, scale=(lambda: 0.5) if rank == world - 1 else None
        ),
        # q records a backward on rank 0 only
        "requires-grad": lambda g: ring_attention(
            x.clone().requires_grad_(rank == 0), x, x, group=g
        ),
        # grad mode off on the last rank only
        "no-grad": no_grad_on_last_rank,
        # observers on rank 1 only: the registered kind, and the single attribute before it
        "observers": module(_observe(MultiHeadAttention(8, 2)) if rank == 1 else mha, wide),
        "legacy-observer": module(legacy if rank == 1 else mha, wide),
        # the projections reject rank 1's input (another dtype): torch's error, agreed on too
        "module-dtype": module(mha, wide.double() if rank == 1 else wide),
    }


def _missed_backward(rank: int) -> str:
    """Rank 1 skips the backward that rank 0 runs: rank 0 must not wait forever."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=MISSED_BACKWARD_TIMEOUT_S))
    x = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = ring_attention(x, x, x, group=group)
    if rank != 0:
        return "skipped"
    # Left unmatched, its messages make this group useless afterwards: it is used for nothing else.
    return _error_of(lambda: out.sum().backward())


def _worker(rank: int, world: int, port: int, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        results: dict[str, Any] = {"errors": {}}
        groups = {}
        for name, case in _error_cases(rank, world).items():
            # A group per case, with a short timeout: a case that leaves a rank waiting fails
            # alone, in seconds, and the ranks meet again at the barrier of the default group.
            dist.barrier()
            groups[name] = dist.new_group(timeout=datetime.timedelta(seconds=ERRORS_TIMEOUT_S))
            results["errors"][name] = _error_of(functools.partial(case, groups[name]))
        dist.barrier()
        try:  # after an error every rank agreed on, its group must still work
            results["after_errors"] = _ring_case(rank, world, CASES[-1], group=groups["length"])
        except Exception as e:  # reported by its test, so that the other cases still run
            results["after_errors"] = {"error": f"{type(e).__name__}: {e}"}
        if world == 2:
            results["missed_backward"] = _missed_backward(rank)
        results["ring"] = {case[0]: _ring_case(rank, world, case) for case in CASES}
        results["layouts"] = {
            f"{name}-{relayout}": _ring_case(rank, world, _LAYOUT_BASE, relayout=(name, relayout))
            for name in ("q", "k", "v", "dout")
            for relayout in RELAYOUTS
        }
        results["module"] = {
            f"{layout}-{causal}": _module_case(rank, world, layout, causal)
            for layout, causal in MODULE_CASES
        }
        queue.put((rank, results))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, {"crash": traceback.format_exc()}))
        raise


def _run_group(world: int) -> dict[int, dict[str, Any]]:
    args = (world, _free_port())
    return run_spawned(_worker, world, args, timeout_s=TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def group_results(request: pytest.FixtureRequest) -> tuple[int, dict[int, dict[str, Any]]]:
    world = int(request.param)
    return world, _run_group(world)


# -- the spawned groups' verdicts ------------------------------------------------------------------


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_ring_matches_single_process(group_results: Any, name: str) -> None:
    world, results = group_results
    for rank in range(world):
        errors = results[rank]["ring"][name]
        assert max(errors.values()) < ATOL, f"rank {rank}: {errors}"


@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_ring_reads_any_memory_layout(group_results: Any, name: str) -> None:
    # Strided rows once made the CPU flash kernel read the wrong memory (errors up to 1e21).
    world, results = group_results
    for rank in range(world):
        errors = results[rank]["layouts"][name]
        assert max(errors.values()) < ATOL, f"rank {rank}: {errors}"


@pytest.mark.parametrize("layout,causal", MODULE_CASES)
def test_ring_self_attention_matches_module(group_results: Any, layout: str, causal: bool) -> None:
    world, results = group_results
    for rank in range(world):
        errors = results[rank]["module"][f"{layout}-{causal}"]
        assert errors["nparams"] == 4  # qkv weight and bias, out_proj weight and bias
        assert max(errors["out"], errors["dx"], errors["dparams"]) < ATOL, f"rank {rank}: {errors}"


def _messages(results: dict[int, dict[str, Any]], case: str) -> list[str]:
    return [results[rank]["errors"][case] for rank in sorted(results)]


def _assert_one_rank_rejects(
    results: dict[int, dict[str, Any]], case: str, culprit: int, own: str
) -> None:
    """The culprit raises its own error, starting with ``own``; every other rank names it."""
    world = len(results)
    for rank, message in enumerate(_messages(results, case)):
        if rank == culprit:
            assert message.startswith(own), f"rank {rank}: {message}"
        else:
            expected = f"ValueError: ring_attention: rank {culprit} of {world} rejected its input"
            assert message.startswith(f"{expected} ({own.split(': ')[0]}"), (
                f"rank {rank}: {message}"
            )


def test_mismatched_lengths_raise_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    for message in _messages(results, "length"):
        assert message.startswith("ValueError: ring_attention: the ranks disagree on q")
        assert "rank 1: (1, 2, 2, 8)" in message and "rank 0: (1, 2, 4, 8)" in message


def test_mismatched_options_raise_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    for message in _messages(results, "causal"):
        assert message.startswith("ValueError: ring_attention: the ranks disagree on is_causal")


def test_one_rank_invalid_input_raises_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    _assert_one_rank_rejects(results, "local", 0, "ValueError: q and k must have the same head dim")


def test_module_bad_input_on_one_rank_raises_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    _assert_one_rank_rejects(
        results, "module", 1, "ValueError: x must be (B, T/world, E) with E = embed_dim"
    )


def test_non_bool_is_causal_on_one_rank_raises_on_every_rank(group_results: Any) -> None:
    # It once raised on its own rank only, and the others waited until the group's timeout.
    world, results = group_results
    _assert_one_rank_rejects(
        results,
        "causal-tensor",
        0,
        "TypeError: is_causal must be a bool, got a torch.bool tensor of shape (2,)",
    )


def test_unpicklable_argument_on_one_rank_raises_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    _assert_one_rank_rejects(
        results, "unpicklable-scale", world - 1, "ValueError: scale must be a finite number, got"
    )


@pytest.mark.parametrize("case", ["requires-grad", "no-grad"])
def test_backward_on_some_ranks_only_raises_on_every_rank(group_results: Any, case: str) -> None:
    world, results = group_results
    culprit = 0 if case == "requires-grad" else world - 1
    for message in _messages(results, case):
        assert message.startswith(
            "ValueError: ring_attention: the ranks disagree on requires_grad ("
        ), message
        assert f"rank {culprit}: {case == 'requires-grad'}" in message
        assert "either every rank records the call for backward or none does" in message


def test_missed_backward_times_out_with_the_reason(group_results: Any) -> None:
    world, results = group_results
    if world != 2:
        pytest.skip("run with 2 ranks only: it waits for the group's timeout")
    assert results[1]["missed_backward"] == "skipped"
    message = results[0]["missed_backward"]
    assert message.startswith(
        "RuntimeError: ring_attention backward: rank 0 of 2 timed out waiting for its neighbours"
    ), message
    assert "Every rank of the group must run backward through its ring_attention output" in message


@pytest.mark.parametrize("case", ["observers", "legacy-observer"])
def test_module_with_observers_is_refused_on_every_rank(group_results: Any, case: str) -> None:
    world, results = group_results
    _assert_one_rank_rejects(
        results, case, 1, "ValueError: mha must have no observers to run under RingSelfAttention"
    )


def test_module_projection_error_on_one_rank_raises_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    _assert_one_rank_rejects(results, "module-dtype", 1, "RuntimeError: ")


def test_group_works_after_the_errors(group_results: Any) -> None:
    world, results = group_results
    for rank in range(world):
        errors = results[rank]["after_errors"]
        assert "error" not in errors, f"rank {rank}: {errors['error']}"
        assert max(errors.values()) < ATOL, f"rank {rank}: {errors}"


# -- one process -----------------------------------------------------------------------------------


def _check_one_process(layout: str) -> None:
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, requires_grad=True)
    out = ring_attention(q, k, v, is_causal=True, layout=layout)
    ref = functional.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    (grad_q,) = torch.autograd.grad(out.sum(), q)
    (ref_grad_q,) = torch.autograd.grad(ref.sum(), q)
    torch.testing.assert_close(grad_q, ref_grad_q, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_without_process_group_is_plain_attention(layout: str) -> None:
    assert not dist.is_initialized()
    _check_one_process(layout)


def test_world_size_one_is_plain_attention(tmp_path: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        _check_one_process("zigzag")
        ring = RingSelfAttention(MultiHeadAttention(8, 2))
        x = torch.randn(1, 5, 8)
        torch.testing.assert_close(ring(x, is_causal=True), ring.mha(x, is_causal=True))
    finally:
        dist.destroy_process_group()


def test_one_process_checks_input() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(
        ValueError, match=r"layout must be one of 'contiguous', 'zigzag', got 'ring'"
    ):
        ring_attention(q, q, q, layout="ring")
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, heads, T/world, head_dim\)"):
        ring_attention(q[0], q, q)
    with pytest.raises(ValueError, match=r"must hold the same positions"):
        ring_attention(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(ValueError, match=r"q's heads must be a multiple of k's"):
        ring_attention(q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8))
    with pytest.raises(ValueError, match=r"layout='zigzag' .* local length must be even, got 3"):
        ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], layout="zigzag")
    with pytest.raises(TypeError, match=r"q, k and v must have one dtype"):
        ring_attention(q, q.double(), q)
    with pytest.raises(TypeError, match=r"q must have a floating point dtype, got torch.int64"):
        ring_attention(*(torch.ones(1, 2, 4, 8, dtype=torch.long),) * 3)
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor, got list"):
        ring_attention(q, [1], q)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got a torch.bool tensor of sh"):
        ring_attention(q, q, q, is_causal=torch.tensor([True, False]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got 1"):
        ring_attention(q, q, q, is_causal=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"scale must be a finite number, got inf"):
        ring_attention(q, q, q, scale=math.inf)


def test_ring_self_attention_refuses_what_it_cannot_run() -> None:
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match=r"ring attention has no attention dropout"):
        RingSelfAttention(MultiHeadAttention(8, 2, dropout=0.1))(x)
    with pytest.raises(TypeError, match=r"mha must be a multihead.MultiHeadAttention"):
        RingSelfAttention(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layout must be one of"):
        RingSelfAttention(MultiHeadAttention(8, 2), layout="striped")
    with pytest.raises(ValueError, match=r"x must be \(B, T/world, E\) with E = embed_dim = 8"):
        RingSelfAttention(MultiHeadAttention(8, 2))(torch.randn(1, 4, 6))
    observed = _observe(MultiHeadAttention(8, 2))
    with pytest.raises(ValueError, match=r"mha must have no observers .*, got 1: an observer sees"):
        RingSelfAttention(observed)(x)
    legacy = MultiHeadAttention(8, 2)
    legacy.observer = lambda *args: None
    with pytest.raises(ValueError, match=r"mha must have no observers"):
        RingSelfAttention(legacy)(x)


# -- sharding helpers and the causal plan ----------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_unshard_round_trip(layout: str, world: int) -> None:
    x = torch.arange(2 * 12 * 3).view(2, 12, 3)
    parts = [shard_sequence(x, r, world, layout, dim=1) for r in range(world)]
    assert all(p.shape == (2, 12 // world, 3) for p in parts)
    torch.testing.assert_close(unshard_sequence(parts, layout, dim=1), x)


def test_zigzag_shards_hold_an_early_and_a_late_chunk() -> None:
    x = torch.arange(8).view(1, 1, 8, 1)
    got = [shard_sequence(x, r, 2, "zigzag").flatten().tolist() for r in range(2)]
    assert got == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_shard_sequence_errors() -> None:
    x = torch.zeros(1, 1, 6, 1)
    with pytest.raises(ValueError, match=r"length along dim -2 \(6\) must divide into 4 equal"):
        shard_sequence(x, 0, 2, "zigzag")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world\) = \[0, 2\), got 2"):
        shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match=r"world must be a positive int, got 0"):
        shard_sequence(x, 0, 0)
    with pytest.raises(ValueError, match=r"dim index 4 is out of range: there are 4 dimensions"):
        shard_sequence(x, 0, 2, dim=4)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        shard_sequence([0, 1], 0, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunks must all have the same length"):
        unshard_sequence([x, x[:, :, :2]])
    with pytest.raises(ValueError, match=r"chunks must hold one tensor per rank, got none"):
        unshard_sequence([])
    with pytest.raises(ValueError, match=r"zigzag chunks hold two equal halves.* got 3"):
        unshard_sequence([x[:, :, :3]], "zigzag")
    with pytest.raises(ValueError, match=r"layout must be one of"):
        unshard_sequence([x], "striped")


def _work(blocks: tuple[Any, ...]) -> float:
    """Score entries computed, in units of (sub-chunk)²; a causal diagonal counts half."""
    return sum((b.q1 - b.q0) * (b.k1 - b.k0) * (0.5 if b.causal else 1.0) for b in blocks)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_zigzag_balances_causal_work_and_contiguous_skips_the_future(world: int) -> None:
    plan = sharding.plan_blocks
    for step in range(world):
        zigzag, contiguous = [], []
        for rank in range(world):
            source = (rank - step) % world
            ids = (rank, 2 * world - 1 - rank), (source, 2 * world - 1 - source)
            zigzag.append(_work(plan(*ids, True)))
            contiguous.append(_work(plan((rank,), (source,), True)))
            if source > rank:
                assert plan((rank,), (source,), True) == ()
        # every zigzag rank does the same work at every step: 2 units out of 4 (1 at step 0:
        # two half diagonals and one full block make 2 too)
        assert zigzag == [2.0] * world
        assert sum(contiguous) < world  # the ranks after the diagonal's sources idle
    assert math.isclose(_work(plan((0, 1), (0, 1), False)), 4.0)


# -- the per-block kernels the ring runs (multihead.kernels) ---------------------------------------


@pytest.fixture(params=["flash", "formula"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with torch's CPU flash kernels and again with the explicit formula."""
    monkeypatch.setattr(kernels, "_USE_CPU_FLASH", request.param == "flash")
    return str(request.param)


def _reference_lse(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """log Σ_j exp(q·k_j·scale) over the keys each query sees, in float64, by explicit loops."""
    b, h, t, _ = q.shape
    hk, s = k.shape[1], k.shape[2]
    lse = torch.full((b, h, t), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                seen = [j for j in range(s) if not causal or j <= i + s - t]
                if seen:
                    scores = torch.stack(
                        [q[bi, hi, i].double() @ k[bi, hi // (h // hk), j].double() for j in seen]
                    )
                    lse[bi, hi, i] = torch.logsumexp(scores * scale, 0)
    return lse


# (T, S, Dv): square, more keys than queries, more queries than keys (the first two rows see no
# key when causal), and a value head dim unlike the key's
BLOCK_SHAPES = [(5, 5, 4), (5, 7, 4), (7, 5, 4), (5, 7, 3)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,s,dv", BLOCK_SHAPES)
def test_block_attention_matches_reference(
    kernel: str, causal: bool, t: int, s: int, dv: int
) -> None:
    q, k, v = torch.randn(2, 6, t, 4), torch.randn(2, 3, s, 4), torch.randn(2, 3, s, dv)
    out, lse = kernels.block_attention(q, k, v, causal=causal, scale=0.7)
    ref, _ = reference_attention(q, k, v, is_causal=causal, scale=0.7)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse.double(), _reference_lse(q, k, causal, 0.7), atol=ATOL, rtol=0)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and out.shape == (2, 6, t, dv)


def test_flash_serves_only_the_blocks_it_computes_right(kernel: str) -> None:
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 7, 4)
    flash = kernel == "flash"
    assert kernels._use_cpu_flash(q, k, k, causal=False) is flash
    assert kernels._use_cpu_flash(q, q, q, causal=True) is flash  # T == S: the alignments agree
    assert not kernels._use_cpu_flash(q, k, k, causal=True)  # top-left would not be ours
    assert not kernels._use_cpu_flash(q, k, k[..., :3], causal=False)  # Dv != D


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,s,dv", BLOCK_SHAPES)
def test_block_backward_of_one_block_is_its_gradient(
    kernel: str, causal: bool, t: int, s: int, dv: int
) -> None:
    q = torch.randn(2, 6, t, 4, requires_grad=True)
    k = torch.randn(2, 3, s, 4, requires_grad=True)
    v = torch.randn(2, 3, s, dv, requires_grad=True)
    dout = torch.randn(2, 6, t, dv)
    ref = functional.attention(q, k, v, is_causal=causal, scale=0.7, backend="math")
    ref.backward(dout)
    q_, k_, v_ = q.detach(), k.detach(), v.detach()
    out, lse = kernels.block_attention(q_, k_, v_, causal=causal, scale=0.7)
    grads = kernels.block_attention_backward(dout, q_, k_, v_, out, lse, causal=causal, scale=0.7)
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


# How the ring cuts one (T, S) = (6, 6) attention into blocks: (query rows, key columns, causal).
# Causal blocks are square and on the diagonal, where the kernels' causal mask is the global one.
BLOCK_PLANS = {
    "full": [(slice(0, 6), slice(0, 2), False), (slice(0, 6), slice(2, 6), False)],
    "causal": [
        (slice(0, 3), slice(0, 3), True),
        (slice(3, 6), slice(0, 3), False),
        (slice(3, 6), slice(3, 6), True),
    ],
}


@pytest.mark.parametrize("plan", BLOCK_PLANS)
def test_merged_blocks_are_the_whole_attention(kernel: str, plan: str) -> None:
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    causal = plan == "causal"
    whole, whole_lse = kernels.block_attention(q, k, v, causal=causal, scale=0.5)
    out = torch.zeros(2, 4, 6, 8)
    lse = torch.full((2, 4, 6), -math.inf)
    for rows, cols, block_causal in BLOCK_PLANS[plan]:
        o_blk, lse_blk = kernels.block_attention(
            q[:, :, rows], k[:, :, cols], v[:, :, cols], causal=block_causal, scale=0.5
        )
        kernels.merge_block(out[:, :, rows], lse[:, :, rows], o_blk, lse_blk)
    torch.testing.assert_close(out, whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, whole_lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("plan", BLOCK_PLANS)
def test_block_gradients_sum_to_the_whole_gradient(kernel: str, plan: str) -> None:
    # Each block is given the output and lse over all keys (flash-attention-2's backward): the
    # blocks' dq add up to the whole dq, and their dk, dv to the whole dk, dv of their keys.
    causal = plan == "causal"
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, requires_grad=True)
    dout = torch.randn(2, 4, 6, 8)
    ref = functional.attention(q, k, v, is_causal=causal, scale=0.5, backend="math")
    ref.backward(dout)
    q_, k_, v_ = q.detach(), k.detach(), v.detach()
    out, lse = kernels.block_attention(q_, k_, v_, causal=causal, scale=0.5)
    dq, dk, dv = torch.zeros_like(q_), torch.zeros_like(k_), torch.zeros_like(v_)
    for rows, cols, block_causal in BLOCK_PLANS[plan]:
        g_q, g_k, g_v = kernels.block_attention_backward(
            dout[:, :, rows],
            q_[:, :, rows],
            k_[:, :, cols],
            v_[:, :, cols],
            out[:, :, rows],
            lse[:, :, rows],
            causal=block_causal,
            scale=0.5,
        )
        dq[:, :, rows] += g_q
        dk[:, :, cols] += g_k
        dv[:, :, cols] += g_v
    for got, want in zip((dq, dk, dv), (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_merge_keeps_rows_without_keys_empty() -> None:
    out, lse = torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), -math.inf)
    kernels.merge_block(out, lse, torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), -math.inf))
    assert torch.equal(out, torch.zeros(1, 1, 2, 3))
    assert torch.equal(lse, torch.full((1, 1, 2), -math.inf))
    block = torch.randn(1, 1, 2, 3)
    kernels.merge_block(out, lse, block, torch.tensor([[[0.5, -math.inf]]]))
    torch.testing.assert_close(out, torch.cat([block[:, :, :1], torch.zeros(1, 1, 1, 3)], 2))
    torch.testing.assert_close(lse, torch.tensor([[[0.5, -math.inf]]]))


@pytest.mark.parametrize("relayout", RELAYOUTS)
def test_kernels_read_any_memory_layout(kernel: str, relayout: str) -> None:
    # The CPU flash kernels read strided rows wrong unless kernels.py makes them dense.
    change = RELAYOUTS[relayout]
    q, k, v, dout = (
        change(torch.randn(2, 4, 6, 8)).contiguous(),
        change(torch.randn(2, 2, 6, 8)).contiguous(),
        change(torch.randn(2, 2, 6, 8)).contiguous(),
        change(torch.randn(2, 4, 6, 8)).contiguous(),
    )
    out, lse = kernels.block_attention(q, k, v, causal=True, scale=0.5)
    grads = kernels.block_attention_backward(dout, q, k, v, out, lse, causal=True, scale=0.5)
    odd_out, odd_lse = kernels.block_attention(
        change(q), change(k), change(v), causal=True, scale=0.5
    )
    odd_grads = kernels.block_attention_backward(
        change(dout), change(q), change(k), change(v), change(out), lse, causal=True, scale=0.5
    )
    torch.testing.assert_close(odd_out, out, atol=ATOL, rtol=0)
    torch.testing.assert_close(odd_lse, lse, atol=ATOL, rtol=0)
    for got, want in zip(odd_grads, grads, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
