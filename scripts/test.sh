#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the linters and the whole test suite.
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
fi
python -m pytest -q "$@"
