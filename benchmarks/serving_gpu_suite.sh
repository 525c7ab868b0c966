#!/usr/bin/env bash
# Serving under load on the GPU machine (the device tool): open-loop sweeps of PD layouts
# against colocated instances on the same GPUs, through launch_pd.sh. One call runs the
# steps named; each step leaves STEP.tgz (sweep.json, sweep.png, stack logs) under $OUT and
# prints its goodput tables last.
#   bash benchmarks/serving_gpu_suite.sh [single] [pairs_long] [pairs_chat] [four_long]
#   single      1 GPU: 1c on long-prompt, then 1p1d sharing the GPU (a PD smoke test under load)
#   pairs_*     4 GPUs: 1p1d on GPUs 0,1 and 2c on GPUs 2,3 side by side (two 2-GPU sweeps);
#               on 2 GPUs, the two sweeps one after the other
#   four_long   4 GPUs: the layouts of FOUR_LAYOUTS (default 4c 3p1d 2p2d 1p3d), one sweep each
# Knobs (environment): MODEL, LONG_RATES, CHAT_RATES (per GPU; RATES_<layout>, e.g. RATES_3p1d,
# overrides them for one layout), DURATION, CHAT_DURATION, LONG_SLO / LONG_STOP_SLO /
# CHAT_SLO / CHAT_STOP_SLO, CLIENTS (client processes), TIMEOUT (seconds per sweep).
set -uo pipefail
OUT=${OUT:-benchmarks/results/serving_suite}
WORK=$(mktemp -d)
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
LONG_RATES=${LONG_RATES:-1 2 3 4 5 6}
CHAT_RATES=${CHAT_RATES:-5 10 20 30 40}
DURATION=${DURATION:-30}
CHAT_DURATION=${CHAT_DURATION:-20}
# SLOs (docs/benchmarks.md says why): long prompts, TTFT in seconds and a tight TPOT; chat, a
# few hundred ms to the first token. The *_STOP_SLO is the loosest SLO scored afterwards.
LONG_SLO=${LONG_SLO:-ttft:3000 tpot:20}
LONG_STOP_SLO=${LONG_STOP_SLO:-ttft:3000 tpot:50}
CHAT_SLO=${CHAT_SLO:-ttft:500 tpot:30}
CHAT_STOP_SLO=${CHAT_STOP_SLO:-ttft:1000 tpot:50}
CLIENTS=${CLIENTS:-4}
TIMEOUT=${TIMEOUT:-560}
FOUR_LAYOUTS=${FOUR_LAYOUTS:-4c 3p1d 2p2d 1p3d}
rates_for() { local var="RATES_$1"; echo "${!var:-$2}"; }  # rates_for LAYOUT DEFAULT
# PYSPY_LAYOUT=3p1d: PYSPY_AT seconds after that layout's sweep starts, record its first decode
# node with py-spy for PYSPY_S seconds (carry py-spy as a wheel), into $OUT/pyspy_LAYOUT.txt.
PYSPY_LAYOUT=${PYSPY_LAYOUT:-} PYSPY_AT=${PYSPY_AT:-40} PYSPY_S=${PYSPY_S:-15}
profile_decode() {  # profile_decode LAYOUT (in the background while its sweep runs)
  sleep "$PYSPY_AT"
  local pid; pid=$(pgrep -f "m decode_node" | head -1)
  [ -n "$pid" ] || return
  py-spy dump --pid "$pid" --native >"$OUT/pyspy_dump_$1.txt" 2>&1
  py-spy record --pid "$pid" --native --idle --rate 200 --duration "$PYSPY_S" --format raw \
    --output "$OUT/pyspy_$1.txt" >/dev/null 2>&1
  top -H -b -n 1 -p "$pid" | head -40 >"$OUT/top_$1.txt"
}
steps=${*:-single}
gpu_info | sort | uniq -c
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

