"""Which checkpoint a model name means, and its spec, without importing torch or transformers
(the launcher resolves the model before it starts any process; a node reads the spec first).

Sources: an HF directory (config.json + *.safetensors, sharded or not), a hub id (`org/name`)
whose snapshot is in the local Hugging Face cache (`common/model/hub.py`), a GGUF file (through
transformers, converted once to the serving dtype and cached as an HF directory), or the
embedded SmolLM2 GGUF when no model is named. `common/model/loader.py` builds the model from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common.model.embedded import embedded_gguf_path
from common.model.gguf_cache import materialize_gguf
from common.model.hub import ModelNotFound, cached_snapshot, looks_like_hub_id
from common.model.spec import ModelSpec


@dataclass(frozen=True)
class ModelSource:
    """A resolved checkpoint: an HF-style directory (for GGUF, the cached conversion)."""

    directory: Path
    name: str  # what /v1/models reports


def resolve_model(model: str | None, dtype: str = "float32") -> ModelSource:
    """The checkpoint `model` names. `dtype` is the serving dtype: a GGUF file is converted to
    it (once per file and dtype). Raises `ModelNotFound` (a ValueError) with one line that says
    where it looked and what to do."""
    if model is None:
        gguf = embedded_gguf_path()
        return ModelSource(materialize_gguf(gguf, dtype), "SmolLM2-135M-Instruct")
    path = Path(model).expanduser()
    name = path.name
    if not path.exists() and looks_like_hub_id(model):
        path, name = cached_snapshot(model), model
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(materialize_gguf(path, dtype), path.stem)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise ModelNotFound(
            f"model {model!r} is not a directory, a config.json, a .gguf file or a hub id "
            "(org/name) in the Hugging Face cache"
        )
    if not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelSource(materialize_gguf(ggufs[0], dtype), name)
        raise ModelNotFound(f"model directory {path} has no config.json")
    return ModelSource(path, name)


def read_spec(source: ModelSource) -> ModelSpec:
    """The spec of `source`: straight from its config.json when that states every value the
    spec reads (importing transformers costs a node process seconds of CPU at start-up), else
    through transformers' AutoConfig, which fills in its config class's defaults."""
    config: Any = stated_config(json.loads((source.directory / "config.json").read_text()))
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source.directory)
    return ModelSpec.from_hf_config(config, eos_token_ids=generation_eos_ids(source.directory))


# What ModelSpec.from_hf_config reads whose default depends on the config class.
_STATED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "eos_token_id",  # LlamaConfig's default is 2
)
# DeepSeek's config classes default these per version (q_lora_rank 1536; V3's
# routed_scaling_factor 2.5, norm_topk_prob, first_k_dense_replace 3, n_group 8, ...).
_DEEPSEEK_STATED_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "routed_scaling_factor",
    "norm_topk_prob",
    "n_group",
    "topk_group",
)


def stated_config(raw: dict[str, Any]) -> SimpleNamespace | None:
    """`raw` (a config.json) as attributes when it states every value the spec reads; None when
    one is left to its config class's default. Absent flags whose default is off in every
    supported class (attention_bias, use_sliding_window) may stay absent."""
    if any(key not in raw for key in _STATED_KEYS):
        return None
    rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if "rope_theta" not in raw and "rope_theta" not in rope:
        return None
    model_type = raw.get("model_type")
    if model_type in ("deepseek_v2", "deepseek_v3") and any(
        key not in raw for key in _DEEPSEEK_STATED_KEYS
    ):
        return None
    if model_type == "qwen3" and "head_dim" not in raw:  # Qwen3Config defaults it to 128
        return None
    if model_type == "mistral" and "sliding_window" not in raw:  # MistralConfig: 4096
        return None
    return SimpleNamespace(**raw)


def generation_eos_ids(directory: Path) -> tuple[int, ...]:
    path = directory / "generation_config.json"
    if not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)
