"""A draft model's or EAGLE-3 head's weights, loaded before the KV pools are sized.

The worker loads them right after the target, so a GPU's warm-up peak includes them, and then
splits the KV budget between the target's pool and the proposer's: both have the same blocks
(the proposer addresses its pool with the target sequence's block ids), so one block costs the
sum of both pools' block bytes. `assemble` then gives the proposer its pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from common.engine.config import SpeculativeConfig
from common.engine.kv_cache import KVCache, block_bytes
from common.engine.spec_decode.draft_model import DraftModelProposer, check_draft_vocabulary
from common.engine.spec_decode.eagle3 import Eagle3Proposer
from common.engine.spec_decode.paged import ProposerPool
from common.engine.spec_decode.proposer import Proposer
from common.model.attention import AttentionBackend
from common.model.eagle3 import load_eagle3_head, read_eagle3_spec
from common.model.loader import build_model
from common.model.source import ModelSource, read_spec, resolve_model
from common.model.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass
class ProposerWeights:
    method: str  # "draft" or "eagle3"
    model: Any  # the draft CausalLM, or the Eagle3Head
    kv_spec: ModelSpec  # what its KV pool holds per token

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return block_bytes(self.kv_spec, block_size, dtype)


def load_proposer_weights(
    config: SpeculativeConfig,
    target: torch.nn.Module,
    target_source: ModelSource,
    *,
    tp: int,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> ProposerWeights | None:
    """The weights `config` drafts with (None for n-gram lookup or no speculation).
    ValueError naming both sides for a draft that does not fit the target."""
    method = config.speculative_method
    if method not in ("draft", "eagle3"):
        return None
    assert tp == 1, "Worker refuses a drafting pool of several ranks"
    max_positions = max_model_len + config.num_speculative_tokens
    source = resolve_model(config.speculative_model, dtype=str(dtype).removeprefix("torch."))
    if method == "draft":
        spec = read_spec(source)
        check_draft_vocabulary(spec, source.directory, target.spec, target_source.directory)
        model = build_model(spec, source, max_positions=max_positions, dtype=dtype, device=device)
        log.info("draft model %s: %d layers", source.name, spec.num_layers)
        return ProposerWeights(method, model, spec)
    head = load_eagle3_head(
        source.directory,
        target.spec,
        target.model.embed_tokens,
        max_positions=max_positions,
        dtype=dtype,
        device=device,
    )
    target.model.aux_hidden_layers = head.spec.aux_layers(target.spec.num_layers)
    log.info("EAGLE-3 head %s reads target layers %s", source.name, target.model.aux_hidden_layers)
    return ProposerWeights(method, head, head.spec.layer)


def keep_eagle3_inputs(config: SpeculativeConfig, target: torch.nn.Module) -> tuple[int, ...]:
    """A prefill node of an eagle3 pool: make `target` keep the aux hidden states the decode
    node's head reads (they ship with the KV). Reads the head's config.json only, no weights.
    Returns the layers; ValueError when the head was not made for a target this wide."""
    if config.speculative_model is None:
        raise ValueError("speculative_method=eagle3 needs --speculative-model")
    spec = read_eagle3_spec(resolve_model(config.speculative_model).directory)
    if spec.target_hidden_size != target.spec.hidden_size:
        raise ValueError(
            f"EAGLE-3 head {config.speculative_model} reads hidden states of size "
            f"{spec.target_hidden_size}, the target's are {target.spec.hidden_size}"
        )
    target.model.aux_hidden_layers = spec.aux_layers(target.spec.num_layers)
    return target.model.aux_hidden_layers


def assemble(
    weights: ProposerWeights,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
) -> Proposer:
    """The proposer, with a pool of the target's `num_blocks` blocks of `block_size`."""
    kv = KVCache.allocate(weights.kv_spec, num_blocks, block_size, dtype, device)
    pool = ProposerPool(kv, backend, device, weights.kv_spec.attention_scale)
    if weights.method == "draft":
        return DraftModelProposer(weights.model, pool)
    return Eagle3Proposer(weights.model, pool)
