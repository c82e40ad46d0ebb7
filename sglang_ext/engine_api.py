"""Every touch of SGLang's private API, in one place, for the supported version.

HTTP process: the tokenizer manager (its scheduler channel and LoRA registry) and the app.
Scheduler process: the request dispatcher and the LoRA manager of its model runner.
Messages between them are two small msgspec structs of our own (docs/engines.md,
"Extension points for a lora-sync plugin").
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import msgspec
from sglang.srt.managers.io_struct import BaseReq

from lora_sync import wire
from lora_sync.adapter import FUSED_SIBLINGS
from lora_sync.engines import ENGINES
from lora_sync.errors import LoRASyncError
from lora_sync.messages import WorkerReply
from lora_sync.server.pins import require_supported

LORA_PATH_MARK = "__lora_sync__"  # never a real path: SGLang must not re-load these from disk


# Every private SGLang symbol this module touches. scripts/drift_check.py looks each up in a
# release's sources (syntax in its docstring: "(a, *, b)" = how we call it) and fails when
# this module uses an engine import or private name missing here.
TOUCHED = (
    # Hooks and the scheduler's message dispatch
    "sglang.srt.managers.io_struct:BaseReq",
    "sglang.srt.plugins.hook_registry:HookRegistry.register(target, hook, hook_type)",
    "sglang.srt.plugins.hook_registry:HookType.AFTER",
    "sglang.srt.managers.scheduler:Scheduler.init_request_dispatcher()",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.init_request_dispatcher()",
    "sglang.utils:TypeBasedDispatcher(mapping)",
    "sglang.utils:TypeBasedDispatcher.__iadd__(other)",
    "sglang.srt.managers.scheduler:Scheduler._request_dispatcher",
    "sglang.srt.runtime_context:get_parallel()",
    "sglang.srt.runtime_context:ParallelContext.tp_rank",
    "sglang.srt.runtime_context:ParallelContext.tp_size",
    # Scheduler: the LoRA manager of its model runner
    "sglang.srt.managers.scheduler:Scheduler.tp_worker",
    "sglang.srt.managers.tp_worker:TpModelWorker.model_runner",
    "sglang.srt.model_executor.model_runner:ModelRunner.lora_manager",
    "sglang.srt.lora.lora_registry:LoRARef(*, lora_id, lora_name, lora_path, pinned)",
    "sglang.srt.lora.lora_manager:LoRAManager.load_lora_adapter_from_tensors("
    "lora_ref, tensors, config_dict)",
    "sglang.srt.managers.io_struct:LoRAUpdateOutput.success",
    "sglang.srt.managers.io_struct:LoRAUpdateOutput.error_message",
    "sglang.srt.lora.lora_manager:LoRAManager.unload_lora_adapter(lora_ref)",
    "sglang.srt.lora.lora:LoRAAdapter.normalize_qkv_proj(weight_names, weights)",
    "sglang.srt.lora.lora:LoRAAdapter.normalize_gate_up_proj(weight_names, weights)",
    "sglang.srt.lora.lora_manager:LoRAManager.lora_refs",
    "sglang.srt.lora.lora_manager:LoRAManager.configs",
    "sglang.srt.lora.lora_manager:LoRAManager.loras",
    # HTTP process: the tokenizer manager's scheduler channel, registry and the app
    "sglang.srt.managers.communicator:FanOutCommunicator(send, fan_out)",
    "sglang.srt.managers.communicator:FanOutCommunicator.__call__(obj)",
    "sglang.srt.managers.communicator:FanOutCommunicator.handle_recv(recv_obj)",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._dispatch_to_scheduler(obj)",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.generate_request(obj, request)",
    "sglang.srt.managers.io_struct:GenerateReqInput.lora_path",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._result_dispatcher",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.auto_create_handle_loop()",
    "sglang.srt.entrypoints.http_server:app",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.model_config",
    "sglang.srt.configs.model_config:ModelConfig.hf_config",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.server_args",
    "sglang.srt.arg_groups.fields.lora:Lora.max_lora_rank",
    "sglang.srt.arg_groups.fields.parallel:Parallel.tp_size",
    "sglang.srt.arg_groups.fields.serving:Serving.api_key",
    "sglang.srt.arg_groups.fields.serving:Serving.admin_api_key",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.lora_registry",
    "sglang.srt.lora.lora_registry:LoRARegistry.register(lora_ref)",
    "sglang.srt.lora.lora_registry:LoRARef.lora_path",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.served_model_name",
    "sglang.srt.entrypoints.openai.serving_base:OpenAIServingBase._parse_model_parameter(model)",
    "sglang.srt.lora.lora_registry:LoRARegistry.unregister(lora_name)",
    "sglang.srt.lora.lora_registry:LoRARegistry.get_all_adapters()",
    "sglang.srt.lora.lora_registry:LoRARegistry._counters",
    "sglang.srt.utils.common:ConcurrentCounter.value()",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager.rid_to_state",
    "sglang.srt.managers.tokenizer_manager:ReqState.obj",
    "sglang.srt.utils.auth:AuthLevel.ADMIN_OPTIONAL",
    "sglang.srt.utils.auth:auth_level(level)",
    "sglang.srt.utils.auth:decide_request_auth(*, method, path, authorization_header, "
    "api_key, admin_api_key, auth_level)",
    "sglang.srt.utils.auth:AuthDecision(*, allowed)",
    "sglang.srt.utils.auth:AuthDecision.allowed",
    "sglang.srt.utils.auth:AuthLevel.NORMAL",
)


class LoRASyncReq(BaseReq, kw_only=True):
    op: str
    args: Dict[str, Any] = msgspec.field(default_factory=dict)


class LoRASyncOut(BaseReq, kw_only=True):
    result: Dict[str, Any] = msgspec.field(default_factory=dict)


def check_version() -> str:
    import sglang
    return require_supported("SGLang", sglang.__version__)


def register_hooks(on_scheduler: Callable, on_tokenizer_manager: Callable) -> None:
    """Runs `on_scheduler(scheduler)` in every scheduler process and
    `on_tokenizer_manager(tm)` in the HTTP process, once their dispatchers exist."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher",
                          lambda result, self, *a, **k: on_scheduler(self), HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.init_request_dispatcher",
        lambda result, self, *a, **k: on_tokenizer_manager(self), HookType.AFTER)


