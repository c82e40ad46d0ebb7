#!/usr/bin/env bash
# verl 0.9.1's own classes beside .venv's vLLM 0.32, for lora_sync.integrations.verl and its
# tests: installed without dependencies into .venv-verl-lib (the tests put it on sys.path).
# verl's `vllm` extra pins vLLM 0.24.0, which lora-sync does not run on, and its base install
# would swap .venv's transformers; its checkpoint-engine and worker classes import with these
# packages alone (docs/integrations.md, "verl 0.9.1").
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=.venv-verl-lib
if [ -f "$TARGET/.complete" ]; then exit 0; fi
rm -rf "$TARGET"
.venv/bin/python -m pip install -q --no-deps --target "$TARGET" \
  "verl==0.9.1" "ray==2.60.0" "msgpack==1.2.4" "tensordict==0.10.0" "pyvers==0.1.0" \
  "orjson==3.13.0" "omegaconf==2.4.0" "codetiming==1.4.0"
touch "$TARGET/.complete"
