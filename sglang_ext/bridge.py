"""The shared service's view of an SGLang server (HTTP process)."""
from __future__ import annotations

import itertools

from lora_sync.adapter import ModelSpec
from lora_sync.server.bridge import EngineBridge
from lora_sync.server.service import check_worker_replies
from lora_sync.staging import notice_paths, wait_notices

from . import engine_api


class SGLangBridge(EngineBridge):
    def __init__(self, tokenizer_manager):
        self.tm = tokenizer_manager
        self.channel = engine_api.SchedulerChannel(tokenizer_manager)
        self._ids = itertools.count(1)

    async def _call(self, op: str, **args) -> list[dict]:
        return check_worker_replies([await self.channel.call(op, **args)])

    async def model_spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(engine_api.hf_config(self.tm),
                                        engine_api.max_lora_rank(self.tm))

    def new_adapter_id(self) -> int:
        return next(self._ids)

    async def take_staged(self, adapter_id, path, config, checksum):
        return await self._call("take_staged", adapter_id=adapter_id, path=path, config=config,
                                checksum=checksum)

    async def receive(self, adapter_id, group_name, specs, config, bucket_bytes, checksum,
                      timeout_s):
        notices = notice_paths(engine_api.tp_size(self.tm))
        await self._call("receive", adapter_id=adapter_id, group_name=group_name, specs=specs,
                         config=config, bucket_bytes=bucket_bytes, checksum=checksum,
                         notice_paths=notices)
        return check_worker_replies(await wait_notices(notices, timeout_s))

    async def activate(self, served_name, adapter_id):
        await self._call("register", adapter_id=adapter_id)
        await engine_api.register_name(self.tm, served_name, engine_api.lora_id_of(adapter_id))
        return adapter_id

    def publish(self, names, handle):
        pass  # the version is registered by `activate`; the alias lives in admission

    async def unpublish(self, names):
        for name in names:
            await engine_api.unregister_name(self.tm, name)

    async def in_use(self, adapter_id, served_name):
        return engine_api.adapter_in_use(self.tm, engine_api.lora_id_of(adapter_id))

    async def free(self, adapter_ids):
        await self._call("free", adapter_ids=list(adapter_ids))
        for i in adapter_ids:
            engine_api.forget_usage(self.tm, engine_api.lora_id_of(i))

    async def init_group(self, group_name, host, port, rank_offset, world_size, backend,
                         timeout_s):
        notices = notice_paths(engine_api.tp_size(self.tm))
        await self._call("init_group", group_name=group_name, host=host, port=port,
                         rank_offset=rank_offset, world_size=world_size, backend=backend,
                         timeout_s=timeout_s, notice_paths=notices)
        check_worker_replies(await wait_notices(notices, timeout_s + 2))

    async def destroy_group(self, group_name):
        await self._call("destroy_group", group_name=group_name)

    async def worker_status(self) -> list[dict]:
        [status] = await self._call("info")
        return [status] * engine_api.tp_size(self.tm)  # only TP rank 0 replies
