"""The shared service's view of a vLLM server (API process)."""
from __future__ import annotations

from lora_sync.adapter import Coverage, FusedLayer, ModelSpec
from lora_sync.messages import check_replies
from lora_sync.server.bridge import EngineBridge

from . import engine_api

RPC_TIMEOUT_S = 600.0
# The one worker-extension method (worker_extensions/vllm.py): every op goes through it.
WORKER_METHOD = "lora_sync_call"
# What vLLM 0.32's LoRA layers serve (docs/coverage.md): every subset of a fused
# group. vllm/lora/model_manager.py _create_merged_loras_inplace packs a missing part as None
# and MergedColumnParallelLinearWithLoRA.set_lora (layers/column_parallel_linear.py) zeroes
# the slot, then skips None slices. Ranks: any r up to --max-lora-rank
# (PEFTHelper.validate_legal), copied into the slot's first r rows. dtypes: any of ours,
# cast to the LoRA dtype by LoRAModel.from_lora_tensors.
# Config features: rank_pattern, alpha_pattern and use_rslora are all read
# (vllm/lora/peft_helper.py PEFTHelper.get_rank_and_scaling, matching keys as PEFT's
# get_pattern_key does; _scaling: lora_alpha/sqrt(r) under rsLoRA), per module by
# LoRALayerWeights.from_config in LoRAModel.from_lora_tensors, the builder lora-sync's worker
# calls too (engine_api.build_lora_model); each module's scaling then rides on its lora_B to
# the slot (engine_api.defer_scaling / _write_slot) or is folded in (fold_scaling). Slots are
# sized by --max-lora-rank; PEFTHelper.validate_legal counts every rank_pattern value.
COVERAGE = Coverage("vLLM", (FusedLayer("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             FusedLayer("gate_up_proj", ("gate_proj", "up_proj"))),
                    config_features=frozenset({"rank_pattern", "alpha_pattern", "use_rslora"}),
                    whole_experts=True)


class VLLMBridge(EngineBridge):
    freezes_heap = True  # vLLM froze it at start-up already: full_gc leaves it so

    def __init__(self, engine_client, app_state):
        self.engine = engine_client
        self.state = app_state
        self._workers: int | None = None

    async def call_workers(self, op, **args):
        # Workers cannot see how many data-parallel engines there are: tell them.
        return check_replies(await engine_api.worker_rpc(
            self.engine, WORKER_METHOD, op, args, engine_api.data_parallel_size(self.engine),
            timeout=RPC_TIMEOUT_S))

    async def worker_count(self) -> int:
        if self._workers is None:
            self._workers = len(await self.worker_status())
        return self._workers

    async def model_spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(engine_api.hf_config(self.engine),
                                        engine_api.max_lora_rank(self.engine), coverage=COVERAGE)

    def engine_names(self) -> set[str]:
        return engine_api.engine_names(self.state)

    def new_adapter_id(self) -> int:
        return engine_api.next_lora_id(self.state)

    async def activate(self, served_name, adapter_id):
        request = engine_api.lora_request(served_name, adapter_id, self.identity(adapter_id))
        await engine_api.add_lora(self.engine, request)
        return request

    def publish(self, served_name, handle):
        engine_api.publish(self.state, served_name, handle)

    async def unpublish(self, served_name):
        engine_api.unpublish(self.state, served_name)

    async def in_use(self, adapter_id):
        return engine_api.adapter_in_use(self.engine, adapter_id)

    async def free(self, adapter_ids):
        await self.call_workers("free", adapter_ids=list(adapter_ids))

    def engine_adapter_id(self, name):
        return engine_api.native_adapter_id(self.state, name)

    async def evict(self, adapter_id):
        await engine_api.remove_lora(self.engine, adapter_id)
