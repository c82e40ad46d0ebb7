"""lora-sync's vLLM worker extension together with a framework's own.

vLLM takes one `--worker-extension-cls`, and frameworks that own their servers pass theirs
(verl: `verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension`). Replacing it
would break the framework; so the server names `ComposedWorkerExtension` instead, and the
framework's class goes in LORA_SYNC_WORKER_EXTENSION_BASE, which every process vLLM starts
inherits. The workers then hold both: ours (`lora_sync_call`) and every method of theirs.
`vllm_ext.mount.worker_extension` sets both for you.

A method defined on both sides would silently hide one of them: refused at import, which
vLLM does when the worker starts, naming the methods."""
from __future__ import annotations

import importlib
import os

from .vllm import LoRASyncWorkerExtension

BASE_ENV = "LORA_SYNC_WORKER_EXTENSION_BASE"
QUALNAME = f"{__name__}.ComposedWorkerExtension"


def _framework_class() -> type:
    qualname = os.environ.get(BASE_ENV, "")
    module, _, name = qualname.rpartition(".")
    if not module:
        raise RuntimeError(f"{QUALNAME} composes lora-sync's worker extension with a "
                           f"framework's: {BASE_ENV} must name that class as module.Class "
                           f"(it is {qualname!r})")
    theirs = getattr(importlib.import_module(module), name, None)
    if not isinstance(theirs, type):
        raise RuntimeError(f"{BASE_ENV}={qualname!r} is not a class")
    ours = {k for k in vars(LoRASyncWorkerExtension) if not k.startswith("__")}
    clash = sorted(ours & {k for c in theirs.__mro__ for k in vars(c)})
    if clash:
        raise RuntimeError(f"{qualname} and lora-sync's worker extension both define "
                           f"{clash}: one would hide the other")
    return theirs


class ComposedWorkerExtension(LoRASyncWorkerExtension, _framework_class()):
    """Ours first: lora-sync's one method, then the framework's class (its `__new__` and
    `__init__` run as they would alone)."""
