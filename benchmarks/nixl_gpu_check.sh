#!/usr/bin/env bash
# The nixl transport on a GPU machine, in one command: the nixl tests (CPU pools, then PD through
# launch_pd.sh with GPU pools registered as VRAM), then KV transfer bandwidth of nixl next to
# cuda_ipc, zmq and the raw peer copy (cuda:0 -> cuda:1), table last.
#   bash benchmarks/nixl_gpu_check.sh [bench_transfer.py flags]
#   One GPU (P and D sharing it), 2k and 8k tokens of Qwen2.5-7B KV (56 KiB a token):
#   bash benchmarks/nixl_gpu_check.sh --same-gpu --sizes-mb 112 448
# nixl must import: carry nixl-*.whl and the nixl_cuXX wheel matching torch's CUDA (cu13 for
# torch +cu130) in .whl/ (benchmarks/gpu_env.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
PY=${PY:-python3}
if ! "$PY" -c "import nixl" 2>/tmp/nixl_import.err; then
  echo "nixl does not import here: $(tail -1 /tmp/nixl_import.err)"; exit 1
fi
"$PY" -m pytest -q -rs tests/test_kv_transfer_nixl.py
# PD with each transport on one GPU shared by P and D (tests/test_pd_nixl_e2e.py needs the
# embedded model, which the GPU machine lacks): same greedy tokens, nixl's direct path.
"$PY" benchmarks/nixl_gpu_pd.py --out "${OUT:-benchmarks/results}/nixl_pd.json"
if [ $# -eq 0 ]; then set -- --sizes-mb 4 16 64 256; fi
"$PY" benchmarks/bench_transfer.py --transports cuda_ipc zmq nixl "$@" \
  --out "${OUT:-benchmarks/results}/transfer_nixl"
