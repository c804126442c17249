"""The Jacobian lens's estimator: each source layer's Jacobian of the last block's output,
summed over later positions, averaged over positions and prompts.

For each prompt (a row of the inputs) and source layer l::

    J_l(prompt) = 1/|V| Σ_{t ∈ V} Σ_{t' ∈ V} ∂h_target,t' / ∂h_l,t          (E, E)

with V the prompt's real positions after its first ``skip`` and before its last, and
:func:`mean_jacobians` returns the mean over the prompts that have a position in V. One forward
per prompt (its parameters frozen, the graph started at the first source layer's output), then
one backward per ``chunk`` output coordinates: row i of every J_l at once, the cotangent
coordinate i at every position of V (causality keeps t' >= t), the chunk's rows vmapped
through one backward (``torch.autograd.grad(..., is_grads_batched=True)``). This is Anthropic's
reference estimator as TransformerLens 4.3 implements it (there the prompt is copied
``dim_batch`` times along the batch instead of vmapping).

Shapes: T tokens, E width, n a chunk's rows, |V| the positions averaged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from multihead._checks import describe
from multihead.circuits.runs.input_pair import model_inputs, run_model
from multihead.map_types import output_tensor, with_output_tensor
from multihead.mapping import model_map
from multihead.observers import registered

__all__ = ["MeanJacobians", "mean_jacobians"]


class MeanJacobians(NamedTuple):
    """What :func:`mean_jacobians` found.

    Attributes:
        jacobians: {layer: (E, E)} the mean over prompts, float32 at least, on the CPU.
        prompts: how many prompts were averaged.
        skipped: the rows with no position in V (too short), left out.
    """

    jacobians: dict[int, Tensor]
    prompts: int
    skipped: list[int]


def mean_jacobians(
    model: nn.Module, inputs: Any, sources: list[int], *, skip: int, chunk: int
) -> MeanJacobians:
    """The mean Jacobians of the last block's output (module docstring) for the ``sources``
    (sorted layers below the last), ``skip`` leading positions left out, ``chunk`` rows per
    backward. The model's parameters are frozen during the fit and set back after.

    Raises:
        ValueError: inputs without a position axis or with an attention mask not (B, T), a
            model whose map has no block holding one of the layers alone.
    """
    mapped = model_map(model)
    target = mapped.num_layers - 1
    blocks = {
        layer: mapped.stack_block(layer, "JacobianLens.fit").module for layer in [*sources, target]
    }
    prompts = list(_prompts(model_inputs(model, inputs), skip))
    sums: dict[int, Tensor] = {}
    done, skipped = 0, []
    with _frozen(model):
        for row, (prompt, positions) in enumerate(prompts):
            if not positions:
                skipped.append(row)
                continue
            found = _prompt_jacobians(model, blocks, sources, target, prompt, positions, chunk)
            for layer, matrix in found.items():
                sums[layer] = matrix if layer not in sums else sums[layer] + matrix
            done += 1
    means = {layer: (total / done).cpu() for layer, total in sums.items()} if done else {}
    return MeanJacobians(means, done, skipped)


@contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """Every parameter's ``requires_grad`` off, set back on exit: the graph then starts at the
    first source layer's output and holds no weight's gradient."""
    saved = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in saved:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def _prompts(
    inputs: Tensor | dict[str, Any], skip: int
) -> Iterator[tuple[Tensor | dict[str, Any], list[int]]]:
    """Each row of ``inputs`` alone (batch 1) and its positions V: its real tokens (an
    ``attention_mask``'s ones) after the first ``skip`` and before the last. A row padded on the
    right is cut to its real tokens."""
    first = inputs if isinstance(inputs, Tensor) else _first_tensor(inputs)
    if first.dim() < 2:
        raise ValueError(
            f"JacobianLens.fit needs inputs with a position axis, (B, T, ...), got shape "
            f"{tuple(first.shape)}"
        )
    batch, length = first.shape[:2]
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    if mask is not None and (not isinstance(mask, Tensor) or tuple(mask.shape) != (batch, length)):
        raise ValueError(
            f"inputs['attention_mask'] must be (B, T) = ({batch}, {length}), got {describe(mask)}"
        )
    real_rows = mask.bool().cpu() if mask is not None else None
    for b in range(batch):
        real = list(range(length)) if real_rows is None else real_rows[b].nonzero()[:, 0].tolist()
        cut = length
        if real == list(range(len(real))):  # padded on the right, or not at all: cut the pads
            cut = len(real)
        row = _row(inputs, b, batch, length, cut)
        yield row, real[skip : len(real) - 1]


def _first_tensor(inputs: dict[str, Any]) -> Tensor:
    return next(v for v in inputs.values() if isinstance(v, Tensor) and v.dim() > 0)


def _row(
    inputs: Tensor | dict[str, Any], b: int, batch: int, length: int, cut: int
) -> Tensor | dict[str, Any]:
    """Row ``b`` of every batched tensor, its first ``cut`` positions of every (B, T, ...)
    tensor; anything else as it is."""

    def one(value: Any) -> Any:
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != batch:
            return value
        value = value[b : b + 1]
        return value[:, :cut] if value.dim() >= 2 and value.shape[1] == length else value

    if isinstance(inputs, Tensor):
        return one(inputs)
    return {key: one(value) for key, value in inputs.items()}


def _prompt_jacobians(
    model: nn.Module,
    blocks: dict[int, nn.Module],
    sources: list[int],
    target: int,
    prompt: Tensor | dict[str, Any],
    positions: list[int],
    chunk: int,
) -> dict[int, Tensor]:
    """{layer: (E, E)} one prompt's ``1/|V| Σ_{t ∈ V} Σ_{t' ∈ V} ∂h_target,t' / ∂h_layer,t``:
    one forward, then the rows ``chunk`` at a time, each row i one cotangent (output coordinate
    i at every position of V), vmapped through one backward."""
    caught: dict[int, Tensor] = {}
    root = sources[0]

    def hook(layer: int) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> Any:
            stream = output_tensor(output)
            if layer == root:  # the graph starts here: the first source's output, detached
                stream = stream.detach().requires_grad_(True)
                caught[layer] = stream
                return with_output_tensor(output, stream)
            caught[layer] = stream
            return None

        return keep

    hooks = (blocks[layer].register_forward_hook(hook(layer)) for layer in blocks)
    with registered(hooks), torch.enable_grad():
        run_model(model, prompt)
    final = caught[target]  # (1, T, E)
    if final.dim() != 3 or final.shape[0] != 1 or not final.requires_grad:
        raise ValueError(
            f"JacobianLens.fit reads each block's output as a (1, T, E) stream that depends "
            f"on the first source layer's; the last block gave {describe(final)}"
        )
    width = final.shape[-1]
    dtype = torch.promote_types(final.dtype, torch.float32)
    index = torch.tensor(positions, device=final.device)
    streams = [caught[layer] for layer in sources]
    rows = {layer: final.new_empty((width, width), dtype=dtype) for layer in sources}
    for start in range(0, width, chunk):
        n = min(chunk, width - start)
        ones = torch.arange(n, device=final.device)[:, None]  # (n, 1)
        cotangent = final.new_zeros((n, *final.shape))  # (n, 1, T, E)
        cotangent[ones, 0, index[None, :], start + ones] = 1.0
        grads = torch.autograd.grad(
            final, streams, cotangent, retain_graph=start + n < width, is_grads_batched=True
        )
        for layer, grad in zip(sources, grads, strict=True):  # grad (n, 1, T, E)
            picked = grad[:, 0].index_select(1, index.to(grad.device)).to(dtype)  # (n, |V|, E)
            rows[layer][start : start + n] = picked.mean(1).to(final.device)
    return rows
