#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite against real servers.
# With arguments: one pytest run with them. Without: the in-process tests three at a time
# (they mostly wait on sockets and timeouts, not on a core), then the real-server tests one
# at a time (the servers share 2 cores); it fails if either fails.
set -euo pipefail
cd "$(dirname "$0")/.."
LORA_SYNC_TEST_TOOLS=1 bash scripts/install.sh
PYTEST=(.venv/bin/python -m pytest -q)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
rc=0
"${PYTEST[@]}" -m "not server" -n 3 || rc=1
"${PYTEST[@]}" -m server || rc=1
exit "$rc"
