"""vLLM endpoint plugin (entry point group `vllm.endpoint_plugins`, name `lora_sync`).

vLLM loads endpoint plugins only when named in VLLM_PLUGINS; our launcher sets it."""
from __future__ import annotations

import os

from lora_sync.engines import ENGINES
from lora_sync.server import applied, metrics
from lora_sync.server.admission import AdmissionMiddleware, NativeRoute
from lora_sync.server.routes import build_router, own_paths
from lora_sync.server.service import AdapterService
from lora_sync.server.settings import API_KEY_ENV, Settings, read

from . import engine_api
from .bridge import VLLMBridge

PREFIX = ENGINES["vllm"].route_prefix


class LoRASyncEndpointPlugin:
    name = "lora_sync"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        engine_api.check_version()
        app.include_router(build_router(PREFIX))
        app.add_middleware(
            AdmissionMiddleware, own_paths=own_paths(PREFIX),
            native_routes=[NativeRoute(*r) for r in engine_api.NATIVE_ADAPTER_ROUTES],
            engine_guards=lambda path: path.startswith(engine_api.KEY_GUARDED_PREFIXES))
        # vLLM's --api-key middleware sits in front of our /v1 routes: let our key through.
        engine_api.accept_admin_key(app.state.args, read(API_KEY_ENV))

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        engine_api.check_layout(args)
        keys = engine_api.engine_api_keys(args)
        settings = Settings.from_env(engine_has_key=bool(keys))
        settings.generation_keys = tuple(keys)
        service = AdapterService(VLLMBridge(engine_client, state), settings)
        await service.model_spec()  # fail at start-up, not at the first push
        # Every worker of every data-parallel engine answers, each with its own rank.
        status = await service.bridge.worker_status()
        ranks = sorted(w["rank"] for w in status)
        if ranks != list(range(status[0]["world_size"])):
            raise RuntimeError(f"lora-sync reached workers with ranks {ranks} of "
                               f"{status[0]['world_size']}: some engine is not reachable")
        if getattr(args, "worker_extension_cls", "") != WORKER_EXTENSION:
            raise RuntimeError(f"lora-sync needs --worker-extension-cls {WORKER_EXTENSION}")
        state.lora_sync = service
        # A request admitted on an adapter reaches EngineCore carrying it, or is refused.
        engine_api.report_engine_requests(applied.engine_request)
        if service.access.tenancy.enabled and keys:
            engine_api.let_tenant_keys_through(
                lambda header: service.access.tenancy.resolve(header).kind == "tenant")
        # vLLM's one API server serves prometheus_client's global registry at /metrics
        # (a multiprocess registry when PROMETHEUS_MULTIPROC_DIR is set): ours go there.
        metrics.install(service)
        # A model whose LoRA forward cannot run here (MoE experts that need Triton on a CPU
        # build): the server still starts, warns now (lora_sync's log handler is set up by
        # metrics.install), and refuses every push saying why.
        await service.model_unsupported(status)


WORKER_EXTENSION = "worker_extensions.vllm.LoRASyncWorkerExtension"
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
