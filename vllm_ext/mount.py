"""lora-sync in a vLLM server a framework builds itself (verl's `vLLMHttpServer` in a Ray
actor, a server of your own): what `python -m vllm_ext.serve` does, in three public calls.

    args.enable_lora = True
    args.worker_extension_cls = worker_extension(args.worker_extension_cls)  # compose
    engine_client = ...                      # the framework builds its AsyncLLM
    app = ...                                # its FastAPI app (vLLM's build_app or its own)
    mount(app, args)                         # lora-sync's routes and admission, before serving
    service = await start(engine_client, app.state, args)

Generation that does not come through HTTP (verl calls `AsyncLLM.generate` from a Ray
method) asks the service for the adapter a name serves now:

    async with service.using("policy") as version:   # or "policy-v7"
        async for out in engine_client.generate(prompt, params, request_id,
                                                lora_request=version.handle): ...
    # version.served_name == "policy-v7": the version that served it

Every rule of docs/security.md holds: admission guards the framework's HTTP routes as it
guards vLLM's, and `using` counts the request in flight so its version is never freed
under it. docs/integrations.md has the whole recipe."""
from __future__ import annotations

import os
import weakref

from starlette.middleware import Middleware

from lora_sync.engines import ENGINES
from lora_sync.server import applied, metrics
from lora_sync.server.admission import AdmissionMiddleware, NativeRoute
from lora_sync.server.routes import build_router, own_paths, put_first
from lora_sync.server.service import AdapterService
from lora_sync.server.settings import API_KEY_ENV, Settings, read

from . import engine_api
from .bridge import VLLMBridge

PREFIX = ENGINES["vllm"].route_prefix
WORKER_EXTENSION = "worker_extensions.vllm.LoRASyncWorkerExtension"
COMPOSED_EXTENSION = "worker_extensions.composed.ComposedWorkerExtension"
BASE_ENV = "LORA_SYNC_WORKER_EXTENSION_BASE"  # worker_extensions.composed reads it
# The service `start` built for each engine, for a framework whose code keeps the engine but
# never sees the app it mounted on (verl's run_server): `service_for(engine)`.
_services: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def worker_extension(theirs: str | None = None) -> str:
    """The --worker-extension-cls a server with lora-sync needs: ours alone, or (`theirs`,
    the framework's own class as module.Class) both composed into one class, which every
    process the engine starts finds through BASE_ENV."""
    if not theirs or theirs in (WORKER_EXTENSION, COMPOSED_EXTENSION):
        return theirs or WORKER_EXTENSION
    os.environ[BASE_ENV] = theirs
    return COMPOSED_EXTENSION


def mount(app, args=None) -> None:
    """lora-sync's routes and admission on `app`, before it serves. `args`: the server's
    vLLM arguments where vLLM's --api-key middleware guards the app (it then takes
    lora-sync's admin key too); vLLM's build_app leaves them in app.state.args."""
    engine_api.check_version()
    if getattr(app.state, "lora_sync_mounted", False):  # vLLM's plugin hook did it already
        return
    app.state.lora_sync_mounted = True
    before = len(app.router.routes)
    app.include_router(build_router(PREFIX))
    put_first(app.router.routes, before)
    admission = Middleware(
        AdmissionMiddleware, own_paths=own_paths(PREFIX),
        native_routes=[NativeRoute(*r) for r in engine_api.NATIVE_ADAPTER_ROUTES],
        engine_guards=lambda path: path.startswith(engine_api.KEY_GUARDED_PREFIXES))
    if app.middleware_stack is None:  # inside vLLM's build_app (its plugin hook)
        app.user_middleware.insert(0, admission)
    else:
        # vLLM's build_app hands back an app whose middleware stack is built (SageMaker's
        # bootstrap), though it has served nothing: ours goes innermost, where the plugin
        # hook's ends up once vLLM adds its own, and the stack is built again at the first
        # request.
        app.user_middleware.append(admission)
        app.middleware_stack = None
    args = args if args is not None else getattr(app.state, "args", None)
    if args is not None:
        engine_api.accept_admin_key(args, read(API_KEY_ENV))


async def start(engine_client, state, args) -> AdapterService:
    """lora-sync's service for the engine, once the engine runs; kept in `state.lora_sync`
    (the app's state, where the routes look). Fails loudly on what would break later: a
    worker lora-sync cannot reach, a worker extension without ours."""
    engine_api.check_layout(args)
    if getattr(args, "worker_extension_cls", "") not in (WORKER_EXTENSION, COMPOSED_EXTENSION):
        raise RuntimeError(f"lora-sync needs --worker-extension-cls {WORKER_EXTENSION}, or "
                           "vllm_ext.mount.worker_extension(<your class>) to keep yours too")
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
    state.lora_sync = service
    _services[engine_client] = service
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
    return service


def service_for(engine_client) -> AdapterService:
    """The service `start` built for this engine (vLLM's plugin hook calls it where the
    framework builds the app itself)."""
    try:
        return _services[engine_client]
    except KeyError:
        raise RuntimeError("lora-sync was not started on this engine: name lora_sync in "
                           "VLLM_PLUGINS, or call vllm_ext.mount.start") from None
