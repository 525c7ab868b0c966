#!/usr/bin/env bash
# The project's test command (README and .ci/run call this): set up, then run pytest on CPU.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$("$root/scripts/setup_env.sh")
cd "$root"
exec "$python" -m pytest -q "$@"
