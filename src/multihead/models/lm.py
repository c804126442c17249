"""A small causal language model built from multihead's layers, for the synthetic tasks.

    ids (B, T) → token embedding + learned position embedding → dropout
               → N × TransformerEncoderLayer, run causally (each position sees itself and before)
               → final LayerNorm (pre-LN only) → output head → logits (B, T, V)

Seed 003 masks the decoder "to ensure the autoregressive nature" of the task; here the same
bottom-right causal mask serves training on whole sequences and decoding token by token with a
:class:`~multihead.cache.KVCache`.

On disk a model is a directory with ``config.json`` (its :class:`LMConfig` under ``"model"``,
plus whatever the caller adds, e.g. the task) and ``model.safetensors``. Never pickle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.cache import KVCache
from multihead.layers import TransformerEncoder, TransformerEncoderLayer
from multihead.positions import LearnedPositionalEmbedding

__all__ = ["LMConfig", "TransformerLM", "CONFIG_NAME", "WEIGHTS_NAME"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_MODEL_TYPE = "multihead.TransformerLM"


@dataclass(frozen=True)
class LMConfig:
    """The hyperparameters of a :class:`TransformerLM`; what ``config.json`` stores.

    Args: as :class:`TransformerLM`.
    """

    vocab_size: int
    embed_dim: int
    num_heads: int
    num_layers: int
    ff_dim: int
    max_len: int
    num_kv_heads: int | None = None
    dropout: float = 0.0
    norm_first: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_heads", "num_layers", "ff_dim", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        kv = self.num_kv_heads
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0):
            raise ValueError(f"num_kv_heads must be a positive int or None, got {kv!r}")
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})"
            )
        if kv is not None and self.num_heads % kv != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({kv})"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {self.dropout!r}")
        if not isinstance(self.norm_first, bool):
            raise ValueError(f"norm_first must be a bool, got {self.norm_first!r}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LMConfig:
        """Build from a mapping, e.g. parsed JSON; unknown or missing keys raise ValueError."""
        if not isinstance(data, Mapping):
            raise ValueError(f"an LMConfig must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"unknown LMConfig keys {unknown}; expected a subset of {sorted(names)}"
            )
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"LMConfig is missing the keys {missing}")
        return cls(**data)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "saving and loading models needs safetensors: pip install 'multihead[cli]'"
        ) from e
    return safetensors.torch


def _payload_digest(header: Mapping[str, Any], data: bytes) -> str:
    """SHA-256 of a safetensors file's tensor entries (names, dtypes, shapes, offsets) and data."""
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode())
    digest.update(data)
    return digest.hexdigest()


def _split_safetensors(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, data) of safetensors bytes; ValueError when the header is unreadable."""
    if len(blob) < 8:
        raise ValueError(f"{len(blob)} bytes, shorter than the 8-byte header size")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise ValueError(f"the header claims {size} bytes, the file has {len(blob) - 8} after it")
    header = json.loads(blob[8 : 8 + size])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, blob[8 + size :]


def _safetensors_bytes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
    """``tensors`` as safetensors bytes whose metadata also holds their SHA-256 (``sha256``).

    The checksum covers the tensor entries and the data, so a flipped bit anywhere but in the
    metadata is found when :func:`_read_safetensors` reads the file back.
    """
    st = _safetensors()
    header, data = _split_safetensors(st.save(dict(tensors), metadata=dict(metadata)))
    # The metadata lives in the header only: adding the checksum leaves entries and data as is.
    checksum = _payload_digest(header, data)
    blob: bytes = st.save(dict(tensors), metadata={**metadata, "sha256": checksum})
    return blob


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file, its checksum verified when it has one.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is truncated, corrupt or fails its checksum (names the file).
    """
    st = _safetensors()
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing")
    blob = path.read_bytes()
    try:
        header, data = _split_safetensors(blob)
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise ValueError("its __metadata__ is not a JSON object")
        tensors = st.load(blob)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{str(path)!r} is not a valid safetensors file ({e})") from None
    expected = metadata.get("sha256")
    if expected is not None and expected != _payload_digest(header, data):
        raise ValueError(
            f"{str(path)!r} is corrupt: its tensors do not match the checksum stored with them"
        )
    return tensors, metadata


