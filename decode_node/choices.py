"""n > 1 on a decode node: the samples of one request, forked on its prompt's KV blocks.

The request's first sequence (index 0, id = the request id) is prefilled (colocated) or
receives the prompt's KV (PD). `fork` then adds samples 1..n-1 (`Scheduler.fork`: they share
the full prompt blocks by reference count, no copy) with ids `<request id>#<index>` and
seeds `seed + index`. The request ends on the node when its last live sample ends.
"""

from __future__ import annotations

import dataclasses

from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence


class ChoiceGroups:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.live: dict[str, set[str]] = {}  # request id -> ids of its unfinished samples

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Start samples 1..n-1 of `parent`'s request (once per request)."""
        n = parent.params.n
        if n == 1 or parent.group in self.live:
            return []
        seed = parent.params.seed
        children = [
            self.scheduler.fork(
                parent,
                i,
                dataclasses.replace(parent.params, seed=None if seed is None else seed + i),
            )
            for i in range(1, n)
        ]
        self.live[parent.group] = {parent.request_id, *(c.request_id for c in children)}
        return children

    def ended(self, seq: Sequence) -> bool:
        """`seq` finished or was aborted; True when its request has no live sample left."""
        live = self.live.get(seq.group)
        if live is None:
            return True
        live.discard(seq.request_id)
        if live:
            return False
        del self.live[seq.group]
        return True

    def sequence_ids(self, request_id: str) -> list[str]:
        """Every sequence id the request may have on this node (the request id first)."""
        return [request_id, *sorted(self.live.get(request_id, set()) - {request_id})]

    def forget(self, request_id: str) -> None:
        self.live.pop(request_id, None)
