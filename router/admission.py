"""Admission control: a bounded number of requests waiting for each pool (pure Python).

A request waits for the prefill pool from dispatch until its first token, then for the decode
pool until the first token the decode node generates (colocated: from dispatch until its first
token, in the decode pool). Running requests do not count. A request that would make a pool's
waiting count exceed `max_waiting` is refused with a 429 and a Retry-After before any node
sees it, so overload is an immediate, clear answer instead of a growing queue; the requests
already admitted go on undisturbed. `max_waiting=0` means no bound.
"""

from __future__ import annotations

from router.errors import OpenAIError

POOLS = ("prefill", "decode")


class Overloaded(OpenAIError):
    def __init__(self, pool: str, waiting: int, retry_after_s: int) -> None:
        super().__init__(
            429,
            f"the {pool} pool already has {waiting} requests waiting (its bound): retry later",
            code="too_many_requests",
        )
        self.headers = {"Retry-After": str(retry_after_s)}


class Admission:
    def __init__(self, max_waiting: int, retry_after_s: int) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self._waiting: dict[str, set[str]] = {pool: set() for pool in POOLS}

    def waiting(self, pool: str) -> int:
        return len(self._waiting[pool])

    def check(self, pd: bool) -> None:
        """Raise `Overloaded` (429) if one more request would exceed a pool's bound. In PD a
        full decode pool refuses too: its backlog would only move into the prefill pool."""
        if self.max_waiting == 0:
            return
        for pool in POOLS if pd else ("decode",):
            if len(self._waiting[pool]) >= self.max_waiting:
                raise Overloaded(pool, len(self._waiting[pool]), self.retry_after_s)

    def admitted(self, request_id: str, pd: bool) -> None:
        self._waiting["prefill" if pd else "decode"].add(request_id)

    def first_token(self, request_id: str) -> None:
        """PD: prefill done; the request now waits for the decode node's first token."""
        if request_id in self._waiting["prefill"]:
            self._waiting["prefill"].discard(request_id)
            self._waiting["decode"].add(request_id)

    def decoding(self, request_id: str) -> None:
        """A decode-pool node produced a token for the request: it runs there now."""
        self._waiting["prefill"].discard(request_id)
        self._waiting["decode"].discard(request_id)

    def release(self, request_id: str) -> None:
        self.decoding(request_id)
