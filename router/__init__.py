"""The router: the OpenAI-compatible HTTP front end of pdserve.

Lifecycle of one request (PD mode), with the module for each step:
1. `serving`: read the body; `protocol` validates the schema (strict types, 400 otherwise).
2. `prepare`: model name (404), chat template / tokenization, `SamplingParams` (400).
3. `core.route`: the `registry` knows which nodes heartbeat in time (and registers nodes that
   start on their own); one `policy` per pool (round_robin, least_load, cache_aware with the
   `prefix_index`) picks a decode and a prefill node, counting what the router sent that
   heartbeats do not show yet (503 if none).
4. `prepare.apply_limits`: the prompt against the chosen nodes' context and vocabulary (400).
5. `core.dispatch`: DecodeRequest to the decode node, PrefillRequest to the prefill node, over
   `node_link` (ZMQ PUSH); `events` opens the request's queue.
6. `node_link` reads FirstToken / TokenBatch / RequestError / Heartbeat from one PULL socket;
   `core.on_message` feeds heartbeats to the registry and routes the rest by request id.
7. `session`: detokenizes, applies stop strings and max_tokens, aborts the nodes when the
   router ends the request, fails it on a node error, a lost node or the deadline.
8. `formatting`: OpenAI bodies / SSE chunks with usage and the `timing` record (`timing`);
   `metrics` exports counters and histograms at /metrics (prometheus_client, vLLM's names).
Colocated mode skips the prefill node: the decode node prefills and sends every token.
Tests play the nodes in-process with `tests/router_fakes.py`; `config` and `__main__` are
the command line; `app` assembles the FastAPI application.
"""
