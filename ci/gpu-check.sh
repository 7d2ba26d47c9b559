#!/usr/bin/env bash
# One prepared check for a machine with a GPU and no internet, in under 8 minutes:
#   1. hazards         pytest -m gpu_hazard                 what the interpreter cannot show:
#                      a 154,200-row near-boundary top-p sweep (no draw outside the support),
#                      NaN/+inf/all -inf rows (token -1), CUDA graphs vs eager vs float64 HF
#   2. kernels[cuda]   pytest tests/kernels -m cuda         the CUDA grids, compiled Triton
#   3. kernels[other]  pytest tests/kernels -m "not cuda"   the rest of the kernel tests, on CUDA
#   4. engine[cuda]    pytest tests -m cuda (engine files)  decode CUDA graphs, no host sync
#   5. perf            pytest perf/                         microbenchmarks and their table
#   6. e2e             python -m perf.engine.bench_e2e --device cuda --model-shape qwen3-0.6b
#                      (scaled), graphs on and off (--compare-eager)
#   7. tp              python -m perf.engine.bench_tp --device cuda --tp 1 2 (needs >= 2 GPUs, else
#                      "not measured"): per-step time in NCCL collectives, TP=2 tokens = TP=1
# Steps 2-4 leave out the gpu_hazard tests, which step 1 runs.
# each under its own time limit, then a summary table, printed last (GPU, driver, versions,
# pass/fail counts, the performance targets, the e2e ratios). Exit 0 when every step passed; a
# target that is not met never fails the check. Nothing is downloaded: missing packages are
# installed only from a local wheel folder, with pip --no-index.
#
# usage: ci/gpu-check.sh [--dry-run]
#   --dry-run   check the prerequisites, print the steps and the summary header, run nothing
#
# environment (all optional):
#   PYTHON                 a Python that has torch, triton, transformers, pytest (python3)
#   GPU_CHECK_LOG_DIR      logs, junit XML and JSON results (${TMPDIR:-/tmp}/paged-serve-gpu-check)
#   GPU_CHECK_WHEELS       wheel folder for missing packages (.whl/ if it exists)
#   GPU_CHECK_JOBS         parallel shards for the kernel tests: compiling is CPU-bound (6)
#   GPU_CHECK_E2E_SCALE    fraction of the full e2e workload, 0 < s <= 1 (0.25)
#   GPU_CHECK_BUDGET_S     limit for the whole script; no step runs past it (465)
#   GPU_CHECK_TIMEOUT_HAZARDS / _KERNELS_CUDA / _KERNELS_OTHER / _ENGINE / _PERF / _E2E / _TP
#                          step limits, s (60/125/60/30/130/120/90)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

START=$(date +%s)
PY="${PYTHON:-python3}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-465}"
JOBS="${GPU_CHECK_JOBS:-6}"
SCALE="${GPU_CHECK_E2E_SCALE:-0.25}"
T_HAZARDS="${GPU_CHECK_TIMEOUT_HAZARDS:-60}"
T_KERNELS_CUDA="${GPU_CHECK_TIMEOUT_KERNELS_CUDA:-125}"
T_KERNELS_OTHER="${GPU_CHECK_TIMEOUT_KERNELS_OTHER:-60}"
T_ENGINE="${GPU_CHECK_TIMEOUT_ENGINE:-30}"
T_PERF="${GPU_CHECK_TIMEOUT_PERF:-130}"
T_E2E="${GPU_CHECK_TIMEOUT_E2E:-120}"
T_TP="${GPU_CHECK_TIMEOUT_TP:-90}"
WHEELS="${GPU_CHECK_WHEELS:-}"
if [ -z "$WHEELS" ] && [ -d .whl ]; then WHEELS="$REPO/.whl"; fi
if [ "$DRY_RUN" = 1 ]; then
  LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/paged-serve-gpu-check-dry.XXXXXX")"
  trap 'rm -rf "$LOG_DIR"' EXIT
