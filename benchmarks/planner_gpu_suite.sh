#!/usr/bin/env bash
# The pool planner on the GPU machine (the device tool): profile Qwen2.5-7B (dummy weights) on
# one GPU, plan for 4 GPUs with the serving benchmark's long-prompt and chat workloads and the
# SLOs of docs/benchmarks.md (issue 9), and validate the top K layouts of each plan through
# launch_pd.sh with sweep_layouts (predicted against measured). Each step stays under the
# device tool's 10 minutes; run them in order (the profile is cached in $OUT/profiles.json):
#   bash benchmarks/planner_gpu_suite.sh profile      # ~3-5 min: the profile, and both plans
#   bash benchmarks/planner_gpu_suite.sh long         # long-prompt plan + validate the top K
#   bash benchmarks/planner_gpu_suite.sh chat         # chat plan + validate the top K
#   LAYOUTS="4c 3p1d" bash benchmarks/planner_gpu_suite.sh layouts_long  # then "2p2d 1p3d":
#                                                     # the best knobs of each layout, measured
# Each step writes STEP.json (every prediction, the validation rows) and STEP.tgz (sweeps,
# stack logs) under $OUT and prints its tables last.
# Knobs (environment): MODEL, VALIDATE_K (3), DURATION (s of arrivals per measured rate, 20),
# RATES (measured rates as fractions of the predicted goodput, "0.8 1.0 1.2"), CLIENTS, JOBS.
set -uo pipefail
OUT=${OUT:-benchmarks/results/planner_suite}
WORK=$(mktemp -d)
mkdir -p "$OUT"
source benchmarks/gpu_env.sh  # PYTHONPATH, carried wheels
MODEL=${MODEL:-benchmarks/configs/qwen2.5-7b-instruct}
VALIDATE_K=${VALIDATE_K:-3}
DURATION=${DURATION:-20}
RATES=${RATES:-0.8 1.0 1.2}
JOBS=${JOBS:-0}
# docs/benchmarks.md, issue 9: long prompts wait seconds for the first token but stream fast;
# chat answers within half a second; 90% of all requests must meet both objectives.
LONG=(--dataset long-prompt --slo ttft:3000 tpot:20)
CHAT=(--dataset chat --slo ttft:500 tpot:30)
steps=${*:-profile}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sort | uniq -c
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

plan() {  # plan STEP [pdserve plan args...]
  local step=$1; shift
  # shellcheck disable=SC2086
  timeout 580 python3 -m pdserve plan "$MODEL" --load-format dummy --devices 4 \
    --attainment 0.9 --num-prompts 400 --profile-cache "$OUT/profiles.json" --jobs "$JOBS" \
    --validate-duration "$DURATION" --validate-rates $RATES --validate-out "$WORK/$step" \
    --out "$OUT/$step.json" "$@" >"$WORK/$step.log" 2>&1
  echo "   exit $? ($step)"
  tail -30 "$WORK/$step.log"
  tar -C "$WORK" -czf "$OUT/$step.tgz" "$step.log" "$step" 2>/dev/null
}

for step in $steps; do
  echo "=== $step ($(date +%T))"
  case $step in
    profile) plan plan_long "${LONG[@]}"; plan plan_chat "${CHAT[@]}" ;;
    long) plan long "${LONG[@]}" --validate "$VALIDATE_K" ;;
    chat) plan chat "${CHAT[@]}" --validate "$VALIDATE_K" ;;
    layouts_long)  # the best knobs of each layout of $LAYOUTS (two per call fit 10 minutes)
      for layout in ${LAYOUTS:-4c 3p1d}; do
        plan "layout_long_$layout" "${LONG[@]}" --layouts "$layout" --validate 1
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
