"""torchrun worker for tests/test_sharded_push.py: a 2-rank FSDP2 trainer (gloo, CPU) that
pushes its LoRA into a real server every step, calling `push` on every rank.

Usage: torchrun --nproc_per_node 2 tests/sharded_push_worker.py OUT_DIR MODEL_DIR
(server from LORA_SYNC_TEST_URL / _ENGINE / _KEY)"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lora_sync import LoRASyncClient
from lora_sync.errors import LoRASyncError
from lora_sync.trainer.sharded import gather_adapter
from sharded_worker import LR, RANK_R, TARGETS, batches, shard
from testbed.tiny_model import make_lora

torch.set_num_threads(1)
STEPS = 3


def main(out: Path, model_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(make_lora(model_dir, rank=RANK_R, target_modules=TARGETS))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    client = LoRASyncClient(os.environ["LORA_SYNC_TEST_URL"],
                            engine=os.environ["LORA_SYNC_TEST_ENGINE"],
                            api_key=os.environ["LORA_SYNC_TEST_KEY"])
    report = {"rank": rank, "versions": [], "push_ms": [], "gather_ms": []}
    for step in range(STEPS):
        data = batches(step, world)
        model(input_ids=data[rank], labels=data[rank]).loss.backward()
        opt.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        [result] = client.push(model, "fsdp", transport="tensors")  # on every rank
        report["push_ms"].append((time.perf_counter() - t0) * 1e3)
        report["versions"].append(result.version)
        report["bytes_fp32"] = result.bytes
    for _ in range(3):  # the gather alone: the trainer-side overhead of a sharded push
        t0 = time.perf_counter()
        gather_adapter(model)
        report["gather_ms"].append((time.perf_counter() - t0) * 1e3)
    [result] = client.push(model, "fsdp-bf16", transport="tensors", dtype=torch.bfloat16)
    report["bytes_bf16"], report["bf16_version"] = result.bytes, result.version
    # What a disk load of the same adapters should match (rank 0 writes them).
    final, cast = gather_adapter(model), gather_adapter(model, dtype="bfloat16")
    if rank == 0:
        final.save(out / "final")
        cast.save(out / "final-bf16")
    try:  # a refusal on rank 0 reaches every rank as the same error
        client.push(model, "bad name!", transport="tensors")
        report["refusal"] = None
    except LoRASyncError as e:
        report["refusal"] = [type(e).__name__, e.code]
    report["gather_ms_median"] = statistics.median(report["gather_ms"])
    (out / f"report-{rank}.json").write_text(json.dumps(report))
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    # The report is written and the group destroyed: leave without interpreter finalization,
    # where gloo's worker threads can still drop tensors and abort the process (a torch
    # teardown race, "terminate called without an active exception"; seen once in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
