"""No name changes another's output (docs/coverage.md, "One output per name").

vLLM's CPU LoRA ops select each row's weights by its slot index, and a row without an adapter
carries -1, which selects the last slot: a base request batched with requests on the adapter
in that slot got that adapter's output, token for token, and an LM-head adapter there changed
the base model's answers even alone. lora-sync masks those rows in every worker
(vllm_ext.engine_api.mask_unadapted_rows).

In process: each masked op against the op itself, row by row. Real servers (both engines): a
random sequence of pushes (linear, embedding and LM-head adapters, so every slot, the last
included, holds each kind in turn), retirements and rounds of concurrent requests: the base
model answers as it did before any adapter was loaded, and each adapter as PEFT computes it,
alone or in the same batch."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from lora_sync import LoRASyncClient

from .helpers import PROMPT
from .peft_oracle import oracle, server_greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KINDS = {"linear": dict(r=8, lora_alpha=16),
         "embed_tokens": dict(r=8, lora_alpha=16, target_modules=[*ALL, "embed_tokens"]),
         "lm_head": dict(r=8, lora_alpha=16, target_modules=[*ALL, "lm_head"])}
N = 8        # tokens compared
LONG = 64    # tokens an adapter request runs for, so the others land in its batch
STEPS = 7    # operations of the random sequence, per engine


# -- in process: the masked ops -------------------------------------------------------------
@pytest.mark.parametrize("name", ["bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"])
def test_a_row_without_an_adapter_gets_nothing_from_any_slot(name):
    pytest.importorskip("vllm")
    from vllm.lora.ops.torch_ops import lora_ops

    from vllm_ext import engine_api
    engine_api.mask_unadapted_rows()
    masked = getattr(lora_ops, name)
    op = masked.__wrapped__
    torch.manual_seed(0)
    shrink = name == "bgmv_shrink"
    slots, rows, fan_in, fan_out = 3, 5, 16, 8
    weights = torch.randn(slots, 1, fan_out, fan_in)  # every slot filled, the last included
    inputs = torch.randn(rows, fan_in)
    indices = torch.tensor([-1, 0, 2, -1, 1])
    extra = (1.0,) if shrink else (0, fan_out, True) if name.endswith("slice") else (True,)
    base = torch.randn(rows, fan_out)
    out = base.clone()
    masked(inputs, weights, out, indices, *extra)
    for row, slot in enumerate(indices.tolist()):
        if slot < 0:
            # shrink writes the row's buffer (zeros: expand then adds nothing); expand adds
            want = torch.zeros(fan_out) if shrink else base[row]
            assert torch.equal(out[row], want), (name, row)
            continue
        alone = base[row:row + 1].clone()
        op(inputs[row:row + 1], weights, alone, indices[row:row + 1], *extra)
        torch.testing.assert_close(out[row], alone[0])
    assert masked.lora_sync_masked and getattr(masked, "__wrapped__") is op


def test_every_cpu_caller_gets_the_masked_ops():
    pytest.importorskip("vllm")
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from vllm_ext import engine_api
    engine_api.mask_unadapted_rows()
    engine_api.mask_unadapted_rows()  # idempotent: wrapped once
    for name in engine_api.UNMASKED_OPS:
        masked = getattr(lora_ops, name)
        assert not getattr(masked.__wrapped__, "lora_sync_masked", False)
        for module in (torch_ops, punica_cpu):
            assert getattr(module, name) is masked, (module.__name__, name)
    # the sgmv ops call the bgmv ones through lora_ops' names: masked too
    indices, seq_lens = torch.tensor([-1]), torch.tensor([2])
    out = torch.ones(2, 4)
    lora_ops.sgmv_shrink(torch.randn(2, 6), torch.randn(1, 1, 4, 6), out, None, seq_lens,
                         indices, 1, 2, 2, 1.0)
    assert torch.equal(out, torch.zeros(2, 4))


# -- real servers: a random sequence --------------------------------------------------------
def _concurrently(calls: dict) -> dict:
    out, errors = {}, []

    def run(key, fn):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((key, e))
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(out) == len(calls), errors
    return out


def test_no_name_changes_anothers_output(server, model_dir):
    """Random pushes (every kind), retirements and mixed batches; after each step the base
    model and every live adapter answer as they do alone: the base as before any adapter,
    each adapter as PEFT (the first N tokens of a longer run in the same batch)."""
    rng = random.Random(52)
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as c:
        base = server_greedy(c, "base", PROMPT, N)
        live: dict[str, list[int]] = {}  # name -> PEFT's tokens
        for step in range(STEPS):
            if live and (len(live) >= 3 or rng.random() < 0.25):
                name = rng.choice(sorted(live))
                c.retire(name)
                del live[name]
            else:
                kind = list(KINDS)[step % len(KINDS)] if step < len(KINDS) else \
                    rng.choice(list(KINDS))
                adapter, want = oracle(model_dir, 5200 + step, PROMPT, N, **KINDS[kind])
                name = f"xt-{kind[:3]}-{step}"
                [res] = c.push(adapter, name, transport="tensors")
                assert server_greedy(c, res.name, PROMPT, N) == want, (kind, "alone")
                live[name] = want
            # the base request is sent while the adapters' longer requests run
            calls = {name: (lambda n=name: server_greedy(c, n, PROMPT, LONG)[:N])
                     for name in live}
            calls["base"] = lambda: server_greedy(c, "base", PROMPT, N)
            got = _concurrently(calls)
            assert got.pop("base") == base, (step, sorted(live))
            assert got == live, step
            assert server_greedy(c, "base", PROMPT, N) == base, ("alone", step)
        for name in live:
            c.retire(name)
        assert server_greedy(c, "base", PROMPT, N) == base
    assert server.alive(), server.log_tail()
