"""ProjectionColumns: which columns of a projection each slot (head) reads, read off autograd's
graph, and gradients taken back through them, against layouts built here by hand and plain
autograd (each slot's cotangent alone through the whole backward)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from multihead.circuits.edges.projection_columns import ProjectionColumns, walked

E, H, D = 12, 4, 3


def _run(batch: int, order: Tensor, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, nn.Linear]:
    """x (B, T, E), a norm's output -> P = x Mᵀ + b (B, T, out) -> the slots' tensor
    (B, H, T, D) whose slot h reads the columns ``order[h·D:(h + 1)·D]`` of P."""
    torch.manual_seed(seed)
    proj = nn.Linear(E, H * D + 2, dtype=torch.float64)  # two columns no slot reads
    stream = torch.randn(batch, 5, E, dtype=torch.float64, requires_grad=True)
    x = nn.functional.layer_norm(stream, (E,))  # a norm's output, as the projections read it
    out = proj(x)
    tensor = out[..., order].view(batch, 5, H, D).transpose(1, 2)
    return x, out, tensor, proj


@pytest.mark.parametrize("batch", [1, 3, 8])  # 5 sends: five rounds, two, one
@pytest.mark.parametrize("layout", ["heads", "interleaved"])
def test_columns_and_gradients_follow_the_layout(batch: int, layout: str) -> None:
    order = torch.arange(H * D)
    if layout == "interleaved":  # head h reads columns h, h + H, h + 2H (then shifted by 2)
        order = torch.arange(H * D).view(D, H).T.flatten() + 2
    x, out, tensor, proj = _run(batch, order)
    found = ProjectionColumns.find([tensor], x, [out], [proj.weight.detach()])[0]
    assert found is not None
    cols = found.columns[0]
    assert cols is not None
    for h in range(H):
        assert cols[h].tolist() == sorted(order[h * D : (h + 1) * D].tolist())
    cotangent = torch.randn_like(tensor)
    got = found.backward(tensor, [out], [(cotangent, [2, 0, 3])])  # (3, B, T, E)
    for j, h in enumerate([2, 0, 3]):
        alone = torch.zeros_like(cotangent)
        alone[:, h] = cotangent[:, h]
        (want,) = torch.autograd.grad(tensor, x, alone, retain_graph=True)
        torch.testing.assert_close(got[j], want, rtol=0, atol=1e-12)


def test_two_rounds_are_two_cotangents() -> None:
    x, out, tensor, proj = _run(2, torch.arange(H * D))
    found = ProjectionColumns.find([tensor], x, [out], [proj.weight.detach()])[0]
    assert found is not None
    first, second = torch.randn_like(tensor), torch.randn_like(tensor)
    got = found.backward(tensor, [out], [(first, [1]), (second, [1, 3])])
    for j, (cotangent, h) in enumerate([(first, 1), (second, 1), (second, 3)]):
        alone = torch.zeros_like(cotangent)
        alone[:, h] = cotangent[:, h]
        (want,) = torch.autograd.grad(tensor, x, alone, retain_graph=True)
        torch.testing.assert_close(got[j], want, rtol=0, atol=1e-12)


def test_a_column_two_slots_read_gives_no_map() -> None:
    order = torch.arange(H * D)
    order[D] = 0  # slot 1's first column is slot 0's too
    x, out, tensor, proj = _run(3, order)
    assert ProjectionColumns.find([tensor], x, [out], [proj.weight.detach()])[0] is None


def test_slots_of_unequal_widths_give_no_map() -> None:
    order = torch.arange(H * D)
    order[D + 1] = D  # slot 1 reads one column twice: two columns, the others three
    x, out, tensor, proj = _run(3, order)
    assert ProjectionColumns.find([tensor], x, [out], [proj.weight.detach()])[0] is None


def test_a_path_past_the_projection_gives_no_map() -> None:
    x, out, tensor, proj = _run(3, torch.arange(H * D))
    bypass = tensor + x[..., :D].unsqueeze(1)  # the stream reaches the slots directly too
    assert ProjectionColumns.find([bypass], x, [out], [proj.weight.detach()])[0] is None


def test_walked_stops_at_the_cuts() -> None:
    """The nodes leading back from a tensor: a cut node is not walked past, and a node it
    would have led to is still reached by another path (or not at all)."""
    x = torch.randn(3, requires_grad=True)
    a = x * 2
    b = a + 1
    c = b * a
    nodes = walked([c], [b])
    assert id(c.grad_fn) in nodes and id(a.grad_fn) in nodes  # a: also read by c itself
    assert id(b.grad_fn) not in nodes
    assert set(walked([c], [a, b])) == {id(c.grad_fn)}
    assert len(walked([c], [])) == 4  # c, b, a and x's accumulator


def test_overlaps_compares_the_columns_of_each_projection() -> None:
    order = torch.arange(H * D)
    x, out, tensor, proj = _run(2, order)
    first = ProjectionColumns.find([tensor], x, [out], [proj.weight.detach()])[0]
    moved = order + 2  # the same layout two columns on: shares all but two columns
    x, out, tensor, proj = _run(2, moved)
    second = ProjectionColumns.find([tensor], x, [out], [proj.weight.detach()])[0]
    assert first is not None and second is not None
    assert first.overlaps(second) and second.overlaps(first)
    apart = ProjectionColumns((None,), (None,))  # reads no column of the projection
    assert not first.overlaps(apart) and not apart.overlaps(first)


@pytest.mark.parametrize("batch", [1, 2, 16])
def test_several_tensors_found_in_one_backward_as_each_alone(batch: int) -> None:
    """q, k and v of one fused projection, and a tensor of a second projection, found at once:
    each map is the one found alone, and a projection a tensor does not read is None for it."""
    torch.manual_seed(3)
    fused = nn.Linear(E, 3 * H * D, dtype=torch.float64)
    other = nn.Linear(E, 2 * D, dtype=torch.float64)
    stream = torch.randn(batch, 5, E, dtype=torch.float64, requires_grad=True)
    x = nn.functional.layer_norm(stream, (E,))
    out, second = fused(x), other(x)
    q, k, v = (p.view(batch, 5, H, D).transpose(1, 2) for p in out.split(H * D, -1))
    interleaved = second.view(batch, 5, D, 2).permute(0, 3, 1, 2)  # slot s: columns s, s + 2
    tensors = [q, k, v, interleaved]
    matrices = [fused.weight.detach(), other.weight.detach()]
    together = ProjectionColumns.find(tensors, x, [out, second], matrices)
    for tensor, found in zip(tensors, together, strict=True):
        alone = ProjectionColumns.find([tensor], x, [out, second], matrices)[0]
        assert found is not None and alone is not None
        for a, b in zip(found.columns, alone.columns, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    first = together[0]
    assert first is not None and first.columns[1] is None
    assert first.columns[0] is not None and first.columns[0][1].tolist() == list(range(D, 2 * D))
    last = together[3]
    assert last is not None and last.columns[0] is None
    assert last.columns[1] is not None and last.columns[1].tolist() == [[0, 2, 4], [1, 3, 5]]
