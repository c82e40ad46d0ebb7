"""SkyRL 0.3 against external servers: its FSDP policy worker pushes the LoRA adapter with
lora-sync instead of writing it to `lora_sync_path` and asking every server to load that
directory.

    from lora_sync.integrations import skyrl
    skyrl.install()   # in each worker process: LORA_SYNC_SERVERS, LORA_SYNC_API_KEY

SkyRL's workers are Ray actors, so `install` must run in their processes: Ray's
`runtime_env={"worker_process_setup_hook": "lora_sync.integrations.skyrl.install",
"env_vars": {"LORA_SYNC_SERVERS": "http://h1:8000,http://h2:8000"}}` does it.

SkyRL's generator asks for `skyrl-lora` on every request (SKYRL_LORA_ADAPTER_NAME); each
sync pushes `skyrl-lora-v<N>` and the alias follows, so the generator needs no change. As in
SkyRL's own sync, every rank collects the adapter (FSDP gathers it with all ranks), rank 0
sends it, and all ranks meet at SkyRL's barrier after. Nothing is written to disk."""
from __future__ import annotations

import asyncio
import os

from ..adapter import LoRAAdapter
from ..api import API_KEY_ENV, servers_from_env
from ..trainer.client import LoRASyncClient


def install(servers=None, *, api_key: str | None = None, engine: str = "vllm",
            transport: str = "auto", timeout: float = 300.0, worker_cls=None) -> None:
    """Makes `worker_cls` (SkyRL's FSDPPolicyWorkerBase) sync its LoRA by lora-sync.
    `servers`: the servers' URLs (default: LORA_SYNC_SERVERS); `api_key` (default:
    LORA_SYNC_API_KEY), `engine`, `timeout`: as LoRASyncClient's; `transport`: as push's."""
    import torch.distributed as dist
    from skyrl.backends.skyrl_train.distributed.fsdp_utils import collect_lora_params
    if worker_cls is None:
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
        worker_cls = FSDPPolicyWorkerBase
    servers = list(servers) if servers is not None else servers_from_env()
    if not servers:
        raise ValueError("lora_sync.integrations.skyrl needs the servers' URLs: pass servers= "
                         "or set LORA_SYNC_SERVERS")
    args = dict(engine=engine, api_key=api_key or os.environ.get(API_KEY_ENV), timeout=timeout)
    client: LoRASyncClient | None = None  # made on the rank that pushes, at its first sync

    async def _save_lora_adapters_and_sync(self, peft_model, lora_sync_path,
                                           inference_engine_client, lora_name="skyrl-lora"):
        # `lora_sync_path` and `inference_engine_client`: SkyRL's disk route, not taken
        nonlocal client
        params = collect_lora_params(module=self.model.model)
        if dist.get_rank() == 0:
            client = client or LoRASyncClient(servers, **args)
            adapter = LoRAAdapter(params, peft_model.peft_config["default"].to_dict())
            await asyncio.to_thread(client.push, adapter, lora_name, transport=transport)
        dist.barrier()

    worker_cls._save_lora_adapters_and_sync = _save_lora_adapters_and_sync
