#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite against real servers.
# With arguments: one pytest run with them. Without: the in-process tests three at a time
# (they mostly wait on sockets and timeouts, not on a core), then the real-server tests as two
# pytest processes at once, one per group of shared servers (tests/conftest.py, SERVER_GROUPS:
# each boots only its own servers); it fails if any run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
LORA_SYNC_TEST_TOOLS=1 bash scripts/install.sh
PYTEST=(.venv/bin/python -m pytest -q)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
rc=0
"${PYTEST[@]}" -m "not server" -n 3 || rc=1
SGLANG_LOG="$(mktemp -t lora-sync-tests-sglang.XXXXXX)"
LORA_SYNC_SERVER_GROUP=sglang "${PYTEST[@]}" -m server -p no:cacheprovider >"$SGLANG_LOG" 2>&1 &
SGLANG_TESTS=$!
LORA_SYNC_SERVER_GROUP=vllm "${PYTEST[@]}" -m server -p no:cacheprovider || rc=1
wait "$SGLANG_TESTS" || rc=1
echo "-- the real-server tests of group sglang:"
cat "$SGLANG_LOG"
rm -f "$SGLANG_LOG"
exit "$rc"
