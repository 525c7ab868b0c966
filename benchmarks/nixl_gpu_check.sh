#!/usr/bin/env bash
# The nixl transport on a GPU machine, in one command: the nixl tests (CPU pools, then PD through
# launch_pd.sh with GPU pools registered as VRAM), then KV transfer bandwidth of nixl next to
# cuda_ipc, zmq and the raw peer copy (cuda:0 -> cuda:1), table last.
#   bash benchmarks/nixl_gpu_check.sh
# nixl must import: carry nixl-*.whl and the nixl_cuXX wheel matching torch's CUDA (cu13 for
# torch +cu130) in .whl/ (benchmarks/gpu_env.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
PY=${PY:-python3}
if ! "$PY" -c "import nixl" 2>/tmp/nixl_import.err; then
  echo "nixl does not import here: $(tail -1 /tmp/nixl_import.err)"; exit 1
fi
"$PY" -m pytest -q -rs tests/test_kv_transfer_nixl.py tests/test_pd_nixl_e2e.py
"$PY" benchmarks/bench_transfer.py --transports cuda_ipc zmq nixl --sizes-mb 4 16 64 256 \
  --out benchmarks/results/transfer_nixl
