"""Direct logit attribution: the terms add up to the model's logit, and each head's term equals
a hand computation (its columns of the output projection, the final LayerNorm with its scale
frozen, the unembedding row)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead.circuits.decompose.logit_attribution import logit_attribution
from multihead.models import TransformerLM


def _lm(device: torch.device, **kw: Any) -> TransformerLM:
    torch.manual_seed(0)
    lm = TransformerLM(20, 24, 6, 3, 40, max_len=16, num_kv_heads=2, dtype=torch.float64, **kw)
    return lm.to(device).eval()


def _by_hand(
    projections: list[tuple[Tensor, int]],
    norm: nn.LayerNorm,
    run: Any,
    direction: Tensor,
) -> Tensor:
    """(L, H, T): ⟨LN-frozen(z_h W^O_h), d⟩, batch mean. ``projections``: per layer the
    (E, H·Dv) weight mapping the per-head outputs to the residual stream and Dv; ``run()``
    returns the per-layer projection inputs (B, T, H·Dv) and the norm's input (B, T, E)."""
    inputs, x = run()
    sigma = (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()  # frozen scale
    out = []
    for (weight, dv), z in zip(projections, inputs, strict=True):
        rows = []
        for h in range(weight.shape[1] // dv):
            c = z[..., h * dv : (h + 1) * dv] @ weight[:, h * dv : (h + 1) * dv].T  # (B, T, E)
            normed = norm.weight * (c - c.mean(-1, keepdim=True)) / sigma
            rows.append((normed * direction).sum(-1).mean(0))  # (T,)
        out.append(torch.stack(rows))
    return torch.stack(out)


def _recording(model: nn.Module, modules: list[nn.Module], norm: nn.Module, ids: Tensor) -> Any:
    def run() -> tuple[list[Tensor], Tensor]:
        seen: dict[Any, Tensor] = {}
        hooks = [
            m.register_forward_pre_hook(lambda m, a: seen.__setitem__(m, a[0]))
            for m in [*modules, norm]
        ]
        with torch.no_grad():
            model(ids)
        for hook in hooks:
            hook.remove()
        return [seen[m] for m in modules], seen[norm]

    return run


def test_transformer_lm_terms_add_up_and_heads_equal_a_hand_computation(
    device: torch.device,
) -> None:
    lm = _lm(device)
    ids = torch.randint(20, (3, 7), device=device)
    targets = torch.randint(20, (3, 7), device=device)  # a different answer at every position
    got = logit_attribution(lm, ids, targets, wrong=5)
    assert got.heads.shape == (3, 6, 7) and got.mlp.shape == (3, 7)
    with torch.no_grad():
        logits = lm(ids)
    want = (logits.gather(-1, targets[..., None])[..., 0] - logits[..., 5]).mean(0)
    torch.testing.assert_close(got.logit, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.total(), want, rtol=0, atol=1e-12)

    mhas = [block.self_attn for block in lm.blocks]
    direction = lm.head.weight[targets] - lm.head.weight[5]
    projections = [(m.out_proj.weight, m.head_dim) for m in mhas]
    run = _recording(lm, [m.out_proj for m in mhas], lm.norm, ids)
    torch.testing.assert_close(got.heads, _by_hand(projections, lm.norm, run, direction))
    # the feed-forward networks write too; an attention-only model has none
    assert float(got.mlp.abs().max()) > 1e-3
    only = logit_attribution(_lm(device, attn_only=True), ids, 3)
    torch.testing.assert_close(only.mlp, torch.zeros_like(only.mlp), rtol=0, atol=1e-15)
    torch.testing.assert_close(only.total(), only.logit, rtol=0, atol=1e-12)
    assert multihead.logit_attribution is logit_attribution
    layer, head, value = got.top(2, position=-1)[0]
    assert value == float(got.heads[layer, head, -1])
    assert abs(value) == float(got.heads[:, :, -1].abs().max())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_terms_add_up(name: str, device: torch.device) -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(1)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=50, n_embd=24, n_layer=3, n_head=4, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model: Any = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    model = model.to(device, torch.float64).eval()
    ids = torch.randint(50, (2, 6), device=device)
    got = logit_attribution(model, {"input_ids": ids}, 7, wrong=9)
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(got.logit, (logits[..., 7] - logits[..., 9]).mean(0))
    # Llama's RMSNorm computes in float32 whatever the model's dtype
    atol = 1e-12 if name == "gpt2" else 1e-6
    torch.testing.assert_close(got.total(), got.logit, rtol=0, atol=atol)
    if name == "gpt2":  # heads by hand: GPT-2's Conv1D c_proj maps x @ W, W (H·Dv, E)
        blocks = model.transformer.h
        projections = [(block.attn.c_proj.weight.T, 6) for block in blocks]
        run = _recording(model, [b.attn.c_proj for b in blocks], model.transformer.ln_f, ids)
        direction = model.lm_head.weight[7] - model.lm_head.weight[9]
        want = _by_hand(projections, model.transformer.ln_f, run, direction)
        torch.testing.assert_close(got.heads, want)


def test_errors() -> None:
    ids = torch.randint(20, (2, 5))
    with pytest.raises(ValueError, match=r"post-LN \(norm_first=False\)"):
        logit_attribution(TransformerLM(20, 24, 6, 2, 40, max_len=16, norm_first=False), ids, 1)
    lm = TransformerLM(20, 24, 6, 2, 40, max_len=16).eval()
    with pytest.raises(ValueError, match=r"answer must be token ids in \[0, 20\)"):
        logit_attribution(lm, ids, 20)
    with pytest.raises(TypeError, match=r"wrong must be a token id \(int\) or a tensor of ids"):
        logit_attribution(lm, ids, 1, wrong=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"answer must be broadcastable to \(B, T\) = \(2, 5\)"):
        logit_attribution(lm, ids, torch.zeros(3, 1, dtype=torch.long))
    # one id per example, (B,), would broadcast along T: refused, naming the two 2-D spellings
    with pytest.raises(ValueError, match=r"one id per example as \(B, 1\) and one per position"):
        logit_attribution(lm, ids, torch.tensor([1, 2]))
    per_example = logit_attribution(lm, ids, torch.tensor([[1], [2]]))
    first = logit_attribution(lm, ids[:1], 1)
    second = logit_attribution(lm, ids[1:], 2)
    torch.testing.assert_close(per_example.heads, (first.heads + second.heads) / 2)
    with pytest.raises(ValueError, match=r"k must be a positive int, got 0"):
        per_example.top(0)
    with pytest.raises(
        ValueError, match=r"position index 5 is out of range: there are 5 positions"
    ):
        per_example.top(3, position=5)
    encoder = multihead.TransformerEncoder([multihead.TransformerEncoderLayer(24, 6, 40)])
    with pytest.raises(ValueError, match=r"needs a causal LM with an unembedding"):
        logit_attribution(encoder, torch.randn(2, 5, 24), 1)


def test_reduce_none_padding_and_one_position_per_example(device: torch.device) -> None:
    """Issue 30 item 6: ``reduce="none"`` keeps the batch, each row equal to the example run
    alone; the mean leaves padded positions out; ``position`` takes one answer per example."""
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(2)
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=24, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).to(device, torch.float64).eval()
    ids = torch.randint(50, (2, 6), device=device)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]], device=device)
    inputs = {"input_ids": ids, "attention_mask": mask}
    rows = logit_attribution(model, inputs, 7, reduce="none")
    assert rows.heads.shape == (2, 4, 2, 6) and rows.logit.shape == (2, 6)
    for b, n in ((0, 6), (1, 4)):  # right padding: the real positions are the example alone
        alone = logit_attribution(model, ids[b : b + 1, :n], 7)
        torch.testing.assert_close(rows.heads[:, :, b, :n], alone.heads)
        torch.testing.assert_close(rows.mlp[:, b, :n], alone.mlp)
        torch.testing.assert_close(rows.logit[b, :n], alone.logit)
    torch.testing.assert_close(rows.total(), rows.logit, rtol=0, atol=1e-10)
    mean = logit_attribution(model, inputs, 7)
    torch.testing.assert_close(mean.heads[..., :4], rows.heads[..., :4].mean(2))
    # where row 1 is padding only row 0 counts (it was averaged in before)
    torch.testing.assert_close(mean.heads[..., 4:], rows.heads[:, :, 0, 4:])
    torch.testing.assert_close(mean.logit[4:], rows.logit[0, 4:])
    # one answer per example at one position
    answers = torch.tensor([7, 9], device=device)
    last = logit_attribution(model, ids, answers, position=-1, reduce="none")
    assert last.heads.shape == (2, 4, 2, 1)
    for b in range(2):
        alone = logit_attribution(model, ids[b : b + 1], int(answers[b]))
        torch.testing.assert_close(last.heads[:, :, b, 0], alone.heads[..., -1])
        torch.testing.assert_close(last.logit[b, 0], alone.logit[-1])
    layer, head, value = last.top(1)[0]
    assert value == pytest.approx(float(last.heads[layer, head, :, 0].mean()))
    with pytest.raises(ValueError, match="reduce must be one of 'mean', 'none', got 'sum'"):
        logit_attribution(model, ids, 7, reduce="sum")
    with pytest.raises(ValueError, match="position index 6 is out of range"):
        logit_attribution(model, ids, 7, position=6)
