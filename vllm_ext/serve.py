"""Launcher: `python -m vllm_ext.serve --model DIR [vLLM args]`.

Starts vLLM's OpenAI server with lora-sync's routes and worker extension (and LoRA on).
lora-sync's own settings come from the environment (docs/operations.md):
LORA_SYNC_MAX_BODY_MB, LORA_SYNC_KEEP_VERSIONS, LORA_SYNC_API_KEY, ...

vLLM's runtime adapter routes (/v1/load_lora_adapter, SageMaker's /adapters) load server-side
paths by name; they stay off unless the operator sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=True,
and then they take lora-sync's admin key and refuse lora-sync's names."""
from __future__ import annotations

import os
import sys

from . import engine_api
from .mount import WORKER_EXTENSION


def prepare(argv: list[str]) -> list[str]:
    """The vLLM command line and environment lora-sync needs."""
    plugins = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    os.environ["VLLM_PLUGINS"] = ",".join(plugins + ["lora_sync"] * ("lora_sync" not in plugins))
    argv = list(argv)
    if "--enable-lora" not in argv:
        argv.append("--enable-lora")
    if not any(a.startswith("--worker-extension-cls") for a in argv):
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    return argv


def main() -> None:
    engine_api.check_version()
    sys.argv = [sys.argv[0]] + prepare(sys.argv[1:])
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main
    vllm_main()


if __name__ == "__main__":
    main()
