"""vLLM endpoint plugin (entry point group `vllm.endpoint_plugins`, name `lora_sync`).

vLLM loads endpoint plugins only when named in VLLM_PLUGINS; our launcher sets it."""
from __future__ import annotations

import os

from . import mount


class LoRASyncEndpointPlugin:
    """vLLM's plugin hooks, both phases: the public mount (vllm_ext/mount.py) does the work."""
    name = "lora_sync"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        mount.mount(app)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is not None:
            await mount.start(engine_client, state, args)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """`vllm.general_plugins` entry point, run in every vLLM process: a process vLLM started
    (EngineCore, its workers) is SIGKILLed when the process that started it dies, so a
    SIGKILLed launcher leaves no orphan holding the memory a restarted server needs."""
    import ctypes
    import multiprocessing
    import signal
    parent = multiprocessing.parent_process()
    if parent is None:  # the launcher itself: it lives as long as its operator wants
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent.pid:  # the parent died before the line above
        os._exit(1)
