"""The device the test suite runs on, chosen by ``MULTIHEAD_TEST_DEVICE`` (``cpu`` by default).

``MULTIHEAD_TEST_DEVICE=cuda python -m pytest -m "not cpu_only"`` runs every test that can run on a
GPU there: tests build their tensors, modules and generators on :func:`chosen_device` (the
``device`` fixture in conftest.py), and a comparison with a CPU reference moves the result under
test, never the inputs. Tests that are CPU-only by nature carry the ``cpu_only`` marker and are
skipped on any other device.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "MULTIHEAD_TEST_DEVICE"


@functools.cache
def chosen_device() -> torch.device:
    """The device named by ``MULTIHEAD_TEST_DEVICE``: ``cpu`` (default), ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: an unknown device, or ``cuda`` where this torch sees no GPU.
    """
    name = os.environ.get(ENV, "cpu").strip() or "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{ENV} must be 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{ENV}={name} but torch {torch.__version__} sees no CUDA device "
                f"(torch.cuda.is_available() is False; built for CUDA {torch.version.cuda})"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{ENV}={name} but only {count} CUDA device(s) are visible")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def generator(seed: int, device: torch.device | None = None) -> torch.Generator:
    """A generator seeded with ``seed`` on ``device`` (default: the test device).

    A CUDA generator draws other numbers than a CPU one from the same seed: a test that needs a
    property of its draw asserts it on several seeds or with a margin, not on one lucky draw.
    """
    return torch.Generator(device=device or chosen_device()).manual_seed(seed)
