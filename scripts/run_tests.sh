#!/usr/bin/env bash
# The project's test command (README and .ci/run call this): set up, then run pytest on CPU.
# With no arguments the whole suite runs as PDSERVE_TEST_JOBS shards (default: one per core,
# at most 2), each a pytest process over whole test files (tests/conftest.py deals them), with
# one torch thread each; their logs are printed when all have ended, and the exit status is
# the first failing shard's. Arguments run one plain pytest with them.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$("$root/scripts/setup_env.sh")
cd "$root"
jobs=${PDSERVE_TEST_JOBS:-$(nproc)}
jobs=$((jobs > 2 ? 2 : jobs))
if [ "$#" -gt 0 ] || [ "$jobs" -le 1 ]; then
  exec "$python" -m pytest -q "$@"
fi
logs=$(mktemp -d)
pids=()
for ((i = 0; i < jobs; i++)); do
  PDSERVE_TEST_SHARD="$i/$jobs" OMP_NUM_THREADS=1 \
    "$python" -m pytest -q -p no:cacheprovider >"$logs/$i.log" 2>&1 &
  pids+=($!)
done
status=0
for ((i = 0; i < jobs; i++)); do
  rc=0
  wait "${pids[$i]}" || rc=$?
  echo "=== shard $i/$jobs (exit $rc)"
  cat "$logs/$i.log"
  [ "$status" -ne 0 ] || status=$rc
done
rm -rf "$logs"
exit "$status"
