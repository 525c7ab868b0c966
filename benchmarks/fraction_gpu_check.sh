# P and D on one H200 by fractions, Qwen2.5-7B dummy bf16: the launcher's summary and a request.
source benchmarks/gpu_env.sh >/dev/null 2>&1
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/test_memory_fraction.py 2>&1 | tail -3
python -m pdserve serve benchmarks/configs/qwen2.5-7b-instruct --load-format dummy --port 8123 \
  --prefill-gpus 0 --decode-gpus 0 --prefill-gpu-memory-fraction 0.4 --decode-gpu-memory-fraction 0.4 \
  > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 120); do grep -q "pdserve is serving" $OUT/serve.log && break; sleep 2; done
grep "^pdserve" $OUT/serve.log
python - <<'PY'
import httpx, json
r = httpx.post("http://127.0.0.1:8123/v1/completions", json={"model": "qwen2.5-7b-instruct", "prompt": list(range(1000, 3000)), "max_tokens": 16}, timeout=120)
print(r.status_code, json.dumps({k: round(v, 4) for k, v in r.json().get("timing", {}).items() if isinstance(v, float)}))
PY
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
kill -INT $pid; wait $pid
