#!/usr/bin/env bash
# The engine benchmark of two checkouts on one GPU machine, one after the other in one call,
# then their rows side by side (benchmarks/ab_compare.py): a change that must not move the
# numbers (a restructuring) is checked against the commit before it.
#   git archive REV | tar -x -C ab_before   (here; carry ab_before to the GPU machine)
#   bash benchmarks/gpu_ab.sh ab_before [bench_engine.py flags...]     (results under $OUT)
# A runs first, then B (this tree), then A again when AGAIN=1, so drift shows as A vs A.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
other=$(cd "$1" && pwd)
shift
here=$PWD
source benchmarks/gpu_env.sh  # carried wheels into /tmp/site
site=""
[ -d /tmp/site ] && site=:/tmp/site
run() {  # run NAME TREE [flags]: bench_engine.py of TREE, its result in $OUT/NAME.json
  local name=$1 tree=$2
  shift 2
  (cd "$tree" && PYTHONPATH="$tree$site" $PY benchmarks/bench_engine.py --out "$OUT/$name" "$@" 2>&1 \
    | grep -v "Warning\|warn(" | tail -25)
}
run a "$other" "$@"
run b "$here" "$@"
[ "${AGAIN:-0}" = 1 ] && run a2 "$other" "$@"
$PY benchmarks/ab_compare.py "$OUT/a.json" "$OUT/b.json"
status=$?
[ -f "$OUT/a2.json" ] && $PY benchmarks/ab_compare.py "$OUT/a.json" "$OUT/a2.json" | tail -1
exit $status
