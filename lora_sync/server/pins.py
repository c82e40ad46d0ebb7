"""Version pins of the engines (and of TRL, for lora_sync.integrations.trl): the private APIs
we touch move between releases, so refuse to start on an unsupported version unless the
operator overrides it."""
from __future__ import annotations

import logging
import os

from ..engines import ENGINES, STATIC_ONLY, TRL_SUPPORTED

OVERRIDE_ENV = "LORA_SYNC_ALLOW_UNTESTED_ENGINE"

# The versions lora-sync starts on, and how each was tested (lora_sync/engines.py): said at
# start-up, so an operator on a statically-checked release knows no server of that release
# ever ran our code.
SUPPORTED: dict[str, dict[str, str]] = {
    **{e.display: e.supported for e in ENGINES.values()}, "TRL": TRL_SUPPORTED}

logger = logging.getLogger("lora_sync")


def _describe(tested: dict[str, str]) -> str:
    return "; ".join(f"{v}: {how}" for v, how in tested.items())


def require_supported(engine: str, installed: str) -> str:
    """The installed version if it is in SUPPORTED[engine] (or the operator overrides);
    else a RuntimeError naming the supported versions and how each was tested."""
    how = SUPPORTED[engine]
    version = installed.split("+")[0]  # local builds: 0.32.0+cpu is 0.32.0
    if version in how:
        log = logger.warning if how[version].startswith(STATIC_ONLY) else logger.info
        log("lora-sync on %s %s: %s (supported: %s)", engine, installed, how[version],
            _describe(how))
        return installed
    if os.environ.get(OVERRIDE_ENV) != "1":
        raise RuntimeError(
            f"lora-sync is tested with {engine} {' or '.join(how)}, found {installed} "
            f"({_describe(how)}). It touches private {engine} APIs that change between "
            f"releases; set {OVERRIDE_ENV}=1 to try anyway.")
    logger.warning("lora-sync on untested %s %s (%s=1; supported: %s)", engine, installed,
                   OVERRIDE_ENV, _describe(how))
    return installed
