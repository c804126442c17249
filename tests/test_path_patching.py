"""Path patching (path_patching) against independent references.

- By hand, on a two-layer attention-only TransformerLM with grouped-query heads: the model's
  forward rewritten from its parameters in float64 (embeddings, LayerNorm, per-query-head q/k/v,
  causal softmax, output projection), layer 0's heads computed on clean and corrupt, the
  receiver's input rebuilt from the residual stream with the sender's share swapped, layer 1
  recomputed, the metric applied. Nothing of multihead runs but the model's parameters.
- By torch hooks, on deeper models with feed-forward networks (TransformerLM, BertModel, GPT-2,
  a Llama): forward pre-hooks on each layer's output projection replace per-head slices of its
  input (the sender's from corrupt, every later head's frozen at clean), forward hooks on the
  q/k/v projections record and replace one head's columns. A grouped-query Llama is compared with
  its copy whose key/value heads are repeated per query head (the same function; there, one
  query head's keys have their own columns), so the siblings of a receiver must stay untouched.
- The whole of Wang et al., by the same hooks (run 1 freezing every head from the sender's
  layer on, run 2 replacing every head of a set at once, at its positions; a hook on the
  feed-forward module replacing its output for an MLP sender; the logits measured on run 1):
  receivers at chosen positions, a set across two layers, the logits, MLP senders, both
  directions, on TransformerLM, GPT-2 and a grouped-query Llama (kv="query_head" against its
  per-query-head copy, kv="shared" against its own key/value columns).
- A model built so that a sender reaches the metric only through a receiver's keys: via k is
  large, via q and v are zero (to rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import multihead
from multihead import MultiHeadAttention
from multihead.circuits.paths.path_patching import path_patching
from multihead.models import TransformerLM

VIA = ("q", "k", "v")


def _run(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _last_logprob(token: int) -> Callable[[Any], Tensor]:
    def metric(out: Any) -> Tensor:
        logits = out if isinstance(out, Tensor) else out.logits
        return logits[:, -1].log_softmax(-1)[:, token]  # (B,): averaged

    return metric


def _bigger(model: nn.Module, std: float) -> None:
    """Matrices (embeddings, projections) drawn from N(0, std²), norms and biases left: larger
    effects than the inits' (well above rounding)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)


def _compare(got: Tensor, want: Tensor, atol: float = 2e-5) -> None:
    assert got.shape == want.shape
    assert want.nan_to_num().abs().max() > 1e-3, "the reference is all ~0: nothing is tested"
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=1e-4, equal_nan=True)


# -- by hand: a two-layer attention-only model --------------------------------------------------

V, E, H, HK, D, T = 20, 24, 4, 2, 6, 7


def _attn_only(device: torch.device) -> TransformerLM:
    torch.manual_seed(0)
    lm = TransformerLM(V, E, H, 2, 1, max_len=16, num_kv_heads=HK, attn_only=True)
    with torch.no_grad():  # larger weights than the init's: effects well above rounding
        for p in lm.parameters():
            p.normal_(0, 0.5)
    return lm.to(device).eval()


