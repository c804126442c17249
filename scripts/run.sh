#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the multihead CLI; with no arguments, the main job:
# `multihead explain` on all-MiniLM-L6-v2, offline. Usage: bash scripts/run.sh [COMMAND ARGS...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
if [ "$#" -eq 0 ]; then set -- explain; fi
exec "$root/.venv/bin/multihead" "$@"
