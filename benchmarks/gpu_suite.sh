#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install carried wheels if any, check the
# environment, run the GPU tests (engine in every graph mode overlapped and synchronous, seeded
# overlap == synchronous, the staging ring; Triton kernels; sampler ops; flash-attn; KV
# transfer), the bf16 logits check, the message codec, then the engine benchmark (decode node's
# real loop vs the HBM floor, prefill vs its floors, offline throughput, graph memory). The
# benchmark's short table with the targets comes last.
#   bash benchmarks/gpu_suite.sh [bench_engine.py flags...]       (results under $OUT)
#   SKIP_TESTS=1: benchmark only;  SKIP_BENCH=1: tests and checks only
#   SMOKE=1: on a CPU machine, every step at tiny sizes (bench_engine.py --smoke): typo check
set -uo pipefail
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
gpu_info
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 420 $PY -m pytest -q -x -p no:cacheprovider tests/test_gpu_engine.py tests/test_triton_kernels.py \
    tests/test_sampler.py tests/test_sampling_kernels.py tests/test_flash_attn_backend.py tests/test_kv_transfer.py 2>&1 | tail -15
  status=${PIPESTATUS[0]}
  if [ "${SMOKE:-0}" != 1 ]; then
    timeout 120 $PY benchmarks/gpu_checks.py 2>&1 | tail -3
  fi
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  $PY benchmarks/bench_messages.py --json "$OUT/messages.json" 2>&1 | tail -4
  extra=()
  [ "${SMOKE:-0}" = 1 ] && extra=(--smoke)
  $PY benchmarks/bench_engine.py --out "$OUT/engine" "${extra[@]}" "$@" 2>&1 \
    | grep -v "Warning\|warn(" | tail -60
  status=$((status || PIPESTATUS[0]))
fi
exit $status
