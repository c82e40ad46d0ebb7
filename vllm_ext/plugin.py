"""vLLM endpoint plugin (entry point group `vllm.endpoint_plugins`, name `lora_sync`).

vLLM loads endpoint plugins only when named in VLLM_PLUGINS; our launcher sets it."""
from __future__ import annotations

from lora_sync.server.admission import AdmissionMiddleware
from lora_sync.server.routes import build_router
from lora_sync.server.service import AdapterService, Settings

from . import engine_api
from .bridge import VLLMBridge


class LoRASyncEndpointPlugin:
    name = "lora_sync"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        engine_api.check_version()
        app.include_router(build_router("/v1"))
        app.add_middleware(AdmissionMiddleware)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        service = AdapterService(VLLMBridge(engine_client, state), Settings.from_env())
        await service.model_spec()  # fail at start-up, not at the first push
        if getattr(args, "worker_extension_cls", "") != WORKER_EXTENSION:
            raise RuntimeError(f"lora-sync needs --worker-extension-cls {WORKER_EXTENSION}")
        state.lora_sync = service


WORKER_EXTENSION = "worker_extensions.vllm.LoRASyncWorkerExtension"
