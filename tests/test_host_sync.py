"""No host synchronisation on the observer path.

Observing or steering heads must not make a GPU wait for the host inside a forward: no
``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero()``, ``torch.equal`` or tensor built
from Python data there (row and head indices are made once per block, before the forward).
On the CPU this is counted: a ``TorchDispatchMode`` counts the aten ops that read a tensor's
data back to the host or make a tensor from Python data, and a patched ``Tensor.tolist`` counts
what bypasses the dispatcher. A forward inside ``capture``, ``intervene``, ``record_heads``,
``head_statistics`` or ``head_importance`` may show no more of them than the same forward
without (the model's own, e.g. packing a ragged batch, are counted in both). On a GPU,
``torch.cuda.set_sync_debug_mode("error")`` checks the same directly.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import multihead
from multihead import TransformerEncoder, TransformerEncoderLayer
from multihead.models import TransformerLM
from multihead.models.bert import BertModel
from multihead.models.bert_config import BertConfig
from multihead.observe import METRICS, capture, head_statistics

aten = torch.ops.aten
# ops whose result the host reads (a scalar, a count of nonzeros, a bool), or that make a
# tensor from Python data (on a GPU, a copy from the host)
HOST_OPS = (aten._local_scalar_dense, aten.nonzero, aten.equal, aten.lift_fresh)

B, T, E, H = 3, 7, 24, 6
LAYERS = 3


class _HostOps(TorchDispatchMode):
    """Counts HOST_OPS per forward of one model (between its forward pre-hook and hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards: list[Counter[str]] = []
        self.active = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.active and func.overloadpacket in HOST_OPS:
            self.forwards[-1][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> Iterator[_HostOps]:
    mode = _HostOps()
    tolist = Tensor.tolist

    def counted_tolist(self: Tensor) -> Any:
        if mode.active:
            mode.forwards[-1]["tolist"] += 1
        return tolist(self)

    def start(*_: object) -> None:
        mode.forwards.append(Counter())
        mode.active = True

    def stop(*_: object) -> None:
        mode.active = False

    handles = [model.register_forward_pre_hook(start), model.register_forward_hook(stop)]
    with monkeypatch.context() as patch:
        patch.setattr(Tensor, "tolist", counted_tolist)
        try:
            with mode:
                yield mode
        finally:
            for handle in handles:
                handle.remove()


def _host_ops(
    model: nn.Module, fn: Callable[[], object], mp: pytest.MonkeyPatch
) -> list[Counter[str]]:
    """The host ops of every forward of ``model`` while ``fn()`` runs, one Counter each."""
    with _counting(model, mp) as mode:
        fn()
    return mode.forwards


class _Reads(nn.Module):
    """A forward that reads back from its device in each way counted."""

    def forward(self, x: Tensor) -> Tensor:
        x[0].tolist()
        _ = x.sum().item(), bool(x.any()), x.nonzero(), torch.equal(x, x)
        return x + torch.tensor([1.0])


def test_the_count_sees_each_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Reads()
    x = torch.ones(2, 3)
    model(x)  # outside the count
    (seen,) = _host_ops(model, lambda: model(x), monkeypatch)
    assert seen == Counter(
        {"tolist": 1, "_local_scalar_dense": 2, "nonzero": 1, "equal": 1, "lift_fresh": 1}
    )


# -- the models: multihead's own (padded, packed, causal, grouped) and transformers' ---------


@dataclass
class Case:
    """A model and the call to run it with: ``model(inputs, **kwargs)``."""

    model: nn.Module
    inputs: Tensor
    kwargs: dict[str, Any]

    def run(self) -> Tensor:
        out = self.model(self.inputs, **self.kwargs)
        return (out if isinstance(out, Tensor) else out.last_hidden_state).square().sum()


def _key_mask() -> Tensor:
    km = torch.ones(B, T, dtype=torch.bool)
    km[1, 4:] = False
    km[2, 6:] = False
    return km


def _bert(unpad: bool) -> Case:
    config = BertConfig(
        vocab_size=50,
        hidden_size=E,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        intermediate_size=40,
        max_position_embeddings=16,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        activation="gelu",
    )
    model = BertModel(config).eval()
    model.unpad = unpad  # the packed path (PackedBatch) or the padded one
    ids = torch.randint(1, 50, (B, T))
    return Case(model, ids, {"attention_mask": _key_mask().long()})


def _encoder() -> Case:
    enc = TransformerEncoder(
        [TransformerEncoderLayer(E, H, 40, num_kv_heads=2) for _ in range(LAYERS)]
    ).eval()
    return Case(enc, torch.randn(B, T, E), {"key_mask": _key_mask(), "is_causal": True})


def _lm() -> Case:
    lm = TransformerLM(14, E, H, LAYERS, 40, max_len=16, num_kv_heads=3).eval()
    return Case(lm, torch.randint(14, (B, T)), {})


def _transformers(family: str) -> Case:
    transformers = pytest.importorskip("transformers", minversion="5")
    pytest.importorskip("multihead.hf")
    if family == "llama":
        config: Any = transformers.LlamaConfig(
            vocab_size=100,
            hidden_size=E,
            intermediate_size=40,
            num_hidden_layers=LAYERS,
            num_attention_heads=H,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
        )
        model = transformers.LlamaModel(config)
    else:
        config = transformers.GPT2Config(vocab_size=100, n_embd=E, n_layer=LAYERS, n_head=H)
        model = transformers.GPT2Model(config)
    model.set_attn_implementation("multihead")
    model.eval()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    return Case(model, torch.randint(4, 100, (B, T)), {"attention_mask": mask})


MODELS: dict[str, Callable[[], Case]] = {
    "bert-packed": lambda: _bert(True),
    "bert-padded": lambda: _bert(False),
    "encoder-causal-gqa": _encoder,
    "lm": _lm,
    "llama": lambda: _transformers("llama"),
    "gpt2": lambda: _transformers("gpt2"),
}


def _blocks(model: nn.Module) -> dict[str, Callable[[], contextlib.AbstractContextManager[Any]]]:
    device = next(model.parameters()).device
    patch = torch.zeros(B, T, E // H, device=device)
    return {
        "capture rows and heads": lambda: capture(model, rows=[0, -1, 2], heads=[1, -1]),
        "capture a slice, chunked": lambda: capture(
            model, layers=[0, -1], rows=slice(1, None, 2), chunk_size=2
        ),
        "capture everything": lambda: capture(model),
        "intervene": lambda: multihead.intervene(
            model, {(0, 1): 0.0, (1, 2): 0.5, (-1, 0): "mean", (-1, 3): patch}
        ),
        "record_heads": lambda: multihead.record_heads(model, [(0, 1), (-1, 5)]),
    }


def _plain(case: Case, mp: pytest.MonkeyPatch, *, grad: bool = False) -> Counter[str]:
    """The host ops of a forward without observers (after a first one: anything transformers'
    code makes once is made there)."""
    with torch.set_grad_enabled(grad):
        case.run()
        (plain,) = _host_ops(case.model, case.run, mp)
    return plain


@pytest.mark.parametrize("kind", list(MODELS))
def test_observed_forwards_read_nothing_back_from_the_device(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = MODELS[kind]()
    plain = _plain(case, monkeypatch)
    with torch.no_grad():
        for name, block in _blocks(case.model).items():
            with block():
                case.run()  # the first forward of the block
                (observed,) = _host_ops(case.model, case.run, monkeypatch)
            assert not observed - plain, (name, observed, plain)  # no op more than plain


@pytest.mark.parametrize("kind", list(MODELS))
def test_head_statistics_forward_reads_nothing_back_from_the_device(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = MODELS[kind]()
    plain = _plain(case, monkeypatch)
    for heads in (None, [0, -1]):

        def statistics(heads: list[int] | None = heads) -> None:
            head_statistics(case.model, case.inputs, heads=heads, chunk_size=4, **case.kwargs)

        (observed,) = _host_ops(case.model, statistics, monkeypatch)
        assert not observed - plain, (heads, observed, plain)


@pytest.mark.parametrize("kind", ["bert-packed", "encoder-causal-gqa", "llama"])
@pytest.mark.parametrize("method", ["ablation", "gradient"])
def test_head_importance_forwards_read_nothing_back_from_the_device(
    kind: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = MODELS[kind]()
    plain = _plain(case, monkeypatch, grad=method == "gradient")
    forwards = _host_ops(
        case.model,
        lambda: multihead.head_importance(case.model, case.run, method=method),
        monkeypatch,
    )
    # ablation: a clean run (and with multihead's layers a check run), one run per head;
    # gradient: one run
    assert len(forwards) >= (1 + LAYERS * H if method == "ablation" else 1)
    for observed in forwards:
        assert not observed - plain, (observed, plain)


# -- on a GPU: CUDA's own sync debug mode ---------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _on_gpu(case: Case) -> Case:
    device = torch.device("cuda")
    kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in case.kwargs.items()}
    return Case(case.model.to(device), case.inputs.to(device), kwargs)


@contextlib.contextmanager
def _cuda_syncs(model: nn.Module) -> Iterator[list[int]]:
    """Per forward of ``model``, how many synchronising CUDA calls it made (the warnings of
    ``set_sync_debug_mode("warn")``, on during the forward only)."""
    counts: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        marks: list[int] = []

        def start(*_: object) -> None:
            torch.cuda.synchronize()
            marks.append(len(caught))
            torch.cuda.set_sync_debug_mode("warn")

        def stop(*_: object) -> None:
            torch.cuda.set_sync_debug_mode(0)
            syncs = [w for w in caught[marks[-1] :] if "synchroniz" in str(w.message)]
            counts.append(len(syncs))

        handles = [model.register_forward_pre_hook(start), model.register_forward_hook(stop)]
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode(0)
            for handle in handles:
                handle.remove()


@CUDA
@pytest.mark.parametrize("kind", list(MODELS))
def test_observed_forwards_make_no_more_cuda_syncs_than_plain_ones(kind: str) -> None:
    case = _on_gpu(MODELS[kind]())
    with torch.no_grad():
        case.run()
        with _cuda_syncs(case.model) as plain:
            case.run()
        for name, block in _blocks(case.model).items():
            with block():
                case.run()
                with _cuda_syncs(case.model) as observed:
                    case.run()
            assert observed[0] <= plain[0], (name, observed, plain)
        with _cuda_syncs(case.model) as observed:
            head_statistics(case.model, case.inputs, heads=[0, -1], chunk_size=4, **case.kwargs)
        assert observed[0] <= plain[0], ("head_statistics", observed, plain)


@CUDA
def test_sync_debug_mode_error_passes_an_observed_forward_on_the_gpu() -> None:
    case = _on_gpu(_encoder())  # a forward that never syncs by itself
    with torch.no_grad():
        case.run()
        for block in _blocks(case.model).values():
            with block():
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    case.run()
                    case.run()
                finally:
                    torch.cuda.set_sync_debug_mode(0)


def test_statistics_tables_stay_together_whatever_the_default_device() -> None:
    # tensors a function makes follow its inputs, not torch's default device (here "meta",
    # which holds no values: a table made there could not be read)
    case = _bert(False)
    tokens = [["[CLS]", "a", ",", "[SEP]"]] * B
    with torch.device("meta"):
        stats = head_statistics(case.model, case.inputs, tokens=tokens, **case.kwargs)
        roles = stats.roles()
    assert stats.chance is not None
    tables = [getattr(stats, name) for name in METRICS] + list(stats.chance.values())
    tables += [stats.most_attended, stats.most_attended_weight]
    assert {t.device for t in tables} == {case.inputs.device}
    assert len(roles) == LAYERS and all(len(row) == H for row in roles)
    assert stats.to_cls.isfinite().all()  # known: the tokens were given
