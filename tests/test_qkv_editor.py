"""The q/k/v editor channel: ``register_qkv_editor(fn)`` replaces a head's queries, keys or values
before attention, on MultiHeadAttention (dense and packed) and on transformers models alike.

References are computed by hand: the projections read off the module's parameters, the edited
head's tensors swapped in, attention by the naive float64 loop of ``reference.py`` (or
``torch.nn.functional.scaled_dot_product_attention`` on one head for transformers models), then
the output projection. Sizes are pairwise distinct (B=2, T=5, E=24, H=4, Hk=2, D=6).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from devices import generator
from reference import reference_attention
from torch import Tensor, nn

from multihead import MultiHeadAttention
from multihead.observers import AttentionCall
from multihead.packing import PackedBatch

B, T, E, H, HK, D = 2, 5, 24, 4, 2, 6
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _module(device: torch.device) -> MultiHeadAttention:
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H, num_kv_heads=HK, head_dim=D).to(device).eval()
    with torch.no_grad():  # biases start at zero: give them values worth checking
        assert mha.qkv_proj is not None and mha.qkv_proj.bias is not None
        mha.qkv_proj.bias.normal_()
    return mha


def _heads(mha: MultiHeadAttention, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, T, D), k and v (B, Hk, T, D) of self-attention, in float64, read off the
    documented parameter layout: ``qkv_proj``'s rows are [q heads | k heads | v heads]."""
    assert mha.qkv_proj is not None and mha.qkv_proj.bias is not None
    w, b = mha.qkv_proj.weight.double(), mha.qkv_proj.bias.double()
    qkv = x.double() @ w.T + b  # (B, T, (H + 2·Hk)·D)
    q, k, v = qkv.split([H * D, HK * D, HK * D], -1)

    def split(t: Tensor, n: int) -> Tensor:
        return t.view(t.shape[0], t.shape[1], n, D).transpose(1, 2)

    return split(q, H), split(k, HK), split(v, HK)


def _output(mha: MultiHeadAttention, heads: Tensor) -> Tensor:
    """out_proj of the per-head output (B, H, T, D) in float64 -> (B, T, E)."""
    merged = heads.transpose(1, 2).flatten(2)  # (B, T, H·D)
    return merged @ mha.out_proj.weight.double().T + mha.out_proj.bias.double()


