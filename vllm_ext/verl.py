"""verl's rollout server with lora-sync: the server half of lora_sync.integrations.verl.

verl 0.9.1 runs each rollout server as a Ray actor of its `vLLMHttpServer`, which builds vLLM
itself and serves every rollout under one fixed LoRA, "123" (`max_loras=1`), reloaded each
step. `LoRASyncHttpServer` is that class with lora-sync mounted through vLLM's plugin hooks
(vllm_ext/mount.py) and verl's own code otherwise untouched:

- the worker extension is verl's composed with ours (`_get_worker_extension_cls`);
- verl's `build_app` / `init_app_state` calls mount lora-sync's routes and start its service
  (`VLLM_PLUGINS` names lora_sync in the actor's process before vLLM is built);
- each `generate` asks lora-sync for the version `LORA_SYNC_VERL_ADAPTER` (default "policy")
  serves now and runs verl's generate on it in place of "123", counted in flight until it
  returns; the TokenOutput says which version served it (`extra_fields["lora_sync_version"]`).
  Before the trainer's first push the name is unknown and generate raises lora-sync's 404:
  never the base model under the adapter's name.

`register()` adds the replica kind "lora_sync" to verl's `RolloutReplicaRegistry`
(`actor_rollout_ref.rollout.name=lora_sync`); docs/integrations.md has the whole recipe."""
from __future__ import annotations

import contextvars
import os

from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.vllm_rollout import vllm_async_server as verl_vllm
from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID

from .mount import service_for, worker_extension

ADAPTER_ENV = "LORA_SYNC_VERL_ADAPTER"
REPLICA_NAME = "lora_sync"
# Two versions in a batch at once: the requests of the version just pushed start while the
# previous one's finish (verl's one slot would serialise them).
MIN_MAX_LORAS = 2

_serving: contextvars.ContextVar = contextvars.ContextVar("lora_sync_verl_serving", default=None)


class _VersionedEngine:
    """verl's engine as its `generate` sees it while a version is being served: verl's fixed
    LoRA ("123") is loaded, and a request for it is the version's own engine request."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def list_loras(self) -> set[int]:
        ids = set(await self._engine.list_loras())
        return ids | {VLLM_LORA_INT_ID} if _serving.get() is not None else ids

    def generate(self, *args, lora_request=None, **kwargs):
        version = _serving.get()
        if version is not None and lora_request is not None:
            lora_request = version.handle
        return self._engine.generate(*args, lora_request=lora_request, **kwargs)


class LoRASyncHttpServer(verl_vllm.vLLMHttpServer):
    """verl's vLLMHttpServer serving lora-sync's versions instead of its fixed "123"."""

    def __init__(self, *args, **kwargs):
        # vLLM loads endpoint plugins only when VLLM_PLUGINS names them, and reads it when
        # verl builds the app: this process is the actor's own.
        named = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
        if "lora_sync" not in named:
            os.environ["VLLM_PLUGINS"] = ",".join([*named, "lora_sync"])
        super().__init__(*args, **kwargs)
        self.lora_sync_adapter = os.environ.get(ADAPTER_ENV, "policy")

    def _get_worker_extension_cls(self) -> str:
        return worker_extension(super()._get_worker_extension_cls())

    async def run_server(self, args):
        if getattr(args, "enable_lora", False):
            args.max_loras = max(args.max_loras or 1, MIN_MAX_LORAS)
        await super().run_server(args)
        self.lora_sync = service_for(self.engine)
        self.engine = _VersionedEngine(self.engine)

    async def generate(self, *args, **kwargs):
        if not self.lora_as_adapter:
            return await super().generate(*args, **kwargs)
        async with self.lora_sync.using(self.lora_sync_adapter) as version:
            token = _serving.set(version)
            try:
                output = await super().generate(*args, **kwargs)
            finally:
                _serving.reset(token)
        output.extra_fields["lora_sync_version"] = version.served_name
        return output


class LoRASyncReplica(verl_vllm.vLLMReplica):
    """verl's vLLM replica whose server actors are LoRASyncHttpServer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import ray
        self.server_class = ray.remote(LoRASyncHttpServer)


def register() -> None:
    """`actor_rollout_ref.rollout.name=lora_sync` then builds LoRASyncReplica."""
    RolloutReplicaRegistry.register(REPLICA_NAME, lambda: LoRASyncReplica)
