#!/usr/bin/env bash
# The main job: installs what is missing, then runs the RL loop on the embedded tiny model
# against a real vLLM CPU server, syncing the LoRA every step. Extra args go to the loop.
set -euo pipefail
cd "$(dirname "$0")/.."
LORA_SYNC_NO_SGLANG="${LORA_SYNC_NO_SGLANG:-1}" bash scripts/install.sh  # the demo runs on vLLM
exec .venv/bin/python -m examples.rl_loop "$@"