else
  LOG_DIR="${GPU_CHECK_LOG_DIR:-${TMPDIR:-/tmp}/paged-serve-gpu-check}"
  mkdir -p "$LOG_DIR"
  # Only this script's own files from an earlier run (the folder may be shared).
  rm -f "$LOG_DIR"/steps.tsv "$LOG_DIR"/env.json "$LOG_DIR"/perf.json "$LOG_DIR"/benchmark.json \
    "$LOG_DIR"/kernels_*.xml "$LOG_DIR"/kernels_*.log "$LOG_DIR"/kernels_*.out \
    "$LOG_DIR"/kernels_*.err "$LOG_DIR"/engine_cuda* "$LOG_DIR"/hazards.* "$LOG_DIR"/perf.xml "$LOG_DIR"/perf.out "$LOG_DIR"/perf.err \
    "$LOG_DIR"/e2e.out "$LOG_DIR"/e2e.err
fi
LOG_DIR="$(cd "$LOG_DIR" && pwd)"

# The project runs from the source tree (no install: a link to engine/paged_serve, the package's
# own folder, on PYTHONPATH; it finds its subpackages in the repository, which is on the path too
# for tests/ and perf/), compiled Triton (never the interpreter), and never reaches for the network.
SOURCE_LINK="$LOG_DIR/source"
mkdir -p "$SOURCE_LINK" && ln -sfn "$REPO/engine/paged_serve" "$SOURCE_LINK/paged_serve"
export PYTHONPATH="$SOURCE_LINK:$REPO${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PAGED_SERVE_PERF_JSON="$LOG_DIR/perf.json"

say() { echo "gpu-check: $*"; }
# The engine's CUDA-only tests (real graph capture, sync debug mode); the rest of tests/ is CPU's.
ENGINE_TESTS="tests/engine/runner/test_decode_graphs.py tests/engine/runner/test_no_host_sync.py"
# The checks of what the interpreter cannot show (the gpu_hazard marker): reduction order, NaN
# handling in GPU reductions, graphs vs eager.
HAZARD_TESTS="tests/kernels/test_sampling_hazards.py tests/engine/runner/test_decode_graphs.py"
HELPER=("$PY" "$REPO/ci/gpu_check.py")

# ------------------------------------------------------------------------------ prerequisites
problems=0
if ! command -v "$PY" >/dev/null 2>&1; then
  say "no Python at '$PY' (set PYTHON to a Python that has torch, triton, transformers, pytest)"
  exit 1
fi
for path in tests/kernels $ENGINE_TESTS $HAZARD_TESTS perf/conftest.py perf/engine/bench_e2e.py perf/engine/model_shapes.py ci/gpu_check.py; do
  if [ ! -e "$path" ]; then say "missing $path (run from a paged-serve checkout)"; problems=1; fi
done
awk -v s="$SCALE" 'BEGIN { exit !(s + 0 > 0 && s + 0 <= 1) }' \
  || { say "GPU_CHECK_E2E_SCALE must be in (0, 1], got $SCALE"; problems=1; }
case "$JOBS" in ''|*[!0-9]*|0) say "GPU_CHECK_JOBS must be a positive integer, got $JOBS"; problems=1 ;; esac
if command -v nvidia-smi >/dev/null 2>&1; then NVSMI="nvidia-smi found"; else NVSMI="no nvidia-smi"; fi
if [ "$DRY_RUN" = 1 ]; then
  say "repo $REPO; python $(command -v "$PY"); $NVSMI; logs would go to ${GPU_CHECK_LOG_DIR:-${TMPDIR:-/tmp}/paged-serve-gpu-check}"
else
  say "repo $REPO; python $(command -v "$PY"); $NVSMI; logs in $LOG_DIR"
fi
[ "$problems" = 0 ] || exit 1

# The full e2e workload (256 requests, prompt and output lengths uniform in [100, 1024]: the
# workload the GPU speed goal, perf.engine.bench_e2e.E2E_GOALS, refers to) scaled:
# requests and output lengths shrink by SCALE (decode dominates the time); prompts stay as given.
E2E_REQUESTS=$(awk -v s="$SCALE" 'BEGIN { n = int(256 * s + 0.5); print (n < 1 ? 1 : n) }')
E2E_MIN_TOKENS=$(awk -v s="$SCALE" 'BEGIN { n = int(100 * s + 0.5); print (n < 1 ? 1 : n) }')
E2E_MAX_TOKENS=$(awk -v s="$SCALE" -v lo="$E2E_MIN_TOKENS" \
  'BEGIN { n = int(1024 * s + 0.5); print (n < lo ? lo : n) }')
