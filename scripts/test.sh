#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the linters, the device check's smoke run on the CPU
# (scripts/gpu_check.sh --device cpu --quick, without time budgets: a few test files and the
# quick benchmarks, about a minute; its log is printed only when it fails), and the whole test
# suite.
# Usage: bash scripts/test.sh [tested|newest|oldest] [PYTEST ARGS...]
#   tested (default): the pinned versions CI installs (requirements/tested.txt); linters too.
#   newest / oldest: the newest releases / every declared minimum; the suite only (the linters'
#   rules change with their versions, so style is checked on the tested pins alone).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=tested
case "${1:-}" in tested|newest|oldest) mode=$1; shift ;; esac
bash scripts/setup.sh "$mode"
case "$mode" in tested) venv=.venv ;; *) venv=.venv-$mode ;; esac
. "$venv/bin/activate"
python -c "import torch, transformers; print(f'deps ($mode): torch {torch.__version__}, transformers {transformers.__version__}')"
if [ "$mode" = tested ]; then
  ruff check .
  ruff format --check .
  mypy
  smoke=$(mktemp)
  # no budgets: a smoke run checks that the benchmarks run and report, not how fast this
  # machine is today (a busy machine is not a failure)
  if ! bash scripts/gpu_check.sh --device cpu --quick --suite-budget 0 --bench-budget 0 \
    >"$smoke" 2>&1; then
    tail -n 60 "$smoke" >&2
    echo "test.sh: scripts/gpu_check.sh --device cpu --quick failed (log above)" >&2
    exit 1
  fi
  echo "test.sh: scripts/gpu_check.sh --device cpu --quick passed"
fi
python -m pytest -q "$@"
