"""Which global heads a rank holds in a transformers model split by tensor parallelism.

``from_pretrained(..., tp_plan="auto")`` under ``torchrun`` shards each attention module by the
model's tensor-parallel plan: the q/k/v projections column-wise (each rank computes a slice of
the heads), the output projection row-wise (each rank multiplies its slice of the per-head
output, and the ranks' products are summed). The per-head output a rank's attention call returns
is exactly the input slice its output projection holds, so that projection's sharded weight (a
``DTensor``: its global shape, its device mesh and this rank's coordinate) says which global
heads the rank holds. :func:`head_shard` reads it; layouts it cannot map are refused by name.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed
import transformers
from torch import nn

from multihead.head_shard import HeadShard

if torch.distributed.is_available():  # a torch built without it shards nothing
    from torch.distributed.tensor import DTensor

__all__ = ["head_shard"]


def head_shard(
    root: nn.Module, name: str, module: nn.Module, family: str, num_heads: int, head_dim: int
) -> HeadShard | None:
    """The heads this rank's calls of an attention module hold, or None when they hold all.

    Args:
        root: the transformers model that was loaded with a tensor-parallel plan (its
            ``tp_plan`` names modules relative to it).
        name: the attention module's qualified name inside ``root``.
        module: the attention module.
        family: how errors name it, e.g. ``"llama (LlamaAttention)"``.
        num_heads: H, its query heads over all ranks.
        head_dim: Dv, the width of one head's output.

    Returns:
        None when no projection of the module splits heads over ranks (no tensor parallelism,
        or a plan that gathers q/k/v on every rank); else the :class:`HeadShard`.

    Raises:
        ValueError: a layout multihead cannot map to global heads: heads that do not split
            evenly over the ranks, no row-wise output projection inside the module, a style
            that packs or reorders heads, a device mesh of more than one dimension, weights
            sharded as plain tensors rather than DTensors (older transformers).
    """
    splitting = _head_splitting(root, name, module, family)
    if not splitting:
        return None
    refuse = _refusal(family)
    rowwise = [child for child, sharded_input in splitting if sharded_input]
    if len(rowwise) != 1:
        raise refuse(
            f"its tensor-parallel plan splits the heads in {', '.join(n for n, _ in splitting)} "
            f"but has {len(rowwise)} row-wise output projections inside the module (1 is needed "
            f"to tell which heads a rank holds)"
        )
    child = rowwise[0]
    weight = getattr(module.get_submodule(child), "weight", None)
    if not (torch.distributed.is_available() and isinstance(weight, DTensor)):
        raise refuse(
            f"its output projection {child} is sharded as a plain tensor, not a DTensor (as "
            f"transformers {transformers.__version__} shards it): no global shape or device "
            f"mesh says which heads this rank holds"
        )
    placements, mesh = weight.placements, weight.device_mesh
    if mesh.ndim != 1 or len(placements) != 1:
        raise refuse(f"its output projection {child} is sharded over a {mesh.ndim}-D device mesh")
    shard_dim = getattr(placements[0], "dim", None)
    if shard_dim is None or shard_dim % weight.dim() != weight.dim() - 1:
        raise refuse(f"its output projection {child} is not sharded on its input features")
    features = weight.shape[-1]  # the global input width: every head's output, side by side
    if features != num_heads * head_dim:
        raise refuse(
            f"its output projection {child} reads {features} features, not {num_heads} heads of "
            f"width {head_dim}"
        )
    world = mesh.size()
    if num_heads % world:
        raise refuse(
            f"its tensor-parallel plan splits {num_heads} heads over {world} ranks unevenly "
            f"(each rank must hold the same number of whole heads: use a tensor-parallel size "
            f"that divides {num_heads})"
        )
    return HeadShard(num_heads, mesh.get_local_rank(), world, mesh.get_group())


def _refusal(family: str) -> Any:
    def refuse(reason: str) -> ValueError:
        return ValueError(f"{family}: {reason}; multihead cannot tell which heads each rank holds")

    return refuse


# The styles of transformers' plans, by the names plans use (the same across releases): those
# that split heads over ranks (True: a row-wise projection reading this rank's heads; False: a
# column-wise one writing them), and those that keep every head whole on every rank.
_SPLITS = {"colwise": False, "rowwise": True}
_WHOLE = frozenset(
    {
        "colwise_gather_output",
        "colwise_rep",
        "rowwise_split_input",
        "rowwise_rep",
        "replicated_with_grad_allreduce",
        "replicate",
    }
)


def _head_splitting(
    root: nn.Module, name: str, module: nn.Module, family: str
) -> list[tuple[str, bool]]:
    """The module's children whose tensor-parallel style splits heads over ranks, each with
    whether it is a row-wise projection reading sharded heads (True) or a column-wise one
    writing them (False). Children whose style keeps whole heads on every rank are left out."""
    if _has_dtensor(module, recurse=False):
        raise _refusal(family)(
            "parameters of the attention module itself are sharded over ranks (attention sinks?)"
        )
    children = list(module.named_children())
    sharded = {n for n, c in children if _has_dtensor(c)}
    size = getattr(root, "tp_size", None)
    if not sharded and not (isinstance(size, int) and size > 1):
        return []  # no tensor parallelism here
    plan = getattr(root, "tp_plan", None) or {}
    found: list[tuple[str, bool]] = []
    for child, _ in children:
        style = _style(plan, f"{name}.{child}" if name else child)
        if style is None:
            if child in sharded:
                raise _refusal(family)(
                    f"its projection {child} is sharded, but the model's tp_plan names no "
                    f"style for it"
                )
            continue
        if style in _SPLITS:
            found.append((child, _SPLITS[style]))
        elif style not in _WHOLE:
            raise _refusal(family)(
                f"its projection {child} has the tensor-parallel style {style!r}"
            )
    return found


def _style(plan: dict[str, str], name: str) -> str | None:
    """The plan's style for a module: by its exact name, else with layer numbers as ``*``."""
    if name in plan:
        return plan[name]
    # numbers between dots are layers: "model.layers.3.self_attn" -> "model.layers.*.self_attn"
    return plan.get(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name))


def _has_dtensor(module: nn.Module, recurse: bool = True) -> bool:
    if not torch.distributed.is_available():
        return False
    return any(isinstance(p, DTensor) for p in module.parameters(recurse=recurse))
