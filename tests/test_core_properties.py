"""Properties of the core that hold whatever the kernel: symmetry, independence, and a hand count.

- Permutation equivariance: attention is a weighted sum over keys, so permuting the keys and
  values together (and the mask's key axis) changes nothing; each query is handled alone, so
  permuting the queries (and the mask's query axis) permutes the outputs the same way.
- Batch-row independence: a batch row's output, and its gradients, are those of running that row
  alone; changing another row changes nothing.
- One tiny case worked out by hand, with and without the causal mask.

Only the public API: ``multihead.functional.attention``, ``multihead.kernels.causal_mask`` and
``multihead.MultiHeadAttention``. Sizes are pairwise distinct (B=2, T=5, S=7, H=3, D=4) so that a
swapped dimension fails loudly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from reference import reference_attention
from torch import Tensor

from multihead import MultiHeadAttention
from multihead.functional import attention
from multihead.kernels import causal_mask

B, T, S, H, D = 2, 5, 7, 3, 4
E = H * D  # 12
KDIM, VDIM = 10, 11  # key and value input widths of the cross-attention module

BACKENDS = ["sdpa", "math", "auto"]
WEIGHT_BACKENDS = ["math", "auto"]  # the backends that can return weights

# Fixed permutations with no fixed point: every position moves.
KEY_PERM = torch.tensor([3, 6, 0, 5, 1, 4, 2])  # of S = 7
QUERY_PERM = torch.tensor([2, 4, 1, 0, 3])  # of T = 5


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and steadier on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_permutations_move_every_position() -> None:
    for perm, n in ((KEY_PERM, S), (QUERY_PERM, T)):
        assert sorted(perm.tolist()) == list(range(n))
        assert not (perm == torch.arange(n)).any()


def _mask(kind: str | None, device: torch.device) -> Tensor | None:
    """A mask broadcastable to (B, H, T, S) with a per-batch, per-query and per-key pattern."""
    if kind is None:
        return None
    allowed = torch.rand(B, 1, T, S, device=device) > 0.3
    allowed[0, 0, 2] = False  # batch 0, query 2: an emptied row travels with its query
    if kind == "bool":
        return allowed
    return torch.randn(B, H, T, S, device=device).masked_fill(~allowed, -math.inf)


def _qkv(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    return (
        torch.randn(B, H, T, D, device=device),
        torch.randn(B, H, S, D, device=device),
        torch.randn(B, H, S, D, device=device),
    )


# -- permutation equivariance: the core --------------------------------------------------------


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"], ids=["no-mask", "bool", "float"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_permuting_keys_and_values_together_changes_nothing(
    backend: str, mask_kind: str | None, device: torch.device
) -> None:
    q, k, v = _qkv(device)
    mask = _mask(mask_kind, device)
    out = attention(q, k, v, mask=mask, backend=backend)
    ref_out, _ = reference_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    permuted_mask = None if mask is None else mask[..., KEY_PERM]
    out_p = attention(
        q, k[..., KEY_PERM, :], v[..., KEY_PERM, :], mask=permuted_mask, backend=backend
    )
    torch.testing.assert_close(out_p, out)
    # Permuting the keys alone, without the values, does change the result.
    wrong = attention(q, k[..., KEY_PERM, :], v, mask=permuted_mask, backend=backend)
    assert not torch.allclose(wrong, out, atol=1e-3)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"], ids=["no-mask", "bool", "float"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_permuting_queries_permutes_outputs(
    backend: str, mask_kind: str | None, device: torch.device
) -> None:
    q, k, v = _qkv(device)
    mask = _mask(mask_kind, device)
    out = attention(q, k, v, mask=mask, backend=backend)
    permuted_mask = None if mask is None else mask[..., QUERY_PERM, :]
    out_p = attention(q[..., QUERY_PERM, :], k, v, mask=permuted_mask, backend=backend)
    torch.testing.assert_close(out_p, out[..., QUERY_PERM, :])


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"], ids=["no-mask", "bool", "float"])
@pytest.mark.parametrize("backend", WEIGHT_BACKENDS)
def test_permutations_move_the_weights_with_them(
    backend: str, mask_kind: str | None, device: torch.device
) -> None:
    q, k, v = _qkv(device)
    mask = _mask(mask_kind, device)
    _, w = attention(q, k, v, mask=mask, need_weights=True, backend=backend)
    _, ref_w = reference_attention(q, k, v, mask)
    torch.testing.assert_close(w.double(), ref_w, atol=1e-5, rtol=1e-5)
    key_mask = None if mask is None else mask[..., KEY_PERM]
    _, w_keys = attention(
        q,
        k[..., KEY_PERM, :],
        v[..., KEY_PERM, :],
        mask=key_mask,
        need_weights=True,
        backend=backend,
    )
    torch.testing.assert_close(w_keys, w[..., KEY_PERM])
    query_mask = None if mask is None else mask[..., QUERY_PERM, :]
    _, w_queries = attention(
        q[..., QUERY_PERM, :], k, v, mask=query_mask, need_weights=True, backend=backend
    )
    torch.testing.assert_close(w_queries, w[..., QUERY_PERM, :])


def test_causal_mask_is_bottom_right_and_moves_with_the_queries(device: torch.device) -> None:
    """``causal_mask`` is the rule j <= i + (S - T), written out here independently; handing the
    permuted rule over as a mask gives the permuted causal result."""
    expected = [[j <= i + (S - T) for j in range(S)] for i in range(T)]
    assert causal_mask(T, S).tolist() == expected
    q, k, v = _qkv(device)
    for backend in BACKENDS:
        out = attention(q, k, v, is_causal=True, backend=backend)
        out_p = attention(
            q[..., QUERY_PERM, :],
            k,
            v,
            mask=causal_mask(T, S, device=device)[QUERY_PERM],
            backend=backend,
        )
        torch.testing.assert_close(out_p, out[..., QUERY_PERM, :])


# -- permutation equivariance: the module with key/value inputs -------------------------------


def _cross_module(packed: bool, device: torch.device) -> MultiHeadAttention:
    """Cross-attention: the packed layout (key and value as wide as the query) or q/k/v_proj."""
    if packed:
        return MultiHeadAttention(E, H).to(device)
    return MultiHeadAttention(E, H, kdim=KDIM, vdim=VDIM).to(device)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "kdim-vdim"])
def test_module_key_value_permutation(packed: bool, device: torch.device) -> None:
    mha = _cross_module(packed, device)
    kdim, vdim = (E, E) if packed else (KDIM, VDIM)
    query, key, value = (
        torch.randn(B, T, E, device=device),
        torch.randn(B, S, kdim, device=device),
        torch.randn(B, S, vdim, device=device),
    )
    key_mask = torch.ones(B, S, dtype=torch.bool, device=device)
    key_mask[0, [1, 4]] = False  # batch 0: keys 1 and 4 are padding
    key_mask[1, 6] = False
    mask = torch.rand(B, T, S, device=device) > 0.25  # (B, T, S)
    mask[:, :, 0] = True
    out, w = mha(query, key, value, mask=mask, key_mask=key_mask, need_weights=True)
    assert out.shape == (B, T, E) and w.shape == (B, H, T, S)
    # Keys and values permuted together, with the key axis of both masks: nothing changes.
    out_k, w_k = mha(
        query,
        key[:, KEY_PERM],
        value[:, KEY_PERM],
        mask=mask[:, :, KEY_PERM],
        key_mask=key_mask[:, KEY_PERM],
        need_weights=True,
    )
    torch.testing.assert_close(out_k, out)
    torch.testing.assert_close(w_k, w[..., KEY_PERM])
    # The fused path (no weights) too.
    torch.testing.assert_close(
        mha(
            query,
            key[:, KEY_PERM],
            value[:, KEY_PERM],
            mask=mask[:, :, KEY_PERM],
            key_mask=key_mask[:, KEY_PERM],
        ),
        out,
    )
    # Queries permuted, with the mask's query axis: the outputs and weights follow.
    out_q, w_q = mha(
        query[:, QUERY_PERM],
        key,
        value,
        mask=mask[:, QUERY_PERM],
        key_mask=key_mask,
        need_weights=True,
    )
    torch.testing.assert_close(out_q, out[:, QUERY_PERM])
    torch.testing.assert_close(w_q, w[:, :, QUERY_PERM])
    torch.testing.assert_close(
        mha(query[:, QUERY_PERM], key, value, mask=mask[:, QUERY_PERM], key_mask=key_mask),
        out[:, QUERY_PERM],
    )
    # Padding really is ignored: changing a padded key's input changes nothing.
    key2, value2 = key.clone(), value.clone()
    key2[0, 1], value2[0, 4] = 100.0, -100.0
    torch.testing.assert_close(mha(query, key2, value2, mask=mask, key_mask=key_mask), out)


# -- batch-row independence ---------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"], ids=["no-mask", "bool", "float"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_rows_are_independent(
    backend: str, mask_kind: str | None, causal: bool, device: torch.device
) -> None:
    q, k, v = (x.requires_grad_() for x in _qkv(device))
    mask = _mask(mask_kind, device)
    grad_out = torch.randn(B, H, T, D, device=device)
    out = attention(q, k, v, mask=mask, is_causal=causal, backend=backend)
    (out * grad_out).sum().backward()
    for b in range(B):
        row = slice(b, b + 1)
        qb, kb, vb = (x.detach()[row].clone().requires_grad_() for x in (q, k, v))
        mask_b = None if mask is None else mask[row]
        out_b = attention(qb, kb, vb, mask=mask_b, is_causal=causal, backend=backend)
        torch.testing.assert_close(out[row], out_b)
        (out_b * grad_out[row]).sum().backward()
        for name, whole, alone in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            assert whole.grad is not None and alone.grad is not None
            torch.testing.assert_close(whole.grad[row], alone.grad, msg=f"d/d{name}, row {b}")

    # Changing every input of row 1 leaves row 0 exactly as it was.
    q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
    q2[1], k2[1], v2[1] = (
        torch.randn(H, T, D, device=device),
        torch.randn(H, S, D, device=device),
        torch.randn(H, S, D, device=device),
    )
    mask2 = mask
    if mask is not None:
        mask2 = mask.clone()
        mask2[1] = ~mask[1] if mask.dtype == torch.bool else torch.randn_like(mask[1])
    out2 = attention(q2, k2, v2, mask=mask2, is_causal=causal, backend=backend)
    assert torch.equal(out2[0], out.detach()[0])
    assert not torch.allclose(out2[1], out.detach()[1], atol=1e-3)


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_module_batch_rows_are_independent(need_weights: bool, device: torch.device) -> None:
    mha = MultiHeadAttention(E, H, kdim=KDIM, vdim=VDIM).to(device)
    query = torch.randn(B, T, E, requires_grad=True, device=device)
    key = torch.randn(B, S, KDIM, requires_grad=True, device=device)
    value = torch.randn(B, S, VDIM, requires_grad=True, device=device)
    key_mask = torch.ones(B, S, dtype=torch.bool, device=device)
    key_mask[1, 3:] = False
    grad_out = torch.randn(B, T, E, device=device)

    def run(q: Tensor, k: Tensor, v: Tensor, km: Tensor) -> Tensor:
        result = mha(q, k, v, key_mask=km, is_causal=True, need_weights=need_weights)
        return result[0] if need_weights else result

    out = run(query, key, value, key_mask)
    (out * grad_out).sum().backward()
    for b in range(B):
        row = slice(b, b + 1)
        qb, kb, vb = (x.detach()[row].clone().requires_grad_() for x in (query, key, value))
        out_b = run(qb, kb, vb, key_mask[row])
        torch.testing.assert_close(out[row], out_b)
        (out_b * grad_out[row]).sum().backward()
        for whole, alone in ((query, qb), (key, kb), (value, vb)):
            assert whole.grad is not None and alone.grad is not None
            torch.testing.assert_close(whole.grad[row], alone.grad)
    # A changed row 1 leaves row 0 exactly as it was (both runs without a graph, so that both
    # take the same kernel: on CUDA, weights without a graph come from the fused kernel).
    with torch.no_grad():
        base = run(query, key, value, key_mask)
    query2, key2, value2 = (x.detach().clone() for x in (query, key, value))
    query2[1], key2[1], value2[1] = (
        torch.randn(T, E, device=device),
        torch.randn(S, KDIM, device=device),
        torch.randn(S, VDIM, device=device),
    )
    with torch.no_grad():
        out2 = run(query2, key2, value2, key_mask)
    assert torch.equal(out2[0], base[0])
    assert not torch.allclose(out2[1], base[1], atol=1e-3)


# -- one tiny case, by hand ---------------------------------------------------------------------
#
# One head, T = S = 2, D = 1 (so the default scale 1/sqrt(D) is 1), Dv = 2:
#
#   q = [[0], [ln 3]],  k = [[0], [1]],  v = [[4, 0], [8, 4]]
#
#   scores = q kᵀ = [[0·0, 0·1], [ln3·0, ln3·1]] = [[0, 0], [0, ln 3]]
#   softmax([0, 0])    = [1/2, 1/2]
#   softmax([0, ln 3]) = [e^0, e^ln3] / (1 + 3) = [1/4, 3/4]
#
#   out row 0 = 1/2·[4, 0] + 1/2·[8, 4] = [6, 2]
#   out row 1 = 1/4·[4, 0] + 3/4·[8, 4] = [1 + 6, 0 + 3] = [7, 3]
#
# Causal (T = S: query i sees keys j <= i): row 0 sees key 0 alone, weights [1, 0], out [4, 0];
# row 1 sees both keys, as above, [7, 3].
#
# T = 1, S = 2, causal, q = [[ln 3]]: bottom-right alignment lets query 0 see keys j <= 0 + 1,
# both, so weights [1/4, 3/4] and out [7, 3] (torch's top-left is_causal would give key 0 alone,
# [4, 0]).
#
# Mask [[True, False], [False, False]]: row 0 sees key 0 alone, [1, 0] and [4, 0]; row 1 sees no
# key at all: zeros, and zero weights.

HAND_Q = torch.tensor([[[[0.0], [math.log(3)]]]])  # (1, 1, 2, 1)
HAND_K = torch.tensor([[[[0.0], [1.0]]]])  # (1, 1, 2, 1)
HAND_V = torch.tensor([[[[4.0, 0.0], [8.0, 4.0]]]])  # (1, 1, 2, 2)

HAND_CASES = {
    # name: (q, mask, is_causal, expected weights (T, S), expected out (T, 2))
    "full": (HAND_Q, None, False, [[1 / 2, 1 / 2], [1 / 4, 3 / 4]], [[6.0, 2.0], [7.0, 3.0]]),
    "causal": (HAND_Q, None, True, [[1.0, 0.0], [1 / 4, 3 / 4]], [[4.0, 0.0], [7.0, 3.0]]),
    "causal-T1-S2": (HAND_Q[..., 1:, :], None, True, [[1 / 4, 3 / 4]], [[7.0, 3.0]]),
    "bool-mask-empty-row": (
        HAND_Q,
        torch.tensor([[True, False], [False, False]]),
        False,
        [[1.0, 0.0], [0.0, 0.0]],
        [[4.0, 0.0], [0.0, 0.0]],
    ),
    "float-mask-empty-row": (
        HAND_Q,
        torch.tensor([[0.0, -math.inf], [-math.inf, -math.inf]]),
        False,
        [[1.0, 0.0], [0.0, 0.0]],
        [[4.0, 0.0], [0.0, 0.0]],
    ),
}


@pytest.mark.parametrize("case", list(HAND_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed(backend: str, case: str, device: torch.device) -> None:
    q, mask, causal, weights, expected = HAND_CASES[case]
    q, k, v = (x.to(device) for x in (q, HAND_K, HAND_V))
    mask = None if mask is None else mask.to(device)
    out = attention(q, k, v, mask=mask, is_causal=causal, backend=backend)
    torch.testing.assert_close(
        out[0, 0], torch.tensor(expected, device=device), atol=1e-6, rtol=1e-6
    )
    if backend in WEIGHT_BACKENDS:
        out_w, w = attention(
            q, k, v, mask=mask, is_causal=causal, need_weights=True, backend=backend
        )
        torch.testing.assert_close(
            w[0, 0], torch.tensor(weights, device=device), atol=1e-6, rtol=1e-6
        )
        torch.testing.assert_close(
            out_w[0, 0], torch.tensor(expected, device=device), atol=1e-6, rtol=1e-6
        )


def test_hand_computed_explicit_scale(device: torch.device) -> None:
    """The scale multiplies the scores: with scale 2 row 1's scores are [0, 2 ln 3] = [0, ln 9],
    so its weights are [1/10, 9/10] and its output 1/10·[4, 0] + 9/10·[8, 4] = [7.6, 3.6]."""
    q, k, v = (x.to(device) for x in (HAND_Q, HAND_K, HAND_V))
    for backend in WEIGHT_BACKENDS:
        out, w = attention(q, k, v, scale=2.0, need_weights=True, backend=backend)
        torch.testing.assert_close(
            w[0, 0, 1], torch.tensor([0.1, 0.9], device=device), atol=1e-6, rtol=1e-6
        )
        torch.testing.assert_close(
            out[0, 0, 1], torch.tensor([7.6, 3.6], device=device), atol=1e-6, rtol=1e-6
        )
    out = attention(q, k, v, scale=2.0, backend="sdpa")
    torch.testing.assert_close(
        out[0, 0, 1], torch.tensor([7.6, 3.6], device=device), atol=1e-6, rtol=1e-6
    )
