"""lora_sync.integrations.verl against verl 0.9.1's own classes (scripts/install_rl_frameworks.sh
puts them in .venv-rl-lib, beside .venv's vLLM 0.32): its checkpoint-engine registry, the
actor worker's `update_weights` and the rollout's `CheckpointEngineWorker.update_weights`,
driven as verl's own CPU tests drive them (`Cls.__new__`, `update_weights.__wrapped__`), and
its FSDP engine's real `get_per_tensor_param` on a PEFT model (not FSDP-wrapped here).

Stand-ins, for what cannot run on CPU only: verl's CUDA memory logging and device id in its
engine module (`cpu_engine`). The rest is verl's code and lora-sync's.

The verl#7495 class: verl's disaggregated update exports a LoRA model's frozen base; with
the lora_sync backend the servers get the adapter, as the version of the step, and a stream
without one is refused."""
from __future__ import annotations

import asyncio
import types

import pytest

from lora_sync import LoRAAdapter, LoRASyncClient

from .conftest import API_KEY, rl_frameworks
from .engine_fakes import served_text
from .helpers import PROMPT
from .peft_oracle import peft_greedy, peft_model, server_greedy



@pytest.fixture(scope="module")
def verl():
    with rl_frameworks():
        import verl.checkpoint_engine.base as base
        import verl.workers.engine.fsdp.transformer_impl as fsdp
        import verl.workers.engine_workers as workers

        import lora_sync.integrations.verl as integration
        yield types.SimpleNamespace(base=base, fsdp=fsdp, workers=workers,
                                    integration=integration)


@pytest.fixture
def cpu_engine(verl, monkeypatch):
    """make(peft_model) -> verl's FSDPEngine over it, as verl's CPU tests build workers
    (__new__ and the attributes the sync reads). STAND-INS: its CUDA memory log and device
    id, which need a GPU."""
    monkeypatch.setattr(verl.fsdp, "log_gpu_memory_usage", lambda *a, **k: None)
    monkeypatch.setattr(verl.fsdp, "get_device_id", lambda: "cpu")
    original = verl.fsdp.FSDPEngine.get_per_tensor_param
    yield lambda model: _engine(verl.fsdp.FSDPEngine, model)
    verl.fsdp.FSDPEngine.get_per_tensor_param = original  # adapter_on_sync's, undone


def _engine(cls, model):
    engine = cls.__new__(cls)
    engine.module = model
    engine._uses_fsdp2_cpu_offload_policy = True  # placement is not the engine's to do
    engine._is_offload_param = engine._qat_enabled = False
    engine.model_config = types.SimpleNamespace(lora={"merge": False}, hf_config=model.config)
    return engine


def actor_worker(verl, engine, backend):
    w = verl.workers.ActorRolloutRefWorker.__new__(verl.workers.ActorRolloutRefWorker)
    w.config = types.SimpleNamespace(rollout=types.SimpleNamespace(
        checkpoint_engine=types.SimpleNamespace(backend="lora_sync")))
    w.actor = types.SimpleNamespace(engine=engine)
    w.checkpoint_engine = backend
    return w


def update(verl, worker, step: int) -> dict:
    """verl's actor-side update for `step` (the disaggregated path)."""
    return asyncio.run(verl.workers.ActorRolloutRefWorker.update_weights.__wrapped__(
        worker, global_steps=step, mode="auto"))


def new_backend(verl, url: str, **kw):
    return verl.base.CheckpointEngineRegistry.new(
        "lora_sync", bucket_size=1 << 20, servers=[url], api_key=API_KEY, name="verl-policy",
        **kw)


def test_verls_update_pushes_the_adapter_as_the_steps_version(verl, cpu_engine, model_dir,
                                                              fake_server):
    model = peft_model(model_dir, 801)
    engine = cpu_engine(model)
    base_only, _ = engine.get_per_tensor_param()  # verl#7495, on verl's own code
    assert not any(".lora_" in k for k, _ in base_only)

    worker = actor_worker(verl, engine, new_backend(verl, fake_server.url, is_master=True))
    metrics = update(verl, worker, 3)
    assert metrics["lora_sync/version"] == 3 and metrics["lora_sync/bytes"] > 0
    with LoRASyncClient(fake_server.url, api_key=API_KEY) as c:
        text = c.complete("x", "verl-policy", 4)["text"]
        assert text == served_text(LoRAAdapter.from_peft_model(model))
        assert c.newest_versions("verl-policy") == [3]
        # the next step: new weights, the step's number, the alias follows
        from testbed.tiny_model import randomize_lora
        randomize_lora(model, 802)
        update(verl, worker, 4)
        assert c.complete("x", "verl-policy", 4)["text"] == \
            served_text(LoRAAdapter.from_peft_model(model))
        # another actor rank drains its stream and pushes nothing
        other = actor_worker(verl, engine, new_backend(verl, fake_server.url, is_master=False))
        assert update(verl, other, 5) == {}
        assert c.newest_versions("verl-policy") == [4]

        # verl's rollout side takes nothing through verl: the servers already serve it
        rollout = verl.base.CheckpointEngineWorker.__new__(verl.base.CheckpointEngineWorker)
        rollout.checkpoint_engine = new_backend(verl, fake_server.url)
        got = []

        class ServerAdapter:  # records what verl hands its server adapter
            async def update_weights(self, weights, **kwargs):
                got.extend([item async for item in weights])
        rollout.server_adapter = ServerAdapter()
        asyncio.run(verl.base.CheckpointEngineWorker.update_weights.__wrapped__(
            rollout, global_steps=4))
        assert got == []
        c.retire("verl-policy")


def test_a_stream_without_the_adapter_is_refused_naming_verl_7495(verl, cpu_engine, model_dir,
                                                                  fake_server):
    engine = cpu_engine(peft_model(model_dir, 811))
    # the backend without its fix to the engine: verl's base-only export reaches it
    backend = new_backend(verl, fake_server.url, is_master=True, engine_classes=[])
    with pytest.raises(RuntimeError, match="verl#7495"):
        update(verl, actor_worker(verl, engine, backend), 1)
    with LoRASyncClient(fake_server.url, api_key=API_KEY) as c:
        assert c.newest_versions("verl-policy") == [None]  # nothing was pushed


@pytest.mark.server
def test_the_pushed_step_serves_pefts_tokens_on_vllm(verl, cpu_engine, model_dir, vllm):
    model = peft_model(model_dir, 821)
    worker = actor_worker(verl, cpu_engine(model), new_backend(verl, vllm.url, is_master=True))
    update(verl, worker, 7)
    with LoRASyncClient(vllm.url, api_key=API_KEY) as c:
        assert server_greedy(c, "verl-policy", PROMPT, 12) == \
            peft_greedy(model, model_dir, PROMPT, 12)
        assert server_greedy(c, "verl-policy-v7", PROMPT, 12) == \
            server_greedy(c, "verl-policy", PROMPT, 12)
        c.retire("verl-policy")
