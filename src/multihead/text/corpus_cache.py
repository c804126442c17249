"""Activations over a corpus, streamed to safetensors shards: the input of probes, lenses and
sparse autoencoders.

:func:`cache_corpus` runs a :class:`~multihead.text.model.TextModel` over texts in the batches
:func:`~multihead.text.corpus.text_batches` makes (progress, truncations said once) and writes
what :func:`multihead.cache` keeps of each batch to one file, never holding more than one batch:

    out_dir/
        texts-0000000-0000032.safetensors   texts 0 … 31: "blocks.3.hook_resid_post" (B, T, E),
                                            ..., "attention_mask" (B, T), "text_index" (B,)
        ...
        manifest.json                       the shards in text order, the names, the model

Each shard's tensors are padded to its own longest text (``attention_mask`` says which positions
are real). Under ``torch.distributed`` (``torchrun``) every rank writes the shards of its own
batches (each text on one rank) and rank 0 writes the manifest once every rank is done.

Shapes: B texts in a batch, T its padded length, E width, H heads, D a head's width.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from multihead._checks import check_positive_int, describe
from multihead._files import atomic_write, checksummed_safetensors, json_bytes, write_synced
from multihead.circuits.runs.activation_cache import Names, cache, hook_name
from multihead.distributed.data_parallel import DataParallelGroup
from multihead.text.corpus import Progress, check_texts, text_batches
from multihead.text.model import TextModel

__all__ = ["cache_corpus", "MANIFEST"]

MANIFEST = "manifest.json"


def _shard_name(start: int, stop: int) -> str:
    return f"texts-{start:07d}-{stop:07d}.safetensors"


def cache_corpus(
    model: TextModel,
    texts: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    names: Names = "resid_post",
    batch_size: int = 32,
    dtype: torch.dtype | None = None,
    progress: Progress | None = None,
    group: Any = None,
) -> list[Path]:
    """Run ``model`` over ``texts`` and write the named activations, one shard per batch (see
    the module docstring for the layout).

    Args:
        model: a :class:`~multihead.text.model.TextModel` (its own tokenizer and padding).
        texts: N non-empty texts.
        out_dir: a new or empty directory; it is created. Existing files are never replaced.
        names: what :func:`multihead.cache` keeps (default every layer's ``resid_post``);
            stored under TransformerLens's names (``"blocks.3.hook_resid_post"``).
        batch_size: texts per forward (and per shard).
        dtype: the dtype stored (e.g. ``torch.float16`` to halve the files); default the
            model's.
        progress: told ``(texts done, texts in all)`` after each batch (this rank's).
        group: the ``torch.distributed`` process group to share the texts over; default every
            rank when ``torch.distributed`` is initialised.

    Returns:
        The shards this process wrote, in text order.

    Raises:
        TypeError, ValueError: a model that is not a TextModel, bad texts (naming the line),
            ``batch_size`` or ``names``; an ``out_dir`` that is a file or holds files. Nothing
            is written before these checks pass.
    """
    if not isinstance(model, TextModel):
        raise TypeError(f"model must be a multihead.TextModel, got {describe(model)}")
    items = check_texts("texts", texts)
    check_positive_int("batch_size", batch_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {describe(dtype)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a file" if not out.is_dir() else "a directory that holds files"
        raise ValueError(f"out_dir must be a new or empty directory, got {what}: {out}")
    split = DataParallelGroup.of(group, model)
    spans = [(s, min(s + batch_size, len(items))) for s in range(0, len(items), batch_size)]
    mine = split.share(spans)
    # the names are checked on a one-text forward before any directory is made
    cache(model, {"input_ids": model.tokenize(items[0]).input_ids}, names=names)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    kept_names: list[str] = []
    chosen = set(mine)
    done, total = 0, sum(stop - start for start, stop in mine)
    # every rank tokenizes every batch (cheap beside a forward; truncations said once, naming
    # the corpus' lines) and runs its own
    for (start, stop), batch in zip(spans, text_batches(model, items, batch_size), strict=True):
        if (start, stop) not in chosen:
            continue
        inputs = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "token_type_ids": batch.token_type_ids,
        }
        kept = cache(model, inputs, names=names, device="cpu")
        tensors = {
            hook_name(site, layer): (value if dtype is None else value.to(dtype)).contiguous()
            for (site, layer), value in kept.items()
        }
        kept_names = sorted(tensors)
        tensors["attention_mask"] = batch.attention_mask.cpu()
        tensors["text_index"] = torch.arange(start, stop)
        path = out / _shard_name(start, stop)
        write_synced(path, checksummed_safetensors(tensors, {"format": "pt"}))
        written.append(path)
        done += stop - start
        if progress is not None:
            progress(done, total)
    split.gather(None)  # every rank's shards are on disk before the manifest names them
    if split.rank == 0:
        manifest = {
            "texts": len(items),
            "shards": [_shard_name(start, stop) for start, stop in spans],
            "names": kept_names,
            "model": model.name,
        }
        atomic_write(out / MANIFEST, json_bytes(manifest))
    return written
