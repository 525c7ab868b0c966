#!/usr/bin/env bash
# Pipeline parallelism on 2 GPUs of one host, in one call (pattern: benchmarks/tp_gpu_suite.sh):
# check the environment, run the PP tests (stage processes over gloo on CPU, as in CI), then
# benchmarks/bench_pp.py --check: greedy PP1 == PP2 on the GPUs in fp32 (NCCL between stages,
# each stage's CUDA graphs), then Qwen2.5-7B dummy weights on 8k-token prompts for a
# `--prefill-pp 2` node against `--prefill-tp 2` and two single-GPU prefill nodes (decode node
# on GPU 1 beside them): prompt tok/s, TTFT p50/p90, the KV transfer and its exposed part. The
# short table comes last; JSON and the stacks' logs under $OUT/pp.
#   bash benchmarks/pp_gpu_suite.sh [bench_pp.py flags...]   (e.g. --layouts pp2 tp2)
#   SKIP_TESTS=1: no pytest; NO_CHECK=1: no greedy check
# Three 7B stacks and the check may not fit one 600 s call: split with --layouts over calls.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
gpu_info
command -v nvidia-smi >/dev/null && nvidia-smi topo -m | head -4
$PY -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'nccl', d.is_nccl_available() and torch.cuda.nccl.version())"
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "pp_gpu_suite: needs 2 GPUs, found $gpus"; exit 1
fi
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 $PY -m pytest -q -x -p no:cacheprovider tests/test_pipeline_parallel.py 2>&1 | tail -5
  status=${PIPESTATUS[0]}
fi
check=--check
if [ "${NO_CHECK:-0}" = 1 ]; then check=; fi
timeout $((${CALL_S:-590} - 60 - SECONDS)) $PY benchmarks/bench_pp.py --model "$MODEL" $check --out "$OUT/pp" "$@" 2>&1 \
  | grep -v "Warning\|warn(\| INFO " | tail -40
status=$((status || PIPESTATUS[0]))
exit $status
