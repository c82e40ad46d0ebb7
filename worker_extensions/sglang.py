"""lora-sync inside an SGLang scheduler process (one per TP rank), where the model runner and
its LoRA manager live. Requests arrive as `LoRASyncReq` messages and run on the scheduler
thread between forward steps; a broadcast is received on a background thread."""
from __future__ import annotations

from sglang_ext import engine_api

from .receiver import WorkerState, engine_refusal, reply


class SchedulerExtension:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.state = WorkerState()

    def handle(self, op: str, args: dict) -> dict:
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            return {"ok": False, "status": 400, "code": "bad_request",
                    "message": f"unknown lora-sync operation {op!r}"}
        return fn(**args)

    def _keep(self, adapter_id: int, stored) -> dict:
        # Held until `op_register` hands it to SGLang on the scheduler thread.
        self.state.adapters[adapter_id] = stored
        return {"bytes": stored.nbytes}

    def op_info(self) -> dict:
        rank, world = engine_api.scheduler_rank(self.scheduler)
        return {"ok": True, "rank": rank, "world_size": world,
                "cached_ids": engine_api.loaded_ids(self.scheduler),
                "held_ids": sorted(self.state.adapters), "groups": self.state.group_names()}

    def op_take_staged(self, adapter_id: int, path: str, config: dict, checksum=None) -> dict:
        _, world = engine_api.scheduler_rank(self.scheduler)
        return reply(lambda: self._keep(adapter_id, self.state.take_staged(
            path, config, checksum, only_reader=world == 1)))

    def op_receive(self, adapter_id: int, group_name: str, specs: list, config: dict,
                   bucket_bytes: int, checksum, notice_paths: list) -> dict:
        rank, _ = engine_api.scheduler_rank(self.scheduler)
        self.state.receive_in_background(group_name, notice_paths[rank],
                                         lambda s: self._keep(adapter_id, s),
                                         specs, config, bucket_bytes, checksum)
        return {"ok": True}

    def op_register(self, adapter_id: int) -> dict:
        def register():
            stored = self.state.adapters[adapter_id]
            engine_refusal(engine_api.load_adapter, self.scheduler,
                           engine_api.lora_id_of(adapter_id), stored.tensors, stored.config)
        return reply(register)

    def op_free(self, adapter_ids: list) -> dict:
        for i in adapter_ids:
            engine_api.unload_adapter(self.scheduler, engine_api.lora_id_of(i))
            self.state.free(i)
        return {"ok": True, "held": len(self.state.adapters)}

    def op_init_group(self, group_name: str, host: str, port: int, rank_offset: int,
                      world_size: int, backend: str, timeout_s: float,
                      notice_paths: list) -> dict:
        """Starts joining the trainer's group off the scheduler thread (see receiver)."""
        rank, _ = engine_api.scheduler_rank(self.scheduler)
        return reply(self.state.init_group_in_background, group_name, notice_paths[rank],
                     host, port, rank_offset + rank, world_size, backend, timeout_s)

    def op_destroy_group(self, group_name: str) -> dict:
        return {"ok": True, "existed": self.state.destroy_group(group_name)}
