"""edge_attribution (EAP, EAP-IG) and faithfulness against references written here with torch
hooks.

The EAP reference, per model: the senders' writes recorded from two runs by hooks (block 0's
input; each head's slice of the output projection's input times its slice of the weight; each
feed-forward network's output), and each receiver's gradient from its own forward and backward,
in which only that receiver reads a leaf copy of the residual stream: a forward hook on the q/k/v
projection replaces the receiving head's columns with the projection of the block's norm of the
copy (a feed-forward network reads the norm of its copy; the logits, the final norm of its copy).
A grouped-query Llama is compared, for kv="query_head", with its copy whose key/value heads are
repeated per query head (there a query head's keys have their own columns).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead.circuits.edges.edge_attribution import edge_attribution
from multihead.circuits.edges.faithfulness import faithfulness
from multihead.circuits.edges.projection_columns import ProjectionColumns
from multihead.models import TransformerLM


def _run(model: nn.Module, ids: Tensor) -> Tensor:
    out = model(ids) if isinstance(model, TransformerLM) else model(input_ids=ids)
    return out if isinstance(out, Tensor) else out.logits


def _metric(logits: Tensor) -> Tensor:
    return logits[:, -1].log_softmax(-1)[:, 3] - logits[:, -2].log_softmax(-1)[:, 5]


class _Parts:
    """Where a model's pieces are, for the reference: per block (block, attention norm, the
    q/k/v projections with each head's columns, output projection and its head slices, MLP
    norm, MLP), and the final norm."""

    def __init__(self, model: nn.Module, family: str) -> None:
        self.model, self.family = model, family
        if family == "lm":
            assert isinstance(model, TransformerLM)
            self.blocks = list(model.blocks)
            self.final = model.norm
        elif family == "gpt2":
            self.blocks = list(model.transformer.h)  # type: ignore[union-attr]
            self.final = model.transformer.ln_f  # type: ignore[union-attr]
        else:
            self.blocks = list(model.model.layers)  # type: ignore[union-attr]
            self.final = model.model.norm  # type: ignore[union-attr]

    def norm(self, i: int) -> nn.Module:
        b = self.blocks[i]
        if self.family == "lm":
            return b.norm1
        return b.ln_1 if self.family == "gpt2" else b.input_layernorm

    def mlp_norm(self, i: int) -> nn.Module:
        b = self.blocks[i]
        return (
            b.norm2
            if self.family == "lm"
            else b.ln_2
            if self.family == "gpt2"
            else b.post_attention_layernorm
        )

    def mlp(self, i: int) -> nn.Module:
        b = self.blocks[i]
        return b.ff if self.family == "lm" else b.mlp

    def heads(self, i: int) -> tuple[int, int, int]:
        """H, Hk, D."""
        b = self.blocks[i]
        if self.family == "lm":
            a = b.self_attn
            return a.num_heads, a.num_kv_heads, a.head_dim
        if self.family == "gpt2":
            c = self.model.config
            return c.n_head, c.n_head, c.n_embd // c.n_head
        c = self.model.config
        return c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads

    def projection(self, i: int, kind: str, head: int) -> tuple[nn.Module, slice]:
        """The module whose output holds ``head``'s ``kind`` columns, and those columns."""
        h, hk, d = self.heads(i)
        b = self.blocks[i]
        if self.family == "lm":
            start = {"q": 0, "k": h * d, "v": (h + hk) * d}[kind]
            return b.self_attn.qkv_proj, slice(start + head * d, start + (head + 1) * d)
        if self.family == "gpt2":
            start = {"q": 0, "k": h * d, "v": 2 * h * d}[kind]
            return b.attn.c_attn, slice(start + head * d, start + (head + 1) * d)
        return getattr(b.self_attn, f"{kind}_proj"), slice(head * d, (head + 1) * d)

    def out_projection(self, i: int) -> tuple[nn.Module, Callable[[Tensor, int], Tensor]]:
        """The output projection and ``write(z_flat, head)``: the head's slice times its
        weight (B, T, E)."""
        h, _, d = self.heads(i)
        b = self.blocks[i]
        if self.family == "gpt2":
            proj = b.attn.c_proj
            return proj, lambda z, k: z[..., k * d : (k + 1) * d] @ proj.weight[k * d : (k + 1) * d]
        proj = b.self_attn.out_proj if self.family == "lm" else b.self_attn.o_proj
        return (
            proj,
            lambda z, k: z[..., k * d : (k + 1) * d] @ proj.weight[:, k * d : (k + 1) * d].T,
        )


