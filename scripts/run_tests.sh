#!/usr/bin/env bash
# The project's test command (README and .ci/run call this): set up, then run pytest on CPU.
# With no arguments the whole suite runs as PDSERVE_TEST_JOBS shards (default: one per core,
# at most 2), each a pytest process over whole test files (tests/shards.py deals them by their
# recorded times), with one torch thread each; their logs are printed when all have ended, and
# the exit status is the first failing shard's. PDSERVE_RECORD_TEST_TIMES=1 rewrites
# tests/test_times.json from this run. Arguments run one plain pytest with them.
set -euo pipefail
# The venv is installed without bytecode (setup_env.sh: --no-compile), so each module is
# compiled on its first import and its .pyc written for every later process, unless
# PYTHONDONTWRITEBYTECODE is set (as in some sandboxes): then each of the suite's hundreds of
# processes compiles torch, transformers and pdserve from source again (a node's imports take
# 3.2 s instead of 1.6 s here).
unset PYTHONDONTWRITEBYTECODE
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$("$root/scripts/setup_env.sh")
cd "$root"
# lm-eval for tests/test_lm_eval.py: its trimmed set (tests/lm_eval_requirements.txt), again
# only when that list changed.
lm_eval_stamp=$(dirname "$(dirname "$python")")/.pdserve-lm-eval-installed
if [ ! -f "$lm_eval_stamp" ] || [ tests/lm_eval_requirements.txt -nt "$lm_eval_stamp" ]; then
  "$python" -m pip install --disable-pip-version-check -q --no-compile --no-deps \
    -r tests/lm_eval_requirements.txt >&2
  touch "$lm_eval_stamp"
fi
jobs=${PDSERVE_TEST_JOBS:-$(nproc)}
jobs=$((jobs > 2 ? 2 : jobs))
if [ "$#" -gt 0 ] || [ "$jobs" -le 1 ]; then
  exec "$python" -m pytest -q "$@"
fi
logs=$(mktemp -d)
if [ "${PDSERVE_RECORD_TEST_TIMES:-0}" = 1 ]; then
  export PDSERVE_TEST_TIMES_DIR=$logs/times
  mkdir "$PDSERVE_TEST_TIMES_DIR"
fi
pids=()
for ((i = 0; i < jobs; i++)); do
  mapfile -t files < <("$python" -m tests.shards "$i" "$jobs")
  OMP_NUM_THREADS=1 "$python" -m pytest -q -p no:cacheprovider "${files[@]}" \
    >"$logs/$i.log" 2>&1 &
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
[ -z "${PDSERVE_TEST_TIMES_DIR:-}" ] || "$python" -m tests.shards --merge "$PDSERVE_TEST_TIMES_DIR"
rm -rf "$logs"
exit "$status"
