"""A GGUF file converted to a transformers directory: :func:`convert_gguf`.

transformers reads a GGUF file itself (``from_pretrained(dir, gguf_file=...)``, with the ``gguf``
package), rebuilding the config from its metadata, the tokenizer from its vocabulary, and
dequantising every tensor to float32. That takes long (tens of seconds for a 135M model), so the
result is saved as an ordinary directory (``config.json``, ``model.safetensors``,
``tokenizer.json``) that every later load reads like any other
(:mod:`multihead.pretrained.gguf_cache` keeps it). The file's header has been checked before
(:func:`multihead.pretrained.gguf_header.read_gguf_header`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from multihead.hf.loading import quiet

__all__ = ["convert_gguf", "CONVERTER"]

# What a converted directory depends on besides its file: a cache entry made by another
# transformers is made again.
CONVERTER = f"transformers {transformers.__version__}"


def convert_gguf(file: Path, out: Path, given: str) -> None:
    """Write ``file``'s model (float32, with its language-model head) and tokenizer to the
    directory ``out`` (which exists and is empty), as transformers' ``save_pretrained`` does.

    Raises:
        ValueError: transformers cannot read the file (an architecture it doesn't convert, a
            tokenizer it cannot rebuild), in one line naming ``given``.
        ImportError: a package transformers needs for GGUF (``gguf``, ``accelerate``).
    """
    directory, name = str(file.parent), file.name
    with quiet(transformers):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=name, dtype=torch.float32
            )
        except (MemoryError, ImportError):
            raise
        except Exception as e:  # transformers raises several kinds for a file it cannot read
            if "accelerate" in str(e):  # transformers asks for it by a ValueError
                raise ImportError(f"model {given!r}: {e}") from None
            raise ValueError(
                f"model {given!r}: transformers cannot convert its GGUF file: "
                f"{type(e).__name__}: {' '.join(str(e).split())}"
            ) from None
        # the weights are plain float32 tensors now: without the GGUF quantiser transformers
        # saves them like any model's (it refuses to save a model it still counts as quantised)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
