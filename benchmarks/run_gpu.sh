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
#   sanitize_<tool>.log, ncu_<name>.log   the sanitize and profile steps (below), when chosen
#   summary.txt                every step's exit code
# Test and benchmark failures do not stop the script; it exits non-zero at the end if any step
# failed. A failed build stops it at once.
#
# Environment overrides:
#   PYTHON (python), JAXOPS_CUDA (ON), JAXOPS_CUDA_ARCHITECTURES (90a),
#   JAXOPS_BUILD_DIR (<repo>/build/gpu: kept between runs for incremental rebuilds),
#   TESTS_GPU_TIMEOUT (180), TESTS_ALL_TIMEOUT (300), BENCH_TIMEOUT (240): seconds per step,
#   TESTS_GPU_PER_TEST (90): seconds per GPU test (with pytest-timeout; the test ids are printed),
#   BENCH_ARGS: extra arguments for every benchmark (e.g. "--quick"); BENCH_ARGS_<name> (e.g.
#     BENCH_ARGS_fp8) replaces them for one benchmark,
#   STEPS ("tests_gpu tests_all bench"): which steps run after the build, in this order; "sanitize"
#     runs compute-sanitizer over the GPU tests (below), "profile" Nsight Compute over benchmarks,
#   BENCHES (every bench_*.py): benchmark names without the bench_ prefix, e.g. "rms_norm fp8";
#     name@variant runs one again with BENCH_ARGS_<name>_<variant>, its tables in OUT/<variant>/
#     (e.g. "gpu_step gpu_step@fp8" with BENCH_ARGS_gpu_step_fp8="--fp8 ..."),
#   PYTEST_GPU_ARGS: extra arguments for the tests_gpu step (e.g. "-n 8" with pytest-xdist),
#   GPU_TEST_FILES (every test file): test files, relative to tests/, that tests_gpu and sanitize
#     collect (the GPU tests live in test_{rms_norm,fp8,moe,gemm,expert_parallel}.py and
#     test_models_decoder.py),
#   SANITIZE_TOOLS ("memcheck racecheck initcheck synccheck"), SANITIZE_K (a pytest -k expression
#     choosing the GPU tests run under each tool; default: all of them), SANITIZE_TIMEOUT (300),
#   PROFILE_BENCHES ("fp8"), PROFILE_ARGS (e.g. "--shapes 4096x7168 --dtypes bfloat16": arguments
#     of each profiled benchmark; several sets separated by ";" profile it once per set, e.g.
#     "--modes 1x128;--modes tensor+T"; PROFILE_ARGS_<name>, e.g. PROFILE_ARGS_rms_norm, replaces
#     it for one benchmark), PROFILE_LAUNCHES (24: kernels profiled per run, jaxops'
#     only), PROFILE_TIMEOUT (240: per run), PROFILE_SECTIONS ("SpeedOfLight MemoryWorkloadAnalysis
#     LaunchStats Occupancy"; e.g. add InstructionStats WarpStateStats SourceCounters): `ncu` with
#     those sections, its report as text in ncu_<name>.log (ncu_<name>_<i>.log for the i-th of
#     several argument sets, from 1),
#   BUILD (1): 0 skips the build and tests the jaxops already installed for $PYTHON,
#   WHEELS (<repo>/build/gpu_wheels): wheels the machine cannot download (it has no network),
#     carried with the working tree, each installed without dependencies before the build: the
#     nvidia-cutlass wheel gives the build CUTLASS's headers (the sm_90a grouped GEMM); without it
#     the CUDA module is built without that kernel (the build log warns),
#   DEADLINE (0: none): seconds after the start past which no further step starts, and each step's
#     limit is cut to the time left (a lent GPU machine's call has a hard limit).
# The sanitizer instruments only jaxops' own kernels (their names hold "jaxops"; initcheck: every
# kernel), with every XLA buffer its own cudaMalloc (XLA_PYTHON_CLIENT_ALLOCATOR=platform) so that
# memcheck sees each buffer's end, and without reporting failed CUDA API calls (NCCL, which jax
# loads, probes kernels for other architectures at start; our handlers check their own calls).
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
TESTS_GPU_PER_TEST="${TESTS_GPU_PER_TEST:-90}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-240}"
STEPS="${STEPS:-tests_gpu tests_all bench}"
SANITIZE_TOOLS="${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}"
SANITIZE_K="${SANITIZE_K:-}"
SANITIZE_TIMEOUT="${SANITIZE_TIMEOUT:-300}"
DEADLINE="${DEADLINE:-0}"
read -r -a PYTEST_GPU_EXTRA <<< "${PYTEST_GPU_ARGS:-}"
GPU_TESTS=("$REPO/tests")
if [[ -n "${GPU_TEST_FILES:-}" ]]; then
  read -r -a GPU_TESTS <<< "$GPU_TEST_FILES"
  GPU_TESTS=("${GPU_TESTS[@]/#/$REPO/tests/}")
