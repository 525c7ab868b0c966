#!/usr/bin/env bash
# Tensor parallel on 2 GPUs of one host, in one call (pattern: benchmarks/gpu_suite.sh):
# check the environment, run the TP tests (CPU ranks over gloo, as in CI), then
# benchmarks/bench_tp.py: greedy TP1 == TP2 on the GPUs in fp32 (CUDA graphs on, so the
# captured all-reduces are exercised), and the decode node's real loop at TP 2 for Qwen2.5-7B
# dummy weights at batch 32 and 128 against its floor (half the weights and the rank's KV
# heads per GPU / copy bandwidth + the step's collective bytes / GPU0->GPU1 peer bandwidth).
# The short table comes last; JSON under $OUT.
#   bash benchmarks/tp_gpu_suite.sh [bench_tp.py flags...]
#   SKIP_TESTS=1: benchmark only
set -uo pipefail
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
gpu_info
command -v nvidia-smi >/dev/null && nvidia-smi topo -m | head -4
$PY -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'nccl', d.is_nccl_available() and torch.cuda.nccl.version())"
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "tp_gpu_suite: needs 2 GPUs, found $gpus"; exit 1
fi
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 420 $PY -m pytest -q -x -p no:cacheprovider tests/test_tp_layout.py \
    tests/test_kv_transfer_tp.py tests/test_tensor_parallel.py 2>&1 | tail -5
  status=${PIPESTATUS[0]}
fi
timeout 1500 $PY benchmarks/bench_tp.py --tp 2 --out "$OUT/tp" "$@" 2>&1 \
  | grep -v "Warning\|warn(\| INFO " | tail -30
status=$((status || PIPESTATUS[0]))
exit $status
