"""Every touch of vLLM's private API, in one place, for the supported versions.

API-process side: the serving layer's name -> LoRARequest table and the engine client.
Worker side: the LoRA manager, LoRAModel construction and the in-memory adapter loader.
"""
from __future__ import annotations

from functools import lru_cache, partial

import torch

from lora_sync.engines import ENGINES
from lora_sync.server.pins import require_supported

LORA_PATH_SCHEME = "lora-sync://"  # marks our adapters' paths: never read from disk

# What differs between supported releases (pins.SUPPORTED says how each was tested).
# lora_checks: the checks vLLM's disk loader (`WorkerLoRAManager._load_adapter`) runs on a
# built LoRAModel; build_lora_model runs the same ones.
BY_VERSION = {
    "0.32.0": {"lora_checks": ("_validate_moe_lora_format", "_validate_modules_to_save",
                               "_validate_token_classification_lora")},
    "0.33.0": {"lora_checks": ("_validate_moe_lora_format",
                               "_validate_classification_head_lora")},
}

# scripts/drift_check.py checks that each row's lora_checks are the `_validate_*` calls that
# release's disk loader makes, in order: a check added upstream shows up as drift.
MIRRORS = {"lora_checks": ("vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
                           "_validate_")}

# Every private vLLM symbol this module touches. scripts/drift_check.py looks each up in a
# release's sources (syntax in its docstring: "(a, *, b)" = how we call it, "[v]" = only in
# v) and fails when this module uses an engine import or private name missing here.
TOUCHED = (
    # API process: the serving layer's adapter table and the engine client
    "vllm.lora.request:LoRARequest(*, lora_name, lora_int_id, lora_path)",
    "vllm.entrypoints.launchers.api_server.app_state:init_app_state.openai_serving_models",
    "vllm.entrypoints.openai.models.serving:OpenAIServingModels.lora_requests",
    "vllm.entrypoints.openai.models.serving:OpenAIServingModels.lora_id_counter",
    "vllm.entrypoints.openai.models.serving:OpenAIServingModels.base_model_paths",
    "vllm.entrypoints.openai.models.protocol:BaseModelPath.name",
    "vllm.lora.request:LoRARequest.lora_path",
    "vllm.utils.counter:AtomicCounter.inc(num)",
    "vllm.v1.engine.async_llm:AsyncLLM.output_processor",
    "vllm.v1.engine.output_processor:OutputProcessor.request_states",
    "vllm.v1.engine.output_processor:RequestState.lora_request",
    "vllm.v1.engine.async_llm:AsyncLLM.add_lora(lora_request)",
    "vllm.v1.engine.async_llm:AsyncLLM.add_request(request_id, prompt, params, arrival_time,"
    " lora_request)",
    "vllm.v1.engine:EngineCoreRequest.lora_request",
    "vllm.lora.request:LoRARequest.lora_name",
    "vllm.v1.engine.async_llm:AsyncLLM.remove_lora(lora_id)",
    "vllm.lora.request:LoRARequest.lora_int_id",
    "vllm.v1.engine.async_llm:AsyncLLM.collective_rpc(method, *, timeout, args)",
    "vllm.v1.engine.async_llm:AsyncLLM.model_config",
    "vllm.v1.engine.async_llm:AsyncLLM.vllm_config",
    "vllm.config.model:ModelConfig.hf_config",
    "vllm.config.vllm:VllmConfig.lora_config",
    "vllm.config.vllm:VllmConfig.parallel_config",
    "vllm.config.lora:LoRAConfig.max_lora_rank",
    "vllm.config.parallel:ParallelConfig.world_size",
    "vllm.config.parallel:ParallelConfig.data_parallel_index",
    "vllm.config.parallel:ParallelConfig.data_parallel_size",
    "vllm.v1.engine.async_llm:AsyncLLM.engine_core",
    "vllm.v1.engine.core_client:MPClient.core_engines",
    "vllm.v1.engine.core_client:AsyncMPClient.call_utility_all_async(method, *args)",
    # Worker: its LoRA manager and vLLM's own LoRAModel construction
    "vllm.v1.worker.cpu_worker:CPUWorker.model_runner",
    "vllm.v1.worker.cpu_worker:CPUWorker.rank",
    "vllm.v1.worker.cpu_worker:CPUWorker.vllm_config",
    "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.lora_manager",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.lora_config",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.vocab_size",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.max_position_embeddings",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._adapter_manager",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._lora_model_cls",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager._load_adapter(lora_request)",
    "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.remove_adapter(adapter_id)",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager.model",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager._validate_moe_lora_format(lora_model)",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager._validate_modules_to_save(lora_model)"
    " [0.32.0]",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager._validate_token_classification_lora("
    "lora_model) [0.32.0]",
    "vllm.lora.model_manager:LRUCacheLoRAModelManager._validate_classification_head_lora("
    "lora_model) [0.33.0]",
    "vllm.lora.peft_helper:PEFTHelper.from_dict(config_dict)",
    "vllm.lora.peft_helper:PEFTHelper.vllm_max_position_embeddings",
    "vllm.lora.peft_helper:PEFTHelper.validate_legal(lora_config)",
    "vllm.config.lora:LoRAConfig.lora_dtype",
    "vllm.lora.lora_model:LoRAModel.from_lora_tensors(*, lora_model_id, tensors, peft_helper,"
    " device, dtype, model_vocab_size, weights_mapper, skip_prefixes)",
    "vllm.model_executor.models.utils:WeightsMapper.get_rename_mapper()",
    "vllm.lora.lora_model:LoRAModel.loras",
    "vllm.lora.lora_weights:LoRALayerWeights.lora_b",
    "vllm.lora.lora_weights:LoRALayerWeights.scaling",
    "vllm.lora.lora_weights:LoRALayerWeights.optimize()",
    # Worker: activation (the slot writer)
    "vllm.lora.model_manager:LoRAModelManager.modules",
    "vllm.lora.model_manager:LoRAModelManager.packed_modules",
    "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.set_lora(index, lora_a, lora_b)",
    "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.lora_a_stacked",
    "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.lora_b_stacked",
    "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.n_slices",
    "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.tp_size",
    "vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.device",
    "vllm.lora.layers:ColumnParallelLinearWithLoRA",
    "vllm.lora.layers:RowParallelLinearWithLoRA",
    "vllm.lora.layers:ReplicatedLinearWithLoRA",
    "vllm.lora.layers:QKVParallelLinearWithLoRA",
    "vllm.lora.layers:MergedColumnParallelLinearWithLoRA",
    "vllm.lora.layers:MergedQKVParallelLinearWithLoRA",
    # lora-sync tenants through vLLM's --api-key middleware
    "vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware.verify_token(headers)",
    # Worker: whether the model's LoRA forward can run here (lora_path_blocker)
    "vllm.lora.layers:FusedMoEWithLoRA",
    "vllm.lora.layers.fused_moe:FusedMoEWithLoRA._moe_kernel",
    "vllm.lora.layers.fused_moe:FusedMoEWithLoRA.punica_wrapper",
    "vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEKernel.fused_experts",
    "vllm.model_executor.layers.fused_moe.experts.triton_moe:TritonExperts",
    "vllm.triton_utils:HAS_TRITON",
    "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase.add_lora_w13",
    "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase.add_lora_w2",
    # Worker: the CPU LoRA ops, each row masked by its slot (mask_unadapted_rows)
    "vllm.lora.ops:torch_ops",
    "vllm.lora.ops.torch_ops:lora_ops",
    "vllm.lora.punica_wrapper:punica_cpu",
    "vllm.lora.ops.torch_ops.lora_ops:bgmv_shrink",
    "vllm.lora.ops.torch_ops.lora_ops:bgmv_expand",
    "vllm.lora.ops.torch_ops.lora_ops:bgmv_expand_slice",
    "vllm.lora.ops.torch_ops.lora_ops:sgmv_shrink",
    "vllm.lora.ops.torch_ops.lora_ops:sgmv_expand",
    "vllm.lora.ops.torch_ops.lora_ops:sgmv_expand_slice",
    "vllm.lora.punica_wrapper.punica_cpu:bgmv_shrink",
    "vllm.lora.punica_wrapper.punica_cpu:bgmv_expand",
    "vllm.lora.punica_wrapper.punica_cpu:bgmv_expand_slice",
)


def check_version() -> str:
    import vllm
    return require_supported("vLLM", vllm.__version__)


@lru_cache(maxsize=1)
def release() -> dict:
    """BY_VERSION's row for the installed vLLM; the newest row when the operator overrode
    the pin for an unsupported version (the closest guess)."""
    import vllm
    version = vllm.__version__.split("+")[0]
    if version in BY_VERSION:
        return BY_VERSION[version]
    return BY_VERSION[max(BY_VERSION, key=lambda v: tuple(int(x) for x in v.split(".")))]


# ---------------------------------------------------------------- API-process side
def lora_request(served_name: str, lora_int_id: int, identity: str):
    """`identity` is new to this engine at every registration (see EngineBridge): vLLM's
    prefix cache keys blocks by (lora_name, lora_path), so a name that comes back (retire,
    restart, another client) never meets blocks computed under other weights. The path is
    never read for our adapters."""
    from vllm.lora.request import LoRARequest
    return LoRARequest(lora_name=served_name, lora_int_id=lora_int_id,
                       lora_path=f"{LORA_PATH_SCHEME}{identity}/{served_name}")


def engine_names(app_state) -> set[str]:
    """Every name vLLM serves that is not ours: served model names and adapters loaded by
    other means (--lora-modules, its runtime load route)."""
    models = serving_models(app_state)
    return {m.name for m in models.base_model_paths} | {
        name for name, req in list(models.lora_requests.items())
        if not str(req.lora_path).startswith(LORA_PATH_SCHEME)}


# The engine's own routes that load or unload adapters by name (SageMaker's come with
# VLLM_ALLOW_RUNTIME_LORA_UPDATING through model_hosting_container_standards).
# Unloading only forgets the name (vllm#54839): lora-sync evicts the cached copy after.
NATIVE_ADAPTER_ROUTES = (("POST", ENGINES["vllm"].native_load, "lora_name", False, "lora_path"),
                         ("POST", ENGINES["vllm"].native_unload, "lora_name", True),
                         ("POST", "/adapters", "name", False, "src"),
                         ("DELETE", "/adapters/", None, True))
# vLLM's --api-key middleware guards only these prefixes (serve/middleware/authenticate.py):
# /invocations, for one, generates unguarded.
KEY_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def engine_api_keys(args) -> list[str]:
    """The keys vLLM's middleware accepts (--api-key, else VLLM_API_KEY)."""
    import os
    return [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if k]


def accept_admin_key(args, admin_key: str | None) -> None:
    """Lets lora-sync's admin key through vLLM's --api-key middleware (which sits in front
    of our /v1 routes), so a trainer needs one key. Called before the middleware is built."""
    keys = engine_api_keys(args)
    if admin_key and keys and admin_key not in keys:
        args.api_key = keys + [admin_key]


def let_tenant_keys_through(is_tenant_key) -> None:
    """With lora-sync tenants and vLLM's --api-key: vLLM's middleware, in front of ours,
    knows only its own keys (and our admin key, `accept_admin_key`); tenants' keys are held
    as hashes, so they are let through here instead. What a tenant's key may then do on a
    route is lora-sync's to say (routes, admission)."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
    verify = AuthenticationMiddleware.verify_token
    if getattr(verify, "lora_sync_tenants", False):
        return

    def verify_with_tenants(self, headers):
        return verify(self, headers) or is_tenant_key(headers.get("Authorization"))
    verify_with_tenants.lora_sync_tenants = True
    AuthenticationMiddleware.verify_token = verify_with_tenants


def report_engine_requests(report) -> None:
    """Calls `report([adapter name or None])` for every request the API process hands
    EngineCore, before it goes (AsyncLLM.add_request: generate, encode and every route on
    them); an exception from `report` refuses the request (lora_sync.server.applied)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    add_request = AsyncLLM.add_request
    if getattr(add_request, "lora_sync_reports", False):
        return

    async def add_request_reported(self, request_id, prompt, params, *args, **kwargs):
        lora = kwargs.get("lora_request", args[1] if len(args) > 1 else None)
        if lora is None:  # an EngineCoreRequest carries its own
            lora = getattr(prompt, "lora_request", None)
        report([None if lora is None else lora.lora_name])
        return await add_request(self, request_id, prompt, params, *args, **kwargs)
    add_request_reported.lora_sync_reports = True
    AsyncLLM.add_request = add_request_reported


def adapter_in_use(engine_client, lora_int_id: int) -> bool:
    """Whether any request vLLM has not finished (from the API process's add_request until
    its last output, so also requests still on their way to EngineCore) uses the adapter."""
    states = engine_client.output_processor.request_states.values()
    return any(s.lora_request is not None and s.lora_request.lora_int_id == lora_int_id
               for s in list(states))


def serving_models(app_state):
    return app_state.openai_serving_models


def next_lora_id(app_state) -> int:
    return serving_models(app_state).lora_id_counter.inc(1)


def publish(app_state, served_name: str, request) -> None:
    """Makes `request` answer to `served_name` in vLLM's table of adapters."""
    serving_models(app_state).lora_requests[served_name] = request


def unpublish(app_state, served_name: str) -> None:
    serving_models(app_state).lora_requests.pop(served_name, None)


def native_adapter_id(app_state, name: str) -> int | None:
    """The id of an adapter vLLM loaded itself (its disk route) under `name`."""
    request = serving_models(app_state).lora_requests.get(name)
    if request is None or str(request.lora_path).startswith(LORA_PATH_SCHEME):
        return None
    return request.lora_int_id


async def remove_lora(engine_client, lora_int_id: int) -> None:
    await engine_client.remove_lora(lora_int_id)



async def add_lora(engine_client, request) -> None:
    await engine_client.add_lora(request)



async def worker_rpc(engine_client, method: str, *args, timeout: float | None = None) -> list:
    """Calls a worker-extension method on every worker of every data-parallel engine;
    returns one result per worker, in global rank order (engine, then worker). Under data
    parallelism vLLM's own collective_rpc returns the first engine's results only."""
    core = engine_client.engine_core
    if len(getattr(core, "core_engines", ())) > 1:
        per_engine = await core.call_utility_all_async("collective_rpc", method, timeout,
                                                       args, None)
        return [r for replies in per_engine for r in replies]
    return await engine_client.collective_rpc(method, timeout=timeout, args=args)


def data_parallel_size(engine_client) -> int:
    return int(engine_client.vllm_config.parallel_config.data_parallel_size)


def check_layout(args) -> None:
    """lora-sync keeps one name table per API process and reaches engines through it: more
    than one API process, or engines it does not front, would each see part of a push."""
    if int(getattr(args, "api_server_count", 1) or 1) > 1:
        raise RuntimeError("lora-sync needs one API server process (--api-server-count 1); "
                           "each would keep its own adapter table")
    if getattr(args, "data_parallel_external_lb", False) or \
            getattr(args, "data_parallel_hybrid_lb", False):
        raise RuntimeError("lora-sync supports data parallelism with vLLM's internal load "
                           "balancing only (no --data-parallel-external-lb/-hybrid-lb)")


def hf_config(engine_client):
    return engine_client.model_config.hf_config


def max_lora_rank(engine_client) -> int:
    lora_config = engine_client.vllm_config.lora_config
    if lora_config is None:
        raise RuntimeError("lora-sync needs vLLM started with --enable-lora")
    return lora_config.max_lora_rank


# ---------------------------------------------------------------- worker side
# vLLM's CPU LoRA ops (lora/ops/torch_ops/lora_ops.py) pick each row's weights with
# `weights[indices]`, and a row without an adapter carries index -1, which picks the LAST
# slot: a base-model row batched with requests on the adapter in that slot (or, for the LM
# head, any base row once the slot is filled) gets that adapter's delta. The sgmv ops call
# the bgmv ones by their module's names, and the CPU Punica wrapper imported the bgmv ones.
UNMASKED_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def mask_unadapted_rows() -> None:
    """Makes every CPU LoRA op add nothing to a row without an adapter (index < 0): its input
    row is zeroed before the op (shrink then writes zeros, expand adds zeros), which is what
    the GPU kernels do by skipping the row. Idempotent; run in every worker before its first
    forward pass (worker_extensions.vllm imports it)."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    for name in UNMASKED_OPS:
        op = getattr(lora_ops, name)
        if getattr(op, "lora_sync_masked", False):
            continue
        masked = _on_adapted_rows(op)
        for module in (lora_ops, torch_ops, punica_cpu):
            setattr(module, name, masked)


def _on_adapted_rows(op):
    def op_on_adapted_rows(inputs, weights, output, indices, *args, **kwargs):
        # Branch-free (no data-dependent `if`), so it traces like the op it wraps.
        unadapted = (indices < 0).view(-1, *([1] * (inputs.dim() - 1)))
        return op(inputs.masked_fill(unadapted, 0), weights, output, indices, *args, **kwargs)
    op_on_adapted_rows.lora_sync_masked = True
    op_on_adapted_rows.__wrapped__ = op
    return op_on_adapted_rows


def worker_lora_manager(worker):
    manager = worker.model_runner.lora_manager
    if manager is None:
        raise RuntimeError("this vLLM worker has no LoRA manager (start with --enable-lora)")
    return manager


def worker_rank(worker, data_parallel_size: int = 1) -> tuple[int, int]:
    """(rank, world size) of this worker among every worker of the server: each
    data-parallel engine is its own instance (its world_size is one replica's), so the
    engine's data_parallel_index places its workers."""
    pc = worker.vllm_config.parallel_config
    return (pc.data_parallel_index * pc.world_size + worker.rank,
            data_parallel_size * pc.world_size)


# Set by tests/vllm_moe_standin (test-only) on TritonExperts once its apply runs on torch.
MOE_STANDIN_ATTR = "_lora_sync_torch_standin"


def lora_path_blocker(worker) -> str | None:
    """Why a forward pass of this worker's LoRA-enabled model cannot run on this platform
    (one line, for the operator and every refused push), or None when it can. Read once, from
    the LoRA layers vLLM built. Never raises: a probe that fails says so as its reason.

    vLLM 0.32/0.33 run the experts of every MoE layer of a LoRA-enabled model with Triton
    (fused_moe/oracle/unquantized.py `select_unquantized_moe_backend`: is_lora_enabled picks
    TRITON, no platform check), and TritonExperts.apply feeds the LoRA context, set for base
    requests too, to the Punica wrapper's MoE kernels (add_lora_w13/_w2, which the CPU
    wrapper lacks). Without Triton, the first request of any kind kills EngineCore."""
    try:
        return _moe_blocker(list(worker_lora_manager(worker)._adapter_manager.modules.values()))
    except Exception as e:  # noqa: BLE001 - the probe's own failure is the answer
        return (f"lora-sync could not check that this model's LoRA forward path runs on this "
                f"vLLM build ({type(e).__name__}: {str(e)[:200]})")


def _moe_blocker(modules: list) -> str | None:
    from vllm.lora.layers import FusedMoEWithLoRA
    moe = [m for m in modules if isinstance(m, FusedMoEWithLoRA)]
    if not moe:
        return None
    import vllm
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.triton_utils import HAS_TRITON
    for layer in moe:
        experts = type(layer._moe_kernel.fused_experts)
        if getattr(experts, MOE_STANDIN_ATTR, False):
            continue  # the experts' apply runs on torch, LoRA deltas included
        if issubclass(experts, TritonExperts) and not HAS_TRITON:
            return (f"vLLM {vllm.__version__} runs the MoE experts of a LoRA-enabled model "
                    f"with Triton kernels ({experts.__name__}), and Triton is not available "
                    "on this build: every request on this server fails (the first forward "
                    "pass kills the engine), base model included")
        punica = type(layer.punica_wrapper)
        missing = [m for m in ("add_lora_w13", "add_lora_w2")
                   if getattr(punica, m, None) is getattr(PunicaWrapperBase, m)]
        if missing:
            return (f"vLLM {vllm.__version__}'s {punica.__name__} does not implement the MoE "
                    f"LoRA kernels ({', '.join(missing)}) that {experts.__name__} calls on "
                    "every forward pass of a LoRA-enabled MoE model: every request on this "
                    "server fails, base model included")
    return None


def build_lora_model(manager, lora_int_id: int, tensors: dict, config: dict):
    """vLLM's own LoRAModel from in-memory PEFT tensors, with the same checks and name
    mapping as its disk loader (`LRUCacheWorkerLoRAManager._load_adapter`)."""
    from vllm.lora.peft_helper import PEFTHelper
    peft_helper = PEFTHelper.from_dict(
        dict(config, vllm_max_position_embeddings=manager.max_position_embeddings))
    peft_helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_int_id, tensors=tensors, peft_helper=peft_helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    for check in release()["lora_checks"]:
        getattr(manager._adapter_manager, check)(lora)
    return lora


def fold_scaling(lora, take_buffer=None) -> list:
    """vLLM's `LoRALayerWeights.optimize` (lora_B *= scaling, then scaling 1), done at
    intake: in place, or with `take_buffer(dtype, numel)` into a buffer of ours when the
    tensors view read-only memory (a mapped shm lease). vLLM's own optimize at registration
    is then a no-op, so it never writes the tensors. Returns the buffers taken."""
    layers = [w for w in lora.loras.values()
              if w.lora_b is not None and isinstance(w.scaling, (int, float)) and w.scaling != 1]
    if take_buffer is None:
        for w in layers:
            w.optimize()
        return []
    taken = []
    for dtype in {w.lora_b.dtype for w in layers}:
        mine = [w for w in layers if w.lora_b.dtype == dtype]
        flat = take_buffer(dtype, sum(w.lora_b.numel() for w in mine))
        offset = 0
        for w in mine:
            out = flat[offset:offset + w.lora_b.numel()].view(w.lora_b.shape)
            torch.mul(w.lora_b, w.scaling, out=out)  # the same product optimize() makes
            w.lora_b, w.scaling = out, 1
            offset += out.numel()
        taken.append(flat)
    return taken


def plain_slot_layers() -> tuple:
    """Layers whose set_lora, at tensor-parallel size 1, only zeroes the adapter's slot and
    copies each slice's lora_A and lora_B into its top-left corner (no slicing, no reshaping).
    vLLM writes that slot twice (zeros, then the copy), after a pass that scales lora_B in
    place; for our adapters the slot writer writes each byte once, lora_B scaled on the way."""
    from vllm.lora.layers import (ColumnParallelLinearWithLoRA,
                                  MergedColumnParallelLinearWithLoRA,
                                  MergedQKVParallelLinearWithLoRA, QKVParallelLinearWithLoRA,
                                  ReplicatedLinearWithLoRA, RowParallelLinearWithLoRA)
    return (ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA, ReplicatedLinearWithLoRA,
            QKVParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA,
            MergedQKVParallelLinearWithLoRA)


# Set on each lora_B tensor of an adapter lora-sync built (defer_scaling): its scaling, still
# to apply. It marks our adapters for the slot writer; vLLM's own keep its set_lora.
_SCALE_ATTR = "_lora_sync_scale"


def install_slot_writer(manager) -> frozenset:
    """Gives each plain LoRA layer on the CPU the one-pass slot write for our adapters
    (a GPU would need the copy and the scaling as two device steps: untested, so not
    there); returns the names of the layers that have it."""
    plain = plain_slot_layers()
    layers = {name: m for name, m in manager._adapter_manager.modules.items()
              if type(m) in plain and m.tp_size == 1 and torch.device(m.device).type == "cpu"}
    for module in layers.values():
        if not isinstance(module.__dict__.get("set_lora"), partial):
            module.set_lora = partial(_write_slot, module, module.set_lora)
    return frozenset(layers)


def defer_scaling(manager, lora, slot_layers: frozenset) -> bool:
    """Marks an adapter for the slot writer, when each of its weights lands in a layer of
    `slot_layers` (vLLM packs q/k/v and gate/up into one layer): each lora_B keeps its
    values and carries its scaling to the slot, and vLLM's optimize() finds scaling 1, so it
    never writes the tensors (they may view a read-only mapping). False, with nothing
    changed, when a weight lands elsewhere."""
    packed_into = {sub: name for name, subs in manager._adapter_manager.packed_modules.items()
                   for sub in subs}
    if not all(packed_into.get(name, name) in slot_layers for name in lora.loras):
        return False
    for w in lora.loras.values():
        if w.lora_b is not None and isinstance(w.scaling, (int, float)):
            setattr(w.lora_b, _SCALE_ATTR, float(w.scaling))
            w.scaling = 1
    return True


def _write_slot(layer, vllm_set_lora, index: int, lora_a, lora_b) -> None:
    """vLLM's set_lora for a plain layer (slot zeroed, then each slice's A and B copied into
    its corner), for an adapter marked by defer_scaling: each byte written once, B scaled on
    the way. Any other adapter, or a packed group vLLM must first expand, goes to vLLM's."""
    a_list = lora_a if isinstance(lora_a, list) else [lora_a]
    b_list = lora_b if isinstance(lora_b, list) else [lora_b]
    if not is_slot_written(b_list):
        return vllm_set_lora(index, lora_a, lora_b)
    scales = [1.0 if b is None else getattr(b, _SCALE_ATTR) for b in b_list]
    if len(b_list) != layer.n_slices:
        scaled = [None if b is None else b * s for b, s in zip(b_list, scales)]
        return vllm_set_lora(index, lora_a, scaled if isinstance(lora_b, list) else scaled[0])
    for i, (a, b, scale) in enumerate(zip(a_list, b_list, scales)):
        _write_corner(layer.lora_a_stacked[i][index, 0], a, 1.0)
        _write_corner(layer.lora_b_stacked[i][index, 0], b, scale)


def is_slot_written(lora_b: list) -> bool:
    """Whether these lora_B tensors (one layer's slices, or an adapter's: a packed layer's
    come as a list) were marked by defer_scaling: every one present carries its scaling."""
    present = [t for b in lora_b for t in (b if isinstance(b, list) else [b]) if t is not None]
    return bool(present) and all(hasattr(b, _SCALE_ATTR) for b in present)


def _write_corner(slot: torch.Tensor, src, scale: float) -> None:
    """slot := src * scale in its top-left corner, zeros elsewhere. Each torch call costs
    microseconds and a rank-64 adapter has hundreds of tensors: no call for an empty part."""
    if src is None:
        slot.zero_()
        return
    rows, cols = src.shape
    narrower = cols < slot.shape[1]
    if narrower:  # a rank below the slot's: one zeroing sweep beats a short tail per row
        slot.zero_()
    corner = slot[:rows, :cols] if narrower or rows < slot.shape[0] else slot
    if scale == 1:
        corner.copy_(src)
    else:
        torch.mul(src, scale, out=corner)  # the product vLLM's optimize() makes
    if not narrower and rows < slot.shape[0]:
        slot[rows:].zero_()


def install_memory_loader(manager, lookup) -> None:
    """Routes vLLM's adapter loader to `lookup(lora_int_id) -> LoRAModel | None` first, so
    adapters that live in memory are (re)built from memory, also after LRU eviction."""
    if getattr(manager, "_lora_sync_lookup", None) is not None:
        return
    disk_loader = manager._load_adapter

    def load_adapter(lora_request):
        lora = lookup(lora_request.lora_int_id)
        if lora is not None:
            return lora
        if str(lora_request.lora_path).startswith(LORA_PATH_SCHEME):
            raise RuntimeError(f"lora-sync adapter {lora_request.lora_name} was freed while a "
                               "request still used it")
        return disk_loader(lora_request)

    manager._lora_sync_lookup = lookup
    manager._load_adapter = load_adapter


def remove_worker_adapter(manager, lora_int_id: int) -> None:
    manager.remove_adapter(lora_int_id)
