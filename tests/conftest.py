import os
from pathlib import Path
from typing import Any

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


# Read-only artefacts several test files run commands on (built once per session; a test that
# would change one copies it first).
@pytest.fixture(scope="session")
def induction_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step run of ``multihead train --task induction`` (T = 16, width 32, 2 heads)."""
    from multihead.training import TrainConfig, train

    out = tmp_path_factory.mktemp("induction") / "run"
    config = TrainConfig.for_task(
        "induction", seq_len=16, steps=2, batch_size=8, embed_dim=32, num_heads=2, threads=1,
        probe_every=2, plots=False, out=str(out),
    )  # fmt: skip
    train(config)
    return out


@pytest.fixture(scope="session")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 saved as a Hugging Face directory with its tokenizer."""
    from test_hf_explain import BY_NAME, save_family

    return save_family(BY_NAME["gpt2"], tmp_path_factory.mktemp("gpt2") / "gpt2")


@pytest.fixture(scope="session")
def induction_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The induction recipe (`multihead train --task induction`: 2 attention-only layers, width
    128, 4 heads) for 450 steps at a constant learning rate after its warmup: the recipe's
    phase change (steps 280-400) comes at about the same step, about 20 s of training on one
    core (the recipe's 1,200 steps take 53 s); seed 0, deterministic."""
    from multihead.models import TransformerLM
    from multihead.training import TrainConfig, train

    out = tmp_path_factory.mktemp("induction") / "run"
    config = TrainConfig.for_task(
        "induction", steps=450, warmup_steps=30, min_lr_ratio=1.0, out=str(out), plots=False,
        threads=1, probe_every=450,
    )  # fmt: skip
    train(config)
    return TransformerLM.load(out).eval()
