"""Issue 44: until a model's LoRA path runs, lora-sync refuses pushes for it with a 4xx that
says why; it never accepts an adapter whose first request kills the engine.

vLLM 0.32 runs the MoE experts of a LoRA-enabled model with Triton (TritonExperts), so on a
CPU build without Triton the first forward pass of any request, base model included, kills
EngineCore. Each worker reports that as its `model_unsupported` fact (for vLLM:
vllm_ext/engine_api.py `lora_path_blocker`); the service refuses every push with 409
`model_unsupported` (service.refuse_if_unsupported).

  * the rule on every push route, in process, on the FAKE engine (a worker reporting a
    reason): nothing is staged, taken in or registered;
  * the detection, in process, on vLLM's own layer classes (no server);
  * one real vLLM server on the tiny Qwen3-MoE model without the test-only stand-in
    (tests/vllm_moe_standin): the push is refused, and the server stays up. No completion
    is sent: it would kill EngineCore."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from lora_sync import LoRASyncClient, http
from lora_sync.errors import Conflict
from lora_sync.transports import shm
from lora_sync.transports.broadcast import INIT_ROUTE, LOAD_ROUTE

from .conftest import API_KEY, REPO, SERVER_ENV

AUTH = {"Authorization": f"Bearer {API_KEY}"}
REASON = ("vLLM 0.32.0 runs the MoE experts of a LoRA-enabled model with Triton kernels "
          "(TritonExperts), and Triton is not available on this build")


def refused(status: int, reply: dict, reason: str = REASON) -> bool:
    err = reply.get("error") or {}
    return (status, err.get("status"), err.get("code")) == (409, 409, "model_unsupported") \
        and reason in err.get("message", "")


# -- the rule, on the fake engine ---------------------------------------------------------
def test_every_push_route_refuses_a_model_whose_lora_path_cannot_run(make_fake_server,
                                                                     make_adapter, tmp_path):
    """One worker of two says the model's LoRA forward cannot run: every way in (the four
    transports through the client, each transport's first step and the engine's own load
    routes by hand) answers 409 model_unsupported with the worker's reason, before anything
    is staged or reaches a worker; info says so; nothing is registered."""
    server = make_fake_server(workers=2)
    bridge = server.bridge
    bridge.workers[1].engine.model_unsupported = lambda: REASON
    adapter = make_adapter(seed=4401)
    adapter.save(tmp_path / "disk")
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as c:
        info = c.info()[0]
        assert info["model_unsupported"] == REASON
        assert [w["model_unsupported"] for w in info["worker_status"]] == [None, REASON]
        for transport in ("tensors", "shm", "shared", "auto"):
            with pytest.raises(Conflict) as e:  # one server: its error itself
                c.push(adapter, "moe", transport=transport)
            err = e.value
            assert (err.status, err.code) == (409, "model_unsupported"), (transport, err)
            assert REASON in err.message, err.message
        v1 = f"{server.url}/v1"
        by_hand = [
            (f"{v1}/{shm.LEASE_ROUTE}", {"nbytes": 4096, "client": "c" * 32}),
            (f"{v1}/{INIT_ROUTE}", {"master_address": "127.0.0.1", "master_port": 29999,
                                    "rank_offset": 1, "world_size": 3}),
            (f"{v1}/{LOAD_ROUTE}", {"lora_name": "moe", "tensors": [],
                                    "group_token": "t" * 32, "transfer_id": 1}),
            (f"{v1}/load_lora_adapter", {"lora_name": "disk",
                                         "lora_path": str(tmp_path / "disk")}),
            (f"{server.url}/adapters", {"name": "disk", "src": str(tmp_path / "disk")}),
        ]
        for url, body in by_hand:
            status, reply, _ = http.request("POST", url, json_body=body, headers=AUTH)
            assert refused(status, reply), (url, status, reply)
        # access is checked first: no key, no reason
        status, _, _ = http.request("POST", f"{v1}/{shm.LEASE_ROUTE}",
                                    json_body=by_hand[0][1])
        assert status == 401
        assert c.adapters()[0]["adapters"] == []
        assert c.info()[0]["open_leases"] == 0
    assert set(bridge.calls) == {"info"}, bridge.calls  # no intake, no register, no free
    assert bridge.table == {} and bridge.disk == {}
    assert all(not held for held in bridge.held_ids())
    assert not any(server.service.staging.landed.values())  # no body staged
    assert server.alive()


def test_a_model_whose_lora_path_runs_takes_pushes(make_fake_server, make_adapter):
    """No worker reports a reason: info says None, and pushes go through as ever."""
    server = make_fake_server()
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as c:
        assert c.info()[0]["model_unsupported"] is None
        assert c.push(make_adapter(seed=4402), "dense", transport="tensors")[0].version == 1


# -- the detection, on vLLM's own classes -------------------------------------------------
def _worker(modules: dict):
    """What lora_path_blocker reads of a vLLM worker: its LoRA manager's layers."""
    manager = SimpleNamespace(_adapter_manager=SimpleNamespace(modules=modules))
    return SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager))


