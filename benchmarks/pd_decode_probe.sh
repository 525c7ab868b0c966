#!/usr/bin/env bash
# Where a PD decode node's time goes under load, on one GPU (the device tool):
#   1. the decode step (graph replay and the whole ModelRunner step) against its HBM floor at
#      long contexts and large batches, as a PD decode node holds them;
#   2. a 1p1d stack sharing the GPU under Poisson long-prompt load, with the CPU use of every
#      thread of every process (sweep.json cpu_by_thread) and py-spy dumps of the decode node.
# Needs py-spy carried as a wheel for step 2's dumps. Results under $OUT.
set -uo pipefail
OUT=${OUT:-benchmarks/results/pd_decode_probe}
WORK=$(mktemp -d)
source benchmarks/gpu_env.sh  # creates $OUT; PYTHONPATH, MODEL, carried wheels
RATE=${RATE:-3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "=== decode step at long contexts ($(date +%T))"
timeout 240 python3 benchmarks/bench_engine.py --model "$MODEL" --parts decode --repeats 10 \
  --decode-batches 32 64 128 --decode-contexts 1024 4096 8192 --out "$OUT/engine" >"$WORK/engine.log" 2>&1
python3 - "$OUT/engine.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{'batch':>5} {'ctx':>5} {'step ms':>8} {'replay ms':>9} {'floor ms':>8} {'step/floor':>10} {'replay/floor':>12}")
for r in d["decode"]:
    rep = r["graph_replay_s"]
    print(f"{r['batch']:>5} {r['context']:>5} {r['step_s']*1e3:>8.2f} {(rep or 0)*1e3:>9.2f} "
          f"{r['hbm_floor_s']*1e3:>8.2f} {r['ratio_to_floor']:>10.2f} {(rep or 0)/r['hbm_floor_s']:>12.2f}")
EOF
echo "=== 1p1d on one GPU under load ($(date +%T))"
(  # py-spy dumps of the decode node while the load runs
  sleep 50  # start-up and warm-up first
  for _ in 1 2 3; do
    pid=$(pgrep -f "m decode_node" | head -1)
    [ -n "$pid" ] && command -v py-spy >/dev/null && py-spy dump --pid "$pid" --native >>"$OUT/pyspy_decode.txt" 2>&1
    [ -n "$pid" ] && top -H -b -n 1 -p "$pid" | head -30 >>"$OUT/top_decode.txt"
    sleep 10
  done
) &
timeout 300 python3 benchmarks/sweep_layouts.py --model "$MODEL" --load-format dummy --layouts 1p1d \
  --gpus 0,0 --dataset long-prompt --slo ttft:3000 tpot:20 --rates-per-gpu "$RATE" --duration 40 \
  --client-processes 2 --warmup-requests 4 --launch-arg "--prefill-kv-cache-memory-bytes 40000000000" \
  --launch-arg "--decode-kv-cache-memory-bytes 40000000000" --out "$WORK/pd" >"$WORK/pd.log" 2>&1
wait
tail -8 "$WORK/pd.log"
python3 - "$WORK/pd/sweep.json" <<'EOF'
import json, sys
for p in json.load(open(sys.argv[1]))["layouts"][0]["points"]:
    s = p["summary"]
    print("tpot p50/p90", s["tpot_ms"]["p50"], s["tpot_ms"]["p90"], "itl p50/p99", s["itl_ms"]["p50"], s["itl_ms"]["p99"])
    for proc, threads in p["cpu_by_thread"].items():
        print(proc, threads)
EOF
cp "$WORK/pd/sweep.json" "$OUT/pd_sweep.json"; tar -C "$WORK" -czf "$OUT/logs.tgz" engine.log pd.log pd
echo "=== done ($(date +%T))"
