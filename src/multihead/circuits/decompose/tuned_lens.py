"""The tuned lens: each layer's stream through an affine translator, then the final norm and
unembedding.

Belrose et al. (2023), *Eliciting Latent Predictions from Transformers with the Tuned Lens*,
give each layer a translator (A_i, b_i), trained so that the layer's stream read through it
predicts what the model's output does, and read the stream as::

    lens_i(h) = W_U · final_norm(h + A_i h + b_i)          (B, P, V)

(``h + translator(h)``: tuned-lens adds the translator's output to the stream, so that its
weight decay pulls the lens toward the logit lens). :func:`multihead.logit_lens` reads it with
``lens=``; a head's write goes through the linear part ``I + A_i`` alone: the bias b_i is the
lens's, no head's.

**Which stream.** Translator i reads tuned-lens's ``hidden_states[i]`` (transformers'
``output_hidden_states``): i = 0 the embeddings, i >= 1 the output of block i - 1, i < L; the
last block's output has none (its lens is the model's logits). multihead's layers are block
outputs (``resid_post``), so its layer l is read through translator l + 1, and the last layer
by the identity; translator 0 is kept (:meth:`TunedLens.transform_hidden` reads the
embeddings with it) and :func:`~multihead.logit_lens` does not read the embeddings.

**Files** (:mod:`~multihead.circuits.decompose.tuned_lens_layout`): tuned-lens's directory of
``config.json`` and ``params.pt`` (read with ``torch.load(weights_only=True)``), or its twin
``params.safetensors``; tuned-lens 0.0.x's layout is read too. The provenance
(``base_model_name_or_path``, ``unembed_hash``: tuned-lens's hash of the unembedding matrix)
is checked when the lens is loaded for or read on a model: one warning where it differs.

:meth:`TunedLens.fit` is not tuned-lens's training (SGD on the KL divergence to the model's
output): it fits each translator by ridge-regularised least squares of the last block's
output on the layer's stream, in closed form; a quick stand-in where no trained lens exists.

Shapes: B batch, T tokens, P positions read, E width, V vocabulary, L layers.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from multihead._checks import check_non_negative_int, describe, is_int
from multihead.circuits.decompose.lens_provenance import LensProvenance
from multihead.circuits.decompose.tuned_lens_layout import LENS_TYPE, TunedLensLayout
from multihead.circuits.runs.input_pair import model_inputs
from multihead.circuits.runs.site_recorder import cache
from multihead.mapping import model_map

__all__ = ["TunedLens", "unembed_hash"]


# each weight's hash at its version, by the weight's id (a tensor is no dict key: its == is
# elementwise): a lens checked on every logit_lens call copies a (V, E) matrix to the host once
_HASHES: dict[int, tuple[weakref.ref[Tensor], int, str]] = {}


def unembed_hash(weight: Tensor) -> str:
    """tuned-lens's hash of an unembedding matrix (V, E) (``tuned_lens.utils.tensor_hash``):
    the SHA-256 of numpy's summary print of it at one decimal, robust to small changes."""
    known = _HASHES.get(id(weight))
    if known is not None and known[0]() is weight and known[1] == weight._version:
        return known[2]
    array = weight.detach().cpu().float().numpy()
    digest = hashlib.sha256(str.encode(np.array_str(array, precision=1))).hexdigest()
    # a dead weight's entry is replaced when its id comes back (a few bytes each meanwhile)
    _HASHES[id(weight)] = (weakref.ref(weight), weight._version, digest)
    return digest