sweep() {  # sweep OUTDIR DATASET "SLO" "STOP_SLO" "RATES" DURATION [sweep_layouts args...]
  local dir=$1 dataset=$2 slo=$3 stop=$4 rates=$5 duration=$6; shift 6
  # shellcheck disable=SC2086
  timeout "$TIMEOUT" python3 benchmarks/sweep_layouts.py --model "$MODEL" --load-format dummy \
    --dataset "$dataset" --slo $slo --stop-slo $stop --extra-slo $stop \
    --rates-per-gpu $rates --duration "$duration" --client-processes "$CLIENTS" \
    --out "$dir" "$@" >"$dir.log" 2>&1
  echo "   exit $? ($dir)"
}

pack() {  # pack STEP DIR...: one tgz per step, logs included
  local step=$1; shift
  tar -C "$WORK" -czf "$OUT/$step.tgz" "${@#"$WORK"/}" 2>/dev/null
}

for step in $steps; do
  echo "=== $step ($(date +%T))"
  case $step in
    single)
      sweep "$WORK/single_long" long-prompt "$LONG_SLO" "$LONG_STOP_SLO" "$LONG_RATES" "$DURATION" \
        --layouts 1c --gpus 0
      sweep "$WORK/single_pd" long-prompt "$LONG_SLO" "$LONG_STOP_SLO" "1 2" 20 \
        --layouts 1p1d --gpus 0,0 --launch-arg "--prefill-kv-memory-fraction 0.42" \
        --launch-arg "--decode-kv-memory-fraction 0.42"
      for d in single_long single_pd; do tail -12 "$WORK/$d.log"; done
      pack single "$WORK"/single_long "$WORK"/single_pd "$WORK"/single_long.log "$WORK"/single_pd.log ;;
    pairs_long|pairs_chat)
      if [ "$step" = pairs_long ]; then
        dataset=long-prompt slo=$LONG_SLO stop=$LONG_STOP_SLO rates=$LONG_RATES duration=$DURATION
      else
        dataset=chat slo=$CHAT_SLO stop=$CHAT_STOP_SLO rates=$CHAT_RATES duration=$CHAT_DURATION
      fi
      if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then  # side by side
        sweep "$WORK/${step}_1p1d" "$dataset" "$slo" "$stop" "$(rates_for 1p1d "$rates")" \
          "$duration" --layouts 1p1d --gpus 0,1 &
        sweep "$WORK/${step}_2c" "$dataset" "$slo" "$stop" "$(rates_for 2c "$rates")" \
          "$duration" --layouts 2c --gpus 2,3 &
        wait
      else  # 2 GPUs: one after the other on GPUs 0,1
        sweep "$WORK/${step}_1p1d" "$dataset" "$slo" "$stop" "$(rates_for 1p1d "$rates")" \
          "$duration" --layouts 1p1d --gpus 0,1
        sweep "$WORK/${step}_2c" "$dataset" "$slo" "$stop" "$(rates_for 2c "$rates")" \
          "$duration" --layouts 2c --gpus 0,1
      fi
      # shellcheck disable=SC2086
      python3 benchmarks/sweep_layouts.py --plot-only "$WORK/${step}_1p1d" "$WORK/${step}_2c" \
        --slo $slo --extra-slo $stop --out "$WORK/$step" 2>&1 | tail -12
      pack "$step" "$WORK/$step" "$WORK/${step}"_* ;;
    four_long)
      dirs=()
      for layout in $FOUR_LAYOUTS; do
        [ "$layout" = "$PYSPY_LAYOUT" ] && profile_decode "$layout" &
        sweep "$WORK/four_$layout" long-prompt "$LONG_SLO" "$LONG_STOP_SLO" \
          "$(rates_for "$layout" "$LONG_RATES")" "$DURATION" --layouts "$layout" --gpus 0,1,2,3
        dirs+=("$WORK/four_$layout")
      done
      # shellcheck disable=SC2086
      python3 benchmarks/sweep_layouts.py --plot-only "${dirs[@]}" --slo $LONG_SLO \
        --extra-slo $LONG_STOP_SLO --out "$WORK/four_long" 2>&1 | tail -16
      pack "four_long_${FOUR_LAYOUTS// /_}" "$WORK"/four_* ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