def report_engine_requests(tm, report) -> None:
    """Calls `report([adapter name or None, ...])` (one per prompt) for every request the
    tokenizer manager takes (generate_request: /generate, the OpenAI, Anthropic, Ollama and
    scoring routes), before it reaches the scheduler; an exception from `report` refuses
    the request (lora_sync.server.applied)."""
    generate_request = tm.generate_request
    if getattr(generate_request, "lora_sync_reports", False):
        return

    def generate_request_reported(obj, request=None):
        paths = getattr(obj, "lora_path", None)
        report(paths if isinstance(paths, list) and paths else [paths])
        return generate_request(obj, request)
    generate_request_reported.lora_sync_reports = True
    tm.generate_request = generate_request_reported


# ---------------------------------------------------------------- scheduler side
def add_scheduler_handler(scheduler, handle: Callable[[Any, dict], dict]) -> None:
    import logging

    from sglang.utils import TypeBasedDispatcher

    def on_request(req: LoRASyncReq) -> LoRASyncOut:
        # An exception escaping a scheduler handler kills the whole server: never let one.
        try:
            return LoRASyncOut(result=handle(req.op, req.args))
        except Exception as e:
            logging.getLogger("lora_sync").exception("lora-sync %s failed", req.op)
            return LoRASyncOut(result=WorkerReply.failed(LoRASyncError(
                f"{req.op} failed in the scheduler: {e!r}")).to_json())
    scheduler._request_dispatcher += TypeBasedDispatcher([(LoRASyncReq, on_request)])


def scheduler_rank(scheduler) -> tuple[int, int]:
    """(rank, world size) among every scheduler of the server: data-parallel replica, then
    TP rank (`dp_rank` is None without a data-parallel controller)."""
    from sglang.srt.runtime_context import get_parallel
    parallel = get_parallel()
    dp_size = int(scheduler.server_args.dp_size)
    return (parallel.dp_rank or 0) * parallel.tp_size + parallel.tp_rank, \
        dp_size * parallel.tp_size


def lora_manager(scheduler):
    manager = scheduler.tp_worker.model_runner.lora_manager
    if manager is None:
        raise RuntimeError("SGLang runs without LoRA (start it with --enable-lora)")
    return manager


def load_adapter(scheduler, lora_id: str, tensors: dict, config: dict) -> None:
    """SGLang's own path: LoRAConfig.from_dict + LoRAAdapter.initialize_weights_from_tensors."""
    from sglang.srt.lora.lora_registry import LoRARef
    ref = LoRARef(lora_id=lora_id, lora_name=lora_id, lora_path=LORA_PATH_MARK, pinned=False)
    out = lora_manager(scheduler).load_lora_adapter_from_tensors(ref, tensors, config)
    if not out.success:
        raise ValueError(out.error_message or "SGLang refused the adapter")


