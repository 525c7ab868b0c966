"""Counts of drafted and accepted tokens (pure Python), per request and per engine.

The names follow vLLM's `spec_decode` metrics: a *draft* is one verify step of one sequence
that carried at least one drafted token; the mean accepted length is 1 + accepted / drafts,
the tokens one target forward emits for a speculating sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [j]: how often the drafted token at position j (0-based) was accepted
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        """One verify step of one sequence: `num_draft` drafted, the first `num_accepted` kept."""
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"accepted {num_accepted} of {num_draft} drafted tokens")
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def add(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, n in enumerate(other.accepted_per_position):
            if j == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[j] += n

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted / drafts (1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
        }
