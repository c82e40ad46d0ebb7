"""lora-sync inside an SGLang scheduler process (one per TP rank), where the model runner and
its LoRA manager live. Requests arrive as `LoRASyncReq` messages and run on the scheduler
thread between forward steps (a broadcast is received on a background thread); the shared
dispatcher handles them, SGLang supplies `SGLangWorkerEngine`."""
from __future__ import annotations

from sglang_ext import engine_api

from .dispatcher import LoRASyncWorker, WorkerEngine
from .receiver import StoredAdapter


class SGLangWorkerEngine(WorkerEngine):
    # SGLang only reads the tensors it is given: it concatenates q/k/v and gate/up lora_A into
    # new tensors (lora_B comes stacked, a view: engine_api.stack_in_place), copies the rest
    # into its memory pool and applies the scaling there, out of place
    # (sglang/srt/lora/lora.py, mem_pool.py in 0.5.23).
    maps_read_only = True
    freezes_heap = True  # SGLang does not freeze its own (only on a FreezeGCReq)
    # Its memory pool takes an adapter's weights at the first batch that uses it
    # (mem_pool.py load_lora_weight_to_buffer).
    reads_at_first_use = True

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.lora_ids: dict[int, str] = {}  # adapter id -> SGLang's id (the API's identity)

    def rank(self):
        return engine_api.scheduler_rank(self.scheduler)

    def build(self, adapter_id: int, stored: StoredAdapter, take_buffer):
        return None  # SGLang builds when it registers, on the scheduler thread

    def register(self, adapter_id: int, stored: StoredAdapter, lora_id: str) -> None:
        self.lora_ids[adapter_id] = lora_id  # before the load: a half-made one is unloaded
        engine_api.load_adapter(self.scheduler, lora_id, engine_api.stack_in_place(stored.tensors),
                                stored.config)

    def unload(self, adapter_id: int) -> None:
        lora_id = self.lora_ids.pop(adapter_id, None)
        if lora_id is not None:
            engine_api.unload_adapter(self.scheduler, lora_id)

    def cached_ids(self):
        return engine_api.loaded_ids(self.scheduler)


def install(scheduler) -> None:
    """Run by the plugin in every scheduler process: our requests go to the dispatcher."""
    engine_api.add_scheduler_handler(scheduler,
                                     LoRASyncWorker(SGLangWorkerEngine(scheduler)).call)
