"""Inputs the circuit functions used to take silently or with the wrong error (issue 34's rows
5, 10, 13, 14, 15): each test names the row and its input."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import multihead
from multihead.models import TransformerLM

V = 20


def _lm(device: torch.device, **kw: Any) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(V, 24, 4, 2, 40, max_len=16, **kw).to(device).eval()


def _pair(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.randint(V, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    corrupt = clean.clone()
    corrupt[:, 3] = (corrupt[:, 3] + 1) % V
    return clean, corrupt


def _logit_diff(out: torch.Tensor) -> torch.Tensor:
    return out[:, -1, 1] - out[:, -1, 2]


def test_row5_logit_attribution_of_a_bfloat16_model_adds_up_to_its_logit(
    device: torch.device,
) -> None:
    """Row 5, any bfloat16 model (was: refused, the final norm "computes something else")."""
    lm = _lm(device, dtype=torch.bfloat16)
    clean, _ = _pair(device)
    found = multihead.logit_attribution(lm, clean, 3, 4)
    with torch.no_grad():
        logits = lm(clean).float()
    reference = (logits[..., 3] - logits[..., 4]).mean(0)  # (T,), the model's own
    torch.testing.assert_close(found.logit, reference, rtol=0, atol=1e-6)
    # the terms add up to it within bfloat16's rounding of the stream they were read from
    torch.testing.assert_close(found.total(), reference, rtol=0.05, atol=0.05)


def test_row10_gradient_functions_warn_about_a_model_left_in_training_with_dropout(
    device: torch.device,
) -> None:
    """Row 10, a model in training mode with dropout (was: a different result each call, no
    warning)."""
    lm = _lm(device, dropout=0.1).train()
    clean, corrupt = _pair(device)
    with pytest.warns(UserWarning, match="attribution_patching: the model is in training mode"):
        multihead.attribution_patching(lm, clean, corrupt, _logit_diff)
    with pytest.warns(UserWarning, match="logit_attribution: the model is in training mode"):
        multihead.logit_attribution(lm, clean, 1, 2)
    lm.eval()  # the same calls in eval mode warn of nothing (warnings are errors here)
    multihead.attribution_patching(lm, clean, corrupt, _logit_diff)
    multihead.logit_attribution(lm, clean, 1, 2)


def test_row13_logit_attribution_under_inference_mode_equals_outside_it(
    device: torch.device,
) -> None:
    """Row 13, called under ``torch.inference_mode()`` (was: a bare autograd RuntimeError)."""
    lm = _lm(device)
    clean, _ = _pair(device)
    outside = multihead.logit_attribution(lm, clean, 1, 2)
    with torch.inference_mode():
        inside = multihead.logit_attribution(lm, clean, 1, 2)
    torch.testing.assert_close(inside.heads, outside.heads, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(inside.logit, outside.logit, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0)], ids=["empty batch", "empty sequence"])
def test_row14_an_empty_batch_or_sequence_is_a_value_error_naming_the_input(
    device: torch.device, shape: tuple[int, int]
) -> None:
    """Row 14, an empty batch or sequence (was: RuntimeError or ZeroDivisionError)."""
    lm = _lm(device)
    empty = torch.zeros(shape, dtype=torch.long, device=device)
    expected = r"must hold at least one sequence \(B >= 1\) of at least one token \(T >= 1\)"
    calls = {
        "patch_heads": lambda: multihead.patch_heads(lm, empty, empty, _logit_diff).values,
        "attribution_patching": lambda: multihead.attribution_patching(
            lm, empty, empty, _logit_diff
        ),
        "path_patching": lambda: multihead.path_patching(
            lm, empty, empty, _logit_diff, [(0, 0)], [(1, 0)]
        ),
        "logit_attribution": lambda: multihead.logit_attribution(lm, empty, 1),
    }
    for name, call in calls.items():
        argument = "inputs" if name == "logit_attribution" else "clean"
        with pytest.raises(ValueError, match=f"^{argument} {expected}"):
            call()
    as_dict = {"ids": empty}
    with pytest.raises(ValueError, match=rf"^clean\['ids'\] {expected}"):
        multihead.patch_heads(lm, as_dict, as_dict, _logit_diff)


def test_row15_a_metric_nan_on_the_unpatched_run_is_named(device: torch.device) -> None:
    """Row 15, a metric that is NaN on the unpatched run (was: "is metric() deterministic?"
    and the prefix reuse silently dropped)."""
    lm = _lm(device)
    clean, corrupt = _pair(device)

    def nan_metric(out: torch.Tensor) -> torch.Tensor:
        return _logit_diff(out) * float("nan")

    with pytest.raises(ValueError, match="metric\\(output\\) is NaN on the unpatched run"):
        multihead.patch_heads(lm, clean, corrupt, nan_metric)
    with pytest.raises(ValueError, match="metric\\(output\\) is NaN on the clean run"):
        multihead.path_patching(lm, clean, corrupt, nan_metric, [(0, 0)], [(1, 0)])


def test_the_metric_is_given_the_logits_as_transformer_lens_gives_them(
    device: torch.device,
) -> None:
    """Issue 30 item 4: a TransformerLens-style metric ``logits[:, -1, a] - logits[:, -1, b]``
    works on a transformers model (it was handed the output object and failed inside itself);
    ``metric_input="output"`` hands over the whole output; a metric that fails is told what it
    was given."""
    transformers = pytest.importorskip("transformers", minversion="5")
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=24, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).to(device).eval()
    clean = torch.randint(50, (2, 6), device=device)
    corrupt = torch.randint(50, (2, 6), device=device)

    def tl_style(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 3] - logits[:, -1, 4]

    def whole(output: Any) -> torch.Tensor:
        return output.logits[:, -1, 3] - output.logits[:, -1, 4]

    given = multihead.patch_heads(model, clean, corrupt, tl_style).values
    torch.testing.assert_close(
        given, multihead.patch_heads(model, clean, corrupt, whole, metric_input="output").values
    )
    # the unpatched value the effects are measured from: the logits of a plain forward
    with torch.no_grad():
        logits = model(corrupt).logits
    assert given.shape == (2, 4) and float(tl_style(logits).mean()) != 0.0
    with pytest.raises(AttributeError) as failed:
        multihead.patch_heads(model, clean, corrupt, whole)
    assert "metric was given the logits (a torch.float32 tensor of shape (2, 6, 50))" in str(
        failed.value.__notes__
    )
    assert "metric_input='output' gives it the whole output" in failed.value.__notes__[0]
    with pytest.raises(ValueError, match="metric_input must be one of 'logits', 'output'"):
        multihead.attribution_patching(model, clean, corrupt, tl_style, metric_input="loss")
    with pytest.raises(TypeError) as failed_output:
        multihead.path_patching(
            model, clean, corrupt, tl_style, [(0, 0)], [(1, 0)], metric_input="output"
        )
    assert (
        "metric was given the model's output (CausalLMOutputWithCrossAttentions)"
        in (failed_output.value.__notes__[0])
    )