def _writes(parts: _Parts, ids: Tensor) -> dict[str, Tensor]:
    """Every sender's write (B, T, E) on ``ids``, by hooks."""
    writes: dict[str, Tensor] = {}
    handles = []

    def embed(m: nn.Module, args: Any, kwargs: Any) -> None:
        writes["embed"] = (args[0] if args else kwargs["hidden_states"]).detach()

    handles.append(parts.blocks[0].register_forward_pre_hook(embed, with_kwargs=True))
    for i in range(len(parts.blocks)):
        proj, write = parts.out_projection(i)
        h = parts.heads(i)[0]

        def heads(m: nn.Module, args: Any, i: int = i, write: Any = write, h: int = h) -> None:
            for k in range(h):
                writes[f"L{i}H{k}"] = write(args[0].detach(), k)

        def mlp(m: nn.Module, args: Any, out: Any, i: int = i) -> None:
            writes[f"MLP{i}"] = out.detach()

        handles.append(proj.register_forward_pre_hook(heads))
        handles.append(parts.mlp(i).register_forward_hook(mlp))
    with torch.no_grad():
        _run(parts.model, ids)
    for handle in handles:
        handle.remove()
    return writes


def _receiver_gradient(parts: _Parts, ids: Tensor, receiver: str) -> Tensor:
    """The metric's gradient (B, T, E) at the receiver's own copy of the stream."""
    leaf: list[Tensor] = []
    handles = []
    if receiver == "logits":

        def final(m: nn.Module, args: Any) -> Any:
            leaf.append(args[0].detach().requires_grad_())
            return (leaf[0],)

        handles.append(parts.final.register_forward_pre_hook(final))
    elif receiver.startswith("MLP"):
        i = int(receiver[3:])
        norm, mlp = parts.mlp_norm(i), parts.mlp(i)
        stream: list[Tensor] = []
        handles.append(norm.register_forward_pre_hook(lambda m, a: stream.append(a[0])))

        def read(m: nn.Module, args: Any) -> Any:
            leaf.append(stream[0].detach().requires_grad_())
            return (norm(leaf[0]),)

        handles.append(mlp.register_forward_pre_hook(read))
    else:
        head, kind = receiver.split(".")
        i, k = (int(x) for x in head[1:].split("H"))
        norm = parts.norm(i)
        proj, cols = parts.projection(i, kind, k)
        stream = []
        handles.append(norm.register_forward_pre_hook(lambda m, a: stream.append(a[0])))

        inside: list[bool] = []

        def replace(m: nn.Module, args: Any, out: Tensor) -> Tensor | None:
            if inside:  # the hook's own call of the projection
                return None
            leaf.append(stream[0].detach().requires_grad_())
            inside.append(True)
            own = proj(norm(leaf[0]))
            return torch.cat([out[..., : cols.start], own[..., cols], out[..., cols.stop :]], -1)

        handles.append(proj.register_forward_hook(replace))
    value = _metric(_run(parts.model, ids)).mean()
    for handle in handles:
        handle.remove()
    (grad,) = torch.autograd.grad(value, leaf)
    return grad


