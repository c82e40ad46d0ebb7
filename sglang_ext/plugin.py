"""SGLang plugin (entry point group `sglang.srt.plugins`, name `lora_sync`).

SGLang calls `load()` in its launcher, scheduler and detokenizer processes. The hooks add our
message handler to every scheduler and our routes + admission middleware to the HTTP server.
"""
from __future__ import annotations

import importlib
from functools import partial

from lora_sync.engines import ENGINES

from . import engine_api

# The worker side, named as vLLM's --worker-extension-cls is: worker_extensions depends on
# this package's engine_api, never the other way round.
SCHEDULER_EXTENSION = "worker_extensions.sglang:install"
PREFIX = ENGINES["sglang"].route_prefix


def load() -> None:
    engine_api.register_hooks(_on_scheduler, _on_tokenizer_manager)


def _on_scheduler(scheduler) -> None:
    engine_api.check_version()  # raising here stops the server: loud, at start-up
    module, attr = SCHEDULER_EXTENSION.split(":")
    getattr(importlib.import_module(module), attr)(scheduler)


def _on_tokenizer_manager(tm) -> None:
    engine_api.check_version()
    engine_api.check_layout(tm)
    from lora_sync.server import applied, metrics
    from lora_sync.server.admission import AdmissionMiddleware, NativeRoute
    from lora_sync.server.routes import build_router, own_paths
    from lora_sync.server.service import AdapterService
    from lora_sync.server.settings import API_KEY_ENV, Settings, read

    from .bridge import SGLangBridge
    api_key, admin_key = engine_api.engine_keys(tm)
    ours = read(API_KEY_ENV)
    # SGLang's own middleware checks admin routes (ours included) against --admin-api-key,
    # and against --api-key when that is the only key: one admin key must serve both.
    if ours and (admin_key or api_key) and admin_key != ours:
        raise RuntimeError("lora-sync: LORA_SYNC_API_KEY must also be SGLang's "
                           "--admin-api-key when SGLang has API keys (python -m "
                           "sglang_ext.launch_server passes it)")
    settings = Settings.from_env(engine_has_key=bool(api_key or admin_key),
                                 engine_admin_key=admin_key)
    service = AdapterService(SGLangBridge(tm), settings)
    router = build_router(PREFIX)
    engine_api.mark_admin(router)
    # SGLang's OpenAI routes pick the adapter from `lora_path`, not from `model`.
    # SGLang serves the base model for a `model` it does not know: strict_models makes that
    # a 404, and its "base:adapter" form is read exactly as SGLang reads it.
    app = engine_api.add_routes_and_middleware(router, partial(
        AdmissionMiddleware, own_paths=own_paths(PREFIX), also_set=("lora_path",),
        native_routes=[NativeRoute(*r) for r in engine_api.NATIVE_ADAPTER_ROUTES],
        model_adapter=partial(engine_api.model_adapter,
                              served_model_name=tm.served_model_name),
        strict_models=True, model_names=frozenset({tm.served_model_name}),
        cache_key_fields={"extra_key": engine_api.LORA_ID_PREFIX},
        reads_adapter_header=False))
    app.state.lora_sync = service
    # A request admitted on an adapter reaches the scheduler carrying it, or is refused.
    engine_api.report_engine_requests(tm, applied.engine_request)
    if service.access.tenancy.enabled:
        engine_api.let_tenant_keys_through(
            own_paths(PREFIX), lambda header: service.access.tenancy.resolve(header).kind != "anonymous")
    # Served by SGLang's /metrics when it runs with --enable-metrics (prometheus_client's
    # multiprocess mode: SGLang set PROMETHEUS_MULTIPROC_DIR before this hook runs).
    metrics.install(service)
