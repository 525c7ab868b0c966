#!/usr/bin/env bash
# One call on a multi-GPU machine (the device tool) for the PD transfer path: install carried
# wheels if any, run the CUDA transfer tests, then the transfer bandwidth benchmark, the TTFT
# breakdown (optionally with the node processes profiled) and, with 4+ GPUs, the multi-instance layouts. Steps are
# chosen by name; results and a log go under $OUT (at most 8 files: logs are tarred).
#   bash benchmarks/pd_gpu_suite.sh [tests] [transfer] [ttft] [ttft_profiled] [multi]
#   (default: tests transfer ttft multi)
set -uo pipefail
OUT=${OUT:-benchmarks/results/pd_suite}
WORK=$(mktemp -d)
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
steps=${*:-tests transfer ttft multi}
gpus=$(nvidia-smi -L | wc -l)
gpu_info | sort | uniq -c
nvidia-smi topo -m | head -$((gpus + 1))
for step in $steps; do
  echo "=== $step ($(date +%T))"
  case $step in
    tests)
      timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_kv_transfer_cuda_ipc_gpu.py \
        tests/test_kv_transfer.py tests/test_triton_kernels.py -k "gpu or cuda or block_copier" 2>&1 | tail -8 ;;
    transfer)
      timeout 300 python3 benchmarks/bench_transfer.py --out "$WORK/transfer" >"$OUT/transfer.log" 2>&1
      tail -14 "$OUT/transfer.log"
      # Where the sender's host time goes, apart (cProfile slows what it watches).
      timeout 120 python3 benchmarks/bench_transfer.py --profile --sizes-mb 16 --repeats 20 \
        --transports cuda_ipc --out "$WORK/transfer_profile" >>"$OUT/transfer.log" 2>&1
      cp "$WORK"/transfer/transfer.{json,png} "$OUT"/ ;;
    ttft)
      timeout 420 python3 benchmarks/ttft_breakdown.py --out "$WORK/ttft" 2>&1 | grep -v "^    " | tail -30
      cp "$WORK"/ttft/ttft.{json,png} "$OUT"/ 2>/dev/null
      tar -C "$WORK" -czf "$OUT/ttft_logs.tgz" --exclude='*.png' ttft ;;
    ttft_profiled)  # the node processes under cProfile (slower: for where the time goes)
      PDSERVE_PROFILE_DIR=$WORK/profiles timeout 300 python3 benchmarks/ttft_breakdown.py \
        --setups pd_cuda_ipc colocated --lengths 128 2048 --out "$WORK/ttft_profiled" 2>&1 | tail -12
      tar -C "$WORK" -czf "$OUT/profiles.tgz" profiles ;;
    multi)
      if [ "$gpus" -ge 4 ]; then
        timeout 400 python3 benchmarks/multi_instance.py --out "$WORK/multi" 2>&1 | tail -24
        cp "$WORK/multi/multi_instance.json" "$OUT"/
        tar -C "$WORK" -czf "$OUT/multi_logs.tgz" multi
      else
        echo "multi: needs 4 GPUs, $gpus here"
      fi ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
