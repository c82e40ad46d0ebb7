#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite against real servers.
set -euo pipefail
cd "$(dirname "$0")/.."
LORA_SYNC_TEST_TOOLS=1 bash scripts/install.sh
exec .venv/bin/python -m pytest -q "$@"