def _per_query_head(t: Tensor) -> Tensor:
    """(B, Hk, S, D) -> (B, H, S, D): query head h reads key/value head h // (H // Hk). A tensor
    already per query head (an earlier editor's) stays as it is."""
    return t.repeat_interleave(H // HK, dim=1) if t.shape[1] == HK else t.clone()


EDITS = [("q", 1), ("k", 2), ("v", 3), ("k", 0)]


def _editor(which: str, head: int, new: Tensor) -> Any:
    """An editor that puts ``new`` (B, T, D) in place of ``which`` of query head ``head``; k and
    v come back per query head (H of them), so the head's sibling keeps its own."""

    def edit(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = call.q.clone(), _per_query_head(call.k), _per_query_head(call.v)
        {"q": q, "k": k, "v": v}[which][:, head] = new
        return q, k, v

    return edit


def _reference(
    mha: MultiHeadAttention,
    x: Tensor,
    which: str,
    head: int,
    new: Tensor,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """(output (B, T, E), per-head output (B, H, T, D)) with ``which`` of ``head`` replaced."""
    q, k, v = _heads(mha, x)
    k, v = _per_query_head(k), _per_query_head(v)
    {"q": q, "k": k, "v": v}[which][:, head] = new.double()
    mask = key_mask[:, None, None, :] if key_mask is not None else None
    heads, _ = reference_attention(q, k, v, mask=mask, is_causal=is_causal)
    return _output(mha, heads), heads


@pytest.mark.parametrize(("which", "head"), EDITS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_editing_one_head_equals_attention_with_it_swapped(
    which: str, head: int, is_causal: bool, device: torch.device
) -> None:
    mha = _module(device)
    g = generator(1, device)
    x = torch.randn(B, T, E, generator=g, device=device)
    new = torch.randn(B, T, D, generator=g, device=device)
    with torch.no_grad():
        plain = mha(x, is_causal=is_causal)
        handle = mha.register_qkv_editor(_editor(which, head, new))
        got = mha(x, is_causal=is_causal)
        want, _ = _reference(mha, x, which, head, new, is_causal=is_causal)
        handle.remove()
        again = mha(x, is_causal=is_causal)
    assert (got.double() - plain.double()).abs().max() > 1e-3  # the edit changed the output
    torch.testing.assert_close(got.double(), want, **TOL)
    assert not mha.observers and len(mha.observers) == 0
    assert torch.equal(again, plain)  # removed: the plain forward again


@pytest.mark.parametrize(("which", "head"), EDITS)
def test_editing_on_the_packed_path_equals_the_padded_reference(
    which: str, head: int, device: torch.device
) -> None:
    """Ragged batch (packing=): the editor sees batch order, as the padded call."""
    mha = _module(device)
    g = generator(2, device)
    b = 3
    key_mask = torch.tensor(
        [[True] * 3 + [False] * 2, [True] * 5, [True] * 4 + [False]], device=device
    )
    packing = PackedBatch(key_mask)
    assert packing.order.tolist() != list(range(b))  # sorted unlike the batch
    x = torch.randn(b, T, E, generator=g, device=device)
    new = torch.randn(b, T, D, generator=g, device=device)
    mha.register_qkv_editor(_editor(which, head, new))
    with torch.no_grad():
        got = mha(packing.pack(x), packing=packing, is_causal=True)  # (N, E)
        want, _ = _reference(mha, x, which, head, new, key_mask=key_mask, is_causal=True)
        dense = mha(x, key_mask=key_mask, is_causal=True)
    torch.testing.assert_close(got.double(), packing.pack(want), **TOL)
    torch.testing.assert_close(got, packing.pack(dense), **TOL)


def test_observers_see_the_edited_call_and_can_still_replace_the_output(
    device: torch.device,
) -> None:
    mha = _module(device)
    g = generator(3, device)
    x = torch.randn(B, T, E, generator=g, device=device)
    new = torch.randn(B, T, D, generator=g, device=device)
    seen: list[tuple[Tensor, Tensor]] = []

    def observer(call: AttentionCall, out: Tensor) -> Tensor:
        seen.append((call.k.clone(), out.clone()))
        out = out.clone()
        out[:, :, 3] = 0.0  # and ablate head 3 on top of the edit
        return out

    # registered before the editor: editors run before attention, observers after, whatever
    # the order of registration
    mha.register_observer(observer)
    mha.register_qkv_editor(_editor("k", 2, new))
    with torch.no_grad():
        got = mha(x)
    _, heads = _reference(mha, x, "k", 2, new)
    ((k_seen, out_seen),) = seen
    assert k_seen.shape == (B, H, T, D)  # the replacement, per query head
    torch.testing.assert_close(k_seen[:, 2], new, **TOL)
    torch.testing.assert_close(out_seen.double(), heads.transpose(1, 2), **TOL)
    heads[:, 3] = 0.0
    torch.testing.assert_close(got.double(), _output(mha, heads), **TOL)
    assert len(mha.observers) == 2


def test_editors_chain_in_registration_order(device: torch.device) -> None:
    mha = _module(device)
    g = generator(4, device)
    x = torch.randn(B, T, E, generator=g, device=device)
    first, second = torch.randn(2, B, T, D, generator=g, device=device)
    order: list[int] = []

    def one(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
        order.append(1)
        return _editor("v", 1, first)(call)

    def two(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor] | None:
        order.append(2)
        assert call.v.shape[1] == H and torch.equal(call.v[:, 1], first)  # sees the first edit
        return _editor("v", 0, second)(call)

    mha.register_qkv_editor(one)
    mha.register_qkv_editor(two)
    with torch.no_grad():
        got = mha(x)
    q, k, v = _heads(mha, x)
    k, v = _per_query_head(k), _per_query_head(v)
    v[:, 1], v[:, 0] = first.double(), second.double()
    heads, _ = reference_attention(q, k, v)
    assert order == [1, 2]
    torch.testing.assert_close(got.double(), _output(mha, heads), **TOL)


def test_an_editor_returning_none_changes_nothing_and_plain_forward_builds_no_call(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    mha = _module(device)
    x = torch.randn(B, T, E, device=device)
    built: list[int] = []
    init = AttentionCall.__init__

    def counting(self: AttentionCall, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(AttentionCall, "__init__", counting)
    with torch.no_grad():
        plain = mha(x)
        assert built == []  # nothing registered: no call is built, nothing extra runs
        with mha.register_qkv_editor(lambda call: None):
            assert torch.equal(mha(x), plain)
        assert built == [1] and not mha.observers


def test_bad_editors_and_returns_are_refused(device: torch.device) -> None:
    mha = _module(device)
    x = torch.randn(B, T, E, device=device)
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        mha.register_qkv_editor(3)  # type: ignore[arg-type]
    assert not mha.observers

    def returning(value: Any) -> Any:
        return lambda call: value(call)

    cases = [
        (lambda c: c.q, r"must return None or a tuple \(q, k, v\) of tensors, got Tensor"),
        (
            lambda c: (c.q, c.k),
            r"must return None or a tuple \(q, k, v\) of tensors, got a tuple of 2",
        ),
        (
            lambda c: (c.q[:, :3], c.k, c.v),
            r"returned q of shape \(2, 3, 5, 6\), expected \(B, H, T, D\) = \(2, 4, 5, 6\)",
        ),
        (
            lambda c: (c.q, c.k[:, :1], c.v),
            r"returned k of shape \(2, 1, 5, 6\), expected \(B, Hk or H, S, D\) = "
            r"\(2, 2 or 4, 5, 6\)",
        ),
        (
            lambda c: (c.q, c.k, c.v.double()),
            r"returned v as torch.float64 on .*, expected the call's torch.float32",
        ),
    ]
    for edit, message in cases:
        with mha.register_qkv_editor(returning(edit)), pytest.raises(ValueError, match=message):
            mha(x)
    assert not mha.observers


# -- transformers models ----------------------------------------------------------------------

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _hf_model(kind: str, device: torch.device) -> nn.Module:
    transformers = pytest.importorskip("transformers", minversion="5")
    pytest.importorskip("multihead.hf")
    torch.manual_seed(0)
    if kind == "llama":  # grouped-query heads: 4 query heads on 2 key/value heads
        config = transformers.LlamaConfig(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    else:
        config = transformers.GPT2Config(vocab_size=100, n_embd=48, n_layer=2, n_head=4)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device).eval()


def _site(model: nn.Module, layer: int) -> Any:
    from multihead.observe import attention_modules

    return attention_modules(model)[layer][1]


def _run(model: nn.Module, ids: Tensor, site: Any) -> tuple[Tensor, AttentionCall, Tensor]:
    """(logits, the site's call, its per-head output (B, T, H, Dv)) of one forward."""
    seen: list[tuple[AttentionCall, Tensor]] = []
    with site.register_observer(lambda call, out: seen.append((call, out.clone()))):
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    ((call, out),) = seen
    return logits, call, out


def _one_head(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of one head in float64: q (B, T, D), k (B, S, D), v (B, S, Dv)."""
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, scale=scale
    )


def test_hf_gqa_editing_one_query_heads_keys_leaves_its_sibling_untouched(
    device: torch.device,
) -> None:
    model = _hf_model("llama", device)
    site = _site(model, 1)  # the last layer: what it computes is the observed output
    ids = torch.randint(0, 100, (B, 7), generator=generator(5, device), device=device)
    logits, call, out = _run(model, ids, site)
    assert call.k.shape[1] == 2 and call.q.shape[1] == 4  # grouped: heads 0, 1 read kv head 0
    new = torch.randn(call.k[:, 0].shape, generator=generator(6, device), device=device)

    def edit(c: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
        k = c.k.repeat_interleave(2, dim=1)  # (B, H, S, D)
        k[:, 0] = new
        return c.q, k, c.v  # values stay per key/value head

    with site.register_qkv_editor(edit):
        edited_logits, edited_call, edited_out = _run(model, ids, site)
    assert model.config._attn_implementation == "sdpa"  # restored after the last removal
    assert not site.observers
    # the sibling on the same key/value head, and the other group: bit for bit on the CPU; on a
    # GPU the expanded keys take another attention kernel, whose rounding may differ by an ulp
    exact = {"rtol": 0.0, "atol": 0.0 if device.type == "cpu" else 1e-6}
    for head in (1, 2, 3):
        torch.testing.assert_close(edited_out[:, :, head], out[:, :, head], **exact)
    # the edited head: q of the plain run (after rotary) against the new keys, by hand
    want = _one_head(call.q[:, 0], new, call.v[:, 0], call.scale)  # (B, T, Dv)
    torch.testing.assert_close(edited_out[:, :, 0].double(), want, **TOL)
    assert torch.equal(edited_call.k[:, 0], new) and torch.equal(edited_call.k[:, 1], call.k[:, 0])
    assert (edited_logits - logits).abs().max() > 1e-4
    after, _, _ = _run(model, ids, site)
    assert torch.equal(after, logits)  # removed: the plain forward again


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_hf_gpt2_editing_one_head_equals_attention_with_it_swapped(
    which: str, device: torch.device
) -> None:
    model = _hf_model("gpt2", device)
    site = _site(model, 0)
    ids = torch.randint(0, 100, (B, 6), generator=generator(7, device), device=device)
    logits, call, out = _run(model, ids, site)
    head = 2
    index = {"q": 0, "k": 1, "v": 2}[which]
    new = torch.randn(call.q[:, head].shape, generator=generator(8, device), device=device)

    def edit(c: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
        qkv = [c.q.clone(), c.k.clone(), c.v.clone()]
        qkv[index][:, head] = new
        return qkv[0], qkv[1], qkv[2]

    with site.register_qkv_editor(edit):
        edited_logits, _, edited_out = _run(model, ids, site)
    swapped = [call.q[:, head], call.k[:, head], call.v[:, head]]
    swapped[index] = new
    want = _one_head(*swapped, call.scale)
    torch.testing.assert_close(edited_out[:, :, head].double(), want, **TOL)
    others = [h for h in range(4) if h != head]
    assert torch.equal(edited_out[:, :, others], out[:, :, others])
    assert (edited_logits - logits).abs().max() > 1e-4  # layer 0's edit reaches the logits
    assert torch.equal(_run(model, ids, site)[0], logits)