def _reference(
    parts: _Parts, clean: Tensor, corrupt: Tensor, senders: list[str], receivers: list[str]
) -> Tensor:
    a, b = _writes(parts, clean), _writes(parts, corrupt)
    out = torch.full((len(senders), len(receivers)), float("nan"), dtype=torch.float64)
    for j, r in enumerate(receivers):
        grad = _receiver_gradient(parts, clean, r)
        for i, s in enumerate(senders):
            if _stage(s) < _stage(r):
                out[i, j] = float(((b[s] - a[s]) * grad).sum())
    return out


def _stage(label: str) -> float:
    if label == "embed":
        return 0
    if label == "logits":
        return 1e9
    if label.startswith("MLP"):
        return 2 * int(label[3:]) + 2
    layer = int(label[1:].split("H")[0].split(".")[0])
    return 2 * layer + (1 if "." in label else 1.5)  # a head writes after its layer reads


def _lm(dtype: torch.dtype) -> TransformerLM:
    torch.manual_seed(0)
    lm = TransformerLM(20, 24, 4, 2, 32, max_len=16)
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4)
    return lm.to(dtype).eval()


def _hf(family: str, dtype: torch.dtype, kv_heads: int = 2) -> nn.Module:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(1)
    if family == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=20, n_embd=24, n_layer=2, n_head=4, n_positions=16, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model: Any = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=20, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.to(dtype).eval()


def _ungrouped(model: nn.Module) -> nn.Module:
    """The grouped Llama's copy with one key/value head per query head (the same function)."""
    c = model.config
    copy = _hf("llama", next(model.parameters()).dtype, kv_heads=c.num_attention_heads)
    state = model.state_dict()
    group = c.num_attention_heads // c.num_key_value_heads
    d = c.hidden_size // c.num_attention_heads
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[name].unflatten(0, (c.num_key_value_heads, d))
            state[name] = w.repeat_interleave(group, 0).flatten(0, 1)
    copy.load_state_dict(state)
    return copy


CASES = [("lm", torch.float32, 1e-5), ("lm", torch.float64, 1e-10)]
CASES += [
    (f, dt, tol)
    for f in ("gpt2", "llama")
    for dt, tol in ((torch.float32, 1e-5), (torch.float64, 1e-10))
]


@pytest.mark.parametrize(("family", "dtype", "tolerance"), CASES)
def test_eap_equals_hooks(family: str, dtype: torch.dtype, tolerance: float) -> None:
    model = _lm(dtype) if family == "lm" else _hf(family, dtype)
    torch.manual_seed(2)
    clean, corrupt = torch.randint(20, (3, 7)), torch.randint(20, (3, 7))
    kinds = ("q", "k", "v", "mlp", "logits")
    got = edge_attribution(model, clean, corrupt, _metric, receivers=kinds)
    assert got.ig_steps == 1 and got.senders[0] == "embed"
    assert not got.values.requires_grad  # the scores hold no graph (of the weights)
    reference_model = _ungrouped(model) if family == "llama" else model
    want = _reference(
        _Parts(reference_model, family), clean, corrupt, list(got.senders), list(got.receivers)
    )
    assert want.nan_to_num().abs().max() > 1e-2, "the reference is all ~0: nothing is tested"
    assert torch.equal(got.values.isnan(), want.isnan())
    torch.testing.assert_close(got.values.double(), want, atol=tolerance, rtol=0, equal_nan=True)
    if family == "llama":  # grouped: 4 query heads read 2 key/value heads
        assert "L1H3.k" in got.receivers and "L1H3.q" in got.receivers
        shared = edge_attribution(model, clean, corrupt, _metric, kv="shared")
        assert "L1KV1.k" in shared.receivers and "L1H3.k" not in shared.receivers
        # a key/value head's receiver is the sum of its query heads' (the gradient is linear)
        for kind in "kv":
            i = shared.receivers.index(f"L1KV1.{kind}")
            summed = sum(got.values[:, got.receivers.index(f"L1H{h}.{kind}")] for h in (2, 3))
            # (the Llama norm computes in float32 whatever the dtype: its rounding)
            torch.testing.assert_close(
                shared.values[:, i], summed, atol=1e-6, rtol=0, equal_nan=True
            )


