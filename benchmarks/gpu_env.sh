# Sourced by the GPU scripts (never run), after they set OUT (their results folder, created
# here). Sets the repository on PYTHONPATH, unbuffered output, MODEL's default (Qwen2.5-7B
# shapes, for the scripts that start stacks) and installs the wheels carried in .whl/ (pyzmq,
# fastapi, xgrammar, py-spy, ...) into /tmp/site, which goes first on PYTHONPATH and PATH.
# Uses $PY when set (default python3). `gpu_info` prints name, memory and driver of each GPU.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi
MODEL=${MODEL:-benchmarks/configs/qwen2.5-7b-instruct}
# A wheel too large to travel whole (nixl_cu13: 59 MB, over the 64 MiB a call carries with the
# tree) comes as WHEELNAME.tar.xz of its unpacked files (32 MB): zipped into the wheel again.
for packed in .whl/*.tar.xz; do
  [ -e "$packed" ] || continue
  wheel=/tmp/wheels/$(basename "$packed" .tar.xz).whl
  [ -e "$wheel" ] && continue
  rm -rf /tmp/unpacked && mkdir -p /tmp/unpacked /tmp/wheels && tar -xJf "$packed" -C /tmp/unpacked
  (cd /tmp/unpacked && ${PY:-python3} -m zipfile -c "$wheel" .)
done
if ls /tmp/wheels/*.whl >/dev/null 2>&1; then
  ${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site /tmp/wheels/*.whl
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  ${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi

gpu_info() {  # one line a GPU; nothing where nvidia-smi is missing
  command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
}
