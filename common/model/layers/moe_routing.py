"""Which experts each token runs, and with what weight: the routing rules of the published
mixture-of-experts families (`MoESpec`), on float32 gate logits.

- softmax top-k (Qwen3-MoE, Mixtral, DeepSeek-V2 "greedy"), renormalized where the config says;
- group-limited (DeepSeek-V2 "group_limited_greedy"): only experts of the `topk_groups` groups
  with the highest best score compete;
- DeepSeek-V3 ("noaux_tc"): sigmoid scores; a per-expert correction bias steers the choice of
  groups (each scored by the sum of its two best) and of experts, but the weights are the
  unbiased scores of the chosen ones, renormalized, then scaled by `routed_scaling`.

Static shapes only (topk, gather, masked_fill): a captured CUDA graph replays it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from common.model.spec import MoESpec


def select_experts(
    logits: torch.Tensor, moe: MoESpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` [T, num_experts] float32 -> (weights [T, top_k] float32, ids [T, top_k] int32)."""
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.num_groups > 1:
        choice = _mask_groups(choice, moe)
    ids = torch.topk(choice, moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.routed_scaling != 1.0:
        weights = weights * moe.routed_scaling
    return weights, ids.to(torch.int32)


def _mask_groups(choice: torch.Tensor, moe: MoESpec) -> torch.Tensor:
    """`choice` with every expert outside the token's `topk_groups` best groups excluded."""
    grouped = choice.view(choice.shape[0], moe.num_groups, -1)
    if moe.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, moe.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    # V2 zeroes the excluded softmax scores, V3 sets them to -inf: either way, with at least
    # top_k experts in the kept groups, none of them is chosen.
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


def pairs_by_expert(
    ids: torch.Tensor, num_experts: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, tokens, slots) for each expert in [0, num_experts) that `ids` [T, k] names, in
    expert order: the (token, slot) pairs routed to it. Ids outside (other ranks' experts under
    expert parallelism) are skipped. The torch loops over experts (CPU path, oracles) walk
    this; it syncs, so it is never captured."""
    ids = ids.long()
    for expert in torch.unique(ids).tolist():
        if 0 <= expert < num_experts:
            tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
            yield expert, tokens, slots
