# Sourced by the GPU scripts (never run), after they set OUT (their results folder, created
# here). Sets the repository on PYTHONPATH, unbuffered output, MODEL's default (Qwen2.5-7B
# shapes, for the scripts that start stacks) and installs the wheels carried in .whl/ (pyzmq,
# fastapi, xgrammar, py-spy, ...) into /tmp/site, which goes first on PYTHONPATH and PATH.
# Uses $PY when set (default python3). `gpu_info` prints name, memory and driver of each GPU.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi
MODEL=${MODEL:-benchmarks/configs/qwen2.5-7b-instruct}
if ls .whl/*.whl >/dev/null 2>&1; then
  ${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi

gpu_info() {  # one line a GPU; nothing where nvidia-smi is missing
  command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
}
