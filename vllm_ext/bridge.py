"""The shared service's view of a vLLM server (API process)."""
from __future__ import annotations

from lora_sync.adapter import ModelSpec
from lora_sync.server.bridge import EngineBridge
from lora_sync.server.service import check_worker_replies
from lora_sync.staging import notice_paths, wait_notices

from . import engine_api

RPC_TIMEOUT_S = 600.0


class VLLMBridge(EngineBridge):
    def __init__(self, engine_client, app_state):
        self.engine = engine_client
        self.state = app_state
        self._workers: int | None = None

    async def _rpc(self, method: str, *args) -> list[dict]:
        return check_worker_replies(
            await engine_api.worker_rpc(self.engine, method, *args, timeout=RPC_TIMEOUT_S))

    async def model_spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(engine_api.hf_config(self.engine),
                                        engine_api.max_lora_rank(self.engine))

    def new_adapter_id(self) -> int:
        return engine_api.next_lora_id(self.state)

    async def take_staged(self, adapter_id, path, config, checksum):
        return await self._rpc("lora_sync_take_staged", path, adapter_id, config, checksum)

    async def receive(self, adapter_id, group_name, specs, config, bucket_bytes, checksum,
                      timeout_s):
        # The RPC only starts the transfer: the engine loop stays free while bytes arrive.
        notices = notice_paths(await self._worker_count())
        await self._rpc("lora_sync_receive", group_name, adapter_id, specs, config,
                        bucket_bytes, checksum, notices)
        return check_worker_replies(await wait_notices(notices, timeout_s))

    async def activate(self, served_name, adapter_id):
        request = engine_api.lora_request(served_name, adapter_id)
        await engine_api.add_lora(self.engine, request)
        return request

    def publish(self, names, handle):
        engine_api.publish(self.state, names, handle)

    async def unpublish(self, names):
        engine_api.unpublish(self.state, names)

    async def in_use(self, adapter_id, served_name):
        return engine_api.adapter_in_use(self.engine, adapter_id)

    async def free(self, adapter_ids):
        await self._rpc("lora_sync_free", list(adapter_ids))

    async def init_group(self, group_name, host, port, rank_offset, world_size, backend,
                         timeout_s):
        notices = notice_paths(await self._worker_count())
        await self._rpc("lora_sync_init_group", group_name, host, port, rank_offset,
                        world_size, backend, timeout_s, notices)
        check_worker_replies(await wait_notices(notices, timeout_s + 2))

    async def destroy_group(self, group_name):
        await self._rpc("lora_sync_destroy_group", group_name)

    async def worker_status(self) -> list[dict]:
        return await self._rpc("lora_sync_info")

    async def _worker_count(self) -> int:
        if self._workers is None:
            self._workers = len(await self.worker_status())
        return self._workers
