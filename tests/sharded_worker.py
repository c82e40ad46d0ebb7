"""torchrun worker for tests/test_sharded.py: FSDP2 (fully_shard) LoRA training on CPU/gloo,
then gather_adapter / share_result checked against independent references.

Usage: torchrun --nproc_per_node 2 tests/sharded_worker.py OUT_DIR"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from peft import get_peft_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lora_sync import LoRAAdapter
from lora_sync.adapter import peft_state, sibling_order
from lora_sync.trainer import sharded
from lora_sync.trainer.sharded import gather_adapter, share_result
from testbed.tiny_model import build_tiny_model, make_lora

torch.set_num_threads(1)  # 2 cores, 2 ranks
RANK_R, TARGETS, STEPS, LR = 8, ["q_proj", "v_proj"], 2, 0.5
SHARED = {"pushed": ["policy@v3"], "version": 3, "ok": True,
          "nested": {"loss": 1.25, "none": None, "text": "é ✓ 漢字"}}


def count_slow_gathers():
    """Counts DTensors gathered one by one (DTensor.full_tensor), not by the one flat gather."""
    calls = []
    full = sharded._full
    sharded._full = lambda t: (calls.append(isinstance(t, DTensor)), full(t))[1]
    return calls


def odd_shardings(rank: int, world: int) -> dict:
    """Placements FSDP2 does not produce: uneven / empty shards, Shard(1), Replicate, plain."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    cases = {"uneven": (5, [Shard(0)]), "empty": (1, [Shard(0)]), "dim1": (6, [Shard(1)]),
             "repl": (3, [Replicate()]), "plain": (2, None)}
    out = {}
    for name, (r, placement) in cases.items():
        for half, shape in (("A", (r, 16)), ("B", (24, r))):
            full = torch.randn(shape, generator=g).to(torch.bfloat16 if name == "repl"
                                                      else torch.float32)
            key = f"m.{name}.q_proj.lora_{half}.weight"
            out[key] = (full, full if placement is None else
                        distribute_tensor(full, mesh, placement))
    return out


def shard(peft_model):
    for layer in peft_model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(peft_model)
    return peft_model


