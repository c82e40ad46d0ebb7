"""Run with SGLang's Python (tests/test_core.py starts it): SGLang's own LoRAAdapter,
given a sealed lease's tensors as lora-sync hands them over (lora_B stacked as views,
engine_api.stack_in_place), must hold bit for bit what it holds when it concatenates them
itself, and the stacked lora_B must be views of the lease, not copies. Prints "ok"."""
import fcntl
import os
import sys
import types
import warnings

import torch
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig

from lora_sync import LoRAAdapter as Adapter
from lora_sync import wire
from lora_sync.transports import shm
from sglang_ext import engine_api

LAYERS, HIDDEN, KV, MLP, RANK = 2, 64, 32, 96, 8
SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV),
          "self_attn.v_proj": (HIDDEN, KV), "self_attn.o_proj": (HIDDEN, HIDDEN),
          "mlp.gate_proj": (HIDDEN, MLP), "mlp.up_proj": (HIDDEN, MLP),
          "mlp.down_proj": (MLP, HIDDEN)}


def peft_tensors(modules) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        for m in modules:  # PEFT's own order: lora_A, lora_B, module by module
            fan_in, fan_out = SHAPES[m]
            key = f"base_model.model.model.layers.{layer}.{m}"
            out[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g).bfloat16()
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g).bfloat16()
    return out


def sealed_views(adapter: Adapter) -> dict:
    fd = os.memfd_create("lora-sync-test", os.MFD_ALLOW_SEALING)
    os.write(fd, wire.encode_bytes(adapter.tensors, adapter.metadata("x", 1)))
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm._SEALS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return shm.view_sealed(fd)[1]


def sglang_weights(tensors: dict, config: dict) -> list[dict]:
    hf = types.SimpleNamespace(num_hidden_layers=LAYERS, vocab_size=1000, hidden_size=HIDDEN)
    lora = LoRAAdapter("x", LoRAConfig.from_dict(config, None, base_vocab_size=1000), hf,
                       None, None)
    lora.initialize_weights_from_tensors(tensors)
    return [dict(layer.weights) for layer in lora.layers]


def check(modules, stacked_expected: int) -> None:
    adapter = Adapter(peft_tensors(modules), {"r": RANK, "lora_alpha": 16, "peft_type": "LORA"})
    views = sealed_views(adapter)
    given = engine_api.stack_in_place(views)
    assert sum(k.endswith("proj.lora_B.weight") and ("qkv_proj" in k or "gate_up_proj" in k)
               for k in given) == stacked_expected, sorted(given)
    theirs = sglang_weights(dict(adapter.tensors), adapter.config)  # SGLang concatenates
    ours = sglang_weights(given, adapter.config)
    lease = {t.untyped_storage().data_ptr() for t in views.values()}
    for layer_theirs, layer_ours in zip(theirs, ours):
        assert layer_theirs.keys() == layer_ours.keys()
        for name, t in layer_theirs.items():
            assert torch.equal(t, layer_ours[name]), name
            if "lora_B" in name and ("qkv_proj" in name or "gate_up_proj" in name) \
                    and stacked_expected:
                assert layer_ours[name].untyped_storage().data_ptr() in lease, name


# all-linear: q/k/v and gate/up lora_B stacked as views, two groups per layer
check(list(SHAPES), stacked_expected=2 * LAYERS)
# q and v only (no k): SGLang's own path (k as zeros), nothing stacked by us
check(["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"], stacked_expected=0)
print("ok")
sys.exit(0)