E2E_WORKLOAD="scale $SCALE of the full workload: $E2E_REQUESTS requests (full: 256), prompts uniform \
in [100, 1024], outputs uniform in [$E2E_MIN_TOKENS, $E2E_MAX_TOKENS] (full: [100, 1024]), greedy, \
ignore_eos; vs HF padded generate and its continuous-batching manager"

PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
M_KERNELS_CUDA="cuda and not gpu_hazard"
M_KERNELS_OTHER="not cuda and not gpu_hazard"
M_ENGINE="cuda and not gpu_hazard"
BENCH_ARGS=()
if "$PY" -c "import pytest_benchmark" >/dev/null 2>&1; then
  BENCH_ARGS=(--benchmark-json="$LOG_DIR/benchmark.json" --benchmark-columns=min,median,rounds
              --benchmark-sort=fullname)
fi
E2E_CMD=("$PY" -m perf.engine.bench_e2e --device cuda --model-shape qwen3-0.6b
         --num-requests "$E2E_REQUESTS" --min-prompt 100 --max-prompt 1024
         --min-tokens "$E2E_MIN_TOKENS" --max-tokens "$E2E_MAX_TOKENS"
         --max-num-seqs 256 --max-num-batched-tokens 8192
         --hf-batch-api manager --check-requests 2 --compare-eager)
# manager, not generate_batch: generate_batch stops its manager with a 5 s join timeout, and on
# the H200 (transformers 5.17, 2026-11-30) the warm-up's thread outlived it; the timed call then
# crashed in HF's worker thread and waited until the step's limit. Our manager loop waits for
# the thread (perf/engine/hf_baselines.py) and stops when it dies.
# Tensor parallelism: eager steps (collectives inside a replayed graph are invisible to the
# timers), then decode graphs captured per rank; --check fails the step unless every run's greedy
# tokens equal TP=1 eager's.
TP_CMD=("$PY" -m perf.engine.bench_tp --device cuda --tp 1 2 --modes eager graphs --check)

print_steps() {
  say "steps (each under its own limit; the whole script under ${BUDGET_S} s):"
  echo "  1. hazards         limit ${T_HAZARDS} s: ${PYTEST[*]} $HAZARD_TESTS -m gpu_hazard"
  echo "  2. kernels[cuda]   limit ${T_KERNELS_CUDA} s, ${JOBS} shards: ${PYTEST[*]} tests/kernels -m '$M_KERNELS_CUDA'"
  echo "  3. kernels[other]  limit ${T_KERNELS_OTHER} s, ${JOBS} shards: ${PYTEST[*]} tests/kernels -m '$M_KERNELS_OTHER'"
  echo "  4. engine[cuda]    limit ${T_ENGINE} s: ${PYTEST[*]} $ENGINE_TESTS -m '$M_ENGINE'"
  echo "  5. perf            limit ${T_PERF} s: PAGED_SERVE_PERF_JSON=$PAGED_SERVE_PERF_JSON ${PYTEST[*]} perf ${BENCH_ARGS[*]+"${BENCH_ARGS[*]}"}"
  echo "  6. e2e             limit ${T_E2E} s: ${E2E_CMD[*]}"
  echo "     e2e workload: $E2E_WORKLOAD"
  echo "  7. tp              limit ${T_TP} s, needs >= 2 GPUs: ${TP_CMD[*]}"
}

if [ "$DRY_RUN" = 1 ]; then
  say "DRY RUN: checking prerequisites and printing the plan; nothing runs"
  "${HELPER[@]}" preflight --log-dir "$LOG_DIR"
  rc=$?
  if [ -n "$WHEELS" ]; then say "missing packages would be installed offline from $WHEELS"; fi
  print_steps
  "${HELPER[@]}" summary --log-dir "$LOG_DIR" --dry-run --e2e-workload "$E2E_WORKLOAD"
  exit "$rc"
