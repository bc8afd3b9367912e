#!/usr/bin/env bash
# The whole GPU job in one command: install, GPU tests, compute-sanitizer, benchmark.
#   bash scripts/gpu_suite.sh OUTDIR [GEOMETRY_DIR] [BENCH_ARGS...]
# Logs and results land in OUTDIR; each stage's exit status is summarised at the end.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUTDIR [GEOMETRY_DIR] [BENCH_ARGS...]}
geometry=${2:-}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary=()
stage() {  # stage NAME COMMAND...: run, log to OUTDIR/NAME.log, remember the status
  local name=$1; shift
  local start=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local status=$?
  summary+=("$(printf '%-12s exit %-3s %4ss' "$name" "$status" $((SECONDS - start)))")
  tail -n 5 "$out/$name.log"
}
stage install python3 -m pip install --no-deps --no-build-isolation -e .
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
stage gpu_tests python3 -m pytest tests -m gpu -q -x -p no:cacheprovider
stage memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
stage racecheck compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
stage initcheck compute-sanitizer --tool initcheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
stage synccheck compute-sanitizer --tool synccheck --error-exitcode 9 python3 scripts/sanitize_kernels.py
if [ -n "$geometry" ]; then
  stage bench python3 -m knnconv.bench --geometry "$geometry" --out "$out" "$@"
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