def batches(step: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randint(0, 384, (2, 16), generator=g) for _ in range(world)]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    if rank == 0:
        build_tiny_model(out / "tiny")
    dist.barrier()  # one writer for the model directory
    model_dir = out / "tiny"
    report: dict = {"world": world}

    # Two identical LoRA models (make_lora is seeded): one sharded, one plain replica.
    model = shard(make_lora(model_dir, rank=RANK_R, target_modules=TARGETS))
    replica = make_lora(model_dir, rank=RANK_R, target_modules=TARGETS)
    initial = {k: v.clone() for k, v in LoRAAdapter.from_peft_model(replica).tensors.items()}

    # Still shards, whatever PEFT does with DTensors (0.22 gathers each itself; 0.21 not).
    state = peft_state(model)
    assert sorted(state) == sorted(get_peft_model_state_dict(model))
    not_dt = [k for k, v in state.items() if not isinstance(v, DTensor)]
    assert state and not not_dt, f"expected DTensors under fully_shard, plain: {not_dt}"
    a_key = next(k for k in state if "lora_A" in k)
    report["keys"] = sorted(state)
    report["local_shape_A"] = list(state[a_key].to_local().shape)
    report["global_shape_A"] = list(state[a_key].shape)
    report["placements"] = str(state[a_key].placements)
    assert state[a_key].to_local().shape[0] == RANK_R // world, report

    # Each rank trains on its own batch; FSDP2 averages gradients, so the replica trains on
    # the mean loss over both ranks' batches.
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    ropt = torch.optim.SGD([p for p in replica.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        data = batches(step, world)
        model(input_ids=data[rank], labels=data[rank]).loss.backward()
        opt.step()
        opt.zero_grad()
        loss = sum(replica(input_ids=d, labels=d).loss for d in data) / world
        loss.backward()
        ropt.step()
        ropt.zero_grad()

    slow = count_slow_gathers()
    t0 = time.perf_counter()
    gathered = gather_adapter(model)
    assert not any(slow), f"FSDP2 shards took the one-by-one path: {slow}"
    report["gather_ms_r8"] = (time.perf_counter() - t0) * 1e3
    state = peft_state(model)
    direct = {k: state[k].full_tensor().detach() for k in sorted(state)}  # reference 1
    from_plain = gather_adapter(replica)  # plain tensors under a 2-rank group
    from_adapter = gather_adapter(LoRAAdapter.from_peft_model(model))  # DTensors in an adapter
    bf16 = gather_adapter(model, dtype=torch.bfloat16)
    bf16_name = gather_adapter(model, dtype="bfloat16")
    for bad in ("int8", torch.int8, "bf16", 16):
        try:
            gather_adapter(model, dtype=bad)
        except ValueError as e:
            assert repr(bad) in str(e), str(e)
        else:
            raise AssertionError(f"dtype={bad!r} was accepted")

    if rank != 0:
        assert all(x is None for x in (gathered, from_plain, from_adapter, bf16, bf16_name))
    else:
        # PEFT's key order, fused siblings brought together as every LoRAAdapter does
        assert list(gathered.tensors) == list(sibling_order(state)), "key order kept"
        assert gathered.config["r"] == RANK_R and gathered.config["target_modules"] == TARGETS
        replica_t = LoRAAdapter.from_peft_model(replica).tensors
        for k, full in direct.items():
            g = gathered.tensors[k]
            assert not isinstance(g, DTensor) and g.is_contiguous() and not g.requires_grad
            assert g.dtype == torch.float32 and g.shape == full.shape, (k, g.shape)
            assert torch.equal(g, full), k  # exact: same bytes as full_tensor()
            assert torch.equal(from_adapter.tensors[k], full), k
            assert torch.equal(from_plain.tensors[k], replica_t[k]), k
            # reference 2: the unsharded replica trained on the same data
            assert torch.allclose(g, replica_t[k], rtol=1e-5, atol=1e-6), \
                (k, (g - replica_t[k]).abs().max())
            assert not torch.equal(g, initial[k]), f"{k} did not train"
            for b in (bf16, bf16_name):
                assert b.tensors[k].dtype == torch.bfloat16
                assert torch.equal(b.tensors[k], full.to(torch.bfloat16)), k
        report["max_abs_diff_vs_replica"] = max(
            (gathered.tensors[k] - replica_t[k]).abs().max().item() for k in direct)
        # plain path copies: training the replica further must not change what was gathered
        before = replica_t[a_key].clone()
        with torch.no_grad():
            for n, p in replica.named_parameters():
                if "lora_" in n:
                    p.add_(1.0)
        assert not torch.equal(replica_t[a_key], before)  # (from_peft_model aliases params)
        assert torch.equal(from_plain.tensors[a_key], before)
        gathered.save(out / "gathered")
        bf16.save(out / "gathered_bf16")

    # Other layouts: uneven and empty shards go through the flat gather, Shard(1) and Replicate
    # through full_tensor(); mixed dtypes and plain tensors come back unchanged.
    odd = odd_shardings(rank, world)
    slow.clear()
    got = gather_adapter(LoRAAdapter({k: d for k, (_, d) in odd.items()},
                                     {"r": 8, "target_modules": ["q_proj"]}))
    assert slow.count(True) == 4, slow  # dim1 and repl, A and B
    if rank == 0:
        for k, (full, _) in odd.items():
            assert got.tensors[k].dtype == full.dtype and torch.equal(got.tensors[k], full), k
    else:
        assert got is None
    local_rows = {k.split(".")[1]: d.to_local().shape[0] for k, (_, d) in odd.items()
                  if "lora_A" in k and isinstance(d, DTensor)}
    report[f"odd_local_rows_rank{rank}"] = local_rows
    # Ranks that disagree on the tensors raise (all of them) instead of hanging.
    mine = {k: d for k, (_, d) in odd.items() if "uneven" in k}
    if rank == 1:
        mine["m.extra.q_proj.lora_A.weight"] = torch.zeros(2, 16)
        mine["m.extra.q_proj.lora_B.weight"] = torch.zeros(24, 2)
    try:
        gather_adapter(LoRAAdapter(mine, {"r": 5, "target_modules": ["q_proj"]}))
    except RuntimeError as e:
        assert "hold other LoRA tensors" in str(e), e
    else:
        raise AssertionError("ranks with different tensors were gathered")

    # share_result: rank 0 -> all, rank 1 -> all, and an unencodable value fails on every rank
    # without leaving the ranks out of step.
    got = share_result(SHARED if rank == 0 else None)
    assert got == SHARED, got
    (out / f"share_{rank}.json").write_text(json.dumps(got, ensure_ascii=False))
    back = share_result({"from": rank} if rank == 1 else "ignored", src=1)
    assert back == {"from": 1}, back
    try:
        share_result({"bad": object()} if rank == 0 else None)
    except (TypeError, RuntimeError) as e:
        report[f"share_error_rank{rank}"] = type(e).__name__
    else:
        raise AssertionError("unencodable value was shared")
    assert share_result([] if rank == 0 else None) == []
    errors = share_result(report.get("share_error_rank0") if rank == 0 else None)
    assert errors == "TypeError" and report[f"share_error_rank{rank}"] in ("TypeError",
                                                                          "RuntimeError")

    # Timing: a rank-64 all-linear adapter on the tiny model (warm-up, then the median of 5).
    big = shard(make_lora(model_dir, rank=64))
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        gather_adapter(big, dtype=dtype)
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            a = gather_adapter(big, dtype=dtype)
            times.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            report[f"gather_ms_r64_{name}"] = statistics.median(times)
            report[f"r64_{name}_mb"] = a.nbytes / 2 ** 20
            report["r64_tensors"] = len(a.tensors)
            print(f"gather r64 {name}: {statistics.median(times):.1f} ms median "
                  f"({a.nbytes / 2**20:.2f} MiB, {len(a.tensors)} tensors)", flush=True)

    if rank == 0:
        (out / "report.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # The report is written and the group destroyed: leave without interpreter finalization,
    # where gloo's worker threads can still drop tensors and abort the process (a torch
    # teardown race, "terminate called without an active exception"; seen once in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
