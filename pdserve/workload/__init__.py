"""The serving workload, shared by the serving benchmark (`benchmarks/loadgen`, which sends it)
and the planner (`pdserve.planner`, which simulates it), so both see the same requests:

- `datasets`: the requests (prompts and output lengths) built from a seed or a JSONL trace;
- `arrivals`: when each is sent (gamma gaps at a rate);
- `slo`: the latency objectives a request must meet, and the percentile both report.

Pure Python: no HTTP client, no torch.
"""
