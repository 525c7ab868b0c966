#!/usr/bin/env bash
# Issue 22 on one GPU: the MoE and MLA kernels' GPU tests, then their microbenchmarks
# (grouped GEMM paths against the touched-expert floor and the matmul rate; MLA decode against
# its bytes floor), each with ceilings measured in the same run. PARTS picks a subset:
# tests moe mla engine. Results: $OUT/*.json; a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/moe_suite}
source benchmarks/gpu_env.sh
PARTS=${PARTS:-"tests moe mla"}
PY=${PY:-python3}
gpu_info
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
  $PY -m pytest -q -x tests/test_fused_moe.py tests/test_moe_routing.py tests/test_mla_attention.py \
    ${EXTRA_TESTS:-} 2>&1 | tail -15
fi
if has moe; then
  $PY benchmarks/bench_moe.py ${MOE_ARGS:-} --out "$OUT/moe.json" 2>&1 | tail -60
fi
if has mla; then
  $PY benchmarks/bench_mla_decode.py ${MLA_ARGS:-} --out "$OUT/mla.json" 2>&1 | tail -30
fi
if has engine; then
  for m in ${ENGINE_MODELS:-qwen3-30b-a3b}; do
    $PY benchmarks/bench_engine.py --model benchmarks/configs/$m ${ENGINE_ARGS:-} \
      --out "$OUT/engine_$m.json" 2>&1 | tail -25
  done
fi
