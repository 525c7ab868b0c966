"""Per-request token statistics on the device, for the repetition/frequency/presence penalties.

One row per request that uses a penalty: how often each token appears in its output (int32)
and whether it appears in its prompt (bool), both [V] wide. A row is filled once, from the host
lists, the first time the request samples; after that the sampler adds each sampled token on
the device (`add`), so a step needs no host work and no O(context) padding. Rows are recycled
when a request ends; the table grows by doubling when it is full.

Stream order is the only synchronisation: a row's reuse (zeroed and refilled) is queued after
every step that read or updated it for its previous owner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.engine.device_copy import to_device
from common.engine.sequence import PLACEHOLDER
from common.protocol.sampling_params import SamplingParams


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._slots: dict[str, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._slots)

    def slot(
        self,
        request_id: str,
        prompt: Sequence[int],
        output: Sequence[int],
        params: SamplingParams,
    ) -> int:
        """The request's row, filled from `prompt` and `output` on first use."""
        slot = self._slots.get(request_id)
        if slot is not None:
            return slot
        if PLACEHOLDER in output:
            raise ValueError(f"request {request_id!r}: counts need every output token on the host")
        if not self._free:
            self._grow()
        slot = self._slots[request_id] = self._free.pop()
        self.counts[slot].zero_()
        self.prompt_seen[slot].zero_()
        # Only queued device work from here: no host sync while a step is in flight (a Python
        # scalar assigned through a tensor index would copy it to the device and wait).
        if output:
            ids = to_device(list(output), torch.int64, self.device)
            ones = torch.ones(len(output), dtype=torch.int32, device=self.device)
            self.counts[slot].scatter_add_(0, ids, ones)
        if prompt and params.repetition_penalty != 1.0:
            ids = to_device(list(prompt), torch.int64, self.device)
            self.prompt_seen[slot].index_fill_(0, ids, True)
        return slot

    def add(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per row (on the device; slots are distinct)."""
        ones = torch.ones(slots.shape[0], dtype=torch.int32, device=self.device)
        self.counts.view(-1).scatter_add_(0, slots * self.vocab_size + token_ids, ones)

    def add_rows(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count several tokens per row: `token_ids` [P, T] int64, -1 where a row has fewer
        (a verify step's emitted tokens); slots [P] are distinct."""
        index = slots.unsqueeze(1) * self.vocab_size + token_ids.clamp(min=0)
        self.counts.view(-1).scatter_add_(
            0, index.view(-1), (token_ids >= 0).to(torch.int32).view(-1)
        )

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old].copy_(self.counts)
        seen[:old].copy_(self.prompt_seen)
        self.counts, self.prompt_seen = counts, seen
        self._free.extend(range(new - 1, old - 1, -1))
