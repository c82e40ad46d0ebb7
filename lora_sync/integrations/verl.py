"""verl 0.9.1: a checkpoint-engine backend that syncs the LoRA adapter, never the base.

    actor_rollout_ref.rollout.checkpoint_engine.backend=lora_sync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=lora_sync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.lora_sync.servers=[http://h:8000]
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.lora_sync.name=policy

At each of verl's weight updates the actor's ranks hand the backend their weights; rank 0
pushes the adapter to every server as `<name>-v<global step>` (the alias `<name>` moves to
it), by lora-sync's transports, and nothing is aborted: rollouts in flight finish on the
version they started with. verl's rollout side receives nothing through verl.

verl 0.9.1's disaggregated update asks the actor's engine for its weights with no arguments,
which on a LoRA model yields the frozen base and no LoRA tensor (verl#7495): rollouts would
keep the initial policy. With this backend in the actor's process, that one call (the only
argument-less one: engine_workers.py, `update_weights`) yields the adapter and its PEFT
config instead (`adapter_on_sync`). A stream that still carries no LoRA tensor is refused,
naming the cause, never pushed as nothing."""
from __future__ import annotations

import asyncio
import time

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from ..adapter import LoRAAdapter
from ..trainer.client import LoRASyncClient

BACKEND = "lora_sync"


class AdapterStream:
    """The actor engine's weights for a sync, with the PEFT config they go with."""

    def __init__(self, params, peft_config):
        self.params, self.peft_config = params, peft_config

    def __iter__(self):
        return iter(self.params)


def adapter_on_sync(engine_cls) -> None:
    """`engine_cls.get_per_tensor_param()` asked with no arguments (verl's disaggregated
    update) gives the adapter (base_sync_done=True) as an AdapterStream; any other call is
    verl's own. Idempotent."""
    get = engine_cls.get_per_tensor_param
    if getattr(get, "lora_sync", False):
        return

    def get_per_tensor_param(self, *args, **kwargs):
        if args or kwargs:
            return get(self, *args, **kwargs)
        params, peft_config = get(self, base_sync_done=True)
        return AdapterStream(params, peft_config), peft_config
    get_per_tensor_param.lora_sync = True
    engine_cls.get_per_tensor_param = get_per_tensor_param


def _actor_engines() -> list[type]:
    """verl's actor engine classes that train LoRA and export it for a sync."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
    return [FSDPEngine]


@CheckpointEngineRegistry.register(BACKEND)
class LoRASyncCheckpointEngine(CheckpointEngine):
    """`servers`: the rollout servers' URLs (lora-sync mounted: docs/integrations.md);
    `name`: the adapter's name there; `api_key`, `engine`, `timeout`: as LoRASyncClient's;
    `transport`: as `push`'s. verl builds one per actor rank (`is_master`: rank 0, which
    pushes) and one per rollout worker (no `is_master`). `engine_classes`: the actor engines
    whose sync export gives the adapter (default: verl's FSDP engine)."""

    def __init__(self, bucket_size: int = 0, is_master: bool | None = None, *, servers=(),
                 name: str = "policy", api_key: str | None = None, engine: str = "vllm",
                 transport: str = "auto", timeout: float = 300.0, engine_classes=None):
        self.bucket_size, self.is_master = bucket_size, is_master
        self.name, self.transport = name, transport
        self._client_args = dict(servers=list(servers), api_key=api_key, engine=engine,
                                 timeout=timeout)
        self._client: LoRASyncClient | None = None
        if is_master is not None:  # the actor's side: its engine gives the adapter
            for cls in _actor_engines() if engine_classes is None else engine_classes:
                adapter_on_sync(cls)
        if is_master and not servers:
            raise ValueError("the lora_sync checkpoint engine needs engine_kwargs.lora_sync."
                             "servers: the rollout servers' URLs")

    # verl's process group set-up: lora-sync reaches the servers itself, there is none
    def prepare(self) -> dict:
        return {}

    @classmethod
    def build_topology(cls, actor_world_size: int, rollout_world_size: int, metadata: list):
        return {}, {}

    def init_process_group(self, **kwargs) -> None:
        pass

    def finalize(self) -> None:
        pass

    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        """Every rank drains the stream (FSDP gathers each tensor with all ranks); rank 0
        pushes the LoRA tensors under version `global_steps` (the client numbers it when
        verl gives none). Returns verl's metrics for the step."""
        tensors = {k: v for k, v in weights if ".lora_A." in k or ".lora_B." in k}
        if not self.is_master:
            return {}
        config = getattr(weights, "peft_config", None)
        if not tensors or config is None:
            raise RuntimeError(
                "verl handed the lora_sync checkpoint engine no LoRA adapter (no lora_A/lora_B "
                "tensor, or no PEFT config): its disaggregated update exports the frozen base "
                "of a LoRA model (verl#7495), which lora-sync never pushes. Train with a PEFT "
                "LoRA model on an engine adapter_on_sync covers "
                f"({', '.join(c.__name__ for c in _actor_engines())}).")
        adapter = LoRAAdapter(tensors, config.to_dict() if hasattr(config, "to_dict")
                              else dict(config))
        if self._client is None:
            self._client = LoRASyncClient(**self._client_args)
        t0 = time.perf_counter()
        results = await asyncio.to_thread(self._client.push, adapter, self.name,
                                          version=global_steps or None,
                                          transport=self.transport)
        return {"lora_sync/push_s": time.perf_counter() - t0,
                "lora_sync/version": results[0].version,
                "lora_sync/bytes": adapter.nbytes}

    async def receive_weights(self, global_steps: int | None = None):
        """Nothing comes through verl: the servers already serve the new version."""
        return
        yield  # an async generator, as verl iterates it
