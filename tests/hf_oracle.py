"""HF transformers as the correctness oracle: greedy continuation of one prompt."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, use_cache: bool = True
) -> list[int]:
    """HF `generate()` in greedy mode, never stopping early on EOS. `use_cache` off
    recomputes the whole sequence at every step (HF's cached steps sum in another order)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=use_cache,
    )
    return out[0, len(prompt_ids) :].tolist()