fi

"${HELPER[@]}" preflight --log-dir "$LOG_DIR" --require-cuda
rc=$?
missing=$("$PY" -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))["missing"]))' \
  "$LOG_DIR/env.json" 2>/dev/null || true)
if [ -n "$missing" ] && [ -n "$WHEELS" ]; then
  # One package at a time: a wheel missing for one must not stop the others.
  for dist in $missing; do
    say "installing $dist offline from $WHEELS"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$dist" \
      || say "could not install $dist from $WHEELS; continuing without it"
  done
  "${HELPER[@]}" preflight --log-dir "$LOG_DIR" --require-cuda
  rc=$?
elif [ -n "$missing" ]; then
  say "missing: $missing (no wheel folder: put wheels in .whl/ or set GPU_CHECK_WHEELS)"
fi
if [ "$rc" != 0 ]; then
  say "prerequisites not met (exit $rc above): no step can run"
  for name in hazards "kernels[cuda]" "kernels[other]" "engine[cuda]" perf e2e tp; do
    "${HELPER[@]}" skip --log-dir "$LOG_DIR" --name "$name" --note "prerequisites not met"
  done
  "${HELPER[@]}" summary --log-dir "$LOG_DIR" --e2e-workload "$E2E_WORKLOAD"
  exit 1
fi
print_steps

# ------------------------------------------------------------------------------------- steps
# run_step NAME LIMIT_S JOBS JUNIT(0/1) CMD...: the helper enforces the limit (SIGINT, then
# SIGKILL); `timeout` is a backstop in case the helper itself hangs.
run_step() {
  local name="$1" limit="$2" jobs="$3" junit="$4"
  shift 4
  local now left
  now=$(date +%s)
  left=$(( BUDGET_S - (now - START) - 5 ))
  if [ "$left" -lt 20 ]; then
    say "$name: skipped, only ${left} s left of the ${BUDGET_S} s budget"
    "${HELPER[@]}" skip --log-dir "$LOG_DIR" --name "$name" --note "no time left in budget"
    return
  fi
  if [ "$limit" -gt "$left" ]; then limit="$left"; fi
  echo
  say "=== $name (limit ${limit} s) ==="
  local junit_flag=(--jobs "$jobs")
  if [ "$junit" = 1 ]; then junit_flag+=(--junit); fi
  local backstop=(env)
  if command -v timeout >/dev/null 2>&1; then backstop=(timeout -k 10 $(( limit + 45 ))); fi
  "${backstop[@]}" "${HELPER[@]}" run --log-dir "$LOG_DIR" --name "$name" --timeout "$limit" \
    "${junit_flag[@]}" -- "$@"
}

run_step hazards "$T_HAZARDS" 1 1 "${PYTEST[@]}" $HAZARD_TESTS -m gpu_hazard
run_step "kernels[cuda]" "$T_KERNELS_CUDA" "$JOBS" 1 "${PYTEST[@]}" tests/kernels -m "$M_KERNELS_CUDA"
run_step "kernels[other]" "$T_KERNELS_OTHER" "$JOBS" 1 "${PYTEST[@]}" tests/kernels -m "$M_KERNELS_OTHER"
run_step "engine[cuda]" "$T_ENGINE" 1 1 "${PYTEST[@]}" $ENGINE_TESTS -m "$M_ENGINE"
run_step perf "$T_PERF" 1 1 "${PYTEST[@]}" perf ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}
run_step e2e "$T_E2E" 1 0 "${E2E_CMD[@]}"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${GPUS:-0}" -ge 2 ]; then
  run_step tp "$T_TP" 1 0 "${TP_CMD[@]}"
else
  say "tp: not measured (needs >= 2 GPUs, this machine has ${GPUS:-0})"
  "${HELPER[@]}" skip --log-dir "$LOG_DIR" --name tp --note "not measured: needs >= 2 GPUs"
fi

echo
"${HELPER[@]}" summary --log-dir "$LOG_DIR" --e2e-workload "$E2E_WORKLOAD"
