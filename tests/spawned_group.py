"""Spawned process groups for the distributed tests: start the ranks, collect what each reports,
and fail (killing the rest) when one crashes or the group is not done in time: never hang.

A rank's worker is ``worker(rank, *args, queue)``; it puts ``(rank, payload)`` once: a dict of its
results, or ``{"crash": traceback}`` when it raised (then it re-raises). A payload may come
pickled (bytes): a tensor sent through the queue itself shares memory that is gone with its
process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["run_spawned"]


def run_spawned(
    worker: Callable[..., None],
    world: int,
    args: tuple[Any, ...],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> dict[int, dict[str, Any]]:
    """Run ``worker(rank, *args, queue)`` on ``world`` spawned ranks (``env`` set while they
    start, e.g. ``OMP_NUM_THREADS``); every rank's payload by rank.

    Fails with an AssertionError naming every crashed rank's traceback as soon as one reports a
    crash (the others may be waiting for it in a collective), or when a rank died without a
    report or the group is not done within ``timeout_s``; ranks still running are killed.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    env = dict(env or {})
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        procs = [
            ctx.Process(target=worker, args=(rank, *args, queue), daemon=True)
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
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world and time.monotonic() < deadline:
            if not queue.empty():
                rank, payload = queue.get()
                results[rank] = pickle.loads(payload) if isinstance(payload, bytes) else payload
                if "crash" in results[rank]:
                    break
            elif any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)  # a crash report may still be on its way
                if queue.empty():
                    break
            else:
                time.sleep(0.05)
        crashed = any("crash" in r for r in results.values())
        for p in procs:
            if not crashed:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    crashes = {r: res["crash"] for r, res in results.items() if "crash" in res}
    assert not crashes, f"ranks crashed: {crashes}"
    assert len(results) == world, (
        f"only ranks {sorted(results)} of {world} reported within {timeout_s} s "
        f"(exit codes {[p.exitcode for p in procs]})"
    )
    return results
