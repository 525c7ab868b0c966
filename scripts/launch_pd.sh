#!/usr/bin/env bash
# Start the router plus N prefill and M decode node processes on this host, wait until every
# node is healthy, print the router's URL, and stop every started process on Ctrl-C / SIGTERM.
# With no arguments: the embedded SmolLM2-135M-Instruct model, one prefill and one decode
# process (first GPUs if present, else CPU), router on 127.0.0.1:8000, ZMQ KV transport,
# internal ZMQ ports chosen free (so a second stack needs only another --port), and each node
# given its share of its GPU's memory (--gpu-memory-fraction; nodes sharing a GPU split 0.85).
#
# This is `pdserve serve` (pdserve/cli.py) run from the project's venv, which it sets up on
# first use; every flag is listed by `scripts/launch_pd.sh --help`, for example
#   --model PATH|org/name --num-prefill N --num-decode M --colocated --transport cuda_ipc
#   --max-num-seqs 64 (both pools)  --decode-max-num-seqs 64 (one pool)  --request-timeout 120
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$("$root/scripts/setup_env.sh")
cd "$root"
exec "$python" -m pdserve serve "$@"
