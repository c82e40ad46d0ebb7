"""A sharded (FSDP2) trainer pushes into a real vLLM server: `push` is called on every rank,
the shards are gathered to rank 0, which alone talks to the server, and every rank gets the
same results. The served adapter must be token-identical to the gathered adapter loaded from
disk, in float32 and cast to bfloat16 (half the bytes)."""
from __future__ import annotations

import json

from lora_sync import LoRASyncClient

from .conftest import API_KEY, REPO
from .helpers import greedy, torchrun

WORKER = REPO / "tests" / "sharded_push_worker.py"


def test_fsdp2_trainer_pushes_on_every_rank(vllm, model_dir, tmp_path):
    rc, log = torchrun(WORKER, tmp_path, model_dir, env={
        "LORA_SYNC_TEST_URL": vllm.url, "LORA_SYNC_TEST_ENGINE": "vllm",
        "LORA_SYNC_TEST_KEY": API_KEY})
    assert rc == 0, log[-8000:]
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in (0, 1)]
    for key in ("versions", "bytes_fp32", "bytes_bf16", "refusal"):
        assert reports[0][key] == reports[1][key], key  # every rank got rank 0's results
    assert reports[0]["versions"] == [1, 2, 3]
    assert reports[0]["refusal"] == ["BadRequest", "bad_name"]  # the server's own error
    assert reports[0]["bytes_bf16"] * 2 == reports[0]["bytes_fp32"]
    print(f"\nsharded push: fp32 {reports[0]['bytes_fp32']} B, bf16 {reports[0]['bytes_bf16']} B;"
          f" push {reports[0]['push_ms']} ms, gather alone {reports[0]['gather_ms_median']:.1f} ms")

    with LoRASyncClient(vllm.url, api_key=API_KEY) as client:
        assert greedy(client, "fsdp") != greedy(client, "base")  # training moved the LoRA
        for pushed, saved in (("fsdp", "final"), ("fsdp-bf16", "final-bf16")):
            client.load_from_disk(str(tmp_path / saved), f"disk-{saved}")
            try:
                assert greedy(client, pushed) == greedy(client, f"disk-{saved}"), saved
            finally:
                client.unload_from_disk(f"disk-{saved}")
