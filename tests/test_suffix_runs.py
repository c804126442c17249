"""Per-position patches run from their position on (multihead.circuits.runs.suffix_runs): equal
to one full forward per patch (record_heads + intervene, written here) for metrics reading any
positions; only the positions a metric reads are unembedded; the cases the runs cannot serve
fall back to whole sequences and say why. (Every site against hook references, per position:
test_site_patching.py, which runs these paths.)"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead import MultiHeadAttention
from multihead.models import TransformerLM

Metric = Callable[[Tensor], Tensor]


def _lm() -> TransformerLM:
    torch.manual_seed(4)
    return TransformerLM(30, 24, 4, 3, 40, max_len=16).to(torch.float64).eval()


def _pair() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(5)
    clean = torch.randint(30, (2, 8), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 11) % 30
    return clean, corrupt


def _loop(model: nn.Module, clean: Any, corrupt: Any, metric: Metric, **call: Any) -> Tensor:
    """(L, H, T): one full forward per patch, head (l, h) at position t from clean (denoising)."""
    sites = multihead.model_map(model).sites
    keys = [(layer, h) for layer, site in enumerate(sites) for h in range(site.num_heads)]
    with torch.no_grad():
        with multihead.record_heads(model, keys) as source:
            model(clean, **call)
        with multihead.record_heads(model, keys) as target:
            model(corrupt, **call)
        base = metric(_logits(model(corrupt, **call))).mean()
        t = corrupt.shape[1]
        out = torch.empty(len(sites), sites[0].num_heads, t, dtype=torch.float64)
        for layer, h in keys:
            for at in range(t):
                patched = target[layer, h].clone()
                patched[:, at] = source[layer, h][:, at]
                with multihead.intervene(model, {(layer, h): patched}):
                    value = metric(_logits(model(corrupt, **call))).mean()
                out[layer, h, at] = value - base
    return out


def _logits(output: Any) -> Tensor:
    return output if isinstance(output, Tensor) else output.logits


METRICS: dict[str, Metric] = {
    "last": lambda logits: logits[:, -1, 3] - logits[:, -1, 5],
    "two positions": lambda logits: logits[:, 5, 1] + logits[:, 2, 7],
    "every position": lambda logits: logits.log_softmax(-1)[..., 4].mean(-1),
}


@pytest.mark.parametrize("name", list(METRICS))
def test_per_position_patches_equal_one_forward_each(name: str) -> None:
    lm = _lm()
    clean, corrupt = _pair()
    got = multihead.patch_heads(lm, clean, corrupt, METRICS[name], per_position=True).values
    want = _loop(lm, clean, corrupt, METRICS[name])
    assert float(want.abs().max()) > 1e-4  # the patches change something
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_only_the_positions_the_metric_reads_are_unembedded() -> None:
    lm = _lm()
    clean, corrupt = _pair()
    rows: list[tuple[int, int]] = []
    lm.head.register_forward_hook(lambda m, a, out: rows.append(tuple(out.shape[:2])))
    got = multihead.patch_heads(
        lm, clean, corrupt, METRICS["two positions"], per_position=True
    ).values
    swept = [r for r in rows if r[0] == 4 * 2]  # the 4 heads' variants of one position, B = 2
    # a run from position t <= 2 reads positions 2 and 5, from 3 to 5 position 5; one from a
    # later position cannot change the metric and runs nothing
    positions = [n for _, n in swept]
    assert sorted(positions) == sorted([2] * 3 * 3 + [1] * 3 * 3)
    assert torch.equal(got[..., 6:], torch.zeros_like(got[..., 6:]))


def test_a_run_that_misplaces_positions_is_not_trusted(caplog: pytest.LogCaptureFixture) -> None:
    class Forgetful(TransformerLM):
        """A model that takes positions but embeds every run from position 0."""

        def forward(self, ids: Tensor, *, positions: Tensor | None = None, **kw: Any) -> Tensor:
            return super().forward(ids, **kw)

    torch.manual_seed(4)
    lm = Forgetful(30, 24, 4, 3, 40, max_len=16).to(torch.float64).eval()
    clean, corrupt = _pair()
    with caplog.at_level(logging.INFO, logger="multihead.circuits.patching.patch_heads"):
        got = multihead.patch_heads(lm, clean, corrupt, METRICS["last"], per_position=True).values
    assert "every per-position patch runs the whole sequence" in caplog.text
    assert "from the whole run's" in caplog.text
    torch.testing.assert_close(got, _loop(lm, clean, corrupt, METRICS["last"]))


def test_cases_the_runs_cannot_serve_say_why(caplog: pytest.LogCaptureFixture) -> None:
    lm = _lm()
    clean, corrupt = _pair()
    with caplog.at_level(logging.INFO, logger="multihead.circuits.patching.patch_heads"):
        multihead.patch_heads(
            lm, clean, corrupt, lambda out: METRICS["last"](out), per_position=True,
            metric_input="output",
        )  # fmt: skip
    assert "the metric reads the whole output, not the logits" in caplog.text


def test_padding_and_sliding_windows_run_whole_sequences(caplog: pytest.LogCaptureFixture) -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    import multihead.hf  # noqa: F401  (registers "multihead")

    torch.manual_seed(6)
    config = transformers.MistralConfig(
        vocab_size=30, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
        attn_implementation="multihead",
    )  # fmt: skip
    model = transformers.MistralForCausalLM(config).to(torch.float64).eval()
    clean, corrupt = _pair()
    with caplog.at_level(logging.INFO, logger="multihead.circuits.patching.patch_heads"):
        got = multihead.patch_heads(
            model, clean, corrupt, METRICS["last"], per_position=True
        ).values
    assert "the model attends through a sliding window shorter than the inputs" in caplog.text
    want = _loop(model, clean, corrupt, METRICS["last"], use_cache=False)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)

    caplog.clear()
    config.sliding_window = None
    model = transformers.MistralForCausalLM(config).to(torch.float64).eval()
    mask = torch.ones_like(clean)
    mask[0, :2] = 0  # left padding
    inputs = [{"input_ids": ids, "attention_mask": mask} for ids in (clean, corrupt)]
    with caplog.at_level(logging.INFO, logger="multihead.circuits.patching.patch_heads"):
        multihead.patch_heads(model, *inputs, METRICS["last"], per_position=True)
    assert "the inputs hold padding (an attention_mask with zeros)" in caplog.text


def test_a_q_k_v_editor_may_put_earlier_keys_before_the_call() -> None:
    torch.manual_seed(7)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).to(torch.float64).eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    seen: dict[str, Tensor] = {}

    def record(call: Any) -> None:
        seen["k"], seen["v"] = call.k, call.v

    with torch.no_grad():
        with mha.register_qkv_editor(record):
            whole = mha(x, is_causal=True)  # (2, 6, 16)

        def earlier(call: Any) -> tuple[Tensor, Tensor, Tensor]:
            return (
                call.q,
                torch.cat([seen["k"][:, :, :4], call.k], 2),
                torch.cat([seen["v"][:, :, :4], call.v], 2),
            )

        with mha.register_qkv_editor(earlier):
            later = mha(x[:, 4:], is_causal=True)  # positions 4 and 5 alone
    torch.testing.assert_close(later, whole[:, 4:], rtol=1e-12, atol=1e-12)
    with mha.register_qkv_editor(earlier), pytest.raises(ValueError, match="returned k of shape"):
        mha(x[:, 4:], mask=torch.ones(2, 2, dtype=torch.bool))  # a mask holds the call's keys


@pytest.mark.parametrize("hits", ["none right", "some right"])
def test_row2_a_top1_accuracy_metric_equals_one_forward_each(hits: str) -> None:
    """Issue 51 row 2: a top-1 accuracy metric, ``(logits[:, -1].argmax(-1) == a).float()``,
    gave every cell 0 (the probes found no position read, so nothing ran)."""
    lm = _lm()
    clean, corrupt = _pair()
    # the answer: what the last position predicts under a patch that changes a prediction
    # (found with one forward per patch, as the reference runs them), so that some cell is not 0
    with torch.no_grad():
        before = lm(corrupt)[:, -1].argmax(-1)  # (2,)
    moved = _loop(lm, clean, corrupt, lambda logits: logits[:, -1].argmax(-1).double())
    assert float(moved.abs().max()) > 0, "no single patch moves a prediction of this model"
    sites = multihead.model_map(lm).sites
    keys = [(layer, h) for layer, site in enumerate(sites) for h in range(site.num_heads)]
    layer, head, at = (int(i) for i in (moved != 0).nonzero()[0])
    with torch.no_grad():
        with multihead.record_heads(lm, keys) as source:
            lm(clean)
        with multihead.record_heads(lm, keys) as target:
            lm(corrupt)
        patched = target[layer, head].clone()
        patched[:, at] = source[layer, head][:, at]
        with multihead.intervene(lm, {(layer, head): patched}):
            after = lm(corrupt)[:, -1].argmax(-1)
    answer = torch.where(after != before, after, (before + 1) % 30)  # no row right unpatched
    if hits == "some right":  # a row the corrupt run predicts right already
        row = int((after == before).nonzero()[0]) if bool((after == before).any()) else 0
        answer[row] = before[row]

    def accuracy(logits: Tensor) -> Tensor:
        return (logits[:, -1].argmax(-1) == answer).float()

    got = multihead.patch_heads(lm, clean, corrupt, accuracy, per_position=True).values
    want = _loop(lm, clean, corrupt, accuracy)
    assert float(want.abs().max()) > 0
    torch.testing.assert_close(got.double(), want, rtol=0, atol=0)


# -- issue 51 row 16: a rotary that embeds positions by the run's length ----------------------

_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
_DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def _rotary_llama(rope: dict[str, Any], dtype: torch.dtype) -> Any:
    """A tiny random Llama of 8 embedded positions, weights large enough for effects of tenths."""
    transformers = pytest.importorskip("transformers", minversion="5")
    import multihead.hf  # noqa: F401  (registers "multihead")

    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
        rope_parameters=dict(rope), initializer_range=0.2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _long_pair() -> tuple[Tensor, Tensor]:
    """Two inputs of 20 tokens (past 2 × the 8 embedded positions), differing at position 1."""
    generator = torch.Generator().manual_seed(5)
    clean = torch.randint(40, (2, 20), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 1] = (corrupt[:, 1] + 7) % 40
    return clean, corrupt


def _by_hand_heads(model: Any, clean: Tensor, corrupt: Tensor, metric: Metric) -> Tensor:
    """(L, H, T) float64: one whole 20-token forward per patch, head h's slice of o_proj's input
    at position t taken from the clean run by a forward pre-hook (no multihead involved)."""
    layers = model.model.layers
    heads, width = model.config.num_attention_heads, model.config.head_dim
    seen: dict[int, Tensor] = {}

    def keep(layer: int) -> Any:
        return lambda m, args: seen.__setitem__(layer, args[0].detach().clone())  # (B, T, H·D)

    with torch.no_grad():
        hooks = [
            la.self_attn.o_proj.register_forward_pre_hook(keep(i)) for i, la in enumerate(layers)
        ]
        model(clean, use_cache=False)
        for hook in hooks:
            hook.remove()
        base = metric(model(corrupt, use_cache=False).logits).mean()
        t = corrupt.shape[1]
        out = torch.empty(len(layers), heads, t, dtype=torch.float64)
        for layer, h, at in (
            (la, h, at) for la in range(len(layers)) for h in range(heads) for at in range(t)
        ):
            cut = slice(h * width, (h + 1) * width)

            def put(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                x = args[0].clone()
                x[:, at, cut] = seen[layer][:, at, cut]  # noqa: B023  (used within the loop)
                return (x, *args[1:])

            hook = layers[layer].self_attn.o_proj.register_forward_pre_hook(put)
            value = metric(model(corrupt, use_cache=False).logits).mean()
            hook.remove()
            out[layer, h, at] = value - base
    return out


def _by_hand_mlp_out(model: Any, clean: Tensor, corrupt: Tensor, metric: Metric) -> Tensor:
    """(L, T) float64: one whole forward per patch, layer l's feed-forward write (its mlp's
    output) at position t taken from the clean run by a forward hook."""
    layers = model.model.layers
    seen: dict[int, Tensor] = {}

    def keep(layer: int) -> Any:
        return lambda m, args, out: seen.__setitem__(layer, out.detach().clone())  # (B, T, E)

    with torch.no_grad():
        hooks = [la.mlp.register_forward_hook(keep(i)) for i, la in enumerate(layers)]
        model(clean, use_cache=False)
        for hook in hooks:
            hook.remove()
        base = metric(model(corrupt, use_cache=False).logits).mean()
        t = corrupt.shape[1]
        out = torch.empty(len(layers), t, dtype=torch.float64)
        for layer, at in ((la, at) for la in range(len(layers)) for at in range(t)):

            def put(m: nn.Module, args: tuple[Any, ...], written: Tensor) -> Tensor:
                x = written.clone()
                x[:, at] = seen[layer][:, at]  # noqa: B023  (used within the loop)
                return x

            hook = layers[layer].mlp.register_forward_hook(put)
            value = metric(model(corrupt, use_cache=False).logits).mean()
            hook.remove()
            out[layer, at] = value - base
    return out


@pytest.mark.parametrize("function", ["patch_heads", "patch mlp_out"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_row16_dynamic_rotary_past_twice_the_positions_equals_whole_sequences(
    function: str, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 51 row 16: on a dynamic (NTK) rotary Llama given 20 tokens, past 2 ×
    ``max_position_embeddings`` = 8, the fast path's early positions were off (up to 0.02 on
    effects of 0.4 here): a run of one position resets transformers' stateful rotary, which
    the whole sequence rescales. Now every patch runs the whole sequence, and the log says why."""
    model = _rotary_llama(_DYNAMIC, dtype)
    clean, corrupt = _long_pair()
    metric = METRICS["last"]
    assert multihead.model_map(model).positions_by_length
    with caplog.at_level(logging.INFO, logger="multihead.circuits.patching"):
        if function == "patch_heads":
            got = multihead.patch_heads(model, clean, corrupt, metric, per_position=True).values
            want = _by_hand_heads(model, clean, corrupt, metric)
        else:
            got = multihead.patch(
                model, clean, corrupt, metric, site="mlp_out", per_position=True
            ).values
            want = _by_hand_mlp_out(model, clean, corrupt, metric)
    assert float(want.abs().max()) > 0.1
    # the early positions' patches (where a one-position run resets the rotary) change the
    # metric by far more than the tolerance
    assert float(want[..., 1:7].abs().max()) > 1e-3
    assert "every per-position patch runs the whole sequence" in caplog.text
    assert "embeds positions by the run's length" in caplog.text
    tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tolerance)