@dataclass(frozen=True, eq=False)
class TunedLens:
    """A tuned lens: one affine translator per stream read (module docstring).

    Attributes:
        weights: (L, E, E) A_i, translator i's weight (``nn.Linear``'s: it maps h to A_i h).
        biases: (L, E) b_i, or None for a lens without biases.
        config: tuned-lens's ``config.json`` (``base_model_name_or_path``, ``d_model``,
            ``num_hidden_layers``, ``bias``, ``base_model_revision``, ``unembed_hash``,
            ``lens_type``).

    Raises:
        ValueError: weights not (L, E, E), biases not (L, E).
    """

    weights: Tensor
    biases: Tensor | None
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        w = self.weights
        if not isinstance(w, Tensor) or w.dim() != 3 or w.shape[1] != w.shape[2]:
            raise ValueError(f"weights must be an (L, E, E) tensor, got {describe(w)}")
        if not w.is_floating_point():
            raise TypeError(f"weights must be floating point, got {w.dtype}")
        b = self.biases
        if b is not None and (not isinstance(b, Tensor) or tuple(b.shape) != tuple(w.shape[:2])):
            raise ValueError(
                f"biases must be None or (L, E) = {tuple(w.shape[:2])}, got {describe(b)}"
            )
        count, width = w.shape[:2]
        config = {
            "base_model_name_or_path": "",
            "d_model": width,
            "num_hidden_layers": count,
            "bias": b is not None,
            "base_model_revision": None,
            "unembed_hash": None,
            "lens_type": LENS_TYPE,
            **(self.config or {}),
        }
        if config["d_model"] != width or config["num_hidden_layers"] != count:
            raise ValueError(
                f"config says d_model {config['d_model']} and num_hidden_layers "
                f"{config['num_hidden_layers']}, the weights are {tuple(w.shape)}"
            )
        object.__setattr__(self, "config", config)

    @property
    def num_layers(self) -> int:
        """L, the model's layers (one translator per stream before the last block's output)."""
        return self.weights.shape[0]

    @property
    def d_model(self) -> int:
        """E, the width of the stream."""
        return self.weights.shape[1]

    def __repr__(self) -> str:
        name = self.config.get("base_model_name_or_path") or None
        return f"TunedLens(num_layers={self.num_layers}, d_model={self.d_model}, model={name!r})"

    # -- reading -----------------------------------------------------------------------------

    def transform_hidden(self, stream: Tensor, idx: int) -> Tensor:
        """(..., E) ``h + A_idx h + b_idx`` for tuned-lens's ``hidden_states[idx]`` ``stream``
        (idx 0 the embeddings, idx >= 1 block idx - 1's output), in float32 at least.

        Raises:
            ValueError: idx outside 0 .. L - 1, a stream not E wide.
        """
        if not is_int(idx) or not 0 <= idx < self.num_layers:
            raise ValueError(f"idx must be an int in 0..{self.num_layers - 1}, got {idx!r}")
        if stream.shape[-1] != self.d_model:
            raise ValueError(
                f"stream must be (..., {self.d_model}), got shape {tuple(stream.shape)}"
            )
        dtype = torch.promote_types(stream.dtype, torch.float32)
        h = stream.to(dtype)
        out = h + h @ self.weights[idx].to(h.device, dtype).T
        return out if self.biases is None else out + self.biases[idx].to(h.device, dtype)

    def affine(self, layer: int, num_layers: int) -> tuple[Tensor | None, Tensor | None]:
        """(M, b) with the lens of block ``layer``'s output ``M h + b`` on a model of
        ``num_layers`` layers: (I + A_{layer+1}, b_{layer+1}); (None, None), the identity, for
        the last layer."""
        if layer == num_layers - 1:
            return None, None
        weight = self.weights[layer + 1]
        linear = weight + torch.eye(self.d_model, dtype=weight.dtype, device=weight.device)
        return linear, None if self.biases is None else self.biases[layer + 1]

    def check(self, model: nn.Module, *, stacklevel: int = 2) -> None:
        """Check that the lens fits ``model``; warn once where its provenance differs.

        Raises:
            ValueError: another width or number of layers.

        Warns:
            UserWarning: one, where ``base_model_name_or_path`` names another model or
                ``unembed_hash`` differs from the model's unembedding's.
        """
        mapped = model_map(model)
        if (mapped.width is not None and mapped.width != self.d_model) or (
            mapped.num_layers != self.num_layers
        ):
            raise ValueError(
                f"the tuned lens is for {self.num_layers} layers {self.d_model} wide, the model "
                f"{mapped.family} has {mapped.num_layers} layers {mapped.width} wide: it "
                f"belongs to another model"
            )
        name = self.config.get("base_model_name_or_path")
        recorded = LensProvenance(name if isinstance(name, str) else None, None)
        differences = LensProvenance.of(model).differences(recorded)
        stored = self.config.get("unembed_hash")
        if isinstance(stored, str) and stored and mapped.unembedding is not None:
            if unembed_hash(mapped.unembedding.weight) != stored:
                differences.append("its unembed_hash is not the model's unembedding's")
        LensProvenance.warn("this tuned lens", differences, stacklevel + 1)

    # -- fitting -----------------------------------------------------------------------------

    @classmethod
    @torch.no_grad()
    def fit(
        cls, model: nn.Module, inputs: Any, *, ridge: float = 1e-2, skip_first_positions: int = 0
    ) -> TunedLens:
        """Fit a translator per stream by least squares (not tuned-lens's training).

        Translator i (tuned-lens's ``hidden_states[i]``, module docstring) is the (A_i, b_i)
        minimising, over the real positions of ``inputs``::

            Σ_t ‖h_final,t - (h_t + A_i h_t + b_i)‖²  +  λ ‖A_i‖²,   λ = ridge · tr(X_cᵀX_c) / E

        with h_final the last block's output (before the final norm) and X_c the layer's
        streams less their mean; b_i is not penalised. Solved in float64 in closed form.

        Args:
            model: a model whose map knows its blocks and unembedding, as for
                :func:`multihead.logit_lens`.
            inputs: token ids (B, T), a dict of the model's keyword arguments (an
                ``attention_mask``'s zeros are left out), or for a text model texts.
            ridge: the penalty's weight, relative to the streams' mean variance: > 0 (with
                fewer positions than E a translator is otherwise not determined).
            skip_first_positions: the leading real positions of each row left out (the first
                token's stream, an attention sink, can dwarf the others).

        Returns:
            A :class:`TunedLens` whose config records the model's name and unembedding hash.

        Raises:
            ValueError: a model without blocks or unembedding, ridge not a positive number,
                no position left.
        """
        if (
            isinstance(ridge, bool)
            or not isinstance(ridge, (int, float))
            or not (math.isfinite(ridge) and ridge > 0)
        ):
            raise ValueError(f"ridge must be a finite number > 0, got {describe(ridge)}")
        skip = check_non_negative_int("skip_first_positions", skip_first_positions)
        mapped = model_map(model)
        if mapped.unembedding is None:
            raise ValueError(
                f"TunedLens.fit needs a model with an unembedding (a causal LM), got "
                f"{type(model).__name__}"
            )
        count = mapped.num_layers
        checked = model_inputs(model, inputs)
        names = [("resid_pre", 0)] + [("resid_post", layer) for layer in range(count)]
        kept = cache(model, checked, names=names)
        first = kept["resid_pre", 0]  # (B, T, E)
        mask = checked.get("attention_mask") if isinstance(checked, dict) else None
        real = (
            torch.ones(first.shape[:2], dtype=torch.bool, device=first.device)
            if mask is None
            else mask.to(first.device).bool()
        )
        keep = real & (real.cumsum(1) > skip)  # (B, T)
        if not bool(keep.any()):
            raise ValueError(
                f"TunedLens.fit has no position to fit on: every row has at most "
                f"skip_first_positions = {skip} real tokens"
            )
        final = kept["resid_post", count - 1][keep].double()  # (N, E)
        weights, biases = [], []
        for i in range(count):
            stream = first if i == 0 else kept["resid_post", i - 1]
            x = stream[keep].double()  # (N, E)
            residual = final - x
            x_mean, r_mean = x.mean(0), residual.mean(0)
            xc, rc = x - x_mean, residual - r_mean
            gram = xc.T @ xc  # (E, E)
            penalty = ridge * float(gram.diagonal().sum()) / gram.shape[0]
            eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
            a_t = torch.linalg.solve(gram + max(penalty, 1e-12) * eye, xc.T @ rc)  # Aᵀ (E, E)
            weights.append(a_t.T)
            biases.append(r_mean - x_mean @ a_t)
        dtype = torch.promote_types(first.dtype, torch.float32)
        assert mapped.unembedding is not None
        config = {
            "base_model_name_or_path": mapped.name or "",
            "unembed_hash": unembed_hash(mapped.unembedding.weight),
        }
        return cls(
            torch.stack(weights).to(dtype).cpu(), torch.stack(biases).to(dtype).cpu(), config
        )

    # -- files -------------------------------------------------------------------------------

    def save(self, path: str | Path, *, ckpt: str = "params.pt") -> None:
        """Write the lens to the directory ``path`` (made if missing) in tuned-lens's layout:
        ``config.json`` and ``ckpt`` (``params.pt``, or its twin ``params.safetensors``; the
        suffix chooses), each written atomically.

        Raises:
            ValueError: a ckpt not ending in .pt or .safetensors, a path that is a file.
        """
        TunedLensLayout.write(Path(path), ckpt, self.weights, self.biases, self.config)

    @classmethod
    def load(
        cls, path: str | Path, *, model: nn.Module | None = None, ckpt: str | None = None
    ) -> TunedLens:
        """Read a tuned lens from the directory ``path`` (module docstring's layouts); with
        ``model``, :meth:`check` it against the model.

        Args:
            path: the directory holding ``config.json`` and the parameters.
            model: the model it will be read on, checked.
            ckpt: the parameters' file name; default the one of ``params.pt`` and
                ``params.safetensors`` that is there.

        Raises:
            FileNotFoundError: no such directory, config or parameters.
            ValueError: a config or parameters that are not a tuned lens's (names the file and
                what is wrong), both parameter files and no ckpt, a lens type other than
                ``linear_tuned_lens``; with ``model``, one that does not fit it.

        Warns:
            UserWarning: with ``model``, where the recorded provenance differs from it.
        """
        weights, biases, config = TunedLensLayout.read(Path(path), ckpt)
        lens = cls(weights, biases, config)
        if model is not None:
            lens.check(model, stacklevel=3)
        return lens
