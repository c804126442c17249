import os

import pytest
import torch
from devices import ENV, chosen_device

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    try:
        chosen_device()
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_report_header(config: pytest.Config) -> str:
    device = chosen_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"multihead test device: {device} ({name}; {ENV}, default cpu)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    device = chosen_device()
    if device.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"cpu_only: not run with {ENV}={device}")
    for item in items:
        if item.get_closest_marker("cpu_only") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device tests build their tensors, modules and generators on (:mod:`devices`)."""
    return chosen_device()


@pytest.fixture(autouse=True)
def _seed() -> None:
    # Seeds the CPU and every CUDA generator alike.
    torch.manual_seed(0)
