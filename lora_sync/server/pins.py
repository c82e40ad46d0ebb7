"""Engine version pins: private engine APIs move between releases, so refuse to start on an
untested version unless the operator overrides it."""
from __future__ import annotations

import os

OVERRIDE_ENV = "LORA_SYNC_ALLOW_UNTESTED_ENGINE"


def require_tested(engine: str, installed: str, tested: str) -> str:
    if installed != tested and os.environ.get(OVERRIDE_ENV) != "1":
        raise RuntimeError(
            f"lora-sync is tested with {engine} {tested}, found {installed}. It touches private "
            f"{engine} APIs that change between releases; set {OVERRIDE_ENV}=1 to try anyway.")
    return installed
