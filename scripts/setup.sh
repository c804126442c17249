#!/usr/bin/env bash
# Set up a fresh machine (Python 3.10+, pip, gcc): a virtual environment in .venv with multihead
# and everything its tests need, plus Debian's headless Chromium for the page tests.
# Idempotent and quick on a second run (a stamp records what was installed).
# Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

stamp=.venv/.multihead-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing into .venv (torch 2.13.0 CPU first, then multihead[all,test])" >&2
  python3 -m venv .venv
  . .venv/bin/activate
  # Torch first and pinned: an unpinned torch can pull a multi-GB CUDA build.
  python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
  python -m pip install -q -e ".[all,test]" 2>&1 | grep -v "^WARNING: Location" || true
  python -c "import multihead, torch, transformers, tokenizers, safetensors, matplotlib, nbclient, ipykernel" \
    || { echo "setup: installation failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi

# Headless Chromium for the page tests: Debian's packages, never a browser download.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup: installing Debian's chromium and chromium-driver" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "setup: no chromium and no apt-get: the browser test will be skipped" >&2
  fi
fi
