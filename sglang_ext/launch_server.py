"""Launcher: `python -m sglang_ext.launch_server <sglang.launch_server args>`.

The routes come from the `sglang.srt.plugins` entry point (installed with lora-sync); this
launcher checks the SGLang version first and makes sure our plugin is allowed to load."""
from __future__ import annotations

import os
import runpy
import sys

from lora_sync.server.settings import API_KEY_ENV, read

from . import engine_api


def main() -> None:
    engine_api.check_version()
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "lora_sync" not in allowed.split(","):
        os.environ["SGLANG_PLUGINS"] = allowed + ",lora_sync"
    if "--enable-lora" not in sys.argv:
        sys.argv.append("--enable-lora")
    # One admin key for our routes and SGLang's own admin routes (see plugin.py).
    key = read(API_KEY_ENV)
    if key and not any(a.startswith("--admin-api-key") for a in sys.argv):
        sys.argv += ["--admin-api-key", key]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
