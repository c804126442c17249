"""Beyond one process: ring attention (context parallelism) on torch.distributed.

- :mod:`.sharding`: :func:`shard_sequence` / :func:`unshard_sequence` and the :data:`LAYOUTS`
  (``"contiguous"``, ``"zigzag"``) a sequence is cut in.
- :mod:`.ring`: :func:`ring_attention` and :class:`RingSelfAttention`, built on the block kernels
  of :mod:`multihead.kernels`.

How to run it, memory and communication per rank, measurements: docs/distributed.md.
"""

from __future__ import annotations

from multihead.distributed.ring import RingSelfAttention, ring_attention
from multihead.distributed.sharding import LAYOUTS, shard_sequence, unshard_sequence

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "RingSelfAttention", "LAYOUTS"]
