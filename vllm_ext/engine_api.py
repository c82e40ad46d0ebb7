"""Every touch of vLLM's private API, in one place, for the pinned version.

API-process side: the serving layer's name -> LoRARequest table and the engine client.
Worker side: the LoRA manager, LoRAModel construction and the in-memory adapter loader.
"""
from __future__ import annotations

from lora_sync.server.pins import require_tested

TESTED_VLLM = "0.32.0"
LORA_PATH_SCHEME = "lora-sync://"  # marks our adapters' paths: never read from disk


def check_version() -> str:
    import vllm
    return require_tested("vLLM", vllm.__version__, TESTED_VLLM)


# ---------------------------------------------------------------- API-process side
def lora_request(served_name: str, lora_int_id: int):
    from vllm.lora.request import LoRARequest
    # The path is never read for our adapters; it must be non-empty and unique per version
    # because vLLM's prefix-cache keys include it.
    return LoRARequest(lora_name=served_name, lora_int_id=lora_int_id,
                       lora_path=f"{LORA_PATH_SCHEME}{served_name}")


# The engine's own routes that load or unload adapters by name (SageMaker's come with
# VLLM_ALLOW_RUNTIME_LORA_UPDATING through model_hosting_container_standards).
NATIVE_ADAPTER_ROUTES = (("POST", "/v1/load_lora_adapter", "lora_name"),
                         ("POST", "/v1/unload_lora_adapter", "lora_name"),
                         ("POST", "/adapters", "name"), ("DELETE", "/adapters/", None))
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


def publish(app_state, names: list[str], request) -> None:
    """Makes `request` answer to every name in `names` (the version and the alias)."""
    table = serving_models(app_state).lora_requests
    for n in names:
        table[n] = request


def unpublish(app_state, names: list[str]) -> None:
    table = serving_models(app_state).lora_requests
    for n in names:
        table.pop(n, None)



async def add_lora(engine_client, request) -> None:
    await engine_client.add_lora(request)



async def worker_rpc(engine_client, method: str, *args, timeout: float | None = None) -> list:
    """Calls a worker-extension method on every worker; returns one result per worker."""
    return await engine_client.collective_rpc(method, timeout=timeout, args=args)


def hf_config(engine_client):
    return engine_client.model_config.hf_config


def max_lora_rank(engine_client) -> int:
    lora_config = engine_client.vllm_config.lora_config
    if lora_config is None:
        raise RuntimeError("lora-sync needs vLLM started with --enable-lora")
    return lora_config.max_lora_rank


# ---------------------------------------------------------------- worker side
def worker_lora_manager(worker):
    manager = worker.model_runner.lora_manager
    if manager is None:
        raise RuntimeError("this vLLM worker has no LoRA manager (start with --enable-lora)")
    return manager


def worker_rank(worker) -> tuple[int, int]:
    """(rank, world size) of this worker inside its vLLM instance."""
    pc = worker.vllm_config.parallel_config
    return worker.rank, pc.world_size


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
    manager._adapter_manager._validate_modules_to_save(lora)
    return lora


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
