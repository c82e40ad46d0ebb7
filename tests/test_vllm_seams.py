"""vLLM's LoRA objects, in-process (no server): what lora-sync does to them at intake must
equal what vLLM would do itself."""
from __future__ import annotations

import fcntl
import os
from types import SimpleNamespace

import pytest
import torch

from lora_sync import wire
from lora_sync.transports import shm

engine_api = pytest.importorskip("vllm_ext.engine_api")


def lora_model(tensors: dict, config: dict):
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    helper = PEFTHelper.from_dict(dict(config, vllm_max_position_embeddings=4096))
    return LoRAModel.from_lora_tensors(lora_model_id=1, tensors=tensors, peft_helper=helper,
                                       device="cpu", dtype=next(iter(tensors.values())).dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_folding_the_scaling_out_of_place_equals_vllms_optimize(make_adapter, dtype):
    """A mapped shm lease is read-only: the fold into a buffer of ours gives bit for bit what
    vLLM's in-place optimize() gives, leaves the lease untouched, and leaves vLLM's own
    optimize nothing to do."""
    adapter = make_adapter(seed=5)
    adapter.config["lora_alpha"] = 3 * adapter.config["r"]  # a scaling that rounds
    tensors = {k: t.to(dtype) for k, t in adapter.tensors.items()}
    fd = os.memfd_create("lora-sync-test", os.MFD_ALLOW_SEALING)
    os.write(fd, wire.encode_bytes(tensors, adapter.metadata("x", 1, None)))
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm._SEALS)
    header, mapped = shm.map_sealed(f"/proc/{os.getpid()}/fd/{fd}")
    before = {k: t.clone() for k, t in mapped.items()}

    expected = lora_model({k: t.clone() for k, t in tensors.items()}, adapter.config)
    for w in expected.loras.values():
        w.optimize()
    folded = lora_model(mapped, adapter.config)
    taken = engine_api.fold_scaling(folded, lambda dt, n: torch.empty(n, dtype=dt))
    assert len(taken) == 1
    lease = {t.data_ptr() for t in mapped.values()}
    for name, w in folded.loras.items():
        assert w.scaling == 1 and torch.equal(w.lora_b, expected.loras[name].lora_b)
        assert w.lora_a.data_ptr() in lease  # lora_A views the lease: no copy
        w.optimize()  # vLLM's own step at registration: nothing left to do
    assert all(torch.equal(before[k], mapped[k]) for k in mapped)
    os.close(fd)


def plain_layer(cls, in_dim: int, outs: list[int], max_rank: int, seed: int = 0):
    """One of vLLM's LoRA layer classes with its stacked buffers, 2 slots full of noise (what
    an earlier adapter left), without a model around it."""
    gen = torch.Generator().manual_seed(seed)
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.tp_size, layer.n_slices, layer.device = 1, len(outs), torch.device("cpu")
    layer.lora_a_stacked = tuple(torch.randn(2, 1, max_rank, in_dim, generator=gen)
                                 .bfloat16() for _ in outs)
    layer.lora_b_stacked = tuple(torch.randn(2, 1, o, max_rank, generator=gen).bfloat16()
                                 for o in outs)
    return layer


def fake_manager(modules: dict, packed: dict | None = None):
    """What install_slot_writer and defer_scaling read of vLLM's worker LoRA manager."""
    inner = SimpleNamespace(modules=modules, packed_modules=packed or {})
    return SimpleNamespace(_adapter_manager=inner)


def marked(lora_b: list, scaling: float) -> None:
    """Marks lora_B tensors as defer_scaling marks an adapter's."""
    weights = {f"m{i}": SimpleNamespace(lora_b=b, scaling=scaling)
               for i, b in enumerate(lora_b) if b is not None}
    assert engine_api.defer_scaling(fake_manager({}), SimpleNamespace(loras=weights),
                                    frozenset(weights))
    assert all(w.scaling == 1 for w in weights.values())


SLOT_CASES = [("RowParallelLinearWithLoRA", 48, [40]),
              ("QKVParallelLinearWithLoRA", 40, [72]),
              ("MergedQKVParallelLinearWithLoRA", 40, [40, 16, 16]),
              ("MergedColumnParallelLinearWithLoRA", 40, [56, 56])]


@pytest.mark.parametrize("seed", range(6))
def test_the_slot_writer_writes_what_vllms_set_lora_writes(seed):
    """For every plain layer, random ranks up to the slot's, slices without weights, a
    scaling that rounds or none: the slot holds, bit for bit, what vLLM's set_lora writes
    after its optimize() scaled lora_B, and the other slot is untouched."""
    gen = torch.Generator().manual_seed(seed)
    classes = {c.__name__: c for c in engine_api.plain_slot_layers()}
    for name, in_dim, outs in SLOT_CASES:
        max_rank = 16
        rank = int(torch.randint(1, max_rank + 1, (1,), generator=gen))
        scaling = [1.0, 2.0, 3 / 7][seed % 3]
        lora_a = [torch.randn(rank, in_dim, generator=gen).bfloat16() for _ in outs]
        lora_b = [torch.randn(o, rank, generator=gen).bfloat16() for o in outs]
        if len(outs) > 1:  # a slice the adapter does not train
            gone = int(torch.randint(0, len(outs), (1,), generator=gen))
            lora_a[gone] = lora_b[gone] = None
        vllms = plain_layer(classes[name], in_dim, outs, max_rank, seed)
        ours = plain_layer(classes[name], in_dim, outs, max_rank, seed)
        index = seed % 2
        shape = (lambda x: x) if len(outs) > 1 else (lambda x: x[0])

        folded = [None if b is None else b.clone().mul_(scaling) for b in lora_b]
        vllms.set_lora(index, shape(lora_a), shape(folded))
        marked(lora_b, scaling)
        engine_api._write_slot(ours, ours.set_lora, index, shape(lora_a), shape(lora_b))
        for got, want in zip(ours.lora_a_stacked + ours.lora_b_stacked,
                             vllms.lora_a_stacked + vllms.lora_b_stacked):
            assert torch.equal(got, want), (name, rank, scaling)


