#!/usr/bin/env bash
# Start the router plus N prefill and M decode node processes on this host, wait until every
# node is healthy, print the router's URL, and stop every started process on Ctrl-C / SIGTERM.
# With no arguments: the embedded SmolLM2-135M-Instruct model, one prefill and one decode
# process (first GPUs if present, else CPU), router on 127.0.0.1:8000, ZMQ KV transport.
#
# Flags: --model PATH --host H --port P --num-prefill N --num-decode M
#        --prefill-gpus 0,1 --decode-gpus 2,3 --transport zmq|cuda_ipc --colocated
#        --zmq-base-port 5600 --health-timeout 600
#        --prefill-<engine flag> V / --decode-<engine flag> V  (passed to that pool, e.g.
#        --prefill-max-num-batched-tokens 4096 --decode-max-num-seqs 64 --decode-enforce-eager)
#        --router-<flag> V (passed to the router)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model="" host=127.0.0.1 port=8000 num_prefill=1 num_decode=1 transport=zmq colocated=0
prefill_gpus="" decode_gpus="" base=5600 health_timeout=600
prefill_args=() decode_args=() router_args=()
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
need() { [ $# -ge 2 ] || { echo "launch_pd.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --model) need "$@"; model=$2; shift 2 ;;
    --host) need "$@"; host=$2; shift 2 ;;
    --port) need "$@"; port=$2; shift 2 ;;
    --num-prefill) need "$@"; num_prefill=$2; shift 2 ;;
    --num-decode) need "$@"; num_decode=$2; shift 2 ;;
    --prefill-gpus) need "$@"; prefill_gpus=$2; shift 2 ;;
    --decode-gpus) need "$@"; decode_gpus=$2; shift 2 ;;
    --transport) need "$@"; transport=$2; shift 2 ;;
    --colocated) colocated=1; shift ;;
    --zmq-base-port) need "$@"; base=$2; shift 2 ;;
    --health-timeout) need "$@"; health_timeout=$2; shift 2 ;;
    --prefill-*) flag="--${1#--prefill-}"; shift
                 if [ $# -gt 0 ] && [[ "$1" != --* ]]; then prefill_args+=("$flag" "$1"); shift; else prefill_args+=("$flag"); fi ;;
    --decode-*) flag="--${1#--decode-}"; shift
                if [ $# -gt 0 ] && [[ "$1" != --* ]]; then decode_args+=("$flag" "$1"); shift; else decode_args+=("$flag"); fi ;;
    --router-*) flag="--${1#--router-}"; shift
                if [ $# -gt 0 ] && [[ "$1" != --* ]]; then router_args+=("$flag" "$1"); shift; else router_args+=("$flag"); fi ;;
    -h|--help) usage 0 ;;
    *) echo "launch_pd.sh: unknown flag $1" >&2; usage 2 ;;
  esac
done
[ "$colocated" = 1 ] && num_prefill=0

python=$("$root/scripts/setup_env.sh")
cd "$root"
export PYTHONUNBUFFERED=1

