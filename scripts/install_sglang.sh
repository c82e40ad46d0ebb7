#!/usr/bin/env bash
# Creates .venv-sglang: SGLang 0.5.23 on CPU torch, for lora-sync's SGLang integration tests.
# Idempotent and safe to re-run (a stamp file skips pip when nothing changed).
#
# `pip install sglang==0.5.23` would pull ~11 GB of CUDA packages and swap torch for a CUDA build,
# so SGLang is installed with --no-deps plus exactly the packages its server imports (found by
# tracing imports of a running CPU server). torch is pinned to the local 2.13.0+cpu wheel
# (PIP_FIND_LINKS=/opt/wheels). PyPI's sgl-kernel is CUDA-only: test servers get a pure-torch
# stand-in from tests/sgl_kernel_standin via PYTHONPATH (see tests/sglang_server.py).
#
# Env: SGLANG_VENV (default <repo>/.venv-sglang), PYTHON (default python3.11).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SGLANG_VENV:-$REPO/.venv-sglang}"
export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || { echo "need $PY" >&2; exit 1; }

TORCH="torch==2.13.0"   # the +cpu wheel from /opt/wheels; repeated in every pip call
SGLANG="sglang==0.5.23"
# Versions pinned where sglang 0.5.23 pins them; the rest are what it imports at start-up or
# while serving /generate, /v1/completions and the LoRA routes.
DEPS=(
  "transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0"
  "apache-tvm-ffi==0.1.11" "xgrammar==0.2.7" "openai==2.8.0" "sentencepiece==0.2.1"
  "soundfile==0.13.1" "torchvision==0.28.0" "triton==3.9.0"
  "fastapi==0.165.0" "uvicorn==0.54.0" "uvloop==0.23.0" "pyzmq==27.3.0" "msgspec==0.22.0"
  # uvicorn falls back to its pure-Python h11 parser without httptools: 3-4x slower bodies
  "httptools==0.9.0"
  "orjson==3.13.0" "pybase64==1.5.1" "psutil==7.2.2" "setproctitle==1.3.8"
  "requests==2.34.2" "aiohttp==3.14.5" "numpy==2.4.6" "pillow==13.0.0" "pydantic==2.14.3"
  "python-multipart==0.0.34" "einops==0.8.2" "partial-json-parser==0.2.1.1.post7"
  "tqdm==4.70.1" "regex==2026.11.15" "tiktoken==0.14.0" "ipython==9.18.1" "dill==0.4.1"
  "gguf==0.19.0" "jsonschema==4.26.0" "scipy==1.17.1" "zstandard==0.25.0"
  "watchfiles==1.3.0" "distro==1.9.0" "packaging==26.3" "safetensors==0.8.0"
  # /metrics (--enable-metrics), where lora-sync's metrics are served too
  "prometheus-client==0.26.0"
  # not imported by SGLang; used by lora-sync's tests (tiny model, PEFT adapters)
  "peft==0.21.2"
)

stamp_text="$TORCH $SGLANG ${DEPS[*]} torchvision-fix-v1"
STAMP="$VENV/.lora-sync-install-stamp"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp_text" ] && [ -x "$VENV/bin/python" ]; then
  echo "SGLang env up to date: $VENV"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
V="$VENV/bin/python"
pip_q() { "$V" -m pip install -q "$@" 2>&1 | grep -vE "is ignored: it is neither|requires .*which is not installed|dependency resolver does not currently|sglang 0.5.23 requires" || true; }

pip_q "$TORCH"
pip_q --no-deps "$SGLANG"
pip_q "${DEPS[@]}" "$TORCH"

SITE="$("$V" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# PyPI's torchvision is built against CUDA torch: beside torch+cpu its _C.so cannot load and
# `import torchvision` (done by SGLang and transformers at import time) fails with
# "operator torchvision::nms does not exist". This startup hook defines the two op schemas
# torchvision's fake-tensor registrations need, lazily, on the first `import torchvision`.
cat > "$SITE/_lora_sync_torchvision_cpu_fix.py" <<'EOF'
"""Written by lora-sync's scripts/install_sglang.sh (test environment only).

PyPI's torchvision wheel is built against CUDA torch; next to torch+cpu its native library
(_C.so) cannot load and `import torchvision` dies with "operator torchvision::nms does not
exist". On the first `import torchvision` this hook defines the op schemas torchvision's
fake-tensor registrations need (nms, qnms) -- without kernels, so calling them still fails
loudly. Nothing is defined when torchvision's native library loads fine.
"""
import importlib.abc
import sys


class _TorchvisionSchemaHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            _define_missing_schemas()
        return None  # the normal finders import torchvision


_LIB = None


def _define_missing_schemas():
    global _LIB
    import importlib.util
    import os

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    lib = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
    try:
        torch.ops.load_library(lib)
        return  # native ops available
    except (OSError, ImportError, RuntimeError):
        pass
    _LIB = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        if not hasattr(torch.ops.torchvision, op):
            _LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


if not any(isinstance(f, _TorchvisionSchemaHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionSchemaHook())
EOF
echo "import _lora_sync_torchvision_cpu_fix" > "$SITE/_lora_sync_torchvision_cpu_fix.pth"

# Smoke check: torch must be the CPU build, and the server's modules must import.
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$REPO/tests/sgl_kernel_standin" "$V" - <<'EOF'
import warnings
warnings.filterwarnings("ignore")
import torch
assert torch.__version__.endswith("+cpu"), f"expected CPU torch, got {torch.__version__}"
import torchvision, peft  # noqa: F401
import sglang.launch_server, sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.managers.scheduler, sglang.srt.models.llama  # noqa: F401
import sglang.srt.lora.lora_manager, sglang.srt.lora.backend.torch_backend  # noqa: F401
import sglang
print(f"SGLang env ready: sglang {sglang.__version__}, torch {torch.__version__}")
EOF
echo "$stamp_text" > "$STAMP"
