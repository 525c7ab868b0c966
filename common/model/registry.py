"""Model classes by the HF `architectures` name a config.json states, and the interface the
engine runs a model through (`CausalLM`), so nothing outside this package names a class."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from common.model.attention.base import ForwardContext
from common.model.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from common.model.distributed import TPGroup
from common.model.layers.vocab import ParallelLMHead
from common.model.llama import LlamaForCausalLM
from common.model.parallel import StageLayers
from common.model.quantization import LinearMethod
from common.model.spec import ModelSpec


class CausalLM(Protocol):
    """What the engine needs of a model (an `nn.Module`); see `LlamaForCausalLM`."""

    spec: ModelSpec  # this rank's
    stage: StageLayers  # the layers this pipeline stage holds (all of them without PP)
    dtype: torch.dtype  # the model's (activations; a KV pool in the model dtype)
    lm_head: ParallelLMHead | None  # plain (never quantized); the last stage's only

    def __init__(
        self,
        spec: ModelSpec,
        max_positions: int,
        tp: TPGroup | None = None,
        linear_method: LinearMethod | None = None,
        stage: StageLayers | None = None,
    ) -> None: ...

    @property
    def device(self) -> torch.device: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def parameters(self) -> Iterable[torch.nn.Parameter]: ...


MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"no model class for architecture {architecture!r}; "
            f"registered: {', '.join(sorted(MODELS))}"
        ) from None
