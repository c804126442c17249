"""Activations over a corpus, streamed to safetensors shards: the input of probes, lenses and
sparse autoencoders.

:func:`cache_corpus` runs a :class:`~multihead.text.model.TextModel` over texts in the batches
:func:`~multihead.text.corpus.text_batches` makes (progress, truncations said once) and writes
what :func:`multihead.cache` keeps of each batch to one file, never holding more than one batch:

    out_dir/
        texts-0000000-0000032.safetensors   texts 0 … 31: "blocks.3.hook_resid_post" (B, T, E),
                                            ..., "attention_mask" (B, T), "text_index" (B,)
        ...
        manifest.json                       the shards in text order, the names, the model,
                                            the SAEs

With ``saes``, each sparse autoencoder's features of the site it reads are written beside (or
instead of) the activations, under SAELens's name for them (the SAE's hook and
``.hook_sae_acts_post``): ``"blocks.5.attn.hook_z.hook_sae_acts_post"`` (B, T, F), dense, zero
at padding (what :func:`~multihead.circuits.features.sae_features.sae_features` gives for one
text).

Each shard's tensors are padded to its own longest text (``attention_mask`` says which positions
are real). Under ``torch.distributed`` (``torchrun``) every rank writes the shards of its own
batches (each text on one rank) and rank 0 writes the manifest once every rank is done.

A run is all or nothing, on every rank together:

- every rank checks its arguments and ``out_dir`` and the verdicts are exchanged before anyone
  writes: a rank that starts late sees the directory as the others did, and one rank's refusal
  is every rank's;
- while it writes, ``out_dir`` holds ``unfinished.json`` (the shards it will write), which rank 0
  keeps locked (``flock``, where the OS has it) until the manifest is written, then removes;
- an error on any rank (a forward, ``progress``, a full disk) is raised on every rank, each
  removes the shards it wrote, and rank 0 the marker and any directory the run made;
- a run killed without a chance to clean up (SIGKILL, a lost node) leaves its shards and its
  marker, no manifest: a later run into that ``out_dir`` replaces them, with a warning, once
  no live run holds the marker's lock. Files the run did not name in its marker (the user's)
  are never removed: a directory that holds one is refused, as is a finished run's.

Shapes: B texts in a batch, T its padded length, E width, H heads, D a head's width, F an
SAE's features.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

try:  # POSIX: the lock that tells a live run's marker from a killed one's
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, a marker is taken as a killed run's
    fcntl = None  # type: ignore[assignment]

from multihead._checks import check_positive_int, describe, is_int
from multihead._files import (
    atomic_write,
    checksummed_safetensors,
    few,
    fsync_dir,
    json_bytes,
    read_json,
    write_synced,
)
from multihead.circuits.features.sae_features import cache_name, sae_site, site_features
from multihead.circuits.runs.site_names import Names, SiteKey, chosen_sites, hook_name
from multihead.circuits.runs.site_recorder import cache
from multihead.distributed.data_parallel import DataParallelGroup
from multihead.mapping import model_heads
from multihead.sae.sae import SAE
from multihead.text.corpus import Progress, check_texts, text_batches
from multihead.text.model import TextModel

__all__ = ["cache_corpus", "MANIFEST", "UNFINISHED", "FEATURES_SUFFIX"]

T = TypeVar("T")

MANIFEST = "manifest.json"
# The marker of a run still writing (or killed while it did): which files are that run's.
UNFINISHED = "unfinished.json"
_BY = "multihead.cache_corpus"
_SHARD = re.compile(r"texts-\d{7}-\d{7}\.safetensors")
# atomic_write's files aside (".manifest.json.<16 hex>.tmp"), and the marker's
_ASIDE = re.compile(r"\.(?:manifest|unfinished)\.json\.[0-9a-f]{16}\.tmp")
# SAELens's name for an SAE's features (HookedSAETransformer's hook below the SAE's hook)
FEATURES_SUFFIX = ".hook_sae_acts_post"


def _shard_name(start: int, stop: int) -> str:
    return f"texts-{start:07d}-{stop:07d}.safetensors"


def cache_corpus(
    model: TextModel,
    texts: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    names: Names = None,
    saes: SAE | Sequence[SAE] | None = None,
    batch_size: int = 32,
    dtype: torch.dtype | None = None,
    progress: Progress | None = None,
    group: Any = None,
) -> list[Path]:
    """Run ``model`` over ``texts`` and write the named activations, one shard per batch (see
    the module docstring for the layout, and for how a run that fails leaves nothing behind).

    Args:
        model: a :class:`~multihead.text.model.TextModel` (its own tokenizer and padding).
        texts: N non-empty texts.
        out_dir: a new or empty directory (it is created), or one that holds only what an
            unfinished run left (its ``unfinished.json`` and the shards it names, no manifest),
            which is replaced with a warning. No other file is ever replaced or removed.
        names: what :func:`multihead.cache` keeps, stored under TransformerLens's names
            (``"blocks.3.hook_resid_post"``); ``()`` for none. Default every layer's
            ``resid_post``, or with ``saes`` none.
        saes: sparse autoencoders (:func:`multihead.sae.load`; a transcoder reads its input
            site) whose features are stored, each under its hook name (``sae.hook_name``) and
            :data:`FEATURES_SUFFIX` (one head's SAE, ``hook_head_index`` h: the hook name,
            ``.h`` and the suffix; the manifest's ``"saes"`` says which SAE is which); the
            activations they read are stored only where ``names`` names them. Dense (B, T, F)
            tensors: choose ``batch_size`` and ``dtype`` for a wide SAE.
        batch_size: texts per forward (and per shard).
        dtype: the dtype stored (e.g. ``torch.float16`` to halve the files); default the
            model's (an SAE's features: the SAE's).
        progress: told ``(texts done, texts in all)`` after each batch (this rank's).
        group: the ``torch.distributed`` process group to share the texts over; default every
            rank when ``torch.distributed`` is initialised.

    Returns:
        The shards this process wrote, in text order.

    Raises:
        TypeError, ValueError: a model that is not a TextModel, bad texts (naming the line),
            ``batch_size``, ``names`` (one naming nothing, without ``saes``) or ``saes`` (not
            SAEs, two under one name, one whose site the model lacks or whose width differs
            from it); an ``out_dir`` that is a file, holds files this function did not write,
            holds a finished run (a manifest) or is being written by another run. Under
            ``torch.distributed`` every rank raises when any rank does (the others naming it).
            Nothing is written before these checks pass on every rank; an error after that
            removes what the run wrote before it is raised.
    """
    if not isinstance(model, TextModel):  # before the group: it reads the model's parameters
        raise TypeError(f"model must be a multihead.TextModel, got {describe(model)}")
    split = DataParallelGroup.of(group, model)
    out = Path(out_dir)
    # every rank's verdict before anyone writes: a late rank sees what the others saw
    items, left, plan = _agreed(
        split, lambda: _checked(model, texts, out, names, saes, batch_size, dtype)
    )
    spans = [(s, min(s + batch_size, len(items))) for s in range(0, len(items), batch_size)]
    manifest: dict[str, Any] = {"texts": len(items), "shards": [_shard_name(*s) for s in spans]}
    held: list[_Claim] = []  # rank 0's, once taken

    def take() -> None:
        if split.rank == 0:
            held.append(_Claim.take(out, manifest["shards"], left))

    written: list[Path] = []
    try:
        _agreed(split, take)  # nobody writes a shard before the marker is there
        kept_names = _agreed(
            split,
            lambda: _write_shards(
                model, items, batch_size, spans, split.share(spans), out, plan, dtype, progress,
                written,
            ),
        )  # fmt: skip
        manifest.update(names=kept_names, model=model.name, saes=plan.described())
        # every rank's shards are on disk before the manifest names them
        _agreed(split, lambda: held[0].write_manifest(manifest) if held else None)
    except Exception:
        _discard(split, written, held[0] if held else None)
        raise
    finally:
        for claim in held:
            claim.close()  # the lock let go; a failed run's marker stays unless discarded
    if held and held[0].replaced:
        warnings.warn(
            f"out_dir {out} held an unfinished cache_corpus run's {len(held[0].replaced)} files "
            f"({few(held[0].replaced)}) and no {MANIFEST}: they were replaced",
            UserWarning,
            stacklevel=2,
        )
    # the manifest written, the run is complete whatever happens next: the marker goes
    _agreed(split, lambda: held[0].remove_marker() if held else None)
    return written


def _agreed(split: DataParallelGroup, step: Callable[[], T]) -> T:
    """``step()`` on every rank, then one exchange: its value when every rank's step passed;
    else every rank raises (the failing rank its own error, the others one naming it)."""
    try:
        value = step()
    except Exception as error:
        split.gather(None, error)
        raise  # gather raised it already; here for the reader
    split.gather(None)
    return value


@dataclass(frozen=True)
class _Plan:
    """What each forward keeps, worked out once: the user's ``names`` (stored), the sites the
    SAEs read, and what the forward is asked for (both)."""

    names: Names
    saes: dict[str, tuple[SAE, SiteKey]]  # stored name -> (the SAE, the site it reads)
    stored: frozenset[SiteKey] | None  # the keys ``names`` chooses; None for a predicate
    run: Names  # what each batch's forward keeps: the user's names and the SAEs' sites

    @classmethod
    def of(cls, model: TextModel, names: Names, saes: SAE | Sequence[SAE] | None) -> _Plan:
        given = [saes] if isinstance(saes, SAE) else saes
        if given is None:
            given = []
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise TypeError(
                f"saes must be a multihead.sae.SAE, a sequence of them or None, got "
                f"{describe(saes)}"
            )
        chosen: dict[str, tuple[SAE, SiteKey]] = {}
        for i, sae in enumerate(given):
            try:
                key = sae_site(model, sae, None, "cache_corpus")
            except (TypeError, ValueError) as e:
                raise type(e)(f"saes[{i}]: {str(e).removeprefix('cache_corpus: ')}") from None
            head = sae.hook_head_index
            # SAELens's name: the SAE's own hook (at the layer it reads: layer= is not taken)
            name = f"{sae.hook_name}" + (f".{head}" if is_int(head) else "") + FEATURES_SUFFIX
            if name in chosen:
                first = next(j for j, n in enumerate(chosen) if n == name)
                raise ValueError(
                    f"saes[{i}] reads the site saes[{first}] reads ({sae.hook_name}): their "
                    f"features would be stored under one name, {name!r}; cache them in two runs"
                )
            chosen[name] = (sae, key)
        if names is None:
            names = () if chosen else "resid_post"
        if callable(names):
            pick = names
            sites = {key for _, key in chosen.values()}
            # the SAEs' sites each checked by _checked on a forward of its own first
            run: Names = names
            if sites:
                run = lambda site, layer: (site, layer) in sites or pick(site, layer)  # noqa: E731
            return cls(names, chosen, None, run)
        stored = frozenset(chosen_sites(names, len(model_heads(model))))
        if not chosen and not stored:
            raise ValueError(
                f"names: {names!r} names no activation and no saes are given: nothing would be "
                f"stored"
            )
        run = sorted(stored | {key for _, key in chosen.values()}) if chosen else names
        return cls(names, chosen, stored, run)

    def stores(self, key: SiteKey) -> bool:
        """Whether the activation at ``key`` is stored (the user named it)."""
        if self.stored is not None:
            return key in self.stored
        assert callable(self.names)
        return bool(self.names(*key))

    def described(self) -> dict[str, dict[str, Any]]:
        """The manifest's ``"saes"``: per stored name, what the SAE is."""
        return {
            name: {
                "hook_name": sae.hook_name,
                "architecture": sae.architecture,
                "d_in": sae.d_in,
                "d_sae": sae.d_sae,
            }
            for name, (sae, _) in self.saes.items()
        }


def _checked(
    model: TextModel,
    texts: Sequence[str],
    out: Path,
    names: Names,
    saes: SAE | Sequence[SAE] | None,
    batch_size: int,
    dtype: torch.dtype | None,
) -> tuple[list[str], list[Path], _Plan]:
    """The texts, what an unfinished run left in ``out`` (to replace) and what each forward
    keeps; raises on bad input. Writes nothing."""
    items = check_texts("texts", texts)
    check_positive_int("batch_size", batch_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {describe(dtype)}")
    plan = _Plan.of(model, names, saes)
    left = _left_over(out)
    # the names, and each SAE's site and width, are checked on one-text forwards (each SAE's
    # site asked for by its own hook name: a name the cache refuses is refused as named)
    one = {"input_ids": model.tokenize(items[0]).input_ids}
    cache(model, one, names=plan.names)
    for i, (sae, key) in enumerate(plan.saes.values()):
        try:
            kept = cache(model, one, names=[cache_name(sae, key)])
            site_features(sae, key, kept[key], "cache_corpus")
        except ValueError as e:
            raise ValueError(f"saes[{i}]: {str(e).removeprefix('cache_corpus: ')}") from None
    return items, left, plan


def _left_over(out: Path) -> list[Path]:
    """What ``out`` holds that an unfinished run wrote (its marker, the shards it names, its
    files written aside), to be replaced: empty for a new or empty directory.

    Raises:
        ValueError: ``out`` is a file, holds a manifest (a finished run), or a file that no
            unfinished run's marker names.
    """
    refused = "out_dir must be a new or empty directory, got"
    if not out.exists():
        return []
    if not out.is_dir():
        raise ValueError(f"{refused} a file: {out}")
    entries = sorted(out.iterdir())
    found = [p.name for p in entries]
    if MANIFEST in found:
        raise ValueError(
            f"{refused} a finished cache_corpus run's directory (it holds {MANIFEST}): {out}"
        )
    ours = _marked(out / UNFINISHED)
    foreign = [n for n in found if not (n in ours or (ours and _ASIDE.fullmatch(n)))]
    if foreign:
        raise ValueError(f"{refused} a directory that holds files: {few(foreign)}: {out}")
    return entries


def _marked(marker: Path) -> set[str]:
    """The files an unfinished run's marker names as that run's (the marker among them);
    empty when there is no marker, or a file of that name this module did not write."""
    try:
        content = read_json(marker)
    except (OSError, ValueError):
        return set()
    shards = content.get("shards") if isinstance(content, dict) else None
    if (
        not isinstance(content, dict)
        or content.get("by") != _BY
        or not isinstance(shards, list)
        or not all(isinstance(n, str) and _SHARD.fullmatch(n) for n in shards)
    ):
        return set()
    return {UNFINISHED, *shards}


def _another_run(out: Path) -> ValueError:
    return ValueError(
        f"out_dir {out} is being written: another cache_corpus run is writing it (its "
        f"{UNFINISHED} is locked); wait for it to finish, or choose another out_dir"
    )


@dataclass
class _Claim:
    """Rank 0's hold on ``out_dir`` while a run writes it: the marker, kept open and locked
    (a run killed loses its lock with its process), the directories the run made, and what
    an unfinished run had left there that it replaced."""

    out: Path
    fd: int
    made: list[Path]
    replaced: list[str]
    manifest_written: bool = False

    @classmethod
    def take(cls, out: Path, shard_names: list[str], left: list[Path]) -> _Claim:
        """Make ``out`` (and its missing parents), remove what an unfinished run ``left``, and
        write and lock this run's marker.

        Raises:
            ValueError: another live run holds the marker, or made it meanwhile.
        """
        made = [p for p in (out, *out.parents) if not os.path.lexists(p)]
        out.mkdir(parents=True, exist_ok=True)
        data = json_bytes({"by": _BY, "shards": shard_names})
        try:
            if left:
                fd, replaced = cls._replace(out, data)
            else:
                fd, replaced = cls._create(out, data), []
        except BaseException:
            _remove_made(made)
            raise
        fsync_dir(out)
        return cls(out, fd, made, replaced)

    @staticmethod
    def _create(out: Path, data: bytes) -> int:
        """This run's marker in an empty ``out``: its descriptor, locked."""
        marker = out / UNFINISHED
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            raise _another_run(out) from None
        try:
            _lock(fd)
            os.write(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            marker.unlink(missing_ok=True)
            raise
        return fd

    @staticmethod
    def _replace(out: Path, data: bytes) -> tuple[int, list[str]]:
        """Under the old marker's lock (refused while a live run holds it), remove what its
        run left and put this run's marker in its place: the new marker's descriptor, locked,
        and the names of the files replaced."""
        marker = out / UNFINISHED
        try:
            old = os.open(marker, os.O_RDONLY)
        except FileNotFoundError:  # gone since it was checked: that run finished, or another
            _left_over(out)  # took it and is writing
            raise _another_run(out) from None
        try:
            if not _lock(old, wait=False):
                raise _another_run(out)
            left = _left_over(out)  # again, under the lock: still only what that run left
            for path in left:
                if path.name != UNFINISHED:
                    path.unlink(missing_ok=True)
            aside = out / f".{UNFINISHED}.{secrets.token_hex(8)}.tmp"
            fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                _lock(fd)
                os.write(fd, data)
                os.fsync(fd)
                os.replace(aside, marker)
            except BaseException:
                os.close(fd)
                aside.unlink(missing_ok=True)
                raise
        finally:
            os.close(old)
        return fd, [p.name for p in left]

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write(self.out / MANIFEST, json_bytes(manifest))
        self.manifest_written = True

    def remove_marker(self) -> None:
        """Where it cannot be removed it stays: beside a manifest it is ignored, alone a later
        run replaces it."""
        with contextlib.suppress(OSError):
            (self.out / UNFINISHED).unlink(missing_ok=True)
        fsync_dir(self.out)

    def undo(self) -> None:
        """The run failed and every rank removed its shards: the marker, and the directories
        the run made, go too."""
        self.remove_marker()
        _remove_made(self.made)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _write_shards(
    model: TextModel,
    items: list[str],
    batch_size: int,
    spans: list[tuple[int, int]],
    mine: list[tuple[int, int]],
    out: Path,
    plan: _Plan,
    dtype: torch.dtype | None,
    progress: Progress | None,
    written: list[Path],
) -> list[str]:
    """This rank's shards, each appended to ``written`` once on disk; the names kept."""
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
        # kept on the CPU as recorded (an accelerator holds one activation at a time); each
        # SAE's site goes to the SAE's device to be encoded
        kept = cache(model, inputs, names=plan.run, device="cpu")
        tensors = {
            hook_name(*key): (value if dtype is None else value.to(dtype)).contiguous()
            for key, value in kept.items()
            if plan.stores(key)
        }
        real = batch.attention_mask.bool().cpu()
        for name, (sae, key) in plan.saes.items():
            features = site_features(sae, key, kept[key], "cache_corpus").cpu()
            # zero at padding, whatever the SAE made of it (a normalising SAE: NaN of zeros)
            features = torch.where(real[..., None], features, 0.0)
            tensors[name] = (features if dtype is None else features.to(dtype)).contiguous()
        kept_names = sorted(tensors)
        tensors["attention_mask"] = batch.attention_mask.cpu()
        tensors["text_index"] = torch.arange(start, stop)
        path = out / _shard_name(start, stop)
        try:
            write_synced(path, checksummed_safetensors(tensors, {"format": "pt"}))
        except FileExistsError:
            raise  # not this run's file: left alone
        except BaseException:
            path.unlink(missing_ok=True)  # this run's, half written
            raise
        written.append(path)
        done += stop - start
        if progress is not None:
            progress(done, total)
    return kept_names


def _discard(split: DataParallelGroup, written: list[Path], claim: _Claim | None) -> None:
    """After an error every rank raises: each rank removes the shards it wrote (rank 0 the
    manifest first, if it got that far), then rank 0 the marker and the directories the run
    made. If a shard cannot be removed, or a rank is gone, the marker stays: a later run
    recognises what is left as this run's and replaces it."""
    removed = True
    mine = [claim.out / MANIFEST] if claim is not None and claim.manifest_written else []
    for path in [*mine, *written]:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            removed = False
    try:
        every = split.gather(removed)
    except Exception:
        return
    if claim is not None and all(every):
        claim.undo()


def _lock(fd: int, *, wait: bool = True) -> bool:
    """Lock ``fd``'s file for as long as it is open (where the OS has ``flock``); without
    ``wait``, False when another open file holds the lock."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remove_made(made: list[Path]) -> None:
    """The directories a run made (deepest first), each only while it is empty."""
    for path in made:
        try:
            path.rmdir()
        except OSError:
            return
