"""Where observers live in a transformers model: one :class:`AttentionSite` per routed
attention module, and the switch that keeps the model on ``"multihead"`` while they observe."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, cast

from torch import nn
from transformers import PreTrainedModel

from multihead.head_shard import HeadShard
from multihead.hf.forward import NAME, SITE, family_name
from multihead.hf.tensor_parallel import head_shard
from multihead.hf.unrouted_families import UnroutedFamily, unrouted_family
from multihead.hf.unrouted_site import UnroutedCalls
from multihead.holds_transformers import holds_transformers
from multihead.observers import AttentionObserver, ObserverHandle, Observers, QKVEditor

__all__ = ["AttentionSite", "attention_sites", "routed", "uses_transformers"]


def routed(cls: type) -> bool:
    """Whether instances of ``cls`` route their attention through ``AttentionInterface``."""
    return _calls(cast(Any, cls)) > 0


@functools.cache
def _calls(cls: Any) -> int:
    """How many attention calls the forward of ``cls`` makes through the interface (0: none)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return 0
    if "ALL_ATTENTION_FUNCTIONS" not in source:
        return 0
    return max(1, source.count("attention_interface("))


def _projects(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` holds a weight of two or more dimensions (a projection).

    Attention over tokens computes its queries, keys and values from the hidden states with
    projections of its own; a routed module without any attends over what it is handed instead
    (Inkling-2's attention residuals: learned queries, parameters of the module itself, over the
    outputs of earlier blocks, passed with the positions as the heads' axis): it is not an
    attention layer of the model.
    """
    return any(
        t.dim() >= 2 for child in module.children() for t in (*child.parameters(), *child.buffers())
    )


@functools.cache
def _softmax(cls: Any) -> bool:
    """Whether ``cls`` computes a softmax anywhere in its code (linear attention does not; its
    whole class is read: Pegasus-X's global-local attention computes it in a helper method)."""
    try:
        return "softmax" in inspect.getsource(cls)
    except (OSError, TypeError, AttributeError):
        return True


def _unrouted_attention(
    modules: list[tuple[str, nn.Module]], routed_names: list[str]
) -> nn.Module | None:
    """An attention module among a root's ``modules`` that bypasses the interface (hybrid
    families), if any; ``routed_names`` are the routed ones.

    Recognised by name (``*Attention*`` with weights of its own, computing a softmax) with no
    routed module above or below it: observing only the routed ones would renumber the layers
    silently. Linear attention (no softmax: MiniMax's lightning attention) has no attention
    weights to observe: like the Mamba or convolution mixers of other hybrids it is not an
    attention layer, and the layers are the model's softmax attention modules.
    """
    for name, m in modules:
        kind = cast(Any, type(m))
        if "Attention" not in kind.__name__ or routed(kind) or not _softmax(kind):
            continue
        if unrouted_family(m) is not None:
            continue
        if not any(isinstance(c, nn.Linear) or hasattr(c, "nf") for c in m.children()):
            continue
        related = any(
            r.startswith(f"{name}.") or name.startswith(f"{r}.") or not r or not name
            for r in routed_names
        )
        if not related:
            return m
    return None


def _first_int(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


class _Switch:
    """Keeps one model on ``"multihead"`` while any of its sites has observers."""

    def __init__(self, model: PreTrainedModel, sites: list[AttentionSite]) -> None:
        self.model = model
        self.sites = sites
        self.count = 0
        self.previous: Any = None

    def acquire(self) -> None:
        if self.count == 0:
            self.previous = self.model.config._attn_implementation
            if self.previous != NAME:
                self._set(NAME)
            stuck = [s for s in self.sites if _implementation(s.module) != NAME]
            if stuck:
                if self.previous != NAME:
                    self._set(self.previous)
                raise ValueError(
                    f"{type(self.model).__name__}: transformers would not switch the attention "
                    f"of {family_name(stuck[0].module)} to {NAME!r} (it stays on "
                    f"{_implementation(stuck[0].module)!r}); its heads cannot be observed"
                )
        self.count += 1

    def release(self) -> None:
        self.count -= 1
        if self.count == 0 and self.previous != NAME:
            self._set(self.previous)

    def _set(self, implementation: Any) -> None:
        self.model.set_attn_implementation(implementation)
        # transformers before 5.20 leaves the config copies of sub-models (T5's encoder and
        # decoder stacks) on the old implementation: switch each one that stayed behind
        for m in self.model.modules():
            if isinstance(m, PreTrainedModel) and _implementation(m) != implementation:
                m.set_attn_implementation(implementation)


def _implementation(module: nn.Module) -> Any:
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


class AttentionSite:
    """The observers of one routed transformers attention module (one "layer").

    Quacks like :class:`multihead.MultiHeadAttention` for the observe functions (both satisfy
    :class:`~multihead.observers.ObservableAttention`): ``num_heads``, ``head_dim``,
    ``parameters()``, ``observers``, ``register_observer(fn)``, ``register_qkv_editor(fn)``.
    The model runs on ``"multihead"`` while anything is registered on one of its sites.

    Attributes:
        module: the transformers attention module.
        num_heads: H, its query heads (over all ranks, under tensor parallelism).
        head_dim: Dv, the width of one head's output.
        head_shard: None when each call holds all H heads; for a model split by tensor
            parallelism, the :class:`~multihead.head_shard.HeadShard` naming the global heads
            this rank's calls hold (:func:`attention_sites` reads it from the model's plan).
    """

    dropout = 0.0  # transformers applies attention dropout only in training, inside the call

    def __init__(
        self, module: nn.Module, acquire: Callable[[], None], release: Callable[[], None]
    ) -> None:
        config = getattr(module, "config", None)
        heads = _first_int(
            module, ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attn_heads")
        ) or _first_int(config, ("num_attention_heads", "n_head", "num_heads", "n_heads"))
        if heads is None:
            raise ValueError(
                f"{family_name(module)}: cannot tell how many heads this attention module has"
            )
        # Dv, the width of one head's output: MLA families name it apart from the q·k width
        dim = _first_int(
            module,
            ("v_head_dim", "head_dim", "attention_head_size", "head_size", "key_value_proj_dim"),
        ) or _first_int(config, ("v_head_dim", "head_dim", "d_kv"))
        if dim is None:
            # the width itself: the config's, else the module's own (OpenAI-GPT's attention
            # keeps no config, only its split size)
            width = _first_int(config, ("hidden_size", "d_model", "n_embd", "dim")) or _first_int(
                module, ("embed_dim", "split_size")
            )
            dim = width // heads if width else 0
        self.module = module
        self.num_heads = heads
        self.head_dim = dim
        self.head_shard: HeadShard | None = None
        # a routed module: each registration keeps the model on "multihead", the last removal
        # switches it back; an unrouted one: the first registers its hooks, the last removes them
        self._observers = Observers(acquire=acquire, release=release)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    @property
    def observers(self) -> Observers:
        """The observers and q/k/v editors registered on this site (``len``, ``bool``)."""
        return self._observers

    def register_observer(self, fn: AttentionObserver) -> ObserverHandle:
        """Call ``fn(call, out)`` on each call, ``out`` the per-head output (B, T, H, Dv)
        before the module's output projection (see :meth:`MultiHeadAttention.register_observer`).
        """
        return self._observers.register(fn)

    def register_qkv_editor(self, fn: QKVEditor) -> ObserverHandle:
        """Call ``fn(call)`` on each call before attention; it may replace q, k or v as the
        attention function receives them (after rotary embeddings). See
        :meth:`MultiHeadAttention.register_qkv_editor`.
        """
        return self._observers.register_editor(fn)


def attention_sites(model: nn.Module) -> list[tuple[str, AttentionSite]]:
    """The routed attention modules of every transformers model in ``model``, in module order.

    Attaches an :class:`AttentionSite` to each (once). Layers are numbered by module order,
    not ``module.layer_idx`` (which many families lack). A model loaded with a tensor-parallel
    plan (``tp_plan="auto"`` under ``torchrun``) gives each site the global heads this rank
    holds (:func:`multihead.hf.tensor_parallel.head_shard`).

    Raises:
        ValueError: no transformers model inside, one without attention layers (a state-space
            or Fourier-mixing family), one whose attention is not routed through
            ``AttentionInterface``, or one whose tensor-parallel layout does not map to global
            heads (the error names its family).
    """
    # one walk of the module tree: entering a capture block runs this, and on a GPU the host's
    # time before the forward is time the device waits
    modules = list(model.named_modules())
    outer: list[tuple[str, PreTrainedModel]] = []
    for name, m in modules:
        # the outermost transformers models only (a CausalLM holds its base model)
        if isinstance(m, PreTrainedModel) and not any(
            r == "" or name.startswith(f"{r}.") for r, _ in outer
        ):
            outer.append((name, m))
    if not outer:
        raise ValueError(f"model ({type(model).__name__}) holds no transformers PreTrainedModel")
    found: list[tuple[str, AttentionSite]] = []
    for prefix, root in outer:
        inside = (
            modules
            if not prefix
            else [(n[len(prefix) + 1 :], m) for n, m in modules if n.startswith(f"{prefix}.")]
        )
        own = [(n, m) for n, m in inside if routed(type(m)) and _projects(m)]
        known = {
            n: f for n, m in inside if not routed(type(m)) and (f := unrouted_family(m)) is not None
        }
        family = getattr(root.config, "model_type", type(root).__name__)
        if (
            not own
            and not known
            and not any("attention" in type(m).__name__.lower() for _, m in inside)
        ):
            # a state-space, Fourier- or convolution-mixing family (Mamba, FNet): no heads
            raise ValueError(
                f"{family} ({type(root).__name__}) has no attention layers (its token mixers "
                f"are no softmax attention: state-space, Fourier or convolutional): it has no "
                f"heads for multihead to observe or steer"
            )
        if not own and not known:
            raise ValueError(
                f"{family} ({type(root).__name__}) does not route its attention through "
                f"transformers' AttentionInterface, and multihead does not know where its "
                f"heads are: it cannot observe or steer its heads"
            )
        bypass = _unrouted_attention(inside, [n for n, _ in own])
        if bypass is not None:
            raise ValueError(
                f"{family} ({type(root).__name__}) computes some attention outside transformers' "
                f"AttentionInterface ({type(bypass).__name__}): multihead cannot observe or "
                f"steer all of its layers"
            )
        double = next((m for _, m in own if _calls(cast(Any, type(m))) > 1), None)
        if double is not None:
            raise ValueError(
                f"{family} ({type(root).__name__}): {type(double).__name__} makes "
                f"{_calls(cast(Any, type(double)))} attention calls per layer (e.g. differential "
                f"attention), so a head is not one call's head; multihead cannot observe or "
                f"steer its heads"
            )
        switch = getattr(root, "_multihead_switch", None)
        if not isinstance(switch, _Switch):
            switch = _Switch(root, [])
            # a plain attribute: not a submodule, not in the state dict
            object.__setattr__(root, "_multihead_switch", switch)
        by_name = dict(inside)
        routed_ids = {id(m) for _, m in own}
        for name, m in inside:
            if id(m) not in routed_ids and name not in known:
                continue
            site = getattr(m, SITE, None)
            if site is None:
                if id(m) in routed_ids:
                    site = AttentionSite(m, switch.acquire, switch.release)
                    switch.sites.append(site)
                else:
                    site = _unrouted_site(m, name, by_name, known[name], family)
                site.head_shard = head_shard(
                    root, name, m, family_name(m), site.num_heads, site.head_dim
                )
                object.__setattr__(m, SITE, site)
            full = f"{prefix}.{name}" if prefix and name else prefix or name
            found.append((full, site))
    return found


def _unrouted_site(
    module: nn.Module,
    name: str,
    modules: dict[str, nn.Module],
    family: UnroutedFamily,
    model_type: str,
) -> AttentionSite:
    """The site of an unrouted attention module ``name`` among a root's ``modules`` (of the
    family ``model_type``): its calls made at its output projection (``family.output``, found
    from the module or its parent)."""
    label = f"{model_type} ({type(module).__name__})"
    reason = family.refused(module) if family.refused is not None else None
    if reason is not None:
        raise ValueError(f"{label}: {reason}; its heads cannot be observed")
    path = family.output
    base = name
    while path.startswith("../"):
        base, path = base.rpartition(".")[0], path[3:]
    projection = modules.get(f"{base}.{path}" if base else path)
    holder = modules.get(base)
    if projection is None or holder is None:
        raise ValueError(
            f"{label}: its output projection {family.output!r} (from {name!r}) "
            f"is not in the model; its heads cannot be observed"
        )
    calls = UnroutedCalls(module, projection, holder, family, label)
    site = AttentionSite(module, calls.acquire, calls.release)
    calls.site = site
    return site


def uses_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a transformers ``PreTrainedModel`` (the observe functions
    then use sites): :func:`multihead.holds_transformers.holds_transformers`, the one check."""
    return holds_transformers(model)