class _Hand:
    """The attention-only TransformerLM's forward, by hand, in float64."""

    def __init__(self, lm: TransformerLM) -> None:
        self.p = {name: t.detach().double() for name, t in lm.named_parameters()}

    def embed(self, ids: Tensor) -> Tensor:
        p = self.p
        return (
            p["token_embedding.weight"][ids]
            + p["position_embedding.embedding.weight"][: ids.shape[1]]
        )  # (B, T, E)

    def qkv(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, H, T, D) of every query head (k, v: its key/value head's)."""
        p, pre = self.p, f"blocks.{layer}."
        a = F.layer_norm(x, (E,), p[pre + "norm1.weight"], p[pre + "norm1.bias"], 1e-5)
        qkv = a @ p[pre + "self_attn.qkv_proj.weight"].T + p[pre + "self_attn.qkv_proj.bias"]
        q, k, v = qkv.split([H * D, HK * D, HK * D], -1)

        def heads(t: Tensor, n: int) -> Tensor:
            return t.unflatten(-1, (n, D)).transpose(1, 2)  # (B, n, T, D)

        group = H // HK
        return (
            heads(q, H),
            heads(k, HK).repeat_interleave(group, 1),
            heads(v, HK).repeat_interleave(group, 1),
        )

    @staticmethod
    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return scores.masked_fill(~causal, -math.inf).softmax(-1) @ v  # (B, H, T, D)

    def write(self, layer: int, z: Tensor) -> Tensor:
        """What the layer's heads z (B, H, T, D) add to the residual stream (B, T, E)."""
        p, pre = self.p, f"blocks.{layer}.self_attn."
        return (
            z.transpose(1, 2).flatten(2) @ p[pre + "out_proj.weight"].T + p[pre + "out_proj.bias"]
        )

    def logits(self, x: Tensor) -> Tensor:
        p = self.p
        return F.layer_norm(x, (E,), p["norm.weight"], p["norm.bias"], 1e-5) @ p["head.weight"].T

    def path(
        self, clean: Tensor, corrupt: Tensor, sender: int, receiver: int, kind: str, siblings: bool
    ) -> Tensor:
        """(logits of run 2, clean logits): sender (0, sender) -> receiver (1, receiver) via
        kind; with ``siblings`` the whole key/value head is replaced (a wrong reference)."""
        x0 = self.embed(clean)
        z_clean = self.attend(*self.qkv(0, x0))  # (B, H, T, D)
        z_corrupt = self.attend(*self.qkv(0, self.embed(corrupt)))
        z_patched = z_clean.clone()
        z_patched[:, sender] = z_corrupt[:, sender]
        # layer 1's input: the sender's share from corrupt, every other head's clean
        x1 = x0 + self.write(0, z_clean)
        x1_patched = x0 + self.write(0, z_patched)
        qkv = list(self.qkv(1, x1))
        patched = self.qkv(1, x1_patched)
        i = VIA.index(kind)
        heads = [receiver]
        if siblings and kind != "q":
            group = H // HK
            heads = list(range(receiver // group * group, (receiver // group + 1) * group))
        qkv[i] = qkv[i].clone()
        qkv[i][:, heads] = patched[i][:, heads]
        run2 = self.logits(x1 + self.write(1, self.attend(*qkv)))
        return run2

    def clean_logits(self, clean: Tensor) -> Tensor:
        x0 = self.embed(clean)
        x1 = x0 + self.write(0, self.attend(*self.qkv(0, x0)))
        return self.logits(x1 + self.write(1, self.attend(*self.qkv(1, x1))))


def test_against_a_hand_recomputation(device: torch.device) -> None:
    lm = _attn_only(device)
    clean = torch.randint(V, (3, T), device=device)
    corrupt = torch.randint(V, (3, T), device=device)
    metric = _last_logprob(5)
    hand = _Hand(lm)
    senders = [(0, h) for h in range(H)]
    receivers = [(1, h) for h in range(H)]
    result = path_patching(lm, clean, corrupt, metric, senders, receivers)
    got = result.values
    assert got.shape == (H, H, 3) and got.dtype == torch.float32

    base = metric(hand.clean_logits(clean)).mean()
    # the result names its axes and cells, and carries the two runs' metrics
    assert result.dims == ("sender", "receiver", "via") and result.direction == "noise"
    assert result.names == (
        tuple(f"L0H{h}" for h in range(H)),
        tuple(f"L1H{h}" for h in range(H)),
        VIA,
    )
    assert result.label((2, 1, 1)) == "L0H2 -> L1H1.k"
    assert result.clean == pytest.approx(float(base), abs=1e-5)
    assert result.corrupt == pytest.approx(
        float(metric(hand.clean_logits(corrupt)).mean()), abs=1e-5
    )
    want = torch.zeros(H, H, 3, dtype=torch.float64)
    wrong = torch.zeros(H, H, 3, dtype=torch.float64)
    for s in range(H):
        for r in range(H):
            for i, kind in enumerate(VIA):
                want[s, r, i] = metric(hand.path(clean, corrupt, s, r, kind, False)).mean() - base
                wrong[s, r, i] = metric(hand.path(clean, corrupt, s, r, kind, True)).mean() - base
    _compare(got, want.to(got.device))
    # replacing the whole key/value head (the sibling's keys too) gives other numbers
    assert (wrong[:, :, 1:] - want[:, :, 1:]).abs().max() > 1e-2

    # one variant a forward, and the arguments' own order, duplicates and negative indices
    some = path_patching(
        lm, clean, corrupt, metric, [(0, 2), (0, 0), (0, 2)], [(-1, 3), (1, 1)],
        via=("v", "k"), batch_size=1,
    ).values  # fmt: skip
    assert some.shape == (3, 2, 2)
    expect = want[[2, 0, 2]][:, [3, 1]][:, :, [2, 1]]
    _compare(some, expect.to(some.device))


def test_equal_inputs_change_nothing(device: torch.device) -> None:
    lm = _attn_only(device)
    ids = torch.randint(V, (2, T), device=device)
    got = path_patching(lm, ids, ids.clone(), _last_logprob(1), [(0, 0), (0, 3)], [(1, 2)]).values
    assert torch.allclose(got, torch.zeros_like(got), atol=1e-6)


# -- by hooks: deeper models with feed-forward networks -----------------------------------------


class _Site:
    """Where a layer's heads can be reached with torch hooks: ``out`` takes the concatenated
    per-head outputs (B, T, H·Dv) as its input; ``proj[kind]`` = (module, column offset) whose
    output (B, T, ·) holds ``kind``'s heads, D columns each; query head h's keys and values are
    the columns of head ``h // kv_group``."""

    def __init__(
        self,
        out: nn.Module,
        dv: int,
        proj: dict[str, tuple[nn.Module, int]],
        d: int,
        kv_group: int = 1,
    ) -> None:
        self.out, self.dv, self.proj, self.d, self.kv_group = out, dv, proj, d, kv_group


def _hook_reference(
    model: nn.Module,
    sites: list[_Site],
    clean: Any,
    corrupt: Any,
    metric: Callable[[Any], Tensor],
    senders: list[Any],
    receivers: list[Any],
    *,
    mlps: list[nn.Module] | None = None,
    via: tuple[str, ...] = VIA,
    direction: str = "noise",
) -> Tensor:
    """(senders, receivers, via) by Wang et al.'s two runs, one forward each, with hooks, NaN
    where a receiver has no such input.

    Senders are ``(layer, head)`` or ``("mlp", layer)`` (``mlps[layer]``'s output replaced);
    receivers ``(layer, head)``, ``(layer, head, positions)``, a list of these (patched
    together) or ``"logits"``. Run 1 freezes every head from the sender's layer on (those the
    sender cannot reach keep their target values anyway) and runs to the end."""
    source, target = (corrupt, clean) if direction == "noise" else (clean, corrupt)

    def run(inputs: Any, hooks: list[tuple[nn.Module, str, Callable[..., Any]]]) -> Any:
        handles = [
            module.register_forward_pre_hook(fn)
            if kind == "pre"
            else module.register_forward_hook(fn)
            for module, kind, fn in hooks
        ]
        try:
            return _run(model, inputs)
        finally:
            for handle in handles:
                handle.remove()

    def record_outs(inputs: Any) -> list[Tensor]:
        got: list[Tensor] = []
        run(inputs, [(s.out, "pre", lambda m, a: got.append(a[0])) for s in sites])
        return got

    def record_mlps(inputs: Any) -> list[Tensor]:
        got: list[Tensor] = []
        run(inputs, [(m, "fwd", lambda m, a, out: got.append(out)) for m in mlps or []])
        return got

    def columns(layer: int, head: int, kind: str) -> tuple[nn.Module, slice]:
        module, offset = sites[layer].proj[kind]
        d = sites[layer].d
        unit = head if kind == "q" else head // sites[layer].kv_group
        return module, slice(offset + unit * d, offset + (unit + 1) * d)

    def frozen(layer: int, sender: Any) -> Callable[..., Any]:
        """The layer's heads all at the target run's, but a sender head's, from the source."""
        x = target_outs[layer].clone()
        if sender[0] == layer:
            dv = sites[layer].dv
            cols = slice(sender[1] * dv, (sender[1] + 1) * dv)
            x[..., cols] = source_outs[layer][..., cols]
        return lambda m, args: (x, *args[1:])

    def members(receiver: Any) -> list[tuple[int, int, list[int] | None]]:
        group = receiver if isinstance(receiver, list) else [receiver]
        out = []
        for layer, head, *at in group:
            positions = None if not at else [at[0]] if isinstance(at[0], int) else list(at[0])
            out.append((layer, head, positions))
        return out

    def recording(seen: list[Tensor], cols: slice) -> Callable[..., None]:
        return lambda m, a, out: seen.append(out[..., cols].clone())

    def replacing(new: Tensor, cols: slice, positions: list[int] | None) -> Callable[..., Tensor]:
        def hook(m: nn.Module, a: Any, out: Tensor) -> Tensor:
            out = out.clone()
            rows = slice(None) if positions is None else [p % out.shape[1] for p in positions]
            out[:, rows, cols] = new[:, rows]
            return out

        return hook

    with torch.no_grad():
        base = metric(_run(model, target)).mean()
        target_outs, source_outs = record_outs(target), record_outs(source)
        source_mlps = record_mlps(source)
        result = torch.full((len(senders), len(receivers), len(via)), math.nan, dtype=torch.float64)
        for i, sender in enumerate(senders):
            mlp = sender[0] == "mlp"
            layer0 = sender[1] if mlp else sender[0]
            run1 = [(sites[n].out, "pre", frozen(n, sender)) for n in range(layer0, len(sites))]
            if mlp:
                assert mlps is not None
                run1.append((mlps[layer0], "fwd", lambda m, a, out, x=source_mlps[layer0]: x))
            for j, receiver in enumerate(receivers):
                if receiver == "logits":
                    if "resid" in via:
                        out = run(target, run1)  # run 1 is the patched run
                        result[i, j, via.index("resid")] = metric(out).mean() - base
                    continue
                for k, kind in enumerate(via):
                    if kind == "resid":
                        continue
                    seen: list[list[Tensor]] = []
                    record, replace = [], []
                    for layer, head, positions in members(receiver):
                        module, cols = columns(layer, head, kind)
                        seen.append([])
                        record.append((module, "fwd", recording(seen[-1], cols)))
                        replace.append((module, positions, cols))
                    run(target, [*run1, *record])  # run 1
                    run2 = [
                        (module, "fwd", replacing(got[0], cols, positions))
                        for (module, positions, cols), got in zip(replace, seen, strict=True)
                    ]
                    result[i, j, k] = metric(run(target, run2)).mean() - base  # run 2
    return result


def _own_sites(model: nn.Module) -> list[_Site]:
    sites = []
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            assert m.qkv_proj is not None and m.num_kv_heads == m.num_heads
            width = m.num_heads * m.head_dim
            proj = {"q": (m.qkv_proj, 0), "k": (m.qkv_proj, width), "v": (m.qkv_proj, 2 * width)}
            sites.append(_Site(m.out_proj, m.head_dim, proj, m.head_dim))
    return sites


def test_transformer_lm_with_feed_forward(device: torch.device) -> None:
    torch.manual_seed(1)
    lm = TransformerLM(V, E, 4, 4, 40, max_len=16).to(device).eval()
    _bigger(lm, 0.5)
    clean = torch.randint(V, (2, 6), device=device)
    corrupt = torch.randint(V, (2, 6), device=device)
    metric = _last_logprob(2)
    # senders in two layers, receivers in two (frozen heads and feed-forward networks between)
    senders, receivers = [(0, 1), (1, 3), (0, 2)], [(2, 0), (3, 2), (2, 3)]
    got = path_patching(lm, clean, corrupt, metric, senders, receivers, batch_size=4).values
    want = _hook_reference(lm, _own_sites(lm), clean, corrupt, metric, senders, receivers)
    _compare(got, want.to(got.device))
    auto = path_patching(lm, clean, corrupt, metric, senders, receivers).values
    torch.testing.assert_close(auto, got, rtol=1e-5, atol=1e-6)


def test_blocks_before_the_patched_layer_are_not_run(device: torch.device) -> None:
    torch.manual_seed(2)
    lm = TransformerLM(V, E, 4, 3, 40, max_len=16).to(device).eval()
    calls = [0, 0, 0]
    for i, block in enumerate(lm.blocks):
        block.self_attn.register_forward_pre_hook(
            lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1)
        )
    ids = torch.randint(V, (2, 5), device=device)
    other = torch.randint(V, (2, 5), device=device)
    path_patching(lm, ids, other, _last_logprob(1), [(0, 0), (0, 1)], [(2, 0)], batch_size=2)
    # corrupt (whole: its metric is reported), clean once (recording the frozen layer 1 and the
    # blocks for prefix reuse), the check of the prefix reuse (the last layer only), run 1 (one
    # forward of both senders, from layer 0, ending at layer 2's inputs), run 2 (6 variants, 3
    # forwards, from layer 2)
    assert calls == [1 + 1 + 1, 1 + 1 + 1, 1 + 1 + 1 + 1 + 3]


@pytest.mark.cpu_only
def test_bert_padded(device: torch.device) -> None:
    from multihead.models import BertConfig, BertModel

    torch.manual_seed(3)
    config = BertConfig(
        vocab_size=30, hidden_size=24, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12,
        activation="gelu",
    )  # fmt: skip
    bert = BertModel(config).eval()
    _bigger(bert, 0.5)
    direction = torch.randn(24)
    ids = torch.randint(1, 30, (2, 6))
    other = ids.clone()
    other[:, 1:3] = torch.randint(1, 30, (2, 2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    clean = {"input_ids": ids, "attention_mask": mask}
    corrupt = {"input_ids": other, "attention_mask": mask}

    def metric(out: Any) -> Tensor:
        # the first token's (real in every row) along a fixed direction
        return out.last_hidden_state[:, 0] @ direction

    senders, receivers = [(0, 0), (1, 2)], [(2, 1), (2, 3)]
    bert.unpad = True
    got = path_patching(bert, clean, corrupt, metric, senders, receivers).values
    bert.unpad = False  # the reference's hooks read (B, T, ·) projections
    want = _hook_reference(bert, _own_sites(bert), clean, corrupt, metric, senders, receivers)
    _compare(got, want, atol=5e-5)


# -- Hugging Face: GPT-2, and a grouped-query Llama against its per-query-head copy -------------


def _gpt2(device: torch.device, layers: int = 3) -> tuple[nn.Module, list[_Site]]:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(4)
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=24, n_layer=layers, n_head=4, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).to(device).eval()
    _bigger(model, 0.5)
    sites = [
        _Site(b.attn.c_proj, 6, {"q": (b.attn.c_attn, 0), "k": (b.attn.c_attn, 24),
                                 "v": (b.attn.c_attn, 48)}, 6)
        for b in model.transformer.h
    ]  # fmt: skip
    return model, sites


def _llama(device: torch.device, kv_heads: int, layers: int = 3) -> nn.Module:
    transformers = pytest.importorskip("transformers", minversion="5")
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=kv_heads, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(device).eval()


def test_gpt2(device: torch.device) -> None:
    model, sites = _gpt2(device)
    clean = torch.randint(50, (2, 6), device=device)
    corrupt = torch.randint(50, (2, 6), device=device)
    metric = _last_logprob(7)
    senders, receivers = [(0, 1), (1, 0)], [(2, 3), (2, 0)]
    got = path_patching(model, clean, corrupt, metric, senders, receivers).values
    want = _hook_reference(model, sites, clean, corrupt, metric, senders, receivers)
    _compare(got, want.to(got.device))


def test_grouped_query_llama_leaves_the_siblings_alone(device: torch.device) -> None:
    torch.manual_seed(5)
    model = _llama(device, kv_heads=2)
    _bigger(model, 0.5)
    # the same model with each key/value head repeated for its 3 query heads
    copy = _llama(device, kv_heads=6)
    state = model.state_dict()
    for name, t in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = t.unflatten(0, (2, 4)).repeat_interleave(3, 0).flatten(0, 1)
    copy.load_state_dict(state)
    clean = torch.randint(50, (2, 6), device=device)
    corrupt = torch.randint(50, (2, 6), device=device)
    metric = _last_logprob(9)
    with torch.no_grad():
        torch.testing.assert_close(copy(clean).logits, model(clean).logits, atol=1e-4, rtol=1e-5)
    sites = [
        _Site(layer.self_attn.o_proj, 4,
              {"q": (layer.self_attn.q_proj, 0), "k": (layer.self_attn.k_proj, 0),
               "v": (layer.self_attn.v_proj, 0)}, 4)
        for layer in copy.model.layers
    ]  # fmt: skip
    senders, receivers = [(0, 2), (1, 5)], [(2, 1), (2, 0)]  # 0 and 1 share a key/value head
    got = path_patching(model, clean, corrupt, metric, senders, receivers).values
    want = _hook_reference(copy, sites, clean, corrupt, metric, senders, receivers)
    _compare(got, want.to(got.device), atol=5e-5)


# -- the whole of Wang et al.: positions, sets, the logits, MLP senders, both directions ---------

# senders as path_patching takes them, and as the reference reads them
SENDERS: list[Any] = [(0, 1), ("mlp", 0), "L1H2", "mlp1"]
REFERENCE_SENDERS: list[Any] = [(0, 1), ("mlp", 0), (1, 2), ("mlp", 1)]
# a query (key, value) at the last position; a set across two layers, one head at two
# positions; a whole head; the logits; a head at the first and last positions
RECEIVERS: list[Any] = [(2, 0, -1), [(2, 3), (3, 1, [1, 2])], (3, 2), "logits", (2, 1, [0, -1])]
EVERY = ("q", "k", "v", "resid")
NAMES = (
    ("L0H1", "MLP0", "L1H2", "MLP1"),
    ("L2H0@[5]", "{L2H3, L3H1@[1, 2]}", "L3H2", "logits", "L2H1@[0, 5]"),
    EVERY,
)


def _whole(
    model: nn.Module,
    reference: tuple[nn.Module, list[_Site], list[nn.Module]],
    direction: str,
    device: torch.device,
    *,
    kv: str = "query_head",
    atol: float = 2e-5,
) -> Tensor:
    """path_patching of SENDERS and RECEIVERS against the hook reference (of ``reference``'s
    model, sites and feed-forward networks); returns the values."""
    g = torch.Generator().manual_seed(11)  # the same inputs at every call
    clean, corrupt = torch.randint(50, (2, 2, 6), generator=g).to(device).unbind()
    metric = _last_logprob(4)
    result = path_patching(
        model, clean, corrupt, metric, SENDERS, RECEIVERS, direction=direction, kv=kv,
        batch_size=5,
    )  # fmt: skip
    want = _hook_reference(
        reference[0], reference[1], clean, corrupt, metric, REFERENCE_SENDERS, RECEIVERS,
        mlps=reference[2], via=EVERY, direction=direction,
    )  # fmt: skip
    _compare(result.values, want.to(device), atol=atol)
    assert result.names == NAMES and result.direction == direction
    # a head has no "resid", the logits have no q, k, v: NaN there, every other cell a number
    assert result.values[:, 3, :3].isnan().all() and result.values[:, [0, 1, 2, 4], 3].isnan().all()
    with torch.no_grad():
        assert result.clean == pytest.approx(float(metric(_run(model, clean)).mean()), abs=1e-5)
        assert result.corrupt == pytest.approx(float(metric(_run(model, corrupt)).mean()), abs=1e-5)
    # as many variants a forward as the budget holds: the same numbers
    auto = path_patching(
        model, clean, corrupt, metric, SENDERS, RECEIVERS, direction=direction, kv=kv
    )
    torch.testing.assert_close(auto.values, result.values, rtol=1e-5, atol=1e-6, equal_nan=True)
    return result.values


@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_the_whole_of_wang_et_al_on_transformer_lm(direction: str, device: torch.device) -> None:
    torch.manual_seed(7)
    lm = TransformerLM(50, E, 4, 4, 40, max_len=16).to(device).eval()
    _bigger(lm, 0.5)
    _whole(lm, (lm, _own_sites(lm), [b.ff for b in lm.blocks]), direction, device)


@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_the_whole_of_wang_et_al_on_gpt2(direction: str, device: torch.device) -> None:
    model, sites = _gpt2(device, layers=4)
    mlps = [b.mlp for b in model.transformer.h]  # type: ignore[union-attr]
    _whole(model, (model, sites, mlps), direction, device)


@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_the_whole_of_wang_et_al_on_a_grouped_query_llama(
    direction: str, device: torch.device
) -> None:
    torch.manual_seed(8)
    model = _llama(device, kv_heads=2, layers=4)
    _bigger(model, 0.5)
    copy = _llama(device, kv_heads=6, layers=4)  # each key/value head repeated per query head
    state = model.state_dict()
    for name, t in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = t.unflatten(0, (2, 4)).repeat_interleave(3, 0).flatten(0, 1)
    copy.load_state_dict(state)

    def sites(m: Any, group: int) -> list[_Site]:
        return [
            _Site(layer.self_attn.o_proj, 4,
                  {"q": (layer.self_attn.q_proj, 0), "k": (layer.self_attn.k_proj, 0),
                   "v": (layer.self_attn.v_proj, 0)}, 4, kv_group=group)
            for layer in m.model.layers
        ]  # fmt: skip

    # kv="query_head": one query head's keys and values, as its copy's own columns
    own = _whole(
        model, (copy, sites(copy, 1), [la.mlp for la in copy.model.layers]), direction, device,
        atol=5e-5,
    )  # fmt: skip
    # kv="shared": the key/value head's columns, which its 3 query heads read
    shared = _whole(
        model, (model, sites(model, 3), [la.mlp for la in model.model.layers]), direction,
        device, kv="shared", atol=5e-5,
    )  # fmt: skip
    # the queries and the logits agree; the keys and values differ where siblings read them
    torch.testing.assert_close(shared[:, :, [0, 3]], own[:, :, [0, 3]], equal_nan=True)
    assert (shared[:, :, 1:3] - own[:, :, 1:3]).nan_to_num().abs().max() > 1e-3


def test_a_set_is_not_its_members_one_at_a_time(device: torch.device) -> None:
    torch.manual_seed(9)
    lm = TransformerLM(50, E, 4, 3, 40, max_len=16).to(device).eval()
    _bigger(lm, 0.5)
    clean = torch.randint(50, (2, 6), device=device)
    corrupt = torch.randint(50, (2, 6), device=device)
    metric = _last_logprob(4)
    members = [(1, 0), (2, 1), (2, 3)]
    got = path_patching(lm, clean, corrupt, metric, [(0, 2)], [members, *members], via=("v",))
    together, alone = got.values[0, 0, 0], got.values[0, 1:, 0]
    assert (together - alone.sum()).abs() > 1e-4  # paths through several heads interact
    want = _hook_reference(
        lm, _own_sites(lm), clean, corrupt, metric, [(0, 2)], [members], via=("v",)
    )
    _compare(got.values[:, :1], want.to(device))


# -- a sender that reaches the metric only through the receiver's keys --------------------------


class _TwoLayers(nn.Module):
    """x = emb; x = x + attn0(x); x = x + attn1(x); logits = unembed(x): no norms, so which
    residual dimensions a head writes and reads is set by its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, E)
        self.layers = nn.ModuleList(MultiHeadAttention(E, 3) for _ in range(2))
        self.unembed = nn.Linear(E, V)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for attn in self.layers:
            x = x + attn(x, is_causal=True)
        return self.unembed(x)


def test_a_path_through_the_keys_only(device: torch.device) -> None:
    torch.manual_seed(6)
    model = _TwoLayers()
    d = E // 3
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        # sender (0, 0) writes only into residual dimensions 0-3 ...
        model.layers[0].out_proj.weight[4:, :d] = 0.0
        # ... which the receiver (1, 1) reads with its keys only
        qkv = model.layers[1].qkv_proj
        assert qkv is not None
        qkv.weight[1 * d : 2 * d, :4] = 0.0  # q of head 1
        qkv.weight[2 * E + d : 2 * E + 2 * d, :4] = 0.0  # v of head 1
    model = model.to(device).eval()
    clean = torch.randint(V, (4, T), device=device)
    corrupt = torch.randint(V, (4, T), device=device)
    got = path_patching(model, clean, corrupt, _last_logprob(3), [(0, 0)], [(1, 1), (1, 2)]).values
    q, k, v = got[0, 0].tolist()
    assert abs(k) > 1e-2
    assert abs(q) < 1e-5 and abs(v) < 1e-5
    assert got[0, 1].abs().min() > 1e-3  # another receiver reads dimensions 0-3 with all three


# -- errors ---------------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument() -> None:
    lm = _attn_only(torch.device("cpu"))
    ids = torch.randint(V, (2, 5))
    metric = _last_logprob(0)
    s, r = [(0, 0)], [(1, 0)]
    with pytest.raises(
        ValueError, match=r"clean and corrupt must have the same shape, got \(2, 5\)"
    ):
        path_patching(lm, ids, ids[:, :4], metric, s, r)
    scalar = r"metric must return a scalar floating point tensor .*\(2,\).* got a torch.float32"
    with pytest.raises(ValueError, match=scalar + r" tensor of shape \(2, 5, 20\)"):
        path_patching(lm, ids, ids, lambda out: out, s, r)
    with pytest.raises(
        ValueError,
        match=r"senders item \(1, 2\) must be in an earlier layer than every receiver, got "
        r"layer 1 and receivers item \(1, 0\) in layer 1",
    ):
        path_patching(lm, ids, ids, metric, [(0, 0), (1, 2)], [(1, 0)])
    with pytest.raises(ValueError, match=r"senders item \(1, 0\) must be in an earlier layer"):
        path_patching(lm, ids, ids, metric, [(1, 0)], [(0, 0)])
    with pytest.raises(
        ValueError, match=r"via item must be one of 'q', 'k', 'v', 'resid', got 'o'"
    ):
        path_patching(lm, ids, ids, metric, s, r, via=("k", "o"))
    with pytest.raises(
        TypeError, match=r"via must be a sequence of 'q', 'k', 'v', 'resid' .* got 'k'"
    ):
        path_patching(lm, ids, ids, metric, s, r, via="k")
    with pytest.raises(ValueError, match=r"via must name at least one"):
        path_patching(lm, ids, ids, metric, s, r, via=())
    with pytest.raises(
        ValueError, match=r"receivers must name at least one of \(layer, head\), .* 'logits'"
    ):
        path_patching(lm, ids, ids, metric, s, [])
    with pytest.raises(
        TypeError,
        match=r"senders must be a sequence of \(layer, head\) pairs, got \(0, 0\) "
        r"\(one pair: write \[\(0, 0\)\]\)",
    ):
        path_patching(lm, ids, ids, metric, (0, 0), r)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"receivers item \(1, 4\): head index 4 is out of range"):
        path_patching(lm, ids, ids, metric, s, [(1, 4)])
    with pytest.raises(ValueError, match=r"batch_size must be a positive int or None, got 0"):
        path_patching(lm, ids, ids, metric, s, r, batch_size=0)
    with pytest.raises(TypeError, match=r"metric must be a callable"):
        path_patching(lm, ids, ids, "logprob", s, r)  # type: ignore[arg-type]
    # nothing stays registered after an error
    assert not any(m.observers for m in lm.modules() if isinstance(m, MultiHeadAttention))
    assert all("forward" not in vars(b) for b in lm.blocks)
    assert multihead.path_patching is path_patching  # the lazy public name


def test_bad_ends_of_a_path_name_the_item() -> None:
    torch.manual_seed(0)
    lm = TransformerLM(V, E, 4, 2, 40, max_len=16).eval()
    ids = torch.randint(V, (2, 5))
    metric = _last_logprob(0)
    s, r = [(0, 0)], [(1, 0)]

    def refused(error: type[Exception], match: str, **kwargs: Any) -> None:
        with pytest.raises(error, match=match):
            path_patching(lm, ids, ids, metric, **{"senders": s, "receivers": r, **kwargs})

    # the receivers' forms
    refused(
        ValueError,
        r"receivers item L1H0@\[9\] position index 9 is out of range: there are 5 positions in "
        r"the receivers' inputs \(0..4\)",
        receivers=[(1, 0, 9)],
    )
    refused(ValueError, r"receivers item \(1, 0, \[\]\): positions must name at least one",
            receivers=[(1, 0, [])])  # fmt: skip
    refused(TypeError, r"positions must be an int or a sequence of ints, got '3'",
            receivers=[(1, 0, "3")])  # fmt: skip
    refused(TypeError, r"a set of receivers patched together is a list, e\.g\. \[\(1, 3\)",
            receivers=[((1, 0), (1, 1))])  # fmt: skip
    refused(ValueError, r"a set of receivers holds heads, .* got 'logits'",
            receivers=[[(1, 0), "logits"]])  # fmt: skip
    refused(ValueError, r"a set of receivers holds heads, .* got \[\(1, 1\)\]",
            receivers=[[(1, 0), [(1, 1)]]])  # fmt: skip
    refused(TypeError, r"receivers item must be one of .* got 1.5", receivers=[1.5])
    # via against the receivers
    refused(ValueError, r"via must hold 'resid' .* when 'logits' is a receiver, got \('q',\)",
            receivers=["logits"], via=("q",))  # fmt: skip
    refused(ValueError, r"via must hold 'q', 'k' or 'v' .* got \('resid',\)", via=("resid",))
    # the senders' forms
    refused(ValueError, r"senders item 'mlp9': layer index 9 is out of range: there are 2",
            senders=["mlp9"])  # fmt: skip
    refused(ValueError, r"senders item 'MLP1' must be in an earlier layer than every receiver",
            senders=[("MLP", 1)])  # fmt: skip
    refused(TypeError, r"senders item must be a \(layer, head\) pair of ints, got \('mlp',\)",
            senders=[("mlp",)])  # fmt: skip
    attn_only = TransformerLM(V, E, 4, 2, 40, max_len=16, attn_only=True).eval()
    with pytest.raises(ValueError, match=r"senders item 'mlp0': block 0 of .* has no feed-forward"):
        path_patching(attn_only, ids, ids, metric, ["mlp0"], r)
    # the switches
    refused(ValueError, r"direction must be one of 'denoise', 'noise', got 'sideways'",
            direction="sideways")  # fmt: skip
    refused(ValueError, r"kv must be one of 'query_head', 'shared', got 'both'", kv="both")
    assert not any(m.observers for m in lm.modules() if isinstance(m, MultiHeadAttention))


def test_a_feed_forward_sender_on_a_tensor_parallel_model_is_refused() -> None:
    from multihead import hf
    from multihead.head_shard import HeadShard

    model = _llama(torch.device("cpu"), kv_heads=2)
    for _, site in hf.attention_sites(model):  # told it is split over two ranks
        site.head_shard = HeadShard(num_heads=6, rank=0, world_size=2)
    ids = torch.randint(50, (2, 5))
    with pytest.raises(
        ValueError,
        match=r"feed-forward network senders \('MLP3'\) on a tensor-parallel model are not "
        r"supported",
    ):
        path_patching(model, ids, ids, _last_logprob(0), ["mlp0"], ["logits"])
