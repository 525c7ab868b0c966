#!/usr/bin/env bash
# Prefill routing on 4 GPUs, or 2 (the device tool): round_robin against cache_aware on the
# shared-prefix workload, 2 prefill + 2 decode nodes (cuda_ipc), Qwen2.5-7B shapes with dummy
# weights. Each prefill node's KV pool is capped (PREFILL_BLOCKS) so that the prefixes fit the
# two prefill caches together but not one: where routing decides the hit rate. Prints the
# table (hit rate, TTFT p50/p99 per policy) last; JSON and stack logs go to $OUT/routing.
#   bash benchmarks/routing_gpu_suite.sh
# Knobs (environment): MODEL, PREFILL_BLOCKS, NUM_GROUPS, PREFIX_LEN, RATE, PROMPTS, POLICIES,
# NUM_DECODE and GPU_ARGS (where the nodes go). On 2 GPUs: NUM_DECODE=1
# GPU_ARGS="--prefill-gpus 0,1 --decode-gpus 1 --decode-kv-memory-fraction 0.55" (the decode
# node shares GPU 1 with a prefill node).
set -uo pipefail
OUT=${OUT:-benchmarks/results/routing_suite}
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
PREFILL_BLOCKS=${PREFILL_BLOCKS:-4096}  # 65k tokens: 32 prefixes of 2048 per node
NUM_GROUPS=${NUM_GROUPS:-48}
PREFIX_LEN=${PREFIX_LEN:-2048}
RATE=${RATE:-12}
PROMPTS=${PROMPTS:-600}
POLICIES=${POLICIES:-round_robin cache_aware}
NUM_DECODE=${NUM_DECODE:-2}
GPU_ARGS=${GPU_ARGS:---prefill-gpus 0,1 --decode-gpus 2,3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
# shellcheck disable=SC2086
timeout 580 python3 benchmarks/routing_compare.py --policies $POLICIES \
  --num-prefill 2 --num-decode "$NUM_DECODE" --num-prompts "$PROMPTS" --request-rate "$RATE" \
  --num-groups "$NUM_GROUPS" --prefix-len "$PREFIX_LEN" --input-len 64:256 --output-len 32 \
  --model "$MODEL" --load-format dummy --out "$OUT/routing" \
  --launch-arg "$GPU_ARGS --transport cuda_ipc" \
  --launch-arg "--prefill-num-kv-blocks $PREFILL_BLOCKS"
echo "exit $?"
