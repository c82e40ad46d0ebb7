"""The shared service's view of an SGLang server (HTTP process).

Two counts of requests on an adapter, on purpose. lora-sync's own (AdapterRecord.inflight)
counts every request admission let through, from its first byte to the end of its response
(streaming included), the same on both engines: retire, listings and metrics go by it.
SGLang's registry counts requests its tokenizer manager resolved to the adapter; it cannot
replace ours (it starts later, after the body is read and tokenized, and exists on SGLang
only), so it is read for one question only, the engine-side check before the adapter's
memory goes (`in_use`), as vLLM's scheduler is on vLLM."""
from __future__ import annotations

import itertools

from lora_sync.adapter import Coverage, FusedLayer, ModelSpec
from lora_sync.messages import check_replies
from lora_sync.server.bridge import EngineBridge

from . import engine_api

# What SGLang 0.5.23's LoRA memory pool and layers serve (docs/coverage.md).
# Fused groups: sglang/srt/lora/lora.py LoRAAdapter.normalize_qkv_proj fuses one layer's
# q/k/v into qkv_proj only from its q_proj, and reads v_proj unconditionally (a missing k_proj
# becomes zeros shaped like v_proj): q without v fails the load (KeyError); k or v without q
# stay unfused, match none of the pool's buffers, and the first request on the adapter kills
# the scheduler (mem_pool.py load_lora_weight_to_buffer -> utils.get_target_module_name,
# ValueError). normalize_gate_up_proj likewise fuses from gate_proj (a missing up_proj becomes
# zeros); an up_proj alone kills the scheduler the same way. SGLang's own disk route goes
# through the same normalization.
# Ranks: any r up to --max-lora-rank (LoRAMemoryPool.can_support); an adapter fills the first
# r rows of its slot. dtypes: any of ours; torch.cat promotes mixed parts and
# utils.copy_weight_into_buffer casts into the pool's dtype.
# Config features: none. sglang/srt/lora/lora_config.py LoRAConfig reads r and lora_alpha
# only (not rank_pattern, alpha_pattern, use_rslora), lora.py LoRAAdapter.__init__ sets one
# scaling = lora_alpha / r for every module, and mem_pool.py load_lora_weight_to_buffer
# copies each weight into a view of rank config.r (its shape assert fails, in the scheduler,
# for a module of another rank). So an adapter is refused wherever one of them changes a
# module's rank, alpha or scaling (check_config_features); a rank_pattern that gives every
# module r, or use_rslora at r = 1, changes nothing and is served.
COVERAGE = Coverage("SGLang", (
    FusedLayer("qkv_proj", ("q_proj", "k_proj", "v_proj"), frozenset({"q_proj", "v_proj"})),
    FusedLayer("gate_up_proj", ("gate_proj", "up_proj"), frozenset({"gate_proj"}))),
    config_features=frozenset())


class SGLangBridge(EngineBridge):
    freezes_heap = True  # SGLang does not freeze its own (only on a FreezeGCReq)

    def __init__(self, tokenizer_manager):
        self.tm = tokenizer_manager
        self.channel = engine_api.SchedulerChannel(tokenizer_manager)
        self._ids = itertools.count(1)

    async def call_workers(self, op, **args):
        # Every scheduler runs the op; each data-parallel replica's TP rank 0 replies.
        return check_replies(await self.channel.call(op, **args))

    async def worker_count(self) -> int:
        return engine_api.dp_size(self.tm) * engine_api.tp_size(self.tm)

    async def worker_status(self) -> list[dict]:
        tp = engine_api.tp_size(self.tm)  # each replica's TP rank 0 speaks for its group
        return [r.data for r in await self.call_workers("info") for _ in range(tp)]

    async def model_spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(engine_api.hf_config(self.tm),
                                        engine_api.max_lora_rank(self.tm), coverage=COVERAGE)

    def lora_id(self, adapter_id: int) -> str:
        """SGLang keys adapters, and its radix cache, by string ids."""
        return engine_api.LORA_ID_PREFIX + self.identity(adapter_id)

    def engine_names(self) -> set[str]:
        return engine_api.engine_names(self.tm)

    def new_adapter_id(self) -> int:
        return next(self._ids)

    async def activate(self, served_name, adapter_id):
        await self.call_workers("register", adapter_id=adapter_id,
                                lora_id=self.lora_id(adapter_id))
        await engine_api.register_name(self.tm, served_name, self.lora_id(adapter_id))
        return adapter_id

    def publish(self, served_name, handle):
        pass  # the version is registered by `activate`; the alias lives in admission

    async def unpublish(self, served_name):
        await engine_api.unregister_name(self.tm, served_name)

    async def in_use(self, adapter_id):
        return engine_api.adapter_in_use(self.tm, self.lora_id(adapter_id))

    async def free(self, adapter_ids):
        await self.call_workers("free", adapter_ids=list(adapter_ids))
        for i in adapter_ids:
            engine_api.forget_usage(self.tm, self.lora_id(i))
