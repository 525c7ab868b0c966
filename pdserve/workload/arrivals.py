"""The arrival schedule: the benchmark sends at these offsets and the planner simulates them."""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: 0 for the first request, then gamma gaps."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out
