"""Ring attention on real process groups: gloo on 127.0.0.1, 2 and 3 spawned processes.

Spawning costs seconds (every process imports torch), so each world size is spawned once: the
workers run every case and send their errors (against single-process attention over the whole
sequence) to the parent, and the parametrized tests below assert on them one case at a time.
"""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import multihead.distributed as mhd
from multihead import MultiHeadAttention, functional
from multihead.distributed import (
    RingSelfAttention,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)

TIMEOUT_S = 120.0  # for one spawned group, start-up included
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
MODULE_CASES = [(layout, causal) for layout in ("contiguous", "zigzag") for causal in (False, True)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- what each spawned rank runs -------------------------------------------------------------------


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _ring_case(rank: int, world: int, case: tuple[Any, ...]) -> dict[str, float]:
    _, kernel, causal, layout, b, h, hk, c, d, dv = case
    mhd._USE_CPU_FLASH = kernel == "flash"
    gen = torch.Generator().manual_seed(1234)  # the same whole sequence on every rank
    t = c * world
    q = torch.randn(b, h, t, d, generator=gen, requires_grad=True)
    k = torch.randn(b, hk, t, d, generator=gen, requires_grad=True)
    v = torch.randn(b, hk, t, dv, generator=gen, requires_grad=True)
    grad_out = torch.randn(b, h, t, dv, generator=gen)
    ref = functional.attention(q, k, v, is_causal=causal, backend="math")
    ref.backward(grad_out)
    assert q.grad is not None and k.grad is not None and v.grad is not None

    def part(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x.detach(), rank, world, layout).clone().requires_grad_(True)

    ql, kl, vl = part(q), part(k), part(v)
    out = ring_attention(ql, kl, vl, is_causal=causal, layout=layout)
    out.backward(shard_sequence(grad_out, rank, world, layout))
    assert ql.grad is not None and kl.grad is not None and vl.grad is not None
    mhd._USE_CPU_FLASH = True
    return {
        "out": _max_err(out, shard_sequence(ref.detach(), rank, world, layout)),
        "dq": _max_err(ql.grad, shard_sequence(q.grad, rank, world, layout)),
        "dk": _max_err(kl.grad, shard_sequence(k.grad, rank, world, layout)),
        "dv": _max_err(vl.grad, shard_sequence(v.grad, rank, world, layout)),
    }


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
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _error_cases(rank: int, world: int) -> dict[str, str]:
    x = torch.randn(1, 2, 4, 8)
    short = torch.randn(1, 2, 2, 8)
    mha = MultiHeadAttention(8, 2)
    return {
        # rank 1's sequence part is shorter than the others'
        "length": _error_of(lambda: ring_attention(*(short if rank == 1 else x,) * 3)),
        # only the last rank asks for causal attention
        "causal": _error_of(lambda: ring_attention(x, x, x, is_causal=rank == world - 1)),
        # rank 0's own input is invalid (head dims of q and k differ)
        "local": _error_of(
            lambda: ring_attention(
                x, x[..., :4] if rank == 0 else x, x[..., :4] if rank == 0 else x
            )
        ),
        # the module path with a wrong width on rank 1 only
        "module": _error_of(
            lambda: RingSelfAttention(mha)(torch.randn(1, 4, 8 if rank != 1 else 6))
        ),
    }


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
        results: dict[str, Any] = {"errors": _error_cases(rank, world)}
        # after the errors, the group must still work: every case below runs on it
        results["ring"] = {case[0]: _ring_case(rank, world, case) for case in CASES}
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
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    env = {"OMP_NUM_THREADS": "1"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        procs = [
            ctx.Process(target=_worker, args=(rank, world, port, queue), daemon=True)
            for rank in range(world)
        ]
        for p in procs:
            p.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(results) < world and time.monotonic() < deadline:
            if not queue.empty():
                rank, payload = queue.get()
                results[rank] = payload
            elif any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                time.sleep(0.5)  # a crash report may still be on its way
                if queue.empty():
                    break
            else:
                time.sleep(0.05)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    crashes = {r: res["crash"] for r, res in results.items() if "crash" in res}
    assert not crashes, f"ranks crashed: {crashes}"
    assert len(results) == world, (
        f"only ranks {sorted(results)} of {world} reported within {TIMEOUT_S} s "
        f"(exit codes {[p.exitcode for p in procs]})"
    )
    return results


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


@pytest.mark.parametrize("layout,causal", MODULE_CASES)
def test_ring_self_attention_matches_module(group_results: Any, layout: str, causal: bool) -> None:
    world, results = group_results
    for rank in range(world):
        errors = results[rank]["module"][f"{layout}-{causal}"]
        assert errors["nparams"] == 4  # qkv weight and bias, out_proj weight and bias
        assert max(errors["out"], errors["dx"], errors["dparams"]) < ATOL, f"rank {rank}: {errors}"


def test_mismatched_lengths_raise_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    for rank in range(world):
        message = results[rank]["errors"]["length"]
        assert message.startswith("ValueError: ring_attention: the ranks disagree on q")
        assert "rank 1: (1, 2, 2, 8)" in message and "rank 0: (1, 2, 4, 8)" in message


def test_mismatched_options_raise_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    for rank in range(world):
        message = results[rank]["errors"]["causal"]
        assert message.startswith("ValueError: ring_attention: the ranks disagree on is_causal")


def test_one_rank_invalid_input_raises_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    assert results[0]["errors"]["local"].startswith(
        "ValueError: q and k must have the same head dim"
    )
    for rank in range(1, world):
        assert results[rank]["errors"]["local"].startswith(
            f"ValueError: ring_attention: rank 0 of {world} rejected its input (ValueError: q and k"
        )


def test_module_bad_input_on_one_rank_raises_on_every_rank(group_results: Any) -> None:
    world, results = group_results
    for rank in range(world):
        message = results[rank]["errors"]["module"]
        if rank == 1:
            assert message.startswith("ValueError: x must be (B, T/world, E) with E = embed_dim")
        else:
            assert message.startswith(
                f"ValueError: ring_attention: rank 1 of {world} rejected its input"
            )


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
    with pytest.raises(ValueError, match=r"layout must be one of contiguous, zigzag, got 'ring'"):
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
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor, got list"):
        ring_attention(q, [1], q)  # type: ignore[arg-type]
    mha = MultiHeadAttention(8, 2, dropout=0.1)
    with pytest.raises(ValueError, match=r"ring attention has no attention dropout"):
        RingSelfAttention(mha)(torch.randn(1, 4, 8))
    with pytest.raises(TypeError, match=r"mha must be a multihead.MultiHeadAttention"):
        RingSelfAttention(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


# -- sharding helpers and the causal plan ----------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
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
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match=r"chunks must all have the same length"):
        unshard_sequence([x, x[:, :, :2]])
    with pytest.raises(ValueError, match=r"layout must be one of"):
        unshard_sequence([x], "striped")


def _work(blocks: tuple[Any, ...]) -> float:
    """Score entries computed, in units of (sub-chunk)²; a causal diagonal counts half."""
    return sum((b.q1 - b.q0) * (b.k1 - b.k0) * (0.5 if b.causal else 1.0) for b in blocks)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_zigzag_balances_causal_work_and_contiguous_skips_the_future(world: int) -> None:
    for step in range(world):
        zigzag, contiguous = [], []
        for rank in range(world):
            source = (rank - step) % world
            ids = (rank, 2 * world - 1 - rank), (source, 2 * world - 1 - source)
            zigzag.append(_work(mhd._plan(*ids, True)))
            contiguous.append(_work(mhd._plan((rank,), (source,), True)))
            if source > rank:
                assert mhd._plan((rank,), (source,), True) == ()
        # every zigzag rank does the same work at every step: 2 units out of 4 (1 at step 0:
        # two half diagonals and one full block make 2 too)
        assert zigzag == [2.0] * world
        assert sum(contiguous) < world  # the ranks after the diagonal's sources idle
    assert math.isclose(_work(mhd._plan((0, 1), (0, 1), False)), 4.0)