class TransformerLM(nn.Module):
    """A decoder-only transformer language model (GPT-style) from multihead's layers.

    Args:
        vocab_size: V, the number of token ids.
        embed_dim: E.
        num_heads: H.
        num_layers: the number of :class:`~multihead.layers.TransformerEncoderLayer`.
        ff_dim: the feed-forward hidden width.
        max_len: the most positions the model handles (learned position embeddings).
        num_kv_heads: key/value heads per layer (grouped-query attention); default ``num_heads``.
        dropout: on embeddings, attention weights, feed-forward and residual branches.
        norm_first: pre-LN layers and a final LayerNorm (default), or post-LN layers.
        device, dtype: as for any torch module.

    Submodules: ``token_embedding`` (V → E), ``position_embedding``, ``layers``
    (:class:`~multihead.layers.TransformerEncoder`, with the final LayerNorm as its ``norm``),
    ``head`` (E → V).

    Example:
        >>> lm = TransformerLM(14, 64, 4, 2, 256, max_len=32)
        >>> lm(torch.randint(14, (2, 9))).shape
        torch.Size([2, 9, 14])
        >>> lm.generate(torch.randint(14, (2, 9)), 5).shape
        torch.Size([2, 14])
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        ff_dim: int,
        max_len: int,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = LMConfig(
            vocab_size,
            embed_dim,
            num_heads,
            num_layers,
            ff_dim,
            max_len,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            norm_first=norm_first,
        )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.token_embedding = nn.Embedding(vocab_size, embed_dim, **factory)
        self.position_embedding = LearnedPositionalEmbedding(max_len, embed_dim, **factory)
        self.dropout = nn.Dropout(dropout)
        self.layers = TransformerEncoder(
            [
                TransformerEncoderLayer(
                    embed_dim,
                    num_heads,
                    ff_dim,
                    num_kv_heads=num_kv_heads,
                    dropout=dropout,
                    norm_first=norm_first,
                    **factory,
                )
                for _ in range(num_layers)
            ],
            norm=nn.LayerNorm(embed_dim, **factory) if norm_first else None,
        )
        self.head = nn.Linear(embed_dim, vocab_size, bias=False, **factory)
        # GPT-2's small embeddings: N(0, 1) ones would swamp the residual stream at init.
        with torch.no_grad():
            for weight in (
                self.token_embedding.weight,
                self.position_embedding.embedding.weight,
                self.head.weight,
            ):
                nn.init.normal_(weight, std=0.02)

    @classmethod
    def from_config(cls, config: LMConfig, **factory: Any) -> TransformerLM:
        """Build from an :class:`LMConfig` (``factory``: device, dtype)."""
        return cls(**config.to_dict(), **factory)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def max_len(self) -> int:
        return self.config.max_len

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def make_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty :class:`~multihead.cache.KVCache` sized for this model.

        Args:
            batch_size: B.
            max_len: positions to allocate; default the model's ``max_len``.
        """
        c = self.config
        ref = self.head.weight
        return KVCache(
            c.num_layers,
            batch_size,
            c.num_kv_heads or c.num_heads,
            c.head_dim,
            c.max_len if max_len is None else max_len,
            device=ref.device,
            dtype=ref.dtype,
        )

    # -- forward --------------------------------------------------------------------------------

    def _check_ids(self, ids: Tensor, name: str = "ids") -> None:
        if not isinstance(ids, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
        # torch's embedding lookup takes int64 and int32 ids only: say so here, by name.
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"{name} must be an integer tensor of dtype torch.int64 or torch.int32, got dtype "
                f"{ids.dtype}"
            )
        if ids.dim() != 2:
            raise ValueError(f"{name} must be 2-D (B, T), got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"{name} must lie in [0, vocab_size={self.config.vocab_size}), got values in "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )

    def forward(
        self,
        ids: Tensor,
        *,
        key_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Next-token logits at every position; position t sees ids[:, :t+1] (and the cache).

        Args:
            ids: token ids (B, T), in [0, V).
            key_mask: bool (B, S), True = a real token, False = padding; S = cached + T.
            positions: position ids (T,) or (B, T) (per row, for left-padded prompts); default
                cached, cached + 1, ..., cached + T - 1.
            cache: a :class:`~multihead.cache.KVCache` (see :meth:`make_cache`) that the new
                keys/values are written into and attention reads from.

        Returns:
            logits (B, T, V). Attention weights come from :func:`multihead.capture`.

        Raises:
            ValueError: ids outside the vocabulary, or more positions than ``max_len``.
        """
        self._check_ids(ids)
        t = ids.shape[1]
        offset = cache.length if cache is not None else 0
        if offset + t > self.config.max_len:
            held = f" ({offset} cached + {t} new)" if cache is not None else ""
            raise ValueError(
                f"the sequence is {offset + t} positions long{held}, more than the model's "
                f"max_len={self.config.max_len}"
            )
        if positions is None:
            positions = torch.arange(offset, offset + t, device=ids.device)
        elif positions.numel() and int(positions.max()) >= self.config.max_len:
            raise ValueError(
                f"positions must be < max_len={self.config.max_len}, got {int(positions.max())}"
            )
        x = self.dropout(self.position_embedding(self.token_embedding(ids), positions))
        h = self.layers(x, key_mask=key_mask, is_causal=True, cache=cache)  # (B, T, E)
        return self.head(h)  # (B, T, E) -> (B, T, V)

    # -- generation -----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        *,
        use_cache: bool = True,
        temperature: float = 0.0,
        top_k: int | None = None,
        key_mask: Tensor | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue prompts token by token.

        Args:
            ids: prompts (B, T). Prompts of different lengths are left-padded (any in-vocabulary
                id in the padding) and described by ``key_mask``.
            max_new_tokens: N, the most tokens to append (≥ 0).
            use_cache: keep keys/values in a :class:`~multihead.cache.KVCache` (one new
                position per step) instead of recomputing the whole sequence at every step.
                Both give the same tokens.
            temperature: 0 picks the most likely token (greedy); > 0 samples from
                softmax(logits / temperature).
            top_k: when sampling, only from the k most likely tokens.
            key_mask: bool (B, T), True = a real prompt token. Each row's padding must come
                first (left padding); a row's first real token is position 0.
            eos_id: stop once every row has produced this token; later tokens of a finished row
                are ``eos_id`` too.
            generator: the random generator for sampling (reproducible results).

        Returns:
            (B, T + n) ids: the prompts followed by the n ≤ N generated tokens.

        Raises:
            ValueError: ids outside the vocabulary, a prompt (plus N) longer than ``max_len``, a
                key_mask that is not left padding, or bad sampling arguments.
        """
        self._check_ids(ids)
        b, t = ids.shape
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if t == 0:
            raise ValueError("ids must hold at least one prompt token, got shape (B, 0)")
        if t + max_new_tokens > self.config.max_len:
            raise ValueError(
                f"the prompt ({t} tokens) plus max_new_tokens ({max_new_tokens}) is longer than "
                f"the model's max_len={self.config.max_len}"
            )
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if eos_id is not None and not 0 <= eos_id < self.config.vocab_size:
            raise ValueError(f"eos_id must be in [0, {self.config.vocab_size}), got {eos_id}")
        positions = self._prompt_positions(ids, key_mask)

        was_training = self.training
        self.eval()
        try:
            out = ids
            cache = self.make_cache(b, t + max_new_tokens) if use_cache else None
            done = torch.zeros(b, dtype=torch.bool, device=ids.device)
            step_ids, step_pos = ids, positions
            for _ in range(max_new_tokens):
                if cache is None:  # recompute the whole sequence
                    step_ids, step_pos = out, positions
                logits = self(step_ids, key_mask=key_mask, positions=step_pos, cache=cache)
                token = self._pick(logits[:, -1], temperature, top_k, generator)  # (B,)
                if eos_id is not None:
                    token = token.masked_fill(done, eos_id)
                    done = done | (token == eos_id)
                out = torch.cat([out, token[:, None]], dim=1)
                # The new token is position last + 1 of its row, and a real token.
                step_ids, step_pos = token[:, None], positions[:, -1:] + 1
                positions = torch.cat([positions, step_pos], dim=1)
                if key_mask is not None:
                    key_mask = F.pad(key_mask, (0, 1), value=True)
                if eos_id is not None and bool(done.all()):
                    break
        finally:
            self.train(was_training)
        return out

    def _prompt_positions(self, ids: Tensor, key_mask: Tensor | None) -> Tensor:
        """Per-row positions (B, T) of the prompts: 0 at each row's first real token."""
        b, t = ids.shape
        if key_mask is None:
            return torch.arange(t, device=ids.device).expand(b, t)
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
            raise TypeError("key_mask must be a bool tensor (True = a real token)")
        if key_mask.shape != ids.shape:
            raise ValueError(
                f"key_mask must have the shape of ids (B, T) = {tuple(ids.shape)}, got "
                f"{tuple(key_mask.shape)}"
            )
        if not bool(key_mask[:, -1].all()) or bool((key_mask[:, :-1] & ~key_mask[:, 1:]).any()):
            raise ValueError(
                "key_mask must describe left padding (each row False... then True..., ending in "
                "a real token): generation appends after the last position"
            )
        return (key_mask.long().cumsum(-1) - 1).clamp(min=0)

    @staticmethod
    def _pick(
        logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
    ) -> Tensor:
        """The next token (B,) from the last position's logits (B, V)."""
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    # -- saving and loading ---------------------------------------------------------------------

    def save(
        self, directory: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None
    ) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed).

        Each file is replaced atomically (written aside, fsynced, renamed over the old one); the
        weights carry a SHA-256 checksum in their metadata, which :meth:`load` verifies.

        Args:
            directory: where to write.
            extra: more JSON-serialisable entries for ``config.json`` (e.g. the task and its
                vocabulary), beside ``"model"`` (the :class:`LMConfig`).

        Returns:
            The directory.

        Raises:
            ValueError: ``extra`` redefines ``"model"`` or ``"model_type"``.
        """
        path = Path(directory)
        extra = dict(extra or {})
        clash = {"model", "model_type"} & set(extra)
        if clash:
            raise ValueError(f"extra must not redefine the keys {sorted(clash)}")
        config = {"model_type": _MODEL_TYPE, "model": self.config.to_dict(), **extra}
        config_bytes = (json.dumps(config, indent=2) + "\n").encode()  # fails before any write
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        weights = _safetensors_bytes(tensors, {"format": "pt"})
        path.mkdir(parents=True, exist_ok=True)
        _atomic_write(path / WEIGHTS_NAME, weights)
        _atomic_write(path / CONFIG_NAME, config_bytes)
        return path

    @staticmethod
    def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
        """The parsed ``config.json`` of a saved model directory.

        Raises:
            FileNotFoundError: no such directory or no config.json in it.
            ValueError: the file is not a TransformerLM config.
        """
        path = Path(directory)
        if not path.is_dir():
            what = "is not a directory" if path.exists() else "does not exist"
            raise FileNotFoundError(f"checkpoint directory {str(path)!r} {what}")
        file = path / CONFIG_NAME
        if not file.is_file():
            raise FileNotFoundError(f"{str(file)!r} is missing: not a saved TransformerLM")
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(file)!r} is not valid JSON ({e})") from None
        if not isinstance(config, dict) or config.get("model_type") != _MODEL_TYPE:
            raise ValueError(
                f"{str(file)!r} is not a TransformerLM config (model_type must be {_MODEL_TYPE!r})"
            )
        if not isinstance(config.get("model"), dict):
            raise ValueError(f"{str(file)!r} has no 'model' entry (a JSON object)")
        return config

    @classmethod
    def load(
        cls, directory: str | os.PathLike[str], *, device: torch.device | str | None = None
    ) -> TransformerLM:
        """Load a model written by :meth:`save`.

        Args:
            directory: holding ``config.json`` and ``model.safetensors``.
            device: where to put the weights; default CPU.

        Raises:
            FileNotFoundError: the directory or one of its files is missing.
            ValueError: a corrupt file (a failed checksum included), non-finite weights, or
                weights that don't match the config (names the tensors that are missing,
                unexpected or of the wrong shape or dtype).
        """
        path = Path(directory)
        raw = cls.read_config(path)
        try:
            config = LMConfig.from_dict(raw["model"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{str(path / CONFIG_NAME)!r}: {e}") from None
        weights = path / WEIGHTS_NAME
        tensors, _ = _read_safetensors(weights)
        mismatch = f"the weights in {str(weights)!r} don't match its config"
        if config.num_layers > len(tensors):  # each layer holds tensors: don't build millions
            raise ValueError(
                f"{mismatch}: num_layers={config.num_layers} but the file holds only "
                f"{len(tensors)} tensors"
            )
        # Compare on the meta device first: a config edited to absurd widths allocates nothing.
        expected = cls.from_config(config, device="meta").state_dict()
        problems = []
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing:
            problems.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            problems.append(f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
        for name in sorted(set(expected) & set(tensors)):
            want, got = expected[name], tensors[name]
            if want.shape != got.shape:
                problems.append(
                    f"{name} has shape {tuple(got.shape)}, the config needs {tuple(want.shape)}"
                )
            elif want.dtype != got.dtype:
                problems.append(f"{name} has dtype {got.dtype}, the model needs {want.dtype}")
        if problems:
            raise ValueError(f"{mismatch}: " + "; ".join(problems[:4]))
        bad = [name for name, t in tensors.items() if not bool(torch.isfinite(t).all())]
        if bad:
            raise ValueError(
                f"the weights in {str(weights)!r} are not finite (nan or inf in {bad[:4]}): the "
                f"run that wrote them diverged"
            )
        model = cls.from_config(config, device=device)
        model.load_state_dict(tensors)
        return model
