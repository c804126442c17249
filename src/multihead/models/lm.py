"""A small causal language model built from multihead's layers, for the synthetic tasks.

    ids (B, T) → token embedding + learned position embedding → dropout
               → N decoder blocks, causal (each position sees itself and before):
                     x = x + attn(norm1(x));  x = x + ff(norm2(x))      (pre-LN)
               → final LayerNorm (pre-LN only) → output head → logits (B, T, V)

A decoder block here is a :class:`~multihead.layers.TransformerEncoderLayer` run with
``is_causal=True`` (a GPT block: self-attention and feed-forward, no cross-attention), or, with
``attn_only=True``, an :class:`AttentionOnlyBlock` (the setting of Elhage et al.'s "A Mathematical
Framework for Transformer Circuits", where induction heads were first described).

Seed 003 masks the decoder "to ensure the autoregressive nature" of the task; here the same
bottom-right causal mask serves training on whole sequences and decoding token by token with a
:class:`~multihead.kv_cache.KVCache`. The files a model is saved in are
:mod:`multihead.models.lm_io`'s (config.json, checksummed safetensors, old weight names); how
the next token is picked is :mod:`multihead.models.generation`'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead._checks import (
    check_finite_float,
    check_index,
    check_non_negative_int,
    check_optional_positive_int,
)
from multihead._files import TensorInfo, layer_counts, read_header, tensor_problems
from multihead.kv_cache import KVCache
from multihead.layers import TransformerEncoderLayer
from multihead.map_types import ModelMap
from multihead.models import lm_io
from multihead.models.attention_only_block import AttentionOnlyBlock
from multihead.models.generation import pick, prompt_positions
from multihead.models.lm_config import LMConfig
from multihead.models.lm_io import CONFIG_NAME, WEIGHTS_NAME
from multihead.positions import LearnedPositionalEmbedding

__all__ = ["TransformerLM"]


class TransformerLM(nn.Module):
    """A decoder-only transformer language model (GPT-style) from multihead's layers.

    Args:
        vocab_size: V, the number of token ids.
        embed_dim: E.
        num_heads: H.
        num_layers: the number of decoder blocks.
        ff_dim: the feed-forward hidden width (unused with ``attn_only``).
        max_len: the most positions the model handles (learned position embeddings).
        num_kv_heads: key/value heads per layer (grouped-query attention); default ``num_heads``.
        dropout: on embeddings, attention weights, feed-forward and residual branches.
        norm_first: pre-LN blocks and a final LayerNorm (default), or post-LN blocks.
        attn_only: blocks without feed-forward networks (:class:`AttentionOnlyBlock`).
        embedding_std: the standard deviation of the token and position embeddings at
            initialisation. GPT-2's 0.02 (default) keeps the residual stream small at first;
            the induction task uses 1.0, with which an attention-only model grows its induction
            heads in a few hundred steps (with 0.02 it did not within 90 s; docs/induction.md).
        device, dtype: as for any torch module.

    Submodules: ``token_embedding`` (V → E), ``position_embedding``, ``blocks`` (the decoder
    blocks, :class:`~multihead.layers.TransformerEncoderLayer` run causally, or
    :class:`AttentionOnlyBlock`), ``norm`` (the final LayerNorm; None for post-LN), ``head``
    (E → V). Weights saved under the names of earlier versions (``layers.layers.{i}``,
    ``layers.norm``) still load.

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
        attn_only: bool = False,
        embedding_std: float = 0.02,
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
            attn_only=attn_only,
            embedding_std=embedding_std,
        )
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.token_embedding = nn.Embedding(vocab_size, embed_dim, **factory)
        self.position_embedding = LearnedPositionalEmbedding(max_len, embed_dim, **factory)
        self.dropout = nn.Dropout(dropout)
        block_kw: dict[str, Any] = {
            "num_kv_heads": num_kv_heads,
            "dropout": dropout,
            "norm_first": norm_first,
            **factory,
        }
        self.blocks = nn.ModuleList(
            AttentionOnlyBlock(embed_dim, num_heads, **block_kw)
            if attn_only
            else TransformerEncoderLayer(embed_dim, num_heads, ff_dim, **block_kw)
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(embed_dim, **factory) if norm_first else None
        self.head = nn.Linear(embed_dim, vocab_size, bias=False, **factory)
        with torch.no_grad():
            # GPT-2's small embeddings (0.02) by default: N(0, 1) ones would dominate the
            # residual stream at init, which is what an attention-only induction model needs.
            for weight in (self.token_embedding.weight, self.position_embedding.embedding.weight):
                nn.init.normal_(weight, std=embedding_std)
            nn.init.normal_(self.head.weight, std=0.02)

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
        """An empty :class:`~multihead.kv_cache.KVCache` sized for this model.

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

    def check_ids(self, ids: Tensor, name: str = "ids") -> None:
        """Raise TypeError/ValueError unless ``ids`` is a (B, T) int tensor in [0, V)."""
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

    def build_model_map(self) -> ModelMap:
        """Its :class:`~multihead.map_types.ModelMap` (read through :func:`multihead.model_map`):
        blocks and heads, the token and position embeddings, the final norm (None when
        post-LN) and the unembedding ``head``; causal; ``max_len`` positions, taken as
        ``positions``."""
        return ModelMap.of_modules(
            self,
            family="TransformerLM",
            embeddings=(self.token_embedding, self.position_embedding),
            position_table=self.position_embedding.embedding,
            final_norm=self.norm,
            unembedding=self.head,
            width=self.config.embed_dim,
            causal=True,
            position_limit=self.config.max_len,
            positions_argument="positions",
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
            cache: a :class:`~multihead.kv_cache.KVCache` (see :meth:`make_cache`) that the new
                keys/values are written into and attention reads from.

        Returns:
            logits (B, T, V). Attention weights come from :func:`multihead.capture`.

        Raises:
            ValueError: ids outside the vocabulary, or more positions than ``max_len``.
        """
        self.check_ids(ids)
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
        x = self.dropout(self.position_embedding(self.token_embedding(ids), positions))  # (B, T, E)
        for i, block in enumerate(self.blocks):
            x = block(
                x, key_mask=key_mask, is_causal=True, cache=None if cache is None else cache[i]
            )
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x)  # (B, T, E) -> (B, T, V)

    # -- generation ------------------------------------------------------------------------------

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
        """Continue prompts token by token (no gradients; the model is in eval mode meanwhile).

        Args:
            ids: prompts (B, T). Prompts of different lengths are left-padded (any in-vocabulary
                id in the padding) and described by ``key_mask``.
            max_new_tokens: N, the most tokens to append (≥ 0).
            use_cache: keep keys/values in a :class:`~multihead.kv_cache.KVCache` (one new
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
        config = self.config
        self.check_ids(ids)
        b, t = ids.shape
        check_non_negative_int("max_new_tokens", max_new_tokens)
        if t == 0:
            raise ValueError("ids must hold at least one prompt token, got shape (B, 0)")
        if t + max_new_tokens > config.max_len:
            raise ValueError(
                f"the prompt ({t} tokens) plus max_new_tokens ({max_new_tokens}) is longer than "
                f"the model's max_len={config.max_len}"
            )
        check_finite_float("temperature", temperature, minimum=0.0)  # NaN or inf: refused
        check_optional_positive_int("top_k", top_k)
        if eos_id is not None:
            check_index("eos_id", eos_id, config.vocab_size, "token ids")
            if eos_id < 0:
                raise ValueError(f"eos_id must be in [0, {config.vocab_size}), got {eos_id}")
        positions = prompt_positions(ids, key_mask)  # (B, T)

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
                token = pick(logits[:, -1], temperature, top_k, generator)  # (B,)
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

    # -- saving and loading ----------------------------------------------------------------------

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
        return lm_io.write_files(
            directory, lm_io.config_json(self.config, extra), self.state_dict()
        )

    @staticmethod
    def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
        """The parsed ``config.json`` of a saved model directory.

        Raises:
            FileNotFoundError: no such directory or no config.json in it.
            ValueError: the file is not a TransformerLM config.
        """
        return lm_io.read_config(directory)

    @classmethod
    def load(
        cls, directory: str | os.PathLike[str], *, device: torch.device | str | None = None
    ) -> TransformerLM:
        """Load a model written by :meth:`save` (also under an earlier version's weight names).

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
        config = lm_io.read_model_config(path / CONFIG_NAME, lm_io.read_config(path))
        weights = path / WEIGHTS_NAME
        cls.check_weights(config, read_header(weights).tensors, weights)
        # Only now is anything the size of the model read: the header matched the config.
        tensors = lm_io.read_weights(weights, device=device)
        model = cls.from_config(config, device=device)
        model.load_state_dict(tensors)
        return model

    @classmethod
    def check_weights(
        cls, config: LMConfig, found: Mapping[str, TensorInfo], file: str | os.PathLike[str]
    ) -> None:
        """The tensors a safetensors header describes (``found``, names as stored, also an
        earlier version's) must be exactly those of the model ``config`` builds: names, shapes
        and dtypes. Nothing the size of the model is allocated.

        Raises:
            ValueError: one short line naming ``file`` and what disagrees.
        """
        found = lm_io.rename_legacy_keys(found)
        mismatch = f"the weights in {os.fspath(file)!r} don't match its {CONFIG_NAME}"
        blocks = layer_counts(found).get("blocks", 0)
        if blocks != config.num_layers:  # millions of layers are not built to find this out
            raise ValueError(
                f"{mismatch}: it has {config.num_layers} layers, the file holds {blocks} (blocks.N)"
            )
        # The sizes that set the largest tensors, checked on the tensors that show them: a size
        # such as max_len=10**17 overflows even on the meta device.
        e = config.embed_dim
        direct = {
            "token_embedding.weight": TensorInfo((config.vocab_size, e), "float32"),
            "position_embedding.embedding.weight": TensorInfo((config.max_len, e), "float32"),
        }
        if not config.attn_only:
            direct["blocks.0.ff.linear1.weight"] = TensorInfo((config.ff_dim, e), "float32")
        needs = f"{CONFIG_NAME} needs"
        problems = tensor_problems(direct, found, needs=needs, extra=False)
        if not problems:  # every size now matches the file's: the meta model is as small as it
            meta = cls.from_config(config, device="meta").state_dict()
            expected = {k: TensorInfo.of(v) for k, v in meta.items()}
            problems = tensor_problems(expected, found, needs=needs)
        if problems:
            raise ValueError(f"{mismatch}: " + "; ".join(problems))
