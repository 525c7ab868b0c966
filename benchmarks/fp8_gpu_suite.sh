#!/usr/bin/env bash
# The FP8 targets in one call on one GPU (the device tool; ~9 minutes), bf16 and FP8 one after
# the other so every ratio pairs two runs of the same call, each run measuring its own ceilings:
#   a) Qwen2.5-7B dummy: bf16, then FP8 W8A8 per channel (--quantization fp8) + FP8 KV: decode
#      node loop greedy at batch 1/32/128, prefill 2k and 8k, offline 256 requests;
#   b) Qwen3-8B shapes: bf16, then a config stating 128 x 128 FP8 blocks (benchmarks/fp8_config.py)
#      + FP8 KV: decode and prefill;
#   c) bench_transfer.py over cuda_ipc within one GPU, bf16 then FP8 pools, the same token counts;
#   d) the FP8 decode runs again with --kernel-profile and PDSERVE_PDL=0 (device time per kernel
#      at batch 1 and 128);
#   e) time allowing (started before W8_BEFORE_S, default 400 s): Qwen2.5-7B W8A8 with a bf16 KV
#      cache, decode and prefill (KV capacity at the same weights);
#   f) only when PARTS names qm: Qwen3-30B-A3B bf16, then a config stating 128 x 128 blocks
#      (W8A8 dense layers and experts) + FP8 KV: decode and prefill, and its
#      kernel profile;
#   g) only when PARTS names ds: Moonlight-16B-A3B (DeepSeek-V3 architecture) likewise, the
#      FP8 run with an FP8 latent cache, and its kernel profile;
# then benchmarks/fp8_report.py: one table, each target, measured, PASS or MISS by how much.
#   bash benchmarks/fp8_gpu_suite.sh
# $OUT gets 8 files (what the device tool brings back): the engine results q7_bf16, q7_fp8,
# q7_w8, q3_bf16, q3_fp8 (.json), transfer_bf16.json, transfer_fp8.json (fp8_report.py reads
# that folder again) and fp8_suite.tgz with those, every log, plot and the report.
#   SMOKE=1: on a CPU machine, every step at tiny sizes (the embedded model, a tiny Qwen3 config,
#            zmq between CPU pools): a typo check, not a measurement
#   KV=auto: the "FP8" engine runs keep a bf16 KV cache (FP8 weights only)
#   PARTS="q7 q3 transfer w8": a subset, for a call's 10-minute limit (default all); every
#            JSON reaches $OUT as soon as its step ends, so a killed call keeps what finished
set -uo pipefail
OUT=${OUT:-benchmarks/results/fp8}
PY=${PYTHON:-python3}
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, carried wheels
gpu_info
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
RUN=$WORK/results
mkdir -p "$RUN"
status=0
common=(--mixes greedy --no-compare-sync)
if [ "${SMOKE:-0}" = 1 ]; then
  common+=(--smoke)
  tiny=(--tiny)
  transfer=(--cpu-smoke --repeats 1)
  sizes=(1) sizes_fp8=(0.5)  # MiB: half the bytes for the same blocks
  STEP_S=${STEP_S:-900}
else
  common+=(--steps 60 --warmup 15 --repeats 5 --prefill-lengths 2048 8192)
  tiny=()
  transfer=(--same-gpu --transports cuda_ipc --repeats 5)
  sizes=(16 64 256) sizes_fp8=(8 32 128)
  STEP_S=${STEP_S:-150}
fi
FP8=(--quantization fp8 --kv-cache-dtype "${KV:-fp8}")

