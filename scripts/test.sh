#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the linters, the device check's smoke run on the CPU
# (scripts/gpu_check.sh --device cpu --quick: a few test files and the quick benchmarks, under a
# minute; its log is printed only when it fails), and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
mypy
smoke=$(mktemp)
if ! bash scripts/gpu_check.sh --device cpu --quick >"$smoke" 2>&1; then
  tail -n 60 "$smoke" >&2
  echo "test.sh: scripts/gpu_check.sh --device cpu --quick failed (log above)" >&2
  exit 1
fi
echo "test.sh: scripts/gpu_check.sh --device cpu --quick passed"
python -m pytest -q "$@"
