"""Adapter shapes against what each engine's LoRA layers can serve (security review: an
adapter on v_proj alone was accepted, and the first completion on it killed SGLang's
scheduler). The rule: lora-sync never hands an engine an adapter it cannot serve. Every
adapter it accepts serves; every other one gets a 4xx naming the module, and the server,
with its previous versions, stays up.

Which shapes each engine serves, and why, is its bridge's COVERAGE (sglang_ext/bridge.py,
vllm_ext/bridge.py); `test_sglang_coverage_is_what_sglangs_own_code_serves` checks SGLang's
against SGLang's own code, every subset of the seven projections, without a server."""
from __future__ import annotations

import itertools
import json
import os
import subprocess

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lora_sync import LoRAAdapter
from lora_sync.adapter import parse_peft_key
from lora_sync.errors import LoRASyncError

from .conftest import SGLANG_PYTHON, SGLANG_TEST_PATH
from .helpers import PROMPT, versions_of

LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def refused_by(engine: str, leaves: set) -> set:
    """The projections an engine cannot serve as adapted (restated from its code; the
    bridges' COVERAGE comments give file and function). vLLM serves every subset."""
    if engine == "vllm":
        return set()
    out = set()
    qkv = leaves & {"q_proj", "k_proj", "v_proj"}
    if qkv and not {"q_proj", "v_proj"} <= leaves:
        out |= qkv
    if "up_proj" in leaves and "gate_proj" not in leaves:
        out.add("up_proj")
    return out


def shaped(make_adapter, seed: int, leaves: set, rank: int, dtype: str) -> LoRAAdapter:
    """A random all-linear adapter cut down to `leaves`, its tensors in `dtype` ('mixed':
    each tensor in one of the three, in turn)."""
    full = make_adapter(seed, rank)
    kinds = itertools.cycle(DTYPES.values())
    tensors = {k: v.to(next(kinds) if dtype == "mixed" else DTYPES[dtype])
               for k, v in full.tensors.items()
               if parse_peft_key(k)[0].rsplit(".", 1)[-1] in leaves}
    return LoRAAdapter(tensors, dict(full.config, target_modules=sorted(leaves)))


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(leaves=st.sets(st.sampled_from(LEAVES), min_size=1),
       rank=st.sampled_from([1, 8, 64]), dtype=st.sampled_from([*DTYPES, "mixed"]))
# The security review's cases first, then shapes that must keep serving.
@example(leaves={"v_proj"}, rank=8, dtype="F32")
@example(leaves={"k_proj", "v_proj"}, rank=8, dtype="F32")
@example(leaves={"q_proj"}, rank=8, dtype="F32")
@example(leaves={"q_proj", "k_proj"}, rank=8, dtype="BF16")
@example(leaves={"up_proj"}, rank=8, dtype="F32")
@example(leaves={"up_proj", "down_proj", "o_proj"}, rank=4, dtype="F16")
@example(leaves={"q_proj", "v_proj"}, rank=8, dtype="mixed")
@example(leaves={"gate_proj"}, rank=1, dtype="BF16")
@example(leaves=set(LEAVES), rank=64, dtype="mixed")
def test_every_accepted_shape_serves_and_every_other_is_refused_by_name(
        client, server, make_adapter, leaves, rank, dtype):
    name = f"shapes-{server.engine}"
    if not versions_of(client, name):  # a version that must keep serving through refusals
        client.push(make_adapter(seed=950), name, transport="tensors")
    before = versions_of(client, name)[-1]
    adapter = shaped(make_adapter, 951 + len(leaves), leaves, rank, dtype)
    refused = refused_by(server.engine, leaves)
    if not refused:
        [pushed] = client.push(adapter, name, transport="tensors")
        assert client.complete(PROMPT, name, 2)["version"] == pushed.version
        assert client.complete(PROMPT, f"{name}-v{before}", 2)["version"] == before
    else:
        with pytest.raises(LoRASyncError) as e:
            client.push(adapter, name, transport="tensors")
        assert (e.value.status, e.value.code) == (400, "unsupported_module"), e.value
        assert any(f"{leaf}'" in e.value.message for leaf in refused), e.value.message
        assert versions_of(client, name)[-1] == before
        assert client.complete(PROMPT, name, 2)["version"] == before
    assert server.alive(), server.log_tail()


