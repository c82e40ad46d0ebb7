"""The vLLM worker extension (`--worker-extension-cls worker_extensions.vllm.LoRASyncWorkerExtension`).

vLLM adds this class to its worker's bases; the API process calls its one method through
`collective_rpc`. Everything else is the shared dispatcher; vLLM supplies `VLLMWorkerEngine`."""
from __future__ import annotations

import time

from vllm_ext import engine_api

from .dispatcher import LoRASyncWorker, WorkerEngine
from .receiver import StoredAdapter

# vLLM imports this module in each worker before the model's first forward pass: a row
# without an adapter must never get the last slot's (engine_api.mask_unadapted_rows).
engine_api.mask_unadapted_rows()


class VLLMWorkerEngine(WorkerEngine):
    # build leaves lora_B's scaling to our slot writer, or folds it itself (out of place when
    # read-only), so vLLM's own optimize() never writes; its other steps only read the tensors.
    maps_read_only = True
    freezes_heap = True  # vLLM froze it at start-up already: full_gc leaves it so

    def __init__(self, vllm_worker):
        self.worker = vllm_worker
        self.data_parallel_size = 1  # set by each call (the API process knows it)
        self.manager = engine_api.worker_lora_manager(vllm_worker)
        # vLLM (re)loads an adapter through its loader: ours answers from memory.
        self.built: dict[int, object] = {}
        engine_api.install_memory_loader(self.manager, self.built.get)
        # Activation writes our adapters' slots in one pass, lora_B scaled on the way.
        self.slot_layers = engine_api.install_slot_writer(self.manager)
        # Whether the model's LoRA forward runs on this platform at all (MoE on a CPU build
        # without Triton does not): read once, the model's layers do not change.
        self.unsupported = engine_api.lora_path_blocker(vllm_worker)

    def rank(self):
        return engine_api.worker_rank(self.worker, self.data_parallel_size)

    def build(self, adapter_id: int, stored: StoredAdapter, take_buffer):
        # The built LoRAModel is what vLLM gets on every (re)load: merging it again after an
        # LRU eviction is a no-op (already packed, scaling 1), so no copy is kept or rebuilt.
        t0 = time.perf_counter()
        model = engine_api.build_lora_model(self.manager, adapter_id, stored.tensors,
                                            stored.config)
        stored.engine_build_ms = (time.perf_counter() - t0) * 1e3
        if not engine_api.defer_scaling(self.manager, model, self.slot_layers):
            stored.buffers += engine_api.fold_scaling(
                model, take_buffer if stored.read_only else None)
        self.built[adapter_id] = model
        return model

    def facts(self) -> dict:
        return {"slot_layers": len(self.slot_layers),
                "slot_written": sorted(i for i, model in self.built.items()
                                       if engine_api.is_slot_written(
                                           [w.lora_b for w in model.loras.values()]))}

    def model_unsupported(self) -> str | None:
        return self.unsupported

    def unload(self, adapter_id: int) -> None:
        engine_api.remove_worker_adapter(self.manager, adapter_id)
        self.built.pop(adapter_id, None)

    def cached_ids(self):
        return list(self.manager.list_adapters())


class LoRASyncWorkerExtension:
    def lora_sync_call(self, op: str, args: dict, data_parallel_size: int = 1) -> dict:
        # vLLM gives extensions no init hook: set up on first use.
        worker = self.__dict__.get("_lora_sync")
        if worker is None:
            worker = self.__dict__["_lora_sync"] = LoRASyncWorker(VLLMWorkerEngine(self))
        worker.engine.data_parallel_size = data_parallel_size
        return worker.call(op, args)
