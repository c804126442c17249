"""multihead.logit_lens: each layer's stream through the final norm and unembedding (against
hooks recorded here), the last layer equal to the model's logits, and each head's reading equal
to direct logit attribution's term."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import multihead
from multihead.circuits.decompose.logit_lens import logit_lens
from multihead.models import TransformerLM


def _model(name: str, device: torch.device) -> tuple[nn.Module, list[nn.Module], nn.Module, Any]:
    """(model, its blocks, final norm, unembedding) in float64."""
    if name == "lm":
        lm = TransformerLM(30, 24, 6, 3, 40, max_len=16)
        model, blocks, norm, head = lm, list(lm.blocks), lm.norm, lm.head
    else:
        transformers = pytest.importorskip("transformers", minversion="5")
        if name == "gpt2":
            config: Any = transformers.GPT2Config(
                vocab_size=30, n_embd=24, n_layer=3, n_head=4, n_positions=32, bos_token_id=0,
                eos_token_id=0,
            )  # fmt: skip
            model = transformers.GPT2LMHeadModel(config)
            blocks, norm = list(model.transformer.h), model.transformer.ln_f
        else:
            config = transformers.LlamaConfig(
                vocab_size=30, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
            )  # fmt: skip
            model = transformers.LlamaForCausalLM(config)
            blocks, norm = list(model.model.layers), model.model.norm
        head = model.lm_head
    return model.to(device, torch.float64).eval(), blocks, norm, head


@pytest.mark.parametrize("name", ["lm", "gpt2", "llama"])
def test_each_layer_is_its_stream_through_the_final_norm(name: str, device: torch.device) -> None:
    model, blocks, norm, head = _model(name, device)
    ids = torch.randint(30, (2, 7), device=device)
    outs: list[torch.Tensor] = []
    handles = [
        b.register_forward_hook(
            lambda m, a, out: outs.append(out[0] if isinstance(out, tuple) else out)
        )
        for b in blocks
    ]
    with torch.no_grad():
        output = model(ids)
    for h in handles:
        h.remove()
    logits = output if isinstance(output, torch.Tensor) else output.logits
    lens = logit_lens(model, ids, top_k=None)
    assert lens.logits is not None and lens.logits.shape == (3, 2, 7, 30)
    # a float64 model's lens is float64 (issue 51: it was rounded to float32, 2.4e-7 off)
    assert lens.logits.dtype == torch.float64
    with torch.no_grad():
        for layer, stream in enumerate(outs):
            by_hand = head(norm(stream))
            torch.testing.assert_close(lens.logits[layer], by_hand, rtol=0, atol=1e-12)
    # the last layer is the model's own prediction
    torch.testing.assert_close(lens.logits[-1], logits, rtol=0, atol=1e-12)
    # each head's reading, at a token, is direct logit attribution's term for it
    dla = multihead.logit_attribution(model, ids, 5)
    for layer in range(3):
        read = lens.head_logits(layer)[..., 5].mean(0)  # (P, H), a mean over the batch as DLA
        heads = read.shape[1]
        torch.testing.assert_close(read.T, dla.heads[layer, :heads].to(read.dtype))


def test_positions_layers_and_top_k(device: torch.device) -> None:
    model, _, _, _ = _model("lm", device)
    ids = torch.randint(30, (2, 7), device=device)
    whole = logit_lens(model, ids, top_k=None)
    assert whole.logits is not None
    some = logit_lens(model, ids, layers=[-1, 0], positions=[-1, 3], top_k=4)
    assert some.layers == [0, 2] and some.positions == [6, 3] and some.logits is None
    assert some.top_ids.shape == (2, 2, 2, 4) and some.results.shape == (2, 2, 2, 6, 24)
    picked = whole.logits[[0, 2]][:, :, [6, 3]]
    values, ids_ = picked.topk(4, -1)
    torch.testing.assert_close(some.top_logits, values)
    assert torch.equal(some.top_ids, ids_)
    torch.testing.assert_close(some.head_logits(2), whole.head_logits(2)[:, [6, 3]])
    assert multihead.logit_lens is logit_lens


def test_errors() -> None:
    ids = torch.randint(20, (2, 5))
    lm = TransformerLM(20, 24, 6, 2, 40, max_len=16).eval()
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        logit_lens(lm, ids, top_k=0)
    with pytest.raises(ValueError, match="layers index 2 is out of range: there are 2 layers"):
        logit_lens(lm, ids, layers=[2])
    with pytest.raises(TypeError, match="layers must be an int, a sequence of ints or None"):
        logit_lens(lm, ids, layers="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layer must be one of the layers read, \\[1\\], got 0"):
        logit_lens(lm, ids, layers=1).head_logits(0)
    with pytest.raises(ValueError, match="logit_lens needs a model with an unembedding"):
        logit_lens(multihead.MultiHeadAttention(24, 4), torch.randn(2, 5, 24))


def test_row5_a_scaled_models_lens_and_attribution_are_its_logits() -> None:
    """Issue 51 row 5: on Granite (``logits_scaling`` 8) the lens's last layer and logit
    attribution's "the model's own logit" were 8x the model's logits, no warning."""
    transformers = pytest.importorskip("transformers", minversion="5")
    shape = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=40)  # fmt: skip
    torch.manual_seed(0)
    config = transformers.GraniteConfig(**shape, logits_scaling=8.0)
    model = transformers.GraniteForCausalLM(config).double().eval()
    ids = torch.randint(50, (2, 6))
    with torch.no_grad():
        logits = model(ids).logits  # (B, T, V)
    lens = logit_lens(model, ids, top_k=None)
    assert lens.logits is not None
    torch.testing.assert_close(lens.logits[-1], logits, rtol=0, atol=1e-10)
    dla = multihead.logit_attribution(model, ids, 3, wrong=5)
    want = (logits[..., 3] - logits[..., 5]).mean(0)  # (T,) the mean over the batch
    torch.testing.assert_close(dla.logit, want, rtol=0, atol=1e-10)
    parts = dla.heads.nan_to_num().sum((0, 1)) + dla.attention_bias.sum(0) + dla.mlp.sum(0)
    total = parts + dla.embeddings + dla.norm_bias + dla.unembedding_bias
    torch.testing.assert_close(total, want, rtol=1e-6, atol=1e-9)  # the terms add up to it
