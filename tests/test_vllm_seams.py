"""vLLM's LoRA objects, in-process (no server): what lora-sync does to them at intake must
equal what vLLM would do itself."""
from __future__ import annotations

import fcntl
import os

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
