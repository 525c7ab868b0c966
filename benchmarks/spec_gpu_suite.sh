#!/usr/bin/env bash
# Speculative decoding on one H200 (issue 21) in one device call, ~5 minutes (at most ~8:
# each step has its own timeout, and every JSON is rewritten as each of its parts ends, so a
# killed step keeps what finished):
#   q7: Qwen2.5-7B dummy target (bf16, CUDA graphs) with a random Qwen2.5-0.5B-config draft:
#       oracle tok/s on / off at mean accepted length 3, K=4, batch 1, 8, 32; verify-step cost
#       for K=1..7 at batch 1, 8, 32 against plain decode steps; the draft model's step,
#       propose time and tok/s at batch 1 and 32, and its catch-up over a 2k prompt against
#       the target's prefill; the oracle at K=2, 3, 5 (batch 1, 32) while its 180 s budget lasts;
#   l8: Llama-3.1-8B dummy target with a random EAGLE-3 head of the published shape: the same
#       as the draft model's, for the head;
# then benchmarks/spec_report.py: the tables and the targets (x2.2 at batch 1, x1.6 at batch 32).
#   source benchmarks/gpu_env.sh && bash benchmarks/spec_gpu_suite.sh
# $OUT gets spec_q7.json, spec_l8.json, their logs (.log) and report.txt.
#   SMOKE=1: on a CPU machine, every step at tiny sizes: a typo check, not a measurement
#   PARTS="q7 l8": a subset (default both)
set -uo pipefail
OUT=${OUT:-benchmarks/results/spec}
PY=${PYTHON:-python3}
source benchmarks/gpu_env.sh # creates $OUT; PYTHONPATH, carried wheels
gpu_info
$PY -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)" 2>/dev/null ||
  $PY -c "import torch; print('torch', torch.__version__)"
status=0
common=()
Q7_S=${Q7_S:-280} L8_S=${L8_S:-180}
if [ "${SMOKE:-0}" = 1 ]; then
  common=(--smoke)
  Q7_S=900 L8_S=900
fi

step() { # step NAME SECONDS COMMAND...: its output in $OUT/NAME.log, the tail printed
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T), ${SECONDS}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "Warning\|warn(" "$OUT/$name.log" | tail -30
  if [ $rc != 0 ]; then
    echo "   $name FAILED (exit $rc)"
    status=1
  fi
}

PARTS=" ${PARTS:-q7 l8} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
if want q7; then
  step spec_q7 "$Q7_S" $PY benchmarks/bench_spec.py --budget-s 180 --out "$OUT/spec_q7.json" \
    "${common[@]}"
fi
if want l8; then
  step spec_l8 "$L8_S" $PY benchmarks/bench_spec.py --model benchmarks/configs/llama-3.1-8b-instruct \
    --parts eagle3 --out "$OUT/spec_l8.json" "${common[@]}"
fi
echo "=== report ($(date +%T), ${SECONDS}s)"
$PY benchmarks/spec_report.py "$OUT/spec_q7.json" "$OUT/spec_l8.json" >"$OUT/report.txt" 2>&1
cat "$OUT/report.txt"
exit $status
