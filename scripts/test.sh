#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the linters and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
mypy
python -m pytest -q "$@"
