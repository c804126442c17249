"""Beyond one process: ring attention (context parallelism) and data parallelism over
independent items on torch.distributed.

- :mod:`.sharding`: :func:`shard_sequence` / :func:`unshard_sequence` and the :data:`LAYOUTS`
  (``"contiguous"``, ``"zigzag"``) a sequence is cut in.
- :mod:`.ring`: :func:`ring_attention` and :class:`RingSelfAttention`, built on the block kernels
  of :mod:`multihead.kernels`.
- :mod:`.data_parallel`: :class:`DataParallelGroup`, the ranks over which corpus statistics,
  head distances and patching sweeps share out their texts or variants and combine their sums.

How to run it, memory and communication per rank, measurements: docs/distributed.md.
"""

from __future__ import annotations

from multihead.distributed.data_parallel import DataParallelGroup
from multihead.distributed.ring import RingSelfAttention, ring_attention
from multihead.distributed.sharding import LAYOUTS, shard_sequence, unshard_sequence

__all__ = [
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "RingSelfAttention",
    "LAYOUTS",
    "DataParallelGroup",
]
