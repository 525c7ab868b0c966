"""Prefill node: computes prompts' KV and ships it to the decode node that reserved blocks.

Lifecycle of one request here:
1. PrefillRequest arrives from the router; Reservation (block ids) arrives from the decode node,
   in either order. Only with both is the request handed to the scheduler (backpressure: a
   decode node short of memory delays its reservation, so nothing is computed in vain).
2. The scheduler runs it in token-budgeted, possibly chunked, prefill steps (prefix cache on).
3. The step that reaches the prompt's end samples the first token, sent to the router at once.
4. The KV of the prompt's blocks is shipped layer by layer; the completion notice carries the
   first token and the timings to the decode node.
5. When the transfer is terminal, the blocks are freed (full blocks stay in the prefix cache).
An Abort at any point drops the request and frees whatever it held.
"""