def _moe_layer(experts_cls, punica_cls):
    """vLLM's FusedMoEWithLoRA as vLLM builds it for an MoE layer, without a model: its
    kernel's experts and its Punica wrapper are what the detection reads."""
    from vllm.lora.layers import FusedMoEWithLoRA
    layer = FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)
    torch.nn.Module.__init__(layer)
    layer._moe_kernel = SimpleNamespace(fused_experts=experts_cls.__new__(experts_cls))
    layer.punica_wrapper = punica_cls.__new__(punica_cls)
    return layer


@pytest.fixture
def vllm_moe(monkeypatch):
    engine_api = pytest.importorskip("vllm_ext.engine_api")
    import vllm.triton_utils
    from vllm.lora.layers import RowParallelLinearWithLoRA
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    class PunicaWithMoE(PunicaWrapperCPU):  # a wrapper with the MoE kernels (vLLM's GPU one)
        def add_lora_w13(self, *args, **kw):
            raise AssertionError("never called by the detection")
        add_lora_w2 = add_lora_w13

    def has_triton(value: bool):
        monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", value)
    plain = RowParallelLinearWithLoRA.__new__(RowParallelLinearWithLoRA)
    torch.nn.Module.__init__(plain)
    assert PunicaWrapperCPU.add_lora_w13 is PunicaWrapperBase.add_lora_w13  # vLLM 0.32's CPU
    return SimpleNamespace(api=engine_api, TritonExperts=TritonExperts, has_triton=has_triton,
                           cpu=PunicaWrapperCPU, with_moe=PunicaWithMoE, plain=plain,
                           monkeypatch=monkeypatch)


def test_triton_moe_experts_without_triton_block_the_model(vllm_moe):
    v = vllm_moe
    v.has_triton(False)
    reason = v.api.lora_path_blocker(_worker({
        "model.layers.0.self_attn.o_proj": v.plain,
        "model.layers.0.mlp.experts": _moe_layer(v.TritonExperts, v.cpu)}))
    assert reason is not None and "Triton" in reason and "TritonExperts" in reason, reason
    assert "every request" in reason


def test_a_dense_model_is_never_blocked(vllm_moe):
    v = vllm_moe
    v.has_triton(False)
    assert v.api.lora_path_blocker(_worker({"model.layers.0.self_attn.o_proj": v.plain})) \
        is None


def test_the_torch_moe_standin_unblocks_the_model(vllm_moe):
    """tests/vllm_moe_standin marks TritonExperts once its apply runs on torch."""
    v = vllm_moe
    v.has_triton(False)
    v.monkeypatch.setattr(v.TritonExperts, v.api.MOE_STANDIN_ATTR, True, raising=False)
    assert v.api.lora_path_blocker(_worker({
        "model.layers.0.mlp.experts": _moe_layer(v.TritonExperts, v.cpu)})) is None


