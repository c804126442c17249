#!/usr/bin/env bash
# Set up a fresh machine (Python 3.10+, pip, gcc): a virtual environment in .venv with multihead
# and everything its tests need. Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Torch first and pinned: an unpinned torch can pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[all,test]"

# Headless Chromium for the page tests (Debian's packages; never a browser download).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "setup: chromium/chromedriver not found and no apt-get: browser tests will be skipped" >&2
  fi
fi