def test_adapters_not_marked_keep_vllms_set_lora():
    """An adapter vLLM loaded itself (no mark) goes through vLLM's own set_lora, untouched."""
    layer = plain_layer(engine_api.plain_slot_layers()[0], 8, [8], 4)
    calls = []
    a, b = torch.ones(4, 8).bfloat16(), torch.ones(8, 4).bfloat16()
    engine_api._write_slot(layer, lambda *args: calls.append(args), 1, a, b)
    assert calls == [(1, a, b)]


def test_the_slot_writer_takes_plain_cpu_layers_only():
    """vLLM's other layers (here its embedding) and sharded ones keep vLLM's set_lora; an
    adapter with a weight in such a layer is not marked (build folds its scaling), one
    whose weights all land in plain layers, packed q/k/v included, is."""
    from vllm.lora.layers import VocabParallelEmbeddingWithLoRA
    embed = VocabParallelEmbeddingWithLoRA.__new__(VocabParallelEmbeddingWithLoRA)
    torch.nn.Module.__init__(embed)
    embed.tp_size, embed.device = 1, torch.device("cpu")
    qkv, down, sharded = (plain_layer(c, 8, [8], 4) for c in engine_api.plain_slot_layers()[:3])
    sharded.tp_size = 2
    manager = fake_manager({"l0.qkv": qkv, "l0.down": down, "l1.o": sharded, "embed": embed},
                           packed={"l0.qkv": ["l0.q", "l0.k", "l0.v"]})
    layers = engine_api.install_slot_writer(manager)
    assert layers == {"l0.qkv", "l0.down"}
    assert engine_api.install_slot_writer(manager) == layers  # wrapped once
    assert all(m.set_lora.func is engine_api._write_slot and m.set_lora.args[1].__self__ is m
               for m in (qkv, down))
    assert all("set_lora" not in m.__dict__ for m in (sharded, embed))

    def adapter(*names):
        return SimpleNamespace(loras={n: SimpleNamespace(lora_b=torch.ones(2, 2), scaling=2.0)
                                      for n in names})
    for names in [("l0.q", "embed"), ("l0.q", "l1.o")]:
        lora = adapter(*names)
        assert not engine_api.defer_scaling(manager, lora, layers)
        assert all(w.scaling == 2.0 and not hasattr(w.lora_b, "_lora_sync_scale")
                   for w in lora.loras.values())
    lora = adapter("l0.q", "l0.v", "l0.down")
    assert engine_api.defer_scaling(manager, lora, layers)
    assert all(w.scaling == 1 and w.lora_b._lora_sync_scale == 2.0 for w in lora.loras.values())


def test_tenant_keys_pass_vllms_own_key_middleware(monkeypatch):
    """vLLM's AuthenticationMiddleware (its --api-key) in front of a route: with tenants, a
    key lora-sync knows passes as the engine's own key does; any other key, or none, still
    gets vLLM's 401. The patch is applied once however often it is asked for."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
    monkeypatch.setattr(AuthenticationMiddleware, "verify_token",
                        AuthenticationMiddleware.verify_token)  # restored after the test
    for _ in range(2):
        engine_api.let_tenant_keys_through(lambda header: header == "Bearer tenant-key")
    assert AuthenticationMiddleware.verify_token.lora_sync_tenants
    app = Starlette(routes=[Route("/v1/completions", lambda r: PlainTextResponse("ok"),
                                  methods=["POST"])],
                    middleware=[Middleware(AuthenticationMiddleware, tokens=["engine-key"])])
    with TestClient(app) as http_client:
        status = {key: http_client.post("/v1/completions", headers=(
            {"Authorization": f"Bearer {key}"} if key else {})).status_code
            for key in ("engine-key", "tenant-key", "other-key", None)}
    assert status == {"engine-key": 200, "tenant-key": 200, "other-key": 401, None: 401}


def test_our_routes_are_matched_before_the_engines():
    """Starlette matches a request against the routes in order: mounted on an app of many
    routes, ours come first, each once, and the app's own follow in their order."""
    from fastapi import FastAPI

    from lora_sync.server.routes import own_paths
    from vllm_ext.mount import PREFIX, mount
    app = FastAPI()
    for i in range(60):
        app.add_api_route(f"/v1/engine_route_{i}", lambda: {}, methods=["GET"])
    before = [r.path for r in app.router.routes]
    mount(app)
    paths = [r.path for r in app.router.routes]
    ours = [p for p in paths if p in own_paths(PREFIX)]
    assert len(ours) == len(set(ours)) >= 10
    assert paths == ours + before
