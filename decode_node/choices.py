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
from decode_node.request import Request


def fork(scheduler: Scheduler, request: Request, parent: Sequence) -> list[Sequence]:
    """Start samples 1..n-1 of `request` from `parent` (its sample 0), once per request."""
    n = parent.params.n
    if n == 1 or request.forked:
        return []
    request.forked = True
    seed = parent.params.seed
    children = [
        scheduler.fork(
            parent, i, dataclasses.replace(parent.params, seed=None if seed is None else seed + i)
        )
        for i in range(1, n)
    ]
    request.samples.update(c.request_id for c in children)
    return children


def sample_ended(request: Request, seq: Sequence) -> bool:
    """`seq` finished or was aborted; True when `request` has no live sample left."""
    request.samples.discard(seq.request_id)
    return not request.samples