# Resolve (and for GGUF, convert once) the model before the nodes start, so they share it.
read -r model_dir model_name < <("$python" -c "
import sys
from common.loader import resolve_model
s = resolve_model(sys.argv[1] or None)
print(s.directory, s.name)" "$model")

gpu_count=0
if command -v nvidia-smi >/dev/null 2>&1; then gpu_count=$(nvidia-smi -L 2>/dev/null | wc -l || echo 0); fi
if [ "$gpu_count" -gt 0 ] && [ -z "$prefill_gpus$decode_gpus" ]; then
  # Default pools: prefill on the first GPUs, decode on the next ones (shared if too few).
  prefill_gpus=$(seq -s, 0 $((num_prefill - 1)) 2>/dev/null || true)
  decode_gpus=$(seq -s, $((num_prefill % gpu_count)) $(((num_prefill + num_decode - 1) % gpu_count)) 2>/dev/null || true)
  [ -n "$decode_gpus" ] || decode_gpus=0
fi
gpu_for() { local list=$1 i=$2; IFS=, read -r -a g <<<"$list"; [ ${#g[@]} -gt 0 ] && echo "${g[$((i % ${#g[@]}))]}" || echo ""; }

pids=() names=()
stop_all() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

start() {  # start NAME GPU CMD...
  # Every process sees every GPU and is pinned with --device cuda:N, so that a prefill node
  # can open a decode node's KV pool through CUDA IPC (hiding GPUs would force the fallback).
  local name=$1 gpu=$2; shift 2
  if [ -n "$gpu" ]; then "$@" --device "cuda:$gpu" & else "$@" & fi
  pids+=($!); names+=("$name")
}

events="tcp://127.0.0.1:$base"
prefill_list="" decode_list=""
device_flag=(); [ "$gpu_count" -gt 0 ] || device_flag=(--device cpu)
if [ "$gpu_count" -eq 0 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  # CPU nodes share the cores: without this each process would start one torch thread per
  # core and they would fight (measured: 3x slower prefill with two 2-thread nodes on 2 cores).
  nodes=$((num_prefill + num_decode)); cores=$(nproc)
  export OMP_NUM_THREADS=$(( cores / nodes > 0 ? cores / nodes : 1 ))
fi
for i in $(seq 0 $((num_prefill - 1))); do
  addr="tcp://127.0.0.1:$((base + 1 + i))"; prefill_list+="${prefill_list:+,}$addr"
  start "prefill-$i" "$(gpu_for "$prefill_gpus" "$i")" "$python" -m prefill_node --model "$model_dir" \
    --control-address "$addr" --router-address "$events" --transport "$transport" \
    "${device_flag[@]}" "${prefill_args[@]}"
done
for j in $(seq 0 $((num_decode - 1))); do
  addr="tcp://127.0.0.1:$((base + 101 + j))"; decode_list+="${decode_list:+,}$addr"
  extra=(); [ "$colocated" = 1 ] && extra=(--colocated)
  start "decode-$j" "$(gpu_for "$decode_gpus" "$j")" "$python" -m decode_node --model "$model_dir" \
    --control-address "$addr" --kv-address "tcp://127.0.0.1:$((base + 201 + j))" \
    --router-address "$events" --transport "$transport" "${extra[@]}" "${device_flag[@]}" "${decode_args[@]}"
done
start router "" "$python" -m router --model "$model_dir" --served-model-name "$model_name" \
  --host "$host" --port "$port" --events-address "$events" \
  --prefill "$prefill_list" --decode "$decode_list" "${router_args[@]}"

url="http://$host:$port"
deadline=$((SECONDS + health_timeout))
# Serving once every started node heartbeats, not just one of each role: a load that starts
# right away should find the whole pool.
all_healthy='import json, sys, urllib.request
body = json.load(urllib.request.urlopen(sys.argv[1], timeout=2))
sys.exit(0 if all(n["healthy"] for n in body["nodes"]) else 1)'
until "$python" -c "$all_healthy" "$url/health" 2>/dev/null; do
  for k in "${!pids[@]}"; do
    if ! kill -0 "${pids[$k]}" 2>/dev/null; then
      echo "launch_pd.sh: ${names[$k]} (pid ${pids[$k]}) exited during start-up; stopping" >&2
      exit 1
    fi
  done
  [ $SECONDS -lt $deadline ] || { echo "launch_pd.sh: not healthy after ${health_timeout}s" >&2; exit 1; }
  sleep 0.5
done
echo "pdserve is serving $model_name at $url  (prefill: ${num_prefill}, decode: ${num_decode}, transport: $transport)"
# Serve until told to stop. A node that dies is reported (the router's /health shows it and
# it gets no more work); the launch ends only when the router itself exits.
reported=()
while :; do
  for k in "${!pids[@]}"; do
    if ! kill -0 "${pids[$k]}" 2>/dev/null && [ -z "${reported[$k]:-}" ]; then
      reported[$k]=1
      echo "launch_pd.sh: ${names[$k]} (pid ${pids[$k]}) exited" >&2
      [ "${names[$k]}" = router ] && exit 1
    fi
  done
  sleep 0.5
done