def test_a_broadcast_of_a_shape_sglang_cannot_serve_is_refused_before_any_transfer(
        sglang, make_adapter):
    """The trainer applies the server's coverage (lora_sync_info) before any collective
    call: the group stays usable and the next push goes through."""
    from lora_sync import LoRASyncClient
    from lora_sync.errors import BadAdapter
    with LoRASyncClient(sglang.url, engine="sglang", api_key=sglang.api_key) as c:
        [info] = c.info()
        assert {f["name"]: f["needs"] for f in info["coverage"]["fused"]} == \
            {"qkv_proj": ["q_proj", "v_proj"], "gate_up_proj": ["gate_proj"]}
        c.init_group(group_name="shapes", timeout_s=60)
        try:
            with pytest.raises(BadAdapter) as e:
                c.broadcast(shaped(make_adapter, 960, {"v_proj"}, 8, "F32"), "shapes-bc")
            assert e.value.code == "unsupported_module" and "v_proj'" in e.value.message
            [res] = c.broadcast(shaped(make_adapter, 961, {"q_proj", "v_proj"}, 8, "F32"),
                                "shapes-bc")
        finally:
            c.destroy_group()
        assert c.complete(PROMPT, "shapes-bc", 2)["version"] == res.version
    assert sglang.alive(), sglang.log_tail()


# Run by SGLang's Python: for every subset of the seven projections, what SGLang's own code
# does with an adapter as lora-sync's worker hands it over (engine_api.stack_in_place), next
# to what sglang_ext.bridge.COVERAGE decides. "served": SGLang's LoRAAdapter normalizes it
# and every weight finds its memory-pool buffer (mem_pool.load_lora_weight_to_buffer's
# lookup, utils.get_target_module_name) at the buffer's shape; "load": the load fails
# (a clean refusal by SGLang); "first batch": the lookup or the shape fails, which kills the
# scheduler at the first request.
ENGINE_PROBE = r'''
import itertools, json, types
import torch
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora import utils
from lora_sync import LoRAAdapter as Adapter, wire
from lora_sync.adapter import ModelSpec, check_adapter
from lora_sync.errors import BadAdapter
from sglang_ext import engine_api
from sglang_ext.bridge import COVERAGE

R = 4
HF = types.SimpleNamespace(num_hidden_layers=1, vocab_size=1000, hidden_size=64,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           intermediate_size=96)
FAN = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32), "self_attn.v_proj": (64, 32),
       "self_attn.o_proj": (64, 64), "mlp.gate_proj": (64, 96), "mlp.up_proj": (64, 96),
       "mlp.down_proj": (96, 64)}
# The server's pool: --lora-target-modules all, every linear layer (lora_manager.init_lora_shapes)
POOL = (utils.get_normalized_target_modules([p.split(".")[1] for p in FAN])
        | set(utils.EMBEDDING_NAMES))
SPEC = ModelSpec({f"model.layers.0.{p}": f for p, f in FAN.items()}, 16, COVERAGE)

def engine(tensors, config):
    lora = LoRAAdapter("x", LoRAConfig.from_dict(config, None, base_vocab_size=1000), HF,
                       None, None)
    try:
        lora.initialize_weights_from_tensors(engine_api.stack_in_place(tensors))
    except Exception:
        return "load"
    for name, w in lora.layers[0].weights.items():
        try:
            target = utils.get_target_module_name(name, POOL)
        except ValueError:
            return "first batch"
        fan_in, fan_out = utils.get_default_hidden_dim(target, HF, 0)
        c = utils.get_stacked_multiply(target)
        if tuple(w.shape) != ((R * c, fan_in) if "lora_A" in name else (fan_out, R)):
            return "first batch"
    return "served"

out = []
for n in range(1, len(FAN) + 1):
    for parts in itertools.combinations(FAN, n):
        g = torch.Generator().manual_seed(n)
        tensors = {}
        for p in parts:
            key = f"base_model.model.model.layers.0.{p}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(R, FAN[p][0], generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(FAN[p][1], R, generator=g)
        leaves = sorted(p.split(".")[1] for p in parts)
        adapter = Adapter(tensors, {"r": R, "lora_alpha": 8, "peft_type": "LORA",
                                    "target_modules": leaves})
        try:
            check_adapter(adapter.specs(), adapter.config, SPEC)
            ours = "accepted"
        except BadAdapter as e:
            ours = e.code
        out.append([leaves, engine(dict(adapter.tensors), adapter.config), ours])
print(json.dumps(out))
'''


def test_sglang_coverage_is_what_sglangs_own_code_serves():
    if not SGLANG_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail("no .venv-sglang in CI")
        pytest.skip("no .venv-sglang: run scripts/install.sh")
    run = subprocess.run([str(SGLANG_PYTHON), "-c", ENGINE_PROBE], capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": SGLANG_TEST_PATH})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 ** len(LEAVES) - 1
    wrong = [r for r in rows if (r[1] == "served") != (r[2] == "accepted")
             or r[2] not in ("accepted", "unsupported_module")]
    assert not wrong, wrong
    # The security review's shape, and both ways SGLang fails on what we refuse.
    by = {tuple(r[0]): r[1] for r in rows}
    assert by[("v_proj",)] == "first batch" and by[("up_proj",)] == "first batch"
    assert by[("q_proj",)] == "load" and by[("q_proj", "v_proj")] == "served"
    # The oracle the server test uses says the same.
    assert all((not refused_by("sglang", set(r[0]))) == (r[1] == "served") for r in rows)