# SGLang stacks the lora_B of fused siblings into one tensor under the fused name, and takes
# one already stacked as it is (LoRAAdapter.normalize_qkv_proj / normalize_gate_up_proj).
STACKED_B = tuple(zip(("qkv_proj", "gate_up_proj"), FUSED_SIBLINGS))
# (what a group's first lora_B key holds, the fused name, the parts): looked for in every key
_FIRST_B = tuple((f".{parts[0]}.lora_B", fused, parts) for fused, parts in STACKED_B)


def stack_in_place(tensors: dict) -> dict:
    """The tensors with each fused group's lora_B given stacked, as a view, where the parts lie
    back to back (the client's sibling order): SGLang then uses them as they are instead of
    concatenating them into new memory. The same values either way; the rest as given."""
    out = dict(tensors)
    for key in tensors:
        for first_b, fused, parts in _FIRST_B:
            if first_b not in key:
                continue
            names = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            if all(n in out for n in names):
                joined = wire.join_adjacent([out[n] for n in names])
                if joined is not None:
                    for n in names:
                        del out[n]
                    out[key.replace(f".{parts[0]}.", f".{fused}.")] = joined
    return out


def unload_adapter(scheduler, lora_id: str) -> None:
    from sglang.srt.lora.lora_registry import LoRARef
    manager = lora_manager(scheduler)
    if lora_id in manager.lora_refs:
        manager.unload_lora_adapter(LoRARef(lora_id=lora_id, lora_name=lora_id,
                                            lora_path=LORA_PATH_MARK, pinned=False))
    else:  # a load that failed half-way leaves these behind
        manager.configs.pop(lora_id, None)
        manager.loras.pop(lora_id, None)


def loaded_ids(scheduler) -> list[str]:
    return sorted(lora_manager(scheduler).loras)


# ---------------------------------------------------------------- HTTP process side
class SchedulerChannel:
    """Sends a LoRASyncReq to the schedulers and awaits every reply: the data-parallel
    controller sends a message it does not know to every replica's TP rank 0, and each of
    them answers (waiting for fewer would take a late reply as the next call's)."""

    def __init__(self, tm):
        from sglang.srt.managers.communicator import FanOutCommunicator
        from sglang.utils import TypeBasedDispatcher
        self.tm = tm
        self.comm = FanOutCommunicator(tm._dispatch_to_scheduler, dp_size(tm))
        tm._result_dispatcher += TypeBasedDispatcher([(LoRASyncOut, self.comm.handle_recv)])

    async def call(self, op: str, **args) -> list[dict]:
        """One reply per data-parallel replica (from its TP rank 0)."""
        self.tm.auto_create_handle_loop()
        return [out.result for out in await self.comm(LoRASyncReq(op=op, args=args))]


def add_routes_and_middleware(router, middleware):
    """Adds our routes, replacing upstream ones on the same paths (upstream's
    /load_lora_adapter_from_tensors takes pickled tensors: ours refuses anything but a
    safetensors body), and the admission middleware."""
    from sglang.srt.entrypoints.http_server import app

    from lora_sync.server.routes import put_first
    ours = {r.path for r in router.routes}
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in ours]
    # Route by route, not include_router: FastAPI 0.165 includes a router as one lazy
    # entry whose match carries no endpoint, and SGLang's key middleware then reads our
    # routes as NORMAL (generation key) instead of admin (found by test_key_schemes_on_sglang).
    before = len(app.router.routes)
    for r in router.routes:
        app.add_api_route(r.path, r.endpoint, methods=sorted(r.methods))
    put_first(app.router.routes, before)
    app.add_middleware(middleware)
    return app


def hf_config(tm):
    return tm.model_config.hf_config


def max_lora_rank(tm) -> int:
    return int(tm.server_args.max_lora_rank)


def tp_size(tm) -> int:
    return int(tm.server_args.tp_size)


def dp_size(tm) -> int:
    return int(tm.server_args.dp_size)


def check_layout(tm) -> None:
    """DP attention routes control messages differently (one group per attention-DP rank):
    lora-sync's fan-out does not cover it."""
    if getattr(tm.server_args, "enable_dp_attention", False):
        raise RuntimeError("lora-sync does not support --enable-dp-attention (plain "
                           "--dp-size replicas are supported)")


