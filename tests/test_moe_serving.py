"""LoRA on an MoE model (a tiny Qwen3-MoE: 8 experts, top-2): attention LoRA and routed-expert
LoRA, pushed by every transport, token-identical to the engine's own disk route and to PEFT's
forward (target_parameters on the fused experts; lora_sync.moe sends it per expert).

Neither engine runs MoE LoRA on a CPU out of the box: each server here runs with TEST-ONLY
pure-torch stand-ins for exactly the Triton pieces of its MoE LoRA path
(tests/vllm_moe_standin for vLLM's TritonExperts.apply, tests/sgl_kernel_standin's
moe_lora_cpu_standin for SGLang's fused-MoE runner core, fused_moe_lora and
moe_lora_align_block_size). Without them lora-sync refuses every push on vLLM
(tests/test_moe.py); SGLang does not start with experts targeted."""
from __future__ import annotations

import time

import pytest
import torch

from lora_sync import LoRAAdapter, LoRASyncClient
from lora_sync.adapter import ModelSpec, check_adapter
from lora_sync.errors import BadAdapter, LoRASyncError

from .conftest import GENERATION_KEY
from .helpers import PROMPT, disk_model, push_by
from .peft_oracle import peft_greedy, peft_model, server_greedy

N_TOKENS = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Each case: (LoraConfig arguments, transports). Attention LoRA needs no expert LoRA at all.
CASES = {"attention": (dict(r=8, lora_alpha=16, target_modules=ATTENTION), ("tensors",)),
         "experts and attention": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                        target_parameters=EXPERTS),
                                   ("tensors", "shm", "broadcast"))}


def oracle(model_dir, seed, **lora_config):
    model = peft_model(model_dir, seed, **lora_config)
    return LoRAAdapter.from_peft_model(model), peft_greedy(model, model_dir, PROMPT, N_TOKENS)


# -- in process ---------------------------------------------------------------------------
def test_per_expert_form_computes_what_peft_computes(moe_dir):
    """lora_sync.moe.per_expert: expert e's delta B_e @ A_e, scaled, is PEFT's own delta on
    expert e of the fused parameter (gate rows then up rows for gate_up_proj), and PEFT loads
    the per-expert form back as the same adapter (its transformers-5 conversion)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = peft_model(moe_dir, 5, **CASES["experts and attention"][0])
    adapter = LoRAAdapter.from_peft_model(model)
    scale = 8 / 4
    experts = model.base_model.model.model.layers[0].mlp.experts
    for param in ("gate_up_proj", "down_proj"):
        wrapper = experts if param == "down_proj" else experts.base_layer
        delta = wrapper.get_delta_weight("default")  # [E, out, in] as the parameter
        parts = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
        for e in (0, 7):
            key = f"base_model.model.model.layers.0.mlp.experts.{e}.{{}}.lora_{{}}.weight"
            ours = torch.cat([adapter.tensors[key.format(p, "B")]
                              @ adapter.tensors[key.format(p, "A")] for p in parts])
            torch.testing.assert_close(ours * scale, delta[e])  # [out, in], as the parameter
    assert "target_parameters" not in adapter.config
    assert {"gate_proj", "up_proj", "down_proj"} <= set(adapter.config["target_modules"])
    path = moe_dir.parent / "per-expert"
    adapter.save(path)
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32), path).eval()
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_expert_adapters_are_checked_against_the_models_experts(moe_dir):
    """Per-expert pairs fit the experts' shapes; an expert index out of range, a wrong
    expert shape, PEFT's fused 3-D form and the router are refused by name."""
    from transformers import AutoConfig
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(moe_dir), 16)
    adapter, _ = oracle(moe_dir, 6, **CASES["experts and attention"][0])
    check_adapter(adapter.specs(), adapter.config, spec)
    assert ModelSpec.from_info(spec.info()) == spec
    key = "base_model.model.model.layers.1.mlp.experts.{}.down_proj.lora_{}.weight"

    def refused(tensors, config, code, named):
        with pytest.raises(BadAdapter) as e:
            check_adapter(LoRAAdapter(tensors, config).specs(), config, spec)
        assert e.value.code == code and named in e.value.message, e.value.message
    cfg = adapter.config
    refused({**adapter.tensors, key.format(8, "A"): torch.ones(4, 64),
             key.format(8, "B"): torch.ones(128, 4)}, cfg, "unknown_module", "expert index")
    refused({**adapter.tensors, key.format(0, "A"): torch.ones(4, 128)}, cfg, "bad_shape",
            "experts.0.down_proj")
    fused = {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.ones(32, 64),
             "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.ones(128, 32)}
    refused(fused, {**cfg, "target_parameters": EXPERTS}, "unsupported_module",
            "target_parameters")
    refused(fused, cfg, "unknown_module", "per expert")
    router = {"base_model.model.model.layers.0.mlp.gate.lora_A.weight": torch.ones(4, 128),
              "base_model.model.model.layers.0.mlp.gate.lora_B.weight": torch.ones(8, 4)}
    refused(router, cfg, "unknown_module", "router")


def test_a_block_with_experts_left_out_is_refused_where_the_engine_needs_it_whole(moe_dir):
    """vLLM packs a block's expert LoRA only when every expert has gate, up and down (its
    pack_moe asserts, a 500 before): an adapter leaving out an expert, or one projection of
    one, is refused by name there (Coverage.whole_experts); SGLang serves it, and whole
    blocks are served on both. The trainer reads the same rule from lora_sync_info."""
    import dataclasses

    from transformers import AutoConfig

    from vllm_ext.bridge import COVERAGE
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(moe_dir), 16)
    vllm_spec = dataclasses.replace(spec, coverage=COVERAGE)
    assert ModelSpec.from_info(vllm_spec.info()) == vllm_spec
    adapter, _ = oracle(moe_dir, 6, **CASES["experts and attention"][0])
    key = "base_model.model.model.layers.1.mlp.experts.{}.{}.lora_{}.weight"
    whole = adapter.tensors
    for e, parts, named in ((3, ("gate_proj", "up_proj", "down_proj"), "experts.3.gate_proj"),
                            (5, ("gate_proj",), "experts.5.gate_proj"),
                            (7, ("down_proj",), "experts.7.down_proj")):
        left_out = {key.format(e, p, h) for p in parts for h in "AB"}
        tensors = {k: v for k, v in whole.items() if k not in left_out}
        for s in (spec, vllm_spec):
            specs = LoRAAdapter(tensors, adapter.config).specs()
            if not s.coverage.whole_experts:
                check_adapter(specs, adapter.config, s)
                continue
            with pytest.raises(BadAdapter) as e_info:
                check_adapter(specs, adapter.config, s)
            assert e_info.value.code == "unsupported_module", e_info.value.message
            assert named in e_info.value.message and "zero lora_B" in e_info.value.message
    check_adapter(adapter.specs(), adapter.config, vllm_spec)


