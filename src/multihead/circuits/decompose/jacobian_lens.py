"""The Jacobian lens: each layer's stream carried to the last block's output by its mean Jacobian.

Gurnee et al. (2026), *Verbalizable Representations Form a Global Workspace in Language Models*
(Transformer Circuits Thread), fit one (E, E) matrix per layer l::

    J_l = mean over prompts of  1/|V| Σ_{t ∈ V} Σ_{t' ∈ V} ∂h_final,t' / ∂h_l,t

with h_l the output of block l (``resid_post``), h_final the last block's output (before the
final norm) and V a prompt's positions after its first ``skip_first_positions`` and before its
last; causal attention makes the terms with t' < t zero. Each source position's effects on
every later position are summed, and only source positions and prompts are averaged. The lens
reads layer l as::

    lens_l(h) = W_U · final_norm(J_l h)          (B, P, V)

and the last layer by the identity (its lens is the model's logits); the logit lens is
``J_l = I``. :func:`multihead.logit_lens` reads it with ``lens=``.

The estimator (:mod:`~multihead.circuits.decompose.mean_jacobians`) is that of Anthropic's
reference implementation (anthropics/jacobian-lens) as TransformerLens 4.3's
``JacobianLens.fit`` implements it, with the same defaults (the first 16 positions and the last
left out of V): the same token ids give TransformerLens's matrices.

Files (:mod:`~multihead.circuits.decompose.jacobian_artifact`, chosen by the suffix): ``.pt``,
the reference's artifact as TransformerLens writes and reads it, read with
``torch.load(weights_only=True)`` (the reference's fit checkpoint too); ``.safetensors``, its
twin. The metadata records the model
(:class:`~multihead.circuits.decompose.lens_provenance.LensProvenance`), checked when the lens
is loaded for or read on a model: a difference is one warning.

Shapes: B batch, T tokens, P positions read, E width, V vocabulary, L layers.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from multihead import __version__
from multihead._checks import (
    check_indices,
    check_non_negative_int,
    check_positive_int,
    describe,
    is_int,
)
from multihead._files import few
from multihead.circuits.decompose.jacobian_artifact import (
    ESTIMATOR,
    JacobianArtifact,
    check_metadata,
    suffix_of,
)
from multihead.circuits.decompose.lens_provenance import LensProvenance
from multihead.circuits.decompose.mean_jacobians import mean_jacobians
from multihead.mapping import model_map

__all__ = ["JacobianLens"]

# the reference's default: the first positions (attention sinks, atypical streams) left out
DEFAULT_SKIP_FIRST_POSITIONS = 16
# what a fit records itself; a caller's metadata may not set these
_FIT_KEYS = (
    "model_name", "transformers_version", "multihead_version", "estimator", "corpus",
    "n_prompts", "fit_dtype", "target_layer", "dim_batch", "skip_first_positions",
)  # fmt: skip


@dataclass(frozen=True, eq=False)
class JacobianLens:
    """A fitted Jacobian lens: one (E, E) matrix per source layer (module docstring).

    Attributes:
        jacobians: {layer: (E, E)} the matrices, on the CPU, float32 (float64 when fitted on a
            float64 model); layer l's maps the output of block l to the last block's output.
        n_prompts: the prompts averaged into the fit.
        d_model: E, the width of the stream the lens was fitted for.
        metadata: provenance (the model's name, the transformers version, the fit's options);
            kept by :meth:`save` and :meth:`load`, empty for an artifact that carries none.

    Raises:
        ValueError: no matrix, a matrix not (d_model, d_model), a layer that is not an int
            >= 0, metadata of other types than a ``torch.load(weights_only=True)`` reads.
    """

    jacobians: dict[int, Tensor]
    n_prompts: int
    d_model: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.jacobians, Mapping) or not self.jacobians:
            raise ValueError(
                f"jacobians must map at least one layer to its matrix, got "
                f"{describe(self.jacobians)}"
            )
        check_positive_int("d_model", self.d_model)
        check_non_negative_int("n_prompts", self.n_prompts)
        matrices = {}
        for layer, matrix in self.jacobians.items():
            if not is_int(layer) or layer < 0:
                raise ValueError(f"jacobians' layers must be ints >= 0, got {layer!r}")
            if not isinstance(matrix, Tensor) or not matrix.is_floating_point():
                raise TypeError(
                    f"jacobians[{layer}] must be a floating tensor, got {describe(matrix)}"
                )
            if tuple(matrix.shape) != (self.d_model, self.d_model):
                raise ValueError(
                    f"jacobians[{layer}] must be (d_model, d_model) = ({self.d_model}, "
                    f"{self.d_model}), got shape {tuple(matrix.shape)}"
                )
            kept = matrix.detach().cpu()
            matrices[int(layer)] = kept if kept.dtype == torch.float64 else kept.float()
        object.__setattr__(self, "jacobians", dict(sorted(matrices.items())))
        object.__setattr__(self, "metadata", dict(self.metadata or {}))
        check_metadata(self.metadata, "metadata")

    @property
    def source_layers(self) -> list[int]:
        """The layers the lens has a matrix for, in order."""
        return list(self.jacobians)

    def __repr__(self) -> str:
        return (
            f"JacobianLens(layers={self.source_layers}, d_model={self.d_model}, "
            f"n_prompts={self.n_prompts})"
        )

    # -- reading -----------------------------------------------------------------------------

    def affine(self, layer: int, num_layers: int) -> tuple[Tensor | None, None]:
        """(M, b) with the lens of block ``layer``'s output ``M h + b`` on a model of
        ``num_layers`` layers: (J_layer, None); (None, None), the identity, for the last layer.

        Raises:
            ValueError: a layer below the last that the lens has no matrix for.
        """
        if layer == num_layers - 1:
            return None, None
        if layer not in self.jacobians:
            raise ValueError(
                f"the Jacobian lens has no matrix for layer {layer}: it has layers "
                f"{self.source_layers} (and the last, {num_layers - 1}, read by the identity)"
            )
        return self.jacobians[layer], None

    def transport(self, stream: Tensor, layer: int) -> Tensor:
        """(..., E) ``J_layer h`` for block ``layer``'s output ``stream`` (..., E), in float32
        at least.

        Raises:
            ValueError: a layer the lens has no matrix for, a stream not E wide.
        """
        if layer not in self.jacobians:
            raise ValueError(f"layer must be one of {self.source_layers}, got {layer!r}")
        if stream.shape[-1] != self.d_model:
            raise ValueError(
                f"stream must be (..., {self.d_model}), got shape {tuple(stream.shape)}"
            )
        dtype = torch.promote_types(stream.dtype, self.jacobians[layer].dtype)
        return stream.to(dtype) @ self.jacobians[layer].to(stream.device, dtype).T

    def check(self, model: nn.Module, *, stacklevel: int = 2) -> None:
        """Check that the lens fits ``model``; warn once where its provenance differs.

        Raises:
            ValueError: another width, source layers outside 0..L - 2, or a recorded target
                layer that is not the model's last.

        Warns:
            UserWarning: one, naming every difference of the recorded model name and
                transformers version from ``model``'s (:class:`LensProvenance`).
        """
        mapped = model_map(model)
        if mapped.width is not None and mapped.width != self.d_model:
            raise ValueError(
                f"the Jacobian lens is {self.d_model} wide (d_model), the model "
                f"{mapped.family} is {mapped.width} wide: it belongs to another model"
            )
        last = mapped.num_layers - 1
        outside = [layer for layer in self.source_layers if layer >= last]
        if outside:
            raise ValueError(
                f"the Jacobian lens has layers {outside}, outside the model's source layers "
                f"0..{last - 1} ({mapped.family} has {last + 1} layers): it belongs to another "
                f"model"
            )
        target = self.metadata.get("target_layer")
        if is_int(target) and target != last:
            raise ValueError(
                f"the Jacobian lens maps to layer {target}, not to the model's last ({last})"
            )
        recorded = LensProvenance.recorded(self.metadata)
        differences = LensProvenance.of(model).differences(recorded)
        LensProvenance.warn("this Jacobian lens", differences, stacklevel + 1)

    # -- fitting -----------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        model: nn.Module,
        inputs: Any,
        *,
        layers: int | Sequence[int] | None = None,
        skip_first_positions: int = DEFAULT_SKIP_FIRST_POSITIONS,
        dim_batch: int = 32,
        corpus: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> JacobianLens:
        """Fit the lens on ``inputs``, each row one prompt (module docstring's estimator).

        Args:
            model: a causal model whose map knows its blocks (multihead's
                :class:`~multihead.models.TransformerLM`, a transformers causal LM, a
                :class:`multihead.TextModel`), in eval mode; its parameters are frozen during
                the fit and set back after.
            inputs: token ids (B, T), a dict of the model's keyword arguments, or for a text
                model a text or texts. An ``attention_mask`` marks each row's real tokens: a
                row padded on the right runs alone on them, one padded on the left keeps its
                pads and reads only its real positions.
            layers: the source layers (negative from the end), each below the last; default
                all of 0 .. L - 2.
            skip_first_positions: the leading real positions of each prompt left out of V
                (the reference's 16); the last position is always left out.
            dim_batch: output coordinates per backward pass (memory grows with it, the work
                does not).
            corpus: a name for the prompts, recorded in the metadata.
            metadata: more provenance to record (str keys; None, bools, numbers, strings,
                lists and dicts), not the keys the fit records itself.

        Returns:
            A :class:`JacobianLens`.

        Raises:
            ValueError: a model that is not causal, has fewer than 2 layers, is in training
                mode or whose map knows no blocks; a layer out of range or the last; a
                negative ``skip_first_positions``, ``dim_batch`` not positive; bad metadata;
                no prompt long enough (more than ``skip_first_positions`` + 1 real tokens).
            TypeError: inputs, layers or metadata of another kind.

        Warns:
            UserWarning: prompts too short to have a position in V (skipped).
        """
        skip = check_non_negative_int("skip_first_positions", skip_first_positions)
        chunk = check_positive_int("dim_batch", dim_batch)
        if corpus is not None and (not isinstance(corpus, str) or not corpus.strip()):
            raise ValueError(f"corpus must be a non-empty str or None, got {describe(corpus)}")
        extra = dict(metadata or {})
        check_metadata(extra, "metadata")
        reserved = sorted(set(extra) & set(_FIT_KEYS))
        if reserved:
            raise ValueError(f"metadata may not set what the fit records itself: {reserved}")
        mapped = model_map(model)
        count = mapped.num_layers
        if count < 2:
            raise ValueError(
                f"JacobianLens.fit needs a model of at least 2 layers, {mapped.family} has {count}"
            )
        if mapped.causal is not True:
            raise ValueError(
                f"JacobianLens.fit needs a causal model (its estimator sums the later positions "
                f"by causality), {mapped.family} is not known to be causal"
            )
        if any(m.training for m in model.modules()):
            raise ValueError(
                "JacobianLens.fit needs the model in eval mode (model.eval()): dropout would "
                "make each Jacobian a random draw"
            )
        chosen = sorted(set(check_indices("layers", layers, count, "layers") or range(count - 1)))
        if chosen[-1] == count - 1:
            raise ValueError(
                f"layers must be below the last layer ({count - 1}), which the lens reads by "
                f"the identity, got {chosen}"
            )
        if _model_dtype(model) in (torch.float16, torch.bfloat16):
            warnings.warn(
                f"JacobianLens.fit in {_model_dtype(model)} takes each backward pass at reduced "
                "precision (the sums are float32): a float32 model gives the faithful fit",
                stacklevel=2,
            )
        found = mean_jacobians(model, inputs, chosen, skip=skip, chunk=chunk)
        done, skipped = found.prompts, found.skipped
        if skipped:
            warnings.warn(
                f"JacobianLens.fit skipped {len(skipped)} prompt(s) (rows "
                f"{few([str(r) for r in skipped])}) with at most {skip + 1} real tokens: each "
                f"needs more than skip_first_positions + 1 = {skip + 1}",
                stacklevel=2,
            )
        if not done:
            raise ValueError(
                f"JacobianLens.fit found no prompt with more than skip_first_positions + 1 = "
                f"{skip + 1} real tokens: nothing was fitted"
            )
        jacobians = found.jacobians
        provenance = LensProvenance.of(model)
        recorded = {
            "model_name": provenance.model_name,
            "transformers_version": provenance.transformers_version,
            "multihead_version": __version__,
            "estimator": ESTIMATOR,
            "corpus": corpus,
            "n_prompts": done,
            "fit_dtype": str(_model_dtype(model)).removeprefix("torch."),
            "target_layer": count - 1,
            "dim_batch": chunk,
            "skip_first_positions": skip,
        }
        width = next(iter(jacobians.values())).shape[0]
        return cls(jacobians, done, width, {**extra, **recorded})

    # -- files -------------------------------------------------------------------------------

    def save(self, path: str | Path, *, dtype: torch.dtype = torch.float32) -> None:
        """Write the lens to ``path`` (atomically): the reference's artifact for ``.pt`` /
        ``.pth`` (loadable by TransformerLens's and the reference's ``load``), its safetensors
        twin for ``.safetensors`` (module docstring).

        Args:
            path: the file; its suffix chooses the format.
            dtype: the matrices' dtype on disk (the reference writes float16 to halve the
                file; float32 by default here, which keeps a float32 fit exactly).

        Raises:
            ValueError: another suffix, or a dtype that is not floating point.
        """
        path = Path(path)
        suffix_of(path)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {describe(dtype)}")
        JacobianArtifact(self.jacobians, self.n_prompts, self.d_model, self.metadata).write(
            path, dtype
        )

    @classmethod
    def load(cls, path: str | Path, *, model: nn.Module | None = None) -> JacobianLens:
        """Read a lens written by :meth:`save`, by TransformerLens or by the reference
        implementation (its artifact, or its fit checkpoint of running sums, converted as
        TransformerLens converts one); with ``model``, :meth:`check` it against the model.

        Raises:
            FileNotFoundError: no such file.
            ValueError: another suffix; a file ``torch.load(weights_only=True)`` refuses; a
                file that is not a Jacobian lens (names the path and what is wrong); with
                ``model``, one that does not fit it.

        Warns:
            UserWarning: with ``model``, where the recorded provenance differs from it.
        """
        path = Path(path)
        found = JacobianArtifact.read(path)
        try:
            lens = cls(*found)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{str(path)!r} is not a Jacobian lens: {e}") from None
        if model is not None:
            lens.check(model, stacklevel=3)
        return lens


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the model computes in: its first floating parameter's."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
