"""Decode node: reserves KV blocks, receives a prompt's KV, decodes with continuous batching.

Lifecycle of one request here (PD mode), kept in one record (`request.Request`):
1. DecodeRequest arrives from the router; its record joins the reservation queue (FIFO).
2. As soon as the allocator can hold the prompt, its blocks are reserved, the KV receiver is
   told to expect them, and the prefill node gets a Reservation with the block ids. When the
   pool is full the queue waits: backpressure instead of a failure later.
3. The KV lands layer by layer in the reserved blocks; the completion notice brings the first
   token. The request then joins the running set at the next step (admission).
4. Every step decodes one token for every running request; the tokens of a step go to the
   router in one TokenBatch.
5. On EOS / stop token / max_tokens / context limit, on Abort, a deadline or a failed
   transfer, the request ends in one place, which frees whatever it holds.
Steps 1-3 are the node's admission part (`admission.PDAdmission`). With `--colocated` it
composes `admission.LocalPrefill` instead: requests go straight to the scheduler and are
prefilled here, which makes it the single-process baseline for every PD comparison.
"""
