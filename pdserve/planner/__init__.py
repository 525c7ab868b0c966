"""`pdserve plan`: size and tune the prefill and decode pools for a model, a workload and SLOs.

The steps, one module each, with typed dataclasses between them:
1. `profiler` measures the real engine step on one device (prefill time against tokens,
   decode step time against batch and context, KV capacity) into a `Profile`
   (`profile`), cached in a JSON file keyed by model, dtype, device, TP size, expert layout
   and code version.
2. `cost_model` fits step-time models to the raw points (`CostModel`; an MoE model's decode
   step also pays for the experts its batch touches, `ExpertLoad`).
3. `simulator` (with the node models in `sim_nodes`) replays a workload's arrivals through a
   candidate `Layout` (`layout`) and its `Knobs`, in plain Python, deterministically.
4. `search` enumerates layouts and knobs and finds each one's goodput (the highest request rate
   meeting the SLO) or its attainment at a given rate.
5. `report` prints the ranked table and the `pdserve serve` command of the best candidate.
6. `validate` launches the top candidates through `scripts/launch_pd.sh` and measures them with
   the serving benchmark (`benchmarks/sweep_layouts.py` of a checkout, run as its own
   process), predicted against measured.
The workload, its arrivals and the SLO are the serving benchmark's, from `pdserve.workload`.
`main` wires them to the `plan` subcommand.
"""