def test_triton_without_the_punica_moe_kernels_blocks_the_model(vllm_moe):
    """With Triton, the experts still call the Punica wrapper's MoE LoRA kernels on every
    forward pass: vLLM's CPU wrapper has none."""
    v = vllm_moe
    v.has_triton(True)
    reason = v.api.lora_path_blocker(_worker({
        "model.layers.0.mlp.experts": _moe_layer(v.TritonExperts, v.cpu)}))
    assert reason is not None and "add_lora_w13" in reason and "PunicaWrapperCPU" in reason
    assert v.api.lora_path_blocker(_worker({
        "model.layers.0.mlp.experts": _moe_layer(v.TritonExperts, v.with_moe)})) is None


def test_a_failed_probe_is_a_reason_not_a_crash(vllm_moe):
    v = vllm_moe
    no_lora = SimpleNamespace(model_runner=SimpleNamespace(lora_manager=None))
    reason = v.api.lora_path_blocker(no_lora)
    assert isinstance(reason, str) and "could not check" in reason and "RuntimeError" in reason
    layer = _moe_layer(v.TritonExperts, v.cpu)
    del layer._moe_kernel  # a vLLM whose layer keeps its kernel elsewhere
    reason = v.api.lora_path_blocker(_worker({"x": layer}))
    assert isinstance(reason, str) and "could not check" in reason, reason
    v.monkeypatch.setattr(v.api, "_moe_blocker", lambda modules: 1 / 0)
    reason = v.api.lora_path_blocker(_worker({}))
    assert "ZeroDivisionError" in reason, reason


# -- one real vLLM server on the tiny MoE model, without the stand-in ---------------------
# Extended (CI time: a server of its own): the blocker is tested in process above against
# vLLM's own classes, and every push route's 409 on the fake engine.
@pytest.mark.server
@pytest.mark.extended
def test_vllm_moe_without_triton_refuses_pushes_and_stays_up(workdir):
    """vLLM CPU on the tiny Qwen3-MoE model (--enable-lora, no Triton, no stand-in on its
    PYTHONPATH): it starts, warns, says why in lora_sync_info, refuses an attention-only
    adapter by tensors with 409 model_unsupported, and is still up after."""
    pytest.importorskip("vllm")
    from lora_sync import LoRAAdapter
    from testbed.processes import vllm_server
    from testbed.tiny_model import build_tiny_model, make_lora
    moe_dir = build_tiny_model(workdir / "tiny-qwen3-moe", arch="qwen3_moe")
    adapter = LoRAAdapter.from_peft_model(make_lora(
        moe_dir, rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and "vllm_moe_standin" not in p]
    server = vllm_server(moe_dir, env={**SERVER_ENV,
                                       "PYTHONPATH": os.pathsep.join([str(REPO), *path])})
    server.api_key = API_KEY
    with server, LoRASyncClient(server.url, engine="vllm", api_key=API_KEY) as c:
        reason = c.info()[0]["model_unsupported"]
        assert reason and "Triton" in reason and "TritonExperts" in reason, reason
        with pytest.raises(Conflict) as e:
            c.push(adapter, "moe-attn", transport="tensors")
        err = e.value
        assert (err.status, err.code) == (409, "model_unsupported"), err
        assert reason in err.message
        assert c.adapters()[0]["adapters"] == []
        assert "refuses every adapter push" in server.log_tail(400)
        assert server.alive(), "the server died:\n" + server.log_tail()
        status, reply, _ = http.request("POST", f"{server.url}/v1/load_lora_adapter",
                                        json_body={"lora_name": "disk", "lora_path": "/nope"},
                                        headers=AUTH)
        assert refused(status, reply, reason), (status, reply)
        assert server.alive(), "the server died:\n" + server.log_tail()
