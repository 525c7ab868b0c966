#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install carried wheels if any, check the
# environment, run the GPU tests, the bf16 logits check and the engine benchmark.
#   bash benchmarks/gpu_suite.sh [bench_engine.py flags...]      (results under $OUT)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu_engine.py \
    tests/test_flash_attn_backend.py tests/test_kv_transfer.py 2>&1 | tail -12
  timeout 120 python3 benchmarks/gpu_checks.py 2>&1 | tail -3
fi
python3 benchmarks/bench_engine.py --out "$OUT/engine" "$@" 2>&1 | grep -v "Warning\|warn(" | tail -40