fi
read -r -a BENCH_EXTRA <<< "${BENCH_ARGS:-}"
export PYTHONUNBUFFERED=1
# CMake finds nvcc through PATH only; the toolkit's usual home holds compute-sanitizer too.
if [[ -d /usr/local/cuda/bin && ":$PATH:" != *":/usr/local/cuda/bin:"* ]]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

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
# Past DEADLINE the step is skipped (recorded as rc=skipped, a failure); before it, the limit is
# cut to the time left.
step() {
  local name=$1 log=$2 limit=$3 rc=0
  shift 3
  section "$name"
  if [[ $DEADLINE -gt 0 ]]; then
    local left=$((DEADLINE - (SECONDS - START)))
    if [[ $left -lt 20 ]]; then
      echo "!! $name: skipped, ${left}s left before the deadline" | tee "$log"
      printf '%-28s rc=skipped\n' "$name" | tee -a "$SUMMARY"
      FAILED=1
      return
    fi
    if [[ $left -lt $limit ]]; then limit=$left; fi
  fi
  echo "+ $*"
  timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee "$log" || rc=$?
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

WHEELS="${WHEELS:-$REPO/build/gpu_wheels}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  section "carried wheels ($WHEELS)"
  "$PYTHON" -m pip install --no-deps --no-index "$WHEELS"/*.whl 2>&1 | tail -n 3 \
    || echo "!! installing the carried wheels failed" >&2
fi

if [[ "${BUILD:-1}" != "0" ]]; then
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

# Each GPU test under its own limit where pytest-timeout is installed, with the thread method: a
# test stuck in native code (a kernel or a collective that never returns) cannot take a signal,
# and the thread method dumps every thread's stack and ends the process, so the log names the
# test (under xdist the worker is replaced) instead of the whole step running out of time.
PER_TEST=()
if "$PYTHON" -c "import pytest_timeout" >/dev/null 2>&1; then
  PER_TEST=(--timeout "$TESTS_GPU_PER_TEST" --timeout-method thread)
fi

run_tests_gpu() {
  step "tests_gpu" "$OUT/tests_gpu.log" "$TESTS_GPU_TIMEOUT" \
    "${PYTEST[@]}" -m gpu -v -rfE ${PER_TEST[@]+"${PER_TEST[@]}"} \
    ${PYTEST_GPU_EXTRA[@]+"${PYTEST_GPU_EXTRA[@]}"} "${GPU_TESTS[@]}"
}

run_tests_all() {
  step "tests_all" "$OUT/tests_all.log" "$TESTS_ALL_TIMEOUT" "${PYTEST[@]}" -q "$REPO/tests"
}

run_bench() {
  local bench name names=() extra own
  shopt -s nullglob
  if [[ -n "${BENCHES:-}" ]]; then
    read -r -a names <<< "$BENCHES"
  else
    for bench in "$REPO"/benchmarks/bench_*.py; do
      name="$(basename "$bench" .py)"
      names+=("${name#bench_}")
    done
  fi
  local entry out
  for entry in "${names[@]}"; do
    # name@variant: the benchmark once more with BENCH_ARGS_<name>_<variant>, its tables under
    # OUT/<variant>/ and its log bench_<name>@<variant>.log
    name="${entry%%@*}"
    out="$OUT"
    if [[ "$entry" == *@* ]]; then out="$OUT/${entry#*@}"; mkdir -p "$out"; fi
    bench="$REPO/benchmarks/bench_$name.py"
    own="BENCH_ARGS_${entry//@/_}"
    extra=("${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"}")
    if [[ -n "${!own:-}" ]]; then read -r -a extra <<< "${!own}"; fi
    step "bench_$entry" "$OUT/bench_$entry.log" "$BENCH_TIMEOUT" \
      "$PYTHON" "$bench" --out "$out" ${extra[@]+"${extra[@]}"}
  done
}

# compute-sanitizer over the GPU tests, one run per tool: only kernels whose name holds "jaxops"
# are instrumented (initcheck: all), XLA's and cuBLAS' run as they are; the tool's error count
# decides (--error-exitcode).
run_sanitize() {
  local tool filter=(--kernel-name kns=jaxops)
  if ! command -v compute-sanitizer >/dev/null 2>&1; then
    section "sanitize"
    echo "!! compute-sanitizer not on PATH" | tee "$OUT/sanitize.log"
    record "sanitize" 127
    return
  fi
  local help
  help="$(compute-sanitizer --help 2>&1 || true)"  # (grep -q on a pipe would fail under pipefail)
  if [[ "$help" != *"--kernel-name"* ]]; then filter=(--filter kns=jaxops); fi
  local select=()
  if [[ -n "$SANITIZE_K" ]]; then select=(-k "$SANITIZE_K"); fi
  for tool in $SANITIZE_TOOLS; do
    # initcheck needs every kernel instrumented: memory that an unchecked (XLA) kernel wrote would
    # read as uninitialized in ours.
    local only=("${filter[@]}")
    if [[ "$tool" == "initcheck" ]]; then only=(); fi
    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
      step "sanitize_$tool" "$OUT/sanitize_$tool.log" "$SANITIZE_TIMEOUT" \
      compute-sanitizer --tool "$tool" ${only[@]+"${only[@]}"} --report-api-errors no --error-exitcode 86 \
      --print-limit 50 \
      "${PYTEST[@]}" -m gpu -q -rfE -p no:xdist ${select[@]+"${select[@]}"} "${GPU_TESTS[@]}"
  done
}

# Nsight Compute over benchmarks: the first PROFILE_LAUNCHES jaxops kernels each one launches
# (matched in the mangled name, which holds the namespace: the plain function name does not).
run_profile() {
  local name extra sets=() set_args i log sections=() section own
  for section in ${PROFILE_SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis LaunchStats Occupancy}; do
    sections+=(--section "$section")
  done
  if ! command -v ncu >/dev/null 2>&1; then
    section "profile"
    echo "!! ncu not on PATH" | tee "$OUT/ncu.log"
    record "profile" 127
    return
  fi
  for name in ${PROFILE_BENCHES:-fp8}; do
    own="PROFILE_ARGS_$name"
    sets=()
    IFS=';' read -r -a sets <<< "${!own:-${PROFILE_ARGS:-}}"
    if [[ ${#sets[@]} -eq 0 ]]; then sets=(""); fi
    i=0
    for set_args in "${sets[@]}"; do
      i=$((i + 1))
      log="ncu_$name"
      if [[ ${#sets[@]} -gt 1 ]]; then log="ncu_${name}_$i"; fi
      read -r -a extra <<< "$set_args"
      # No preallocation: ncu saves and restores the device memory in use around each replayed
      # kernel, and XLA's default 75% of the GPU made the second kernel's replay fail.
      XLA_PYTHON_CLIENT_PREALLOCATE=false step "$log" "$OUT/$log.log" "${PROFILE_TIMEOUT:-240}" \
        ncu --kernel-name-base mangled --kernel-name regex:jaxops \
        --launch-count "${PROFILE_LAUNCHES:-24}" "${sections[@]}" \
        "$PYTHON" "$REPO/benchmarks/bench_$name.py" --repeats 1 ${extra[@]+"${extra[@]}"}
      # A profiled program that outlived ncu's time limit still holds the GPU's memory.
      pkill -KILL -f "benchmarks/bench_$name.py" 2>/dev/null || true
    done
  done
}

for name in $STEPS; do
  case "$name" in
    tests_gpu) run_tests_gpu ;;
    tests_all) run_tests_all ;;
    bench) run_bench ;;
    sanitize) run_sanitize ;;
    profile) run_profile ;;
    *) echo "!! unknown step $name (tests_gpu, tests_all, bench, sanitize, profile)" >&2
       record "$name" 2 ;;
  esac
done

section "summary"
cat "$SUMMARY"
if [[ $FAILED -ne 0 ]]; then
  echo "!! some steps failed" >&2
  exit 1
fi
echo "all steps passed"