@pytest.mark.parametrize("family", ["lm", "llama"])
def test_eap_through_the_whole_projection_equals_hooks(family: str) -> None:
    # projections given a copy of the norm's output, not the output itself: the graph does not
    # take them for the q/k/v projections, and each receiver's gradient goes back through the
    # whole q/k/v backward instead of its head's columns, with the same result
    model = _lm(torch.float64) if family == "lm" else _hf(family, torch.float64)
    names = ("qkv_proj",) if family == "lm" else ("q_proj", "k_proj", "v_proj")
    for m in model.modules():
        for name in names:
            if isinstance(getattr(m, name, None), nn.Linear):
                getattr(m, name).register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))
    torch.manual_seed(2)
    clean, corrupt = torch.randint(20, (3, 7)), torch.randint(20, (3, 7))
    got = edge_attribution(model, clean, corrupt, _metric)
    reference_model = _ungrouped(model) if family == "llama" else model
    want = _reference(
        _Parts(reference_model, family), clean, corrupt, list(got.senders), list(got.receivers)
    )
    assert want.nan_to_num().abs().max() > 1e-2, "the reference is all ~0: nothing is tested"
    torch.testing.assert_close(got.values.double(), want, atol=1e-10, rtol=0, equal_nan=True)


def test_later_senders_only_score_as_in_the_whole_graph() -> None:
    """Senders of layer 1 alone: layer 0's receivers have no edge (NaN, no gradient taken for
    them), layer 1's and the logits' scores are those rows of the hook reference."""
    model = _lm(torch.float64)
    torch.manual_seed(2)
    clean, corrupt = torch.randint(20, (3, 7)), torch.randint(20, (3, 7))
    kinds = ("q", "k", "v", "mlp", "logits")
    got = edge_attribution(model, clean, corrupt, _metric, receivers=kinds, senders=["L1H2"])
    assert got.senders == ("L1H2",)
    want = _reference(_Parts(model, "lm"), clean, corrupt, ["L1H2"], list(got.receivers))
    layer0 = [j for j, r in enumerate(got.receivers) if r.startswith("L0")]
    assert layer0 and bool(got.values[:, layer0].isnan().all())
    assert want.nan_to_num().abs().max() > 1e-3
    torch.testing.assert_close(got.values.double(), want, atol=1e-10, rtol=0, equal_nan=True)


