#!/usr/bin/env bash
# The pool planner on the GPU machine (the device tool): profile Qwen2.5-7B (dummy weights) on
# one GPU, plan for 4 GPUs with the serving benchmark's long-prompt and chat workloads and the
# SLOs of docs/benchmarks.md (issue 9), and validate the top 3 layouts of each plan through
# launch_pd.sh with sweep_layouts (predicted against measured). Each call stays under the
# device tool's 10 minutes; run them in order (the profile is cached in $OUT/profiles.json):
#   bash benchmarks/planner_gpu_suite.sh profile           # ~4 min: profile, and both plans
#   bash benchmarks/planner_gpu_suite.sh long:1 long:2     # validate ranks 1 and 2 (long-prompt)
#   bash benchmarks/planner_gpu_suite.sh long:3 chat:1     # ... rank 3, then chat rank 1
#   bash benchmarks/planner_gpu_suite.sh chat:2 chat:3
#   bash benchmarks/planner_gpu_suite.sh layout:4c layout:2p2d   # any layout's best knobs,
#                                                          # long-prompt (the "best measured")
# Each step writes STEP.json (every prediction and its validation rows) and STEP.tgz (sweeps,
# stack logs) under $OUT, and prints the plan's table, its command and predicted against
# measured last. Knobs (environment): MODEL, DURATION (s of arrivals per measured rate, 20),
# RATES (measured rates as fractions of the predicted goodput, "0.8 1.0 1.2"), JOBS.
set -uo pipefail
OUT=${OUT:-benchmarks/results/planner_suite}
WORK=$(mktemp -d)
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
DURATION=${DURATION:-20}
RATES=${RATES:-0.8 1.0 1.2}
JOBS=${JOBS:-0}
# docs/benchmarks.md, issue 9: long prompts wait seconds for the first token but stream fast;
# chat answers within half a second; 90% of all requests must meet both objectives.
LONG=(--dataset long-prompt --slo ttft:3000 tpot:20)
CHAT=(--dataset chat --slo ttft:500 tpot:30)
steps=${*:-profile}
gpu_info | sort | uniq -c
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

plan() {  # plan STEP [pdserve plan args...]
  local step=$1; shift
  # shellcheck disable=SC2086
  timeout 560 python3 -m pdserve plan "$MODEL" --load-format dummy --devices 4 \
    --attainment 0.9 --num-prompts 400 --profile-cache "$OUT/profiles.json" --jobs "$JOBS" \
    --validate-duration "$DURATION" --validate-rates $RATES --validate-out "$WORK/$step" \
    --out "$OUT/$step.json" "$@" >"$WORK/$step.log" 2>&1
  echo "   exit $? ($step)"
  tail -32 "$WORK/$step.log"
  tar -C "$WORK" -czf "$OUT/$step.tgz" "$step.log" "$step" 2>/dev/null
}

for step in $steps; do
  echo "=== $step ($(date +%T))"
  case $step in
    profile) plan plan_long "${LONG[@]}"; plan plan_chat "${CHAT[@]}" ;;
    long:*) plan "long_${step#*:}" "${LONG[@]}" --validate 1 --validate-from "${step#*:}" ;;
    chat:*) plan "chat_${step#*:}" "${CHAT[@]}" --validate 1 --validate-from "${step#*:}" ;;
    layout:*) plan "layout_${step#*:}" "${LONG[@]}" --layouts "${step#*:}" --validate 1 ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
