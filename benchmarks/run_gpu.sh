#!/usr/bin/env bash
# Build jaxops with CUDA, run the test suites and every benchmark on a GPU machine (no network).
#
# Usage: bash benchmarks/run_gpu.sh OUT_DIR
#
# Expects Python with jax + its CUDA plugin, nanobind, scikit-build-core, cmake, ninja and the CUDA
# toolkit already installed. Writes to OUT_DIR:
#   build.log                  pip's verbose build output
#   build_info.txt             jaxops.build_info() and the devices, as the installed package sees them
#   tests_gpu.log, tests_all.log   pytest -m gpu, and the whole suite
#   bench_<name>.log           stdout + stderr of benchmarks/bench_<name>.py
#   <name>.md, <name>.json     the benchmarks' result tables (bench_*.py --out OUT_DIR)
#   summary.txt                every step's exit code
# Test and benchmark failures do not stop the script; it exits non-zero at the end if any step
# failed. A failed build stops it at once.
#
# Environment overrides:
#   PYTHON (python), JAXOPS_CUDA (ON), JAXOPS_CUDA_ARCHITECTURES (90a),
#   JAXOPS_BUILD_DIR (<repo>/build/gpu: kept between runs for incremental rebuilds),
#   TESTS_GPU_TIMEOUT (180), TESTS_ALL_TIMEOUT (300), BENCH_TIMEOUT (240): seconds per step,
#   BENCH_ARGS: extra arguments for every benchmark (e.g. "--quick").
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: bash $0 OUT_DIR" >&2
  exit 2
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
PYTHON="${PYTHON:-python}"
export JAXOPS_CUDA="${JAXOPS_CUDA:-ON}"
export JAXOPS_CUDA_ARCHITECTURES="${JAXOPS_CUDA_ARCHITECTURES:-90a}"
BUILD_DIR="${JAXOPS_BUILD_DIR:-$REPO/build/gpu}"
TESTS_GPU_TIMEOUT="${TESTS_GPU_TIMEOUT:-180}"
TESTS_ALL_TIMEOUT="${TESTS_ALL_TIMEOUT:-300}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-240}"
read -r -a BENCH_EXTRA <<< "${BENCH_ARGS:-}"
export PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$SECONDS

section() { printf '\n===== %s (t=%ds) =====\n' "$*" "$((SECONDS - START))"; }

# record NAME RC: append to the summary, remember failures.
record() {
  printf '%-28s rc=%s\n' "$1" "$2" | tee -a "$SUMMARY"
  if [[ "$2" -ne 0 ]]; then FAILED=1; fi
}

# step NAME LOG TIMEOUT CMD...: run CMD with a time limit, tee its output to LOG, record its rc.
step() {
  local name=$1 log=$2 limit=$3 rc=0
  shift 3
  section "$name"
  echo "+ $*"
  timeout --signal=INT --kill-after=30 "$limit" "$@" 2>&1 | tee "$log" || rc=$?
  if [[ $rc -eq 124 ]]; then echo "!! $name: timed out after ${limit}s" | tee -a "$log"; fi
  record "$name" "$rc"
}

section "machine"
echo "repo: $REPO"
echo "out:  $OUT"
nvidia-smi || echo "(nvidia-smi not available)"
nvcc --version || echo "(nvcc not on PATH)"
"$PYTHON" --version
"$PYTHON" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)" \
  || echo "(jax import failed)"
echo "nproc: $(nproc)"

section "build (JAXOPS_CUDA=$JAXOPS_CUDA JAXOPS_CUDA_ARCHITECTURES=$JAXOPS_CUDA_ARCHITECTURES)"
echo "build dir: $BUILD_DIR; log: $OUT/build.log"
BUILD_RC=0
(
  cd "$REPO"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  "$PYTHON" -m pip install --no-build-isolation --no-deps -v \
    --config-settings=build-dir="$BUILD_DIR" .
) > "$OUT/build.log" 2>&1 || BUILD_RC=$?
tail -n 25 "$OUT/build.log"
record "build" "$BUILD_RC"
if [[ $BUILD_RC -ne 0 ]]; then
  echo "!! build failed (rc=$BUILD_RC); see $OUT/build.log" >&2
  exit "$BUILD_RC"
fi

# From here on run outside the source tree, so that `import jaxops` finds the installed package
# (the source tree's jaxops/ has no compiled modules).
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

section "installed jaxops"
INFO_RC=0
"$PYTHON" - > "$OUT/build_info.txt" 2>&1 <<'EOF' || INFO_RC=$?
import os
import jax
import jaxops

print("jaxops", jaxops.__version__, "from", jaxops.__file__)
print("build_info:", jaxops.build_info())
print("cuda_available:", jaxops.cuda_available())
print("devices:", jax.devices())
if os.environ.get("JAXOPS_CUDA", "").upper() == "ON" and not jaxops.cuda_available():
    raise SystemExit("JAXOPS_CUDA=ON but the installed jaxops has no CUDA module")
EOF
cat "$OUT/build_info.txt"
record "build_info" "$INFO_RC"

PYTEST=("$PYTHON" -m pytest -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml")
step "tests_gpu" "$OUT/tests_gpu.log" "$TESTS_GPU_TIMEOUT" \
  "${PYTEST[@]}" -m gpu -q "$REPO/tests"
step "tests_all" "$OUT/tests_all.log" "$TESTS_ALL_TIMEOUT" \
  "${PYTEST[@]}" -q "$REPO/tests"

shopt -s nullglob
for bench in "$REPO"/benchmarks/bench_*.py; do
  name="$(basename "$bench" .py)"
  step "$name" "$OUT/$name.log" "$BENCH_TIMEOUT" \
    "$PYTHON" "$bench" --out "$OUT" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"}
done

section "summary"
cat "$SUMMARY"
if [[ $FAILED -ne 0 ]]; then
  echo "!! some steps failed" >&2
  exit 1
fi
echo "all steps passed"