def test_a_shared_expert_is_refused_by_name():
    """Qwen2-MoE's shared expert is a plain MLP inside the MoE block: refused (not checked
    against PEFT on either engine), named as such; the routed experts still fit."""
    from transformers import Qwen2MoeConfig
    config = Qwen2MoeConfig(vocab_size=384, hidden_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=64,
                            shared_expert_intermediate_size=96)
    spec = ModelSpec.from_hf_config(config, 16)
    assert spec.experts == {"model.layers.0.mlp.experts": (4, 128, 64)}
    assert not [m for m in spec.linear if ".mlp." in m]
    shared = "base_model.model.model.layers.0.mlp.shared_expert.up_proj.lora_{}.weight"
    adapter = LoRAAdapter({shared.format("A"): torch.ones(4, 128),
                           shared.format("B"): torch.ones(96, 4)},
                          {"r": 4, "lora_alpha": 8, "target_modules": ["up_proj"]})
    with pytest.raises(BadAdapter) as e:
        check_adapter(adapter.specs(), adapter.config, spec)
    assert e.value.code == "unknown_module" and "shared experts" in e.value.message


# -- real servers (conftest's moe_vllm / moe_sglang) ------------------------------------------
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_moe_lora_syncs_as_disk_and_peft_on_each_engine(request, engine, moe_dir, tmp_path):
    """On each engine's MoE server (with its stand-ins): each case pushed by each of its
    transports serves PEFT's tokens, as the engine's own disk route does, and differs from
    the base model's. Pushes with the admin key, completions with the generation key (the
    server runs with both: conftest)."""
    server = request.getfixturevalue(f"moe_{engine}")
    with LoRASyncClient(server.url, engine=engine, api_key=server.api_key) as c, \
            LoRASyncClient(server.url, engine=engine, api_key=GENERATION_KEY) as reader:
        base = server_greedy(reader, "base", PROMPT, N_TOKENS)
        for i, (case, (config, transports)) in enumerate(CASES.items()):
            adapter, want = oracle(moe_dir, 60 + i, **config)
            assert want != base, case
            name = f"moe-{i}"
            for transport in transports:
                res = push_by(c, adapter, name, transport)
                assert server_greedy(reader, res.name, PROMPT, N_TOKENS) == want, \
                    (case, transport)
            disk = f"moe-disk-{i}-{time.monotonic_ns() % 10 ** 9}"
            adapter.save(tmp_path / disk)
            c.load_from_disk(str(tmp_path / disk), disk)
            assert server_greedy(reader, disk_model(c, disk), PROMPT, N_TOKENS) == want, case
        # An expert left out: vLLM needs whole blocks (400 by name, the version before keeps
        # serving: it was a 500 from pack_moe); SGLang serves it as its disk route does.
        adapter, _ = oracle(moe_dir, 69, **CASES["experts and attention"][0])
        left_out = {k: v for k, v in adapter.tensors.items() if ".experts.2." not in k}
        adapter = LoRAAdapter(left_out, adapter.config)
        if engine == "vllm":
            kept = server_greedy(reader, "moe-1", PROMPT, N_TOKENS)
            with pytest.raises(LoRASyncError) as e:
                c.push(adapter, "moe-1", transport="tensors")
            assert (e.value.status, e.value.code) == (400, "unsupported_module"), e.value
            assert "experts.2.gate_proj" in e.value.message
            assert server_greedy(reader, "moe-1", PROMPT, N_TOKENS) == kept
        else:
            [res] = c.push(adapter, "moe-left-out", transport="tensors")
            adapter.save(tmp_path / "moe-left-out-disk")
            c.load_from_disk(str(tmp_path / "moe-left-out-disk"), "moe-left-out-disk")
            assert server_greedy(reader, res.name, PROMPT, N_TOKENS) == server_greedy(
                reader, disk_model(c, "moe-left-out-disk"), PROMPT, N_TOKENS)
        assert server.alive(), server.log_tail()
