"""A norm with its scale frozen at one run: an affine map, so a sum splits through it.

A LayerNorm computes ``γ ⊙ (x - mean x) / σ(x) + β``, an RMSNorm ``γ ⊙ x / rms(x)`` (Gemma's
RMSNorm stores the offset of its scale from 1: ``(1 + w) ⊙ x / rms(x)``, read as γ = 1 + w). With σ
(B, T) taken from one run's residual stream x and held fixed, the norm is affine in x, and the
stream's parts (embeddings, each head's write, each feed-forward's) go through it one by one:
``norm(x) = Σ_c linear(c) + β``. Direct logit attribution and the logit lens's per-head reading
are this split, through the final norm and through a norm a block applies to its attention's
output before adding it to the stream (Gemma-2's and OLMo-2's post-attention norms: there x is
the attention's output, and its parts are the heads' writes); QK attribution splits a block's
pre-attention norm the same way.

Shapes: B batch, T tokens, E width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

if dist.is_available():  # a torch built without distributed has no DTensor
    from torch.distributed.tensor import DTensor

__all__ = ["FrozenNorm"]


def _whole(value: object) -> object:
    """A norm's parameter sharded over ranks (a ``DTensor``) as the whole (E,) tensor on every
    rank (a collective); else as it is."""
    if dist.is_available() and isinstance(value, DTensor):
        return value.full_tensor()
    return value


@dataclass(frozen=True)
class FrozenNorm:
    """A LayerNorm or RMSNorm (the final one, or a block's) with its scale frozen at one run.

    Attributes:
        gamma: (E,) the norm's scale: its weight, or 1 + its weight (Gemma), ones without one.
        beta: (E,) its bias, or None (RMSNorm, or a LayerNorm without bias).
        sigma: (B, T, 1) the scale of the run: σ for LayerNorm, rms for RMSNorm.
        centred: whether the norm subtracts the mean (LayerNorm).
    """

    gamma: Tensor
    beta: Tensor | None
    sigma: Tensor
    centred: bool

    @classmethod
    def of(
        cls,
        norm: nn.Module,
        eps: float | None,
        x: Tensor,
        y: Tensor,
        caller: str,
        rounding: float = 0.0,
    ) -> FrozenNorm:
        """Frozen at the run where ``norm`` mapped ``x`` (B, T, E) to ``y``; the rebuilt norm
        must give ``y`` within a few steps of ``rounding`` (the dtype the norm ran in).

        Raises:
            ValueError: ``norm`` is neither a LayerNorm nor an RMSNorm (scale γ or 1 + γ) as
                read here (``caller`` names who needs it), or ``eps`` is None.
        """
        weight = _whole(getattr(norm, "weight", None))
        beta = _whole(getattr(norm, "bias", None))
        beta = beta.to(x.dtype) if isinstance(beta, Tensor) else None
        centred = isinstance(norm, nn.LayerNorm)
        if isinstance(weight, Tensor):
            # the scale is γ, or 1 + γ (Gemma's norms store the scale's offset from 1): the
            # one that gives the run's output is the norm's
            gammas = [weight.to(x.dtype), 1.0 + weight.to(x.dtype)]
        else:
            gammas = [torch.ones_like(x[0, 0])]
        if eps is not None:
            sigma = cls.scale(x, eps, centred)
            # 1e-3 in float32; in half precision a few of its rounding steps (bfloat16: 3e-2)
            rtol = max(1e-3, 4 * rounding)
            tolerance = rtol * float(y.abs().max().clamp(min=1.0))
            for gamma in gammas:
                frozen = cls(gamma, beta, sigma, centred)
                rebuilt = frozen.linear(x) + (beta if beta is not None else 0.0)
                if torch.allclose(rebuilt, y, rtol=rtol, atol=tolerance):
                    return frozen
        raise ValueError(
            f"{caller} reads a LayerNorm or RMSNorm (γ ⊙ x / rms(x), or (1 + γ) ⊙ x / rms(x)); "
            f"the norm {type(norm).__name__} computes something else"
        )

    @staticmethod
    def scale(x: Tensor, eps: float, centred: bool) -> Tensor:
        """(B, T, 1): σ of the stream ``x`` (B, T, E): the rms of ``x`` (less its mean where
        ``centred``), ``eps`` added under the root."""
        c = x - x.mean(-1, keepdim=True) if centred else x
        return (c.pow(2).mean(-1, keepdim=True) + eps).sqrt()

    @staticmethod
    def run_scale(norm: nn.Module, eps: float, x: Tensor) -> Tensor:
        """(B, T, 1): the scale ``norm`` divides its input ``x`` (B, T, E) by, in float32 at
        least (TransformerLens's ``hook_scale``): σ for a LayerNorm, rms for an RMSNorm."""
        compute = torch.promote_types(x.dtype, torch.float32)
        return FrozenNorm.scale(x.to(compute), eps, isinstance(norm, nn.LayerNorm))

    @staticmethod
    def at_scale(norm: nn.Module, y: Tensor, run: Tensor, sigma: Tensor) -> Tensor:
        """(B, T, E): ``y``, what ``norm`` gave at the run whose scale was ``run`` (B, T, 1), as
        it gives it at the scale ``sigma`` instead: ``β + (y - β) · run / sigma`` (a norm is
        affine in 1 / σ, so γ, or 1 + γ, cancels), in float32 at least, in y's dtype."""
        compute = torch.promote_types(y.dtype, torch.float32)
        beta = _whole(getattr(norm, "bias", None))
        shift = beta.to(compute) if isinstance(beta, Tensor) else 0.0
        return (shift + (y.to(compute) - shift) * (run / sigma)).to(y.dtype)

    def linear(self, c: Tensor) -> Tensor:
        """The norm's linear part on a piece ``c`` (B, T, ..., E) of the stream: ``γ ⊙ (c -
        mean c) / σ`` (no β); σ broadcasts over any axes between T and E."""
        centred = c - c.mean(-1, keepdim=True) if self.centred else c
        sigma = self.sigma.reshape(*self.sigma.shape[:2], *[1] * (c.dim() - 3), 1)
        return self.gamma * centred / sigma

    def read(self, direction: Tensor) -> Tensor:
        """(B, T, E): the vector ``u`` with ``linear(c) · direction == c · u`` for every c, so a
        piece's share of a logit along ``direction`` (B, T, E) is ``(c * u).sum(-1)``."""
        u = self.gamma * direction / self.sigma
        return u - u.mean(-1, keepdim=True) if self.centred else u
