"""Which of a block's norms its attention and its feed-forward network read, found on the run.

TransformerLens names a block's two norms by what reads them: ``ln1`` the norm whose output the
attention is given, ``ln2`` the one whose output the feed-forward network is given. A block's
norms are many and named anyhow (Gemma-2 has four: two of them normalise what the attention and
the feed-forward network write), so they are told apart here by identity, as the block runs:
a forward hook on each of the map's norms of the block keeps its input and output, and a forward
pre-hook on the attention (the feed-forward network) finds the norm whose output it was given.
A post-LN block's attention reads no norm's output: it has neither (TransformerLens's ``ln1``
and ``ln2`` there are the norms after the attention and the feed-forward network, which read
nothing of theirs); a parallel block whose one norm feeds both (GPT-J) has no ``ln2``.

The same pre-hook may hand the reader another input (``change``): a norm's scale patched at
the reader, every reader of that norm's output given the changed one.

Shapes: B batch, T tokens, E width.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from multihead.map_types import Block, ModelMap
from multihead.observers import Removable

__all__ = ["NORM_ROLES", "NormRead", "NormReads"]

# TransformerLens's names of a block's norms, by their reader
NORM_ROLES = ("ln1", "ln2")


@dataclass(frozen=True)
class NormRead:
    """One norm's call, as its reader was given it.

    Attributes:
        norm: the norm module.
        eps: its epsilon (the map's).
        x: (B, T, E) what it normalised.
        y: (B, T, E) what it gave the reader.
    """

    norm: nn.Module
    eps: float
    x: Tensor
    y: Tensor


class NormReads:
    """The norms ``roles`` (``"ln1"``, ``"ln2"``) of block ``block``, found on each run its
    :meth:`hooks` are registered for (module docstring).

    Args:
        mapped: the model's map (how the readers are given the stream).
        block: the block.
        roles: the roles to find.
        change: ``change(role, read)`` -> the input to give every reader of that norm's output
            in its place, or None to leave it.

    Attributes:
        reads: role -> the :class:`NormRead` of the last run (absent: none found).
        why: role -> why the block has no such norm, once a run found none.
    """

    def __init__(
        self,
        mapped: ModelMap,
        block: Block,
        roles: Collection[str],
        change: Callable[[str, NormRead], Tensor] | None = None,
    ) -> None:
        self.mapped, self.block, self.roles, self.change = mapped, block, set(roles), change
        self.reads: dict[str, NormRead] = {}
        self.why: dict[str, str] = {}
        self._calls: dict[int, NormRead] = {}  # id of a norm -> its last call
        self._changed: list[tuple[Tensor, Tensor]] = []  # (a norm's output, the input given)
        self._attention_norm: nn.Module | None = None  # the norm the attention read last

    def hooks(self) -> Iterator[Removable]:
        """The hooks on the block's norms and on its attention and feed-forward network."""
        for norm, eps in self.block.norms:
            yield norm.register_forward_hook(self._on_norm(eps))
        readers = zip(NORM_ROLES, (self.block.attention, self.block.mlp), strict=True)
        for role, reader in readers:
            if reader is not None:
                yield reader.register_forward_pre_hook(self._on_reader(role), with_kwargs=True)

    def _on_norm(self, eps: float) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if args:
                self._calls[id(m)] = NormRead(m, eps, args[0], out)

        return hook

    def _on_reader(self, role: str) -> Callable[..., Any]:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            stream = self.mapped.stream_of(args, kwargs)
            if role == NORM_ROLES[0]:  # a new call of the block
                self._changed.clear()
            given = next((new for old, new in self._changed if old is stream), None)
            if given is not None:  # the output of a norm changed for an earlier reader
                return self.mapped.with_stream(args, kwargs, given)
            read = next((c for c in self._calls.values() if c.y is stream), None)
            if role == NORM_ROLES[0]:
                self._attention_norm = read.norm if read is not None else None
            elif read is not None and self._attention_norm is None:
                # TransformerLens's ln2 of a post-LN block is the norm after the feed-forward
                # network, not the one it reads: no name here rather than a misleading one
                self.why[role] = (
                    f"block {self.block.index}'s attention reads no norm's output (a post-LN "
                    f"block: its norms follow its attention and feed-forward network)"
                )
                return None
            elif read is not None and read.norm is self._attention_norm:
                self.why[role] = (
                    f"block {self.block.index}'s feed-forward network reads the norm its "
                    f"attention reads (one norm for both: a parallel block): that is ln1"
                )
                return None
            if read is None:
                self.why[role] = (
                    f"block {self.block.index}'s attention reads no norm's output (a post-LN "
                    f"block normalises after it)"
                    if role == NORM_ROLES[0]
                    else f"block {self.block.index}'s feed-forward network reads no norm's output"
                )
                return None
            self.reads[role] = read
            self.why.pop(role, None)
            if self.change is None or role not in self.roles:
                return None
            changed = self.change(role, read)
            self._changed.append((stream, changed))
            return self.mapped.with_stream(args, kwargs, changed)

        return hook