def test_row16_a_rotary_of_fixed_frequencies_keeps_the_fast_path() -> None:
    """Issue 51 row 16's other side: the same Llama with the default rotary is not marked, runs
    later positions alone (runs shorter than the 20 tokens reach the embedding), and equals the
    whole-sequence effects; multihead's own models are not marked either."""
    model = _rotary_llama(_DEFAULT, torch.float64)
    clean, corrupt = _long_pair()
    metric = METRICS["last"]
    assert not multihead.model_map(model).positions_by_length
    assert not multihead.model_map(_lm()).positions_by_length
    widths: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: widths.append(out.shape[1])
    )
    got = multihead.patch_heads(model, clean, corrupt, metric, per_position=True).values
    hook.remove()
    assert min(widths) < 20  # a run of later positions alone: the fast path
    want = _by_hand_heads(model, clean, corrupt, metric)
    assert float(want.abs().max()) > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


_LONGROPE = {
    "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
    "rope_theta": 10000.0,
}  # fmt: skip


@pytest.mark.parametrize(
    "family, rope, marked",
    [
        ("llama", _DEFAULT, False),
        ("llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, False),
        ("llama", _DYNAMIC, True),
        ("llama", {"type": "dynamic", "factor": 2.0}, True),  # rope_scaling's legacy key
        ("phi3", _LONGROPE, True),  # switches factors at original_max_position_embeddings
        ("gemma3", _DEFAULT, False),  # one rope per layer type: the full layers' given here
        ("gemma3", _DYNAMIC, True),
    ],
    ids=["default", "linear", "dynamic", "legacy dynamic", "longrope", "gemma3", "gemma3 dynamic"],
)
def test_row16_the_map_marks_a_rotary_by_the_runs_length(
    family: str, rope: dict[str, Any], marked: bool
) -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    import multihead.hf  # noqa: F401  (registers "multihead")

    shape: dict[str, Any] = dict(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, rope_scaling=rope))
    elif family == "phi3":
        config = transformers.Phi3Config(
            **shape, max_position_embeddings=16, original_max_position_embeddings=8,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_parameters=rope,
        )  # fmt: skip
        model = transformers.Phi3ForCausalLM(config)
    else:
        per_type = {"sliding_attention": _DEFAULT, "full_attention": {**rope, "rope_theta": 1e6}}
        config = transformers.Gemma3TextConfig(**shape, head_dim=8, rope_parameters=per_type)
        model = transformers.Gemma3ForCausalLM(config)
    assert multihead.model_map(model).positions_by_length is marked