step() {  # step NAME COMMAND...: its output in $RUN/NAME.log, the tail printed
  local name=$1
  shift
  echo "=== $name ($(date +%T), ${SECONDS}s)"
  timeout "$STEP_S" "$@" >"$RUN/$name.log" 2>&1
  local rc=$?
  grep -v "Warning\|warn(" "$RUN/$name.log" | tail -14
  cp "$RUN"/*.json "$OUT"/ 2>/dev/null
  if [ $rc != 0 ]; then
    echo "   $name FAILED (exit $rc)"
    status=1
  fi
}
engine() {  # engine NAME [bench_engine.py flags]: $RUN/NAME.json
  local name=$1
  shift
  step "$name" $PY benchmarks/bench_engine.py --out "$RUN/$name" "${common[@]}" "$@"
}
transfer() {  # transfer KIND [bench_transfer.py flags]: $RUN/transfer_KIND.json
  local kind=$1
  shift
  step "transfer_$kind" $PY benchmarks/bench_transfer.py "${transfer[@]}" "$@" \
    --out "$RUN/transfer_$kind"
  cp "$RUN/transfer_$kind/transfer.json" "$RUN/transfer_$kind.json" 2>/dev/null
}

q3=benchmarks/configs/qwen3-8b
$PY benchmarks/fp8_config.py "$q3" "$WORK/qwen3-8b" --plain "${tiny[@]}" >/dev/null
$PY benchmarks/fp8_config.py "$q3" "$WORK/qwen3-8b-fp8-block" "${tiny[@]}" >/dev/null
q3_bf16=(--model "$WORK/qwen3-8b" --parts decode prefill)
q3_fp8=(--model "$WORK/qwen3-8b-fp8-block" --parts decode prefill)
qm=benchmarks/configs/qwen3-30b-a3b
$PY benchmarks/fp8_config.py "$qm" "$WORK/qwen3-30b-a3b-fp8-block" "${tiny[@]}" >/dev/null
ds=benchmarks/configs/moonlight-16b-a3b
$PY benchmarks/fp8_config.py "$ds" "$WORK/moonlight-fp8-block" >/dev/null

PARTS=" ${PARTS:-q7 q3 transfer w8} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
# The kernel profiles run apart, with PDL off: with it, each kernel's device time would count its
# wait for the one before (common/model/kernels/pdl.py); the timed runs keep it on.
# Their results stay in $RUN/kernels (in the tarball), so $OUT keeps its 8 files.
profile=(--parts decode --decode-batches 1 128 --kernel-profile)
mkdir -p "$RUN/kernels"
if want q7; then
  engine q7_bf16
  engine q7_fp8 "${FP8[@]}"
  PDSERVE_PDL=0 engine kernels/q7_fp8 "${FP8[@]}" "${profile[@]}"
fi
if want q3; then
  engine q3_bf16 "${q3_bf16[@]}"
  engine q3_fp8 "${q3_fp8[@]}" "${FP8[@]}"
  PDSERVE_PDL=0 engine kernels/q3_fp8 --model "$WORK/qwen3-8b-fp8-block" "${FP8[@]}" "${profile[@]}"
fi
if want qm; then
  engine qm_bf16 --model "$qm" --parts decode prefill
  engine qm_fp8 --model "$WORK/qwen3-30b-a3b-fp8-block" --parts decode prefill "${FP8[@]}"
  PDSERVE_PDL=0 engine kernels/qm_fp8 --model "$WORK/qwen3-30b-a3b-fp8-block" "${FP8[@]}" \
    "${profile[@]}"
fi
if want ds; then
  engine ds_bf16 --model "$ds" --parts decode prefill
  engine ds_fp8 --model "$WORK/moonlight-fp8-block" --parts decode prefill "${FP8[@]}"
  PDSERVE_PDL=0 engine kernels/ds_fp8 --model "$WORK/moonlight-fp8-block" "${FP8[@]}" \
    "${profile[@]}"
fi
if want transfer; then
  transfer bf16 --sizes-mb "${sizes[@]}"
  transfer fp8 --sizes-mb "${sizes_fp8[@]}" --kv-cache-dtype fp8
fi
if ! want w8; then
  :
elif [ "$SECONDS" -lt "${W8_BEFORE_S:-400}" ] || [ "${SMOKE:-0}" = 1 ]; then
  engine q7_w8 --quantization fp8 --parts decode prefill
else
  echo "=== q7_w8 skipped: ${SECONDS}s spent"
fi
echo "=== report ($(date +%T), ${SECONDS}s)"
cp "$RUN"/*.json "$OUT"/
$PY benchmarks/fp8_report.py "$RUN" --kernel-log "$RUN/kernels/q7_fp8.log" \
  --kernel-log "$RUN/kernels/q3_fp8.log" --kernel-log "$RUN/kernels/qm_fp8.log" \
  --kernel-log "$RUN/kernels/ds_fp8.log" \
  >"$RUN/report.txt" 2>&1
tar -C "$RUN" -czf "$OUT/fp8_suite.tgz" .
cat "$RUN/report.txt"
exit $status