@pytest.mark.parametrize("read_elsewhere", [False, True])
def test_projection_outputs_read_elsewhere_go_back_through_the_graph(
    read_elsewhere: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head's columns are read off the backward's gradient at the projections' outputs only
    where nothing but q, k and v reads those outputs: when layer 1's fused projection output
    also feeds the stream, its heads' cotangents go back through the graph (q, k and v one
    backward each); layer 0's, and every layer's of the unchanged model, take none."""
    model = _lm(torch.float64)
    projection = model.blocks[1].self_attn.qkv_proj
    assert projection is not None
    kept: list[Tensor] = []
    handles = [projection.register_forward_hook(lambda m, a, out: kept.append(out))]
    if read_elsewhere:
        handles.append(
            model.blocks[1].register_forward_hook(lambda m, a, out: out + 0.1 * kept[-1][..., :24])
        )
    calls: list[int] = []
    taken = ProjectionColumns.at_columns

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return taken(self, *args, **kwargs)

    monkeypatch.setattr(ProjectionColumns, "at_columns", counted)
    torch.manual_seed(2)
    clean, corrupt = torch.randint(20, (2, 6)), torch.randint(20, (2, 6))
    try:
        scores = edge_attribution(model, clean, corrupt, _metric, ig_steps=2)
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == (6 if read_elsewhere else 0)  # 2 runs x layer 1's q, k and v
    assert bool(scores.values.isfinite().any())


@pytest.mark.parametrize("fails", [False, True])
def test_parameters_ask_for_no_gradient_during_the_runs(fails: bool) -> None:
    """The gradient runs take gradients at activations alone: no parameter requires grad while
    the metric reads a run that needs a gradient, and every parameter's flag is as the user
    left it afterwards (one frozen before the call stays frozen), also when a run raises."""
    model = _lm(torch.float32)
    frozen = model.blocks[0].norm1.weight
    frozen.requires_grad_(False)
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    seen: list[tuple[bool, bool]] = []  # (the logits require grad, some parameter does)

    def metric(logits: Tensor) -> Tensor:
        seen.append((logits.requires_grad, any(p.requires_grad for p in model.parameters())))
        if fails and len(seen) == 2:  # the probe (the corrupt run), then a gradient run
            raise RuntimeError("metric failed in a gradient run")
        return _metric(logits)

    torch.manual_seed(2)
    clean, corrupt = torch.randint(20, (2, 6)), torch.randint(20, (2, 6))
    if fails:
        with pytest.raises(RuntimeError, match="metric failed in a gradient run"):
            edge_attribution(model, clean, corrupt, metric, ig_steps=2)
    else:
        edge_attribution(model, clean, corrupt, metric, ig_steps=2)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == before
    graded = [some for needs, some in seen if needs]
    assert graded and not any(graded)
    assert len(graded) == (1 if fails else 2)


def test_per_query_head_keys_and_values_under_padding() -> None:
    """Left padding empties the padded queries' rows (they see no key): they give zeros, not
    NaN, and each key/value head's receiver is still the sum of its query heads' (the shared
    one is autograd through the model's own attention)."""
    pytest.importorskip("transformers", minversion="5")
    import multihead.hf  # noqa: F401  (registers "multihead")

    model = _hf("llama", torch.float32)
    model.config._attn_implementation = "multihead"
    torch.manual_seed(2)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    clean = {"input_ids": torch.randint(1, 20, (2, 7)), "attention_mask": mask}
    corrupt = {"input_ids": torch.randint(1, 20, (2, 7)), "attention_mask": mask}
    got = edge_attribution(model, clean, corrupt, _metric)
    shared = edge_attribution(model, clean, corrupt, _metric, kv="shared")
    for layer in (0, 1):
        for kind in "kv":
            for kv_head in (0, 1):
                want = shared.values[:, shared.receivers.index(f"L{layer}KV{kv_head}.{kind}")]
                summed = sum(
                    got.values[:, got.receivers.index(f"L{layer}H{h}.{kind}")]
                    for h in (2 * kv_head, 2 * kv_head + 1)
                )
                assert bool(want.nan_to_num().abs().max() > 1e-2)
                torch.testing.assert_close(summed, want, atol=1e-5, rtol=0, equal_nan=True)


IG_CASES = [
    ("lm", torch.float64, 1e-10),
    ("gpt2", torch.float64, 1e-10),
    ("llama", torch.float32, 1e-5),  # RMSNorm in closed form, grouped keys and values
    ("llama", torch.float64, 1e-10),  # its norm computes in float32: through autograd
]


@pytest.mark.parametrize(("family", "dtype", "tolerance"), IG_CASES)
def test_integrated_gradients_average_the_path_points(
    family: str, dtype: torch.dtype, tolerance: float
) -> None:
    """ig_steps=m is the mean of m EAP runs whose clean input's embeddings are the path points
    corrupt + k/m (clean - corrupt), k = 1 … m (each by a hook on block 0), the differences
    always clean's and corrupt's."""
    model = _lm(dtype) if family == "lm" else _hf(family, dtype)
    torch.manual_seed(3)
    clean, corrupt = torch.randint(20, (3, 7)), torch.randint(20, (3, 7))
    kinds = ("q", "k", "v", "mlp", "logits")
    got = edge_attribution(model, clean, corrupt, _metric, ig_steps=3, receivers=kinds)
    parts = _Parts(_ungrouped(model) if family == "llama" else model, family)
    a, b = _writes(parts, clean), _writes(parts, corrupt)
    want = torch.zeros(got.values.shape, dtype=torch.float64)
    for k in (1, 2, 3):
        point = b["embed"] + k / 3 * (a["embed"] - b["embed"])

        def given(m: nn.Module, args: Any, kwargs: Any, p: Tensor = point) -> Any:
            if args:
                return (p, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": p}

        handle = parts.blocks[0].register_forward_pre_hook(given, with_kwargs=True)
        try:
            for j, r in enumerate(got.receivers):
                grad = _receiver_gradient(parts, clean, r)
                for i, s in enumerate(got.senders):
                    want[i, j] += float(((b[s] - a[s]) * grad).sum()) / 3
        finally:
            handle.remove()
    want = want.masked_fill(got.values.isnan(), float("nan"))
    assert want.nan_to_num().abs().max() > 1e-2, "the reference is all ~0: nothing is tested"
    torch.testing.assert_close(got.values.double(), want, atol=tolerance, rtol=0, equal_nan=True)
    assert not torch.allclose(
        got.values.nan_to_num(),
        edge_attribution(model, clean, corrupt, _metric, receivers=kinds).values.nan_to_num(),
    )


def test_attribution_patching_ig_steps() -> None:
    """Node attribution with ig_steps: the mean of the gradients at the path points (target's
    embeddings at the last) times the head's output difference; one step is the plain one."""
    model = _lm(torch.float64)
    torch.manual_seed(4)
    clean, corrupt = torch.randint(20, (3, 7)), torch.randint(20, (3, 7))
    plain = multihead.attribution_patching(model, clean, corrupt, _metric, direction="noise")
    one = multihead.attribution_patching(
        model, clean, corrupt, _metric, direction="noise", ig_steps=1
    )
    torch.testing.assert_close(one.values, plain.values, atol=0, rtol=0)
    # nodes = the heads' edges summed over their receivers? no: check against edges' sums
    edges = edge_attribution(
        model, clean, corrupt, _metric, ig_steps=4, receivers=("q", "k", "v", "mlp", "logits")
    )
    nodes = multihead.attribution_patching(
        model, clean, corrupt, _metric, direction="noise", ig_steps=4
    )
    # a head's write reaches the metric only through the receivers after it: its edges' sum
    for layer in range(2):
        for head in range(4):
            row = edges.values[edges.senders.index(f"L{layer}H{head}")]
            torch.testing.assert_close(
                nodes.values[layer, head], row.nansum(), atol=1e-9, rtol=1e-6
            )


def test_feed_forward_labels_are_path_patchings() -> None:
    """A feed-forward network is "MLP1" in and out, as path patching writes it; the pair form
    names the same sender; the old "L1 mlp" is refused."""
    model = _lm(torch.float64)
    torch.manual_seed(5)
    clean, corrupt = torch.randint(20, (2, 5)), torch.randint(20, (2, 5))
    every = edge_attribution(model, clean, corrupt, _metric, receivers=("mlp", "logits"))
    assert "MLP1" in every.senders and "MLP1" in every.receivers
    assert not any("mlp" in label for label in every.senders + every.receivers)
    for name in ("MLP0", "mlp0", ("mlp", 0)):
        one = edge_attribution(model, clean, corrupt, _metric, senders=[name, "L0H1"])
        assert one.senders == ("L0H1", "MLP0")
        row = every.values[every.senders.index("MLP0"), every.receivers.index("logits")]
        # the same sums, taken over other sender counts (BLAS may block them differently)
        torch.testing.assert_close(
            one.values[1, one.receivers.index("logits")], row, rtol=1e-12, atol=0
        )
    with pytest.raises(TypeError, match="got 'L0 mlp'"):
        edge_attribution(model, clean, corrupt, _metric, senders=["L0 mlp"])


def test_faithfulness_ends_and_reference() -> None:
    """No edge: the corrupt run (0); every edge: the clean run (1); one circuit against the
    same run written with hooks."""
    model = _lm(torch.float64)
    torch.manual_seed(5)
    clean, corrupt = torch.randint(20, (3, 7)), torch.randint(20, (3, 7))
    kinds = ("q", "k", "v", "mlp", "logits")
    scores = edge_attribution(model, clean, corrupt, _metric, receivers=kinds)
    assert faithfulness(model, clean, corrupt, _metric, scores.circuit(0)) == pytest.approx(
        0, abs=1e-10
    )
    assert faithfulness(
        model, clean, corrupt, _metric, scores.circuit(len(scores))
    ) == pytest.approx(1, abs=1e-10)
    # a small circuit (most of each receiver's edges cut) and a large one (few cut)
    for some in (scores.circuit(10), scores.circuit(len(scores) - 10, prune=False)):
        got = faithfulness(model, clean, corrupt, _metric, some)
        want = _faithfulness_by_hooks(model, clean, corrupt, set(some.edges), scores)
        assert got == pytest.approx(want, abs=1e-9)
        assert 0.05 < abs(got) and abs(got - 1) > 0.05  # neither end: the circuit matters


def _faithfulness_by_hooks(
    model: TransformerLM, clean: Tensor, corrupt: Tensor, kept: set[str], scores: Any
) -> float:
    """The circuit run by hooks: each receiver's columns (or input) recomputed from the stream
    plus Σ (corrupt write - this run's write) over its senders not in ``kept``."""
    parts = _Parts(model, "lm")
    bad = _writes(parts, corrupt)
    now: dict[str, Tensor] = {}
    handles = []

    def delta(receiver: str, x: Tensor) -> Tensor:
        out = x
        for s in scores.senders:
            if _stage(s) < _stage(receiver) and f"{s} -> {receiver}" not in kept:
                out = out + (bad[s] - now[s])
        return out

    handles.append(
        model.blocks[0].register_forward_pre_hook(
            lambda m, a, kw: now.__setitem__("embed", a[0]), with_kwargs=True
        )
    )
    for i in range(2):
        proj, write = parts.out_projection(i)
        handles.append(
            proj.register_forward_pre_hook(
                lambda m, a, w=write, i=i: now.update({f"L{i}H{k}": w(a[0], k) for k in range(4)})
            )
        )
        handles.append(
            parts.mlp(i).register_forward_hook(lambda m, a, o, i=i: now.__setitem__(f"MLP{i}", o))
        )
        stream: list[Tensor] = []
        handles.append(
            parts.norm(i).register_forward_pre_hook(lambda m, a, s=stream: s.append(a[0]))
        )

        busy: list[bool] = []

        def qkv(
            m: nn.Module,
            args: Any,
            out: Tensor,
            i: int = i,
            s: list[Tensor] = stream,
            busy: list[bool] = busy,
        ) -> Tensor | None:
            if busy:
                return None
            busy.append(True)
            x = s[-1]
            out = out.clone()
            for k in range(4):
                for kind in "qkv":
                    _, cols = parts.projection(i, kind, k)
                    out[..., cols] = m(parts.norm(i)(delta(f"L{i}H{k}.{kind}", x)))[..., cols]
            busy.clear()
            return out

        handles.append(parts.projection(i, "q", 0)[0].register_forward_hook(qkv))
        norm2 = parts.mlp_norm(i)
        handles.append(norm2.register_forward_pre_hook(lambda m, a, i=i: (delta(f"MLP{i}", a[0]),)))
    handles.append(model.norm.register_forward_pre_hook(lambda m, a: (delta("logits", a[0]),)))
    with torch.no_grad():
        m = float(_metric(model(clean)).mean())
    for h in handles:
        h.remove()
    with torch.no_grad():
        m_clean, m_corrupt = (
            float(_metric(model(clean)).mean()),
            float(_metric(model(corrupt)).mean()),
        )
    return (m - m_corrupt) / (m_clean - m_corrupt)
