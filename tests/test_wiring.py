"""Each layer's wiring (multihead.circuits.runs.wiring): found in one run, for any family, and
kept with the model's map for every function after.

References are the modules themselves, reached by the attribute names each family gives them
(``input_layernorm``, ``c_attn``, ``out_proj``, ...), which the finder never reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead.circuits.runs.wiring import Wiring, WiringRun
from multihead.models import TransformerLM
from multihead.observers import registered

V = 50


def _found(model: nn.Module, ids: Tensor) -> Wiring:
    run = WiringRun(multihead.model_map(model))
    with registered(run.hooks()), torch.no_grad():
        model(ids)
    return run.wiring


def _own(device: torch.device) -> tuple[nn.Module, list[dict[str, Any]]]:
    lm = TransformerLM(V, 16, 2, 2, 32, max_len=16).to(device).eval()
    return lm, [
        dict(
            attention=b.self_attn,
            norm=b.norm1,
            inputs=(b.self_attn.qkv_proj,),
            projection=b.self_attn.out_proj,
            post_norms=(),
            mlp_norm=b.norm2,
        )
        for b in lm.blocks
    ]


def _transformers(name: str, device: torch.device) -> tuple[nn.Module, list[dict[str, Any]]]:
    transformers = pytest.importorskip("transformers", minversion="5")
    decoder = dict(
        vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=12,
    )  # fmt: skip
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=V, n_embd=24, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
        gpt2 = transformers.GPT2LMHeadModel(config).to(device).eval()
        return gpt2, [
            dict(
                attention=b.attn,
                norm=b.ln_1,
                inputs=(b.attn.c_attn,),
                projection=b.attn.c_proj,
                post_norms=(),
                mlp_norm=b.ln_2,
            )
            for b in gpt2.transformer.h
        ]
    if name == "bert":  # post-LN: no norm before the attention, the projection outside its site
        config = transformers.BertConfig(
            vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=2,
        )  # fmt: skip
        bert = transformers.BertModel(config).to(device).eval()
        return bert, [
            dict(
                attention=b.attention,
                norm=None,
                inputs=(b.attention.self.query, b.attention.self.key, b.attention.self.value),
                projection=None,
                mlp_norm=None,
            )
            for b in bert.encoder.layer
        ]
    if name == "llama":
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder))
        layers, mlp_norm, post = llama.model.layers, "post_attention_layernorm", None
    else:  # Gemma-2's sandwich: a norm after the attention, another before the MLP
        config = transformers.Gemma2Config(**decoder, sliding_window=4)
        llama = transformers.Gemma2ForCausalLM(config)
        layers, mlp_norm, post = llama.model.layers, "pre_feedforward_layernorm", "post_att"
    return llama.to(device).eval(), [
        dict(
            attention=b.self_attn,
            norm=b.input_layernorm,
            inputs=(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj),
            projection=b.self_attn.o_proj,
            post_norms=(b.post_attention_layernorm,) if post else (),
            mlp_norm=getattr(b, mlp_norm),
        )
        for b in layers
    ]


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, tuple):
        return len(got) == len(want) and all(g is w for g, w in zip(got, want, strict=True))
    return got is want


BUILDERS: dict[str, Callable[[torch.device], tuple[nn.Module, list[dict[str, Any]]]]] = {
    "own": _own,
    "gpt2": lambda d: _transformers("gpt2", d),
    "llama": lambda d: _transformers("llama", d),
    "gemma2": lambda d: _transformers("gemma2", d),
    "bert": lambda d: _transformers("bert", d),
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_wiring_is_each_familys_own_modules(name: str, device: torch.device) -> None:
    torch.manual_seed(0)
    model, expected = BUILDERS[name](device)
    wiring = _found(model, torch.randint(V, (2, 5), device=device))
    assert len(wiring.layers) == len(expected)
    for layer, (wired, want) in enumerate(zip(wiring.layers, expected, strict=True)):
        for field, module in want.items():
            assert _same(getattr(wired, field), module), (layer, field)
        assert wired.width == 24 if name != "own" else wired.width == 16
        if want["norm"] is not None:
            assert wired.norm_eps == pytest.approx(
                getattr(want["norm"], "eps", None) or want["norm"].variance_epsilon
            )


def test_wiring_is_found_once_and_kept_with_the_map(device: torch.device) -> None:
    model, _ = _own(device)
    ids = torch.randint(V, (1, 6), device=device)
    mapped = multihead.model_map(model)
    assert Wiring.known(mapped) is None
    first = _found(model, ids)
    assert Wiring.known(mapped) is first
    # a later run reads it: no hook at all unless post-norms are recorded (there are none)
    later = WiringRun(mapped)
    assert list(later.hooks()) == []
    assert later.wiring is first
    # every function after reads the kept wiring: none finds it again
    multihead.logit_attribution(model, ids, 3)
    multihead.qk_attribution(model, ids, layer=1, head=0, query=-1)
    multihead.cache(model, ids, names=[("result", 0)])
    assert Wiring.known(mapped) is first
    rebuilt = multihead.model_map(model, rebuild=True)  # modules may have changed: found again
    assert Wiring.known(rebuilt) is None


def test_a_run_through_some_layers_keeps_nothing(device: torch.device) -> None:
    model, _ = _own(device)
    mapped = multihead.model_map(model)
    last = mapped.blocks[-1].module

    class Stop(Exception):
        pass

    def stop(m: nn.Module, args: Any) -> None:
        raise Stop

    run = WiringRun(mapped)
    with registered([last.register_forward_pre_hook(stop), *run.hooks()]), torch.no_grad():
        with pytest.raises(Stop):
            model(torch.randint(V, (1, 4), device=device))
    assert run.wiring.layers[0].projection is model.blocks[0].self_attn.out_proj
    assert run.wiring.layers[1].projection is None  # never ran
    assert Wiring.known(mapped) is None


def test_post_norms_are_recorded_on_a_known_wiring(device: torch.device) -> None:
    """Gemma-2's post-attention norm: its input and output at each run, the first run finding
    it and a later one hooking it alone."""
    torch.manual_seed(0)
    model, expected = _transformers("gemma2", device)
    mapped = multihead.model_map(model)
    for _ in range(2):  # found, then known
        seen: list[tuple[Tensor, Tensor]] = []
        norm = expected[1]["post_norms"][0]
        keep = seen.append
        reference = norm.register_forward_hook(lambda m, a, out, keep=keep: keep((a[0], out)))
        run = WiringRun(mapped, post_norms=True)
        with registered([reference, *run.hooks()]), torch.no_grad():
            model(torch.randint(V, (1, 5), device=device))
        written = run.written(1)
        assert written is not None and torch.equal(written, seen[0][1])
        frozen = run.post_norm(1, "test", torch.finfo(torch.float32).eps, torch.float32)
        assert frozen is not None
        torch.testing.assert_close(frozen.linear(seen[0][0]), seen[0][1])
