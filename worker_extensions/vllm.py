"""The vLLM worker extension (`--worker-extension-cls worker_extensions.vllm.LoRASyncWorkerExtension`).

vLLM adds this class to its worker's bases; the API process calls these methods through
`collective_rpc`. Each method returns a plain dict (see `receiver.reply`)."""
from __future__ import annotations

from vllm_ext import engine_api

from .receiver import WorkerState, engine_refusal, reply


class LoRASyncWorkerExtension:
    def _lora_sync_state(self) -> WorkerState:
        # vLLM gives extensions no init hook: set up on first use.
        state = self.__dict__.get("_lora_sync")
        if state is None:
            state = self.__dict__["_lora_sync"] = WorkerState()
            manager = engine_api.worker_lora_manager(self)
            engine_api.install_memory_loader(manager, self._lora_sync_lookup)
        return state

    def _lora_sync_lookup(self, lora_int_id: int):
        stored = self._lora_sync_state().adapters.get(lora_int_id)
        return None if stored is None else stored.built

    def _lora_sync_keep(self, lora_int_id: int, stored) -> dict:
        # Build now so a bad adapter fails here, before it is ever published. The built
        # LoRAModel is what vLLM gets on every (re)load: merging it again after an LRU
        # eviction is a no-op (already packed and scaled), so no copy is kept or rebuilt.
        stored.built = engine_refusal(
            engine_api.build_lora_model, engine_api.worker_lora_manager(self), lora_int_id,
            stored.tensors, stored.config)
        self._lora_sync_state().adapters[lora_int_id] = stored
        return {"bytes": stored.nbytes}

    def lora_sync_info(self) -> dict:
        rank, world = engine_api.worker_rank(self)
        cached = engine_api.worker_lora_manager(self).list_adapters()
        return {"ok": True, "rank": rank, "world_size": world, "cached_ids": sorted(cached),
                "held_ids": sorted(self._lora_sync_state().adapters),
                "groups": self._lora_sync_state().group_names()}

    def lora_sync_take_staged(self, path: str, lora_int_id: int, config: dict,
                        checksum: str | None = None) -> dict:
        _, world = engine_api.worker_rank(self)
        return reply(lambda: self._lora_sync_keep(lora_int_id, self._lora_sync_state(
            ).take_staged(path, config, checksum, only_reader=world == 1)))

    def lora_sync_receive(self, group_name: str, lora_int_id: int, specs: list, config: dict,
                          bucket_bytes: int, checksum: str | None, notice_paths: list) -> dict:
        """Starts receiving and returns at once; the outcome lands in this rank's notice."""
        rank, _ = engine_api.worker_rank(self)
        self._lora_sync_state().receive_in_background(
            group_name, notice_paths[rank], lambda s: self._lora_sync_keep(lora_int_id, s),
            specs, config, bucket_bytes, checksum)
        return {"ok": True}

    def lora_sync_free(self, lora_int_ids: list) -> dict:
        """Forgets adapters: the worker's LoRA cache entry and our in-memory copy."""
        state, manager = self._lora_sync_state(), engine_api.worker_lora_manager(self)
        for i in lora_int_ids:
            engine_api.remove_worker_adapter(manager, i)
            state.free(i)
        return {"ok": True, "held": len(state.adapters)}

    def lora_sync_init_group(self, group_name: str, host: str, port: int, rank_offset: int,
                             world_size: int, backend: str, timeout_s: float,
                             notice_paths: list) -> dict:
        """Starts joining the trainer's group and returns at once (see receiver)."""
        rank, _ = engine_api.worker_rank(self)
        return reply(self._lora_sync_state().init_group_in_background, group_name,
                     notice_paths[rank], host, port, rank_offset + rank, world_size, backend,
                     timeout_s)

    def lora_sync_destroy_group(self, group_name: str) -> dict:
        return {"ok": True, "existed": self._lora_sync_state().destroy_group(group_name)}