async def register_name(tm, served_name: str, lora_id: str) -> None:
    from sglang.srt.lora.lora_registry import LoRARef
    await tm.lora_registry.register(LoRARef(lora_id=lora_id, lora_name=served_name,
                                            lora_path=LORA_PATH_MARK, pinned=False))


async def unregister_name(tm, served_name: str) -> None:
    """New requests naming it get SGLang's own 'unknown adapter' error. The registry's usage
    counter stays until `forget_usage`: `adapter_in_use` reads it while requests drain.
    (The registry's wait_for_unload is not used: it waits without a bound.)"""
    if served_name in tm.lora_registry.get_all_adapters():
        await tm.lora_registry.unregister(served_name)


def adapter_in_use(tm, lora_id: str) -> bool:
    """Whether a request still holds the adapter: the registry's usage count (taken when the
    tokenizer manager resolves lora_path), or any in-flight request carrying its id."""
    counter = tm.lora_registry._counters.get(lora_id)
    if counter is not None and counter.value() > 0:
        return True
    return any(getattr(state.obj, "lora_id", None) == lora_id or
               (isinstance(getattr(state.obj, "lora_id", None), list)
                and lora_id in state.obj.lora_id)
               for state in list(tm.rid_to_state.values()))


def forget_usage(tm, lora_id: str) -> None:
    tm.lora_registry._counters.pop(lora_id, None)


# SGLang's own routes that load or unload adapters by name (admin-optional upstream).
NATIVE_ADAPTER_ROUTES = (("POST", ENGINES["sglang"].native_load, "lora_name", False, "lora_path"),
                         ("POST", ENGINES["sglang"].native_unload, "lora_name"))


def engine_keys(tm) -> tuple[str | None, str | None]:
    """(--api-key, --admin-api-key)."""
    args = tm.server_args
    return getattr(args, "api_key", None) or None, getattr(args, "admin_api_key", None) or None


def let_tenant_keys_through(own_paths: frozenset, is_tenant_key) -> None:
    """With lora-sync tenants: SGLang's key middleware, in front of ours, knows only its own
    keys. A key lora-sync knows (a tenant's, or the operator's, which SGLang takes as its
    admin key only, not on generation routes) is let through where lora-sync then decides
    what it may do: our own routes, and the generation routes (admission admits only the
    adapters it may use). SGLang's own admin routes still take SGLang's admin key alone."""
    import importlib
    auth = importlib.import_module("sglang.srt.utils.auth")  # its global is patched
    decide = auth.decide_request_auth
    if getattr(decide, "lora_sync_tenants", False):
        return

    def decide_with_tenants(*, path, authorization_header, auth_level, **kw):
        decision = decide(path=path, authorization_header=authorization_header,
                          auth_level=auth_level, **kw)
        ours = path in own_paths or auth_level == auth.AuthLevel.NORMAL
        if decision.allowed or not ours or not is_tenant_key(authorization_header):
            return decision
        return auth.AuthDecision(allowed=True)
    decide_with_tenants.lora_sync_tenants = True
    auth.decide_request_auth = decide_with_tenants  # looked up at each request


def mark_admin(router) -> None:
    """SGLang's middleware reads an endpoint's auth level from the route; unmarked routes
    would take the generation key (--api-key) instead of the admin key."""
    from sglang.srt.utils.auth import AuthLevel, auth_level
    for route in router.routes:
        auth_level(AuthLevel.ADMIN_OPTIONAL)(route.endpoint)


# Our SGLang lora ids start with this (SGLangBridge.lora_id); SGLang appends a request's
# lora_id to its client-set `extra_key` to key the radix cache, so admission refuses an
# extra_key that carries it.
LORA_ID_PREFIX = "lora-sync-"


def engine_names(tm) -> set[str]:
    """Every name SGLang serves that is not ours: the served model name and adapters loaded
    by other means (--lora-paths, its own load route)."""
    return {tm.served_model_name} | {
        name for name, ref in list(tm.lora_registry.get_all_adapters().items())
        if ref.lora_path != LORA_PATH_MARK}


def model_adapter(model: str, served_model_name: str) -> str:
    """The adapter name SGLang's OpenAI routes read from `model`, or `model` itself when it
    names no adapter: the same parse as SGLang's `_parse_model_parameter` (first colon,
    the served name matched whole first, stripped), so admission sees what SGLang will."""
    if ":" not in model or model == served_model_name:
        return model
    if model.startswith(f"{served_model_name}:"):
        adapter = model[len(served_model_name) + 1:]
    else:
        adapter = model.split(":", 1)[1]
    return adapter.strip() or model
