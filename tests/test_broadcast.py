"""The broadcast transport (gloo here; the same code path takes nccl) on real servers."""
import signal
import subprocess
import sys
import time

import pytest

from lora_sync import BadAdapter, LoRAAdapter, LoRASyncClient, Server, http

from .helpers import AUTH, disk_model, greedy


def test_broadcast_matches_disk(client, make_adapter, workdir):
    adapter = make_adapter(seed=51)
    adapter.save(workdir / "disk-51")
    client.load_from_disk(str(workdir / "disk-51"), "disk-51")
    client.init_group()
    [res] = client.broadcast(adapter, "b51")
    assert res.name == "b51-v1" and res.reply["transport"] == "broadcast"
    from_disk = greedy(client, disk_model(client, "disk-51"))
    assert greedy(client, "b51") == from_disk != greedy(client, "base")
    client.destroy_group()


def test_ten_versions_in_one_group_follow_the_weights(client, make_adapter):
    a, b = make_adapter(seed=61), make_adapter(seed=62)
    # Several buckets per sync, over three connections: the workers must join with as many
    # (a server that kept its default of collective.DEFAULT_STREAMS would never join).
    client.init_group(bucket_bytes=64 * 1024, streams=3)
    outputs = {}
    for v in range(1, 11):
        [res] = client.broadcast(a if v % 2 else b, "ten")
        assert res.version == v
        outputs[v] = greedy(client, "ten")
        assert greedy(client, f"ten-v{v}") == outputs[v]
    client.destroy_group()
    assert outputs[1] != outputs[2]
    assert all(outputs[v] == outputs[1 if v % 2 else 2] for v in outputs)


def test_two_servers_one_group(vllm, moe_vllm, moe_dir):
    """One group of the trainer and two real vLLM servers (the session's, and the MoE model's:
    a second server that runs anyway; their attention layers have the same shapes): each
    server serves the broadcast version as it serves the same adapter pushed by tensors,
    and not as its base model."""
    from .peft_oracle import peft_model
    adapter = LoRAAdapter.from_peft_model(peft_model(
        moe_dir, 71, r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with LoRASyncClient([vllm.url, moe_vllm.url], api_key=vllm.api_key) as c:
        group = c.init_group()
        assert group.world_size == 3  # trainer + one worker per server
        results = c.broadcast(adapter, "two")
        assert [r.name for r in results] == ["two-v1", "two-v1"]
        c.destroy_group()
        c.push(adapter, "two-by-http", transport="tensors")
        for i in (0, 1):
            text = {m: c.complete("the quick brown", m, 12, server=i)["text"]
                    for m in ("two", "two-by-http", "base")}
            assert text["two"] == text["two-by-http"] != text["base"], (i, text)


def test_bad_metadata_refused_before_any_collective(client, make_adapter, model_dir):
    client.init_group()
    good = make_adapter(seed=81)
    client.broadcast(good, "meta")
    before = greedy(client, "meta")
    too_big = make_adapter(seed=82, rank=128)  # server max rank is 64
    with pytest.raises(BadAdapter, match="rank"):
        client.broadcast(too_big, "meta")
    # The server refuses on its own too (no trainer-side check): 4xx, no collective entered.
    body = {"lora_name": "meta", "adapter_config": good.config, "group_name": "default",
            "group_token": client.states["broadcast"].group.tokens[client.servers[0].url], "transfer_id": 1, "tensors": [{"name": "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight",
                         "dtype": "F32", "shape": [8, 128]}]}
    status, reply, _ = http.request("POST", client.servers[0].route(
        "load_lora_adapter_from_distributed"), json_body=body, headers=AUTH)
    assert status == 400 and reply["error"]["code"] == "unknown_module"
    # The group is still in step: the next broadcast works.
    client.broadcast(make_adapter(seed=83), "meta")
    assert greedy(client, "meta-v1") == before
    assert greedy(client, "meta") != before
    client.destroy_group()


def group_names(client) -> set:
    """Groups the server's workers still hold (waits while a receive RPC runs)."""
    info = http.call("GET", client.servers[0].route("lora_sync_info"), headers=AUTH)[0]
    return set(info["worker_status"][0].get("groups", []))


def wait_until_group_dropped(client, group: str = "default", within_s: float = 60) -> None:
    deadline = time.time() + within_s
    while group in group_names(client) and time.time() < deadline:
        time.sleep(0.5)
    assert group not in group_names(client), f"the workers still hold group {group!r}"


DYING_TRAINER = r"""
import sys, time
from lora_sync import LoRASyncClient, LoRAAdapter, collective
url, engine, adapter_dir, key = sys.argv[1:5]
c = LoRASyncClient(url, engine=engine, api_key=key)
c.init_group(timeout_s=5, bucket_bytes=16 * 1024)
real = collective.send_transfer
def first_bucket_then_stall(group, *args, **kwargs):
    queued, start = [], group.start_broadcast
    def header_and_one_bucket(tensor, src=0):
        if len(queued) == 2:
            print("SENT-FIRST-BUCKET", flush=True)
            time.sleep(3600)
        queued.append(tensor)
        return start(tensor, src)
    group.start_broadcast = header_and_one_bucket
    real(group, *args, **kwargs)
collective.send_transfer = first_bucket_then_stall
c.broadcast(LoRAAdapter.from_dir(adapter_dir), "dying")
"""


@pytest.mark.parametrize("fault", ["killed", "silent"])
def test_trainer_dies_or_stalls_mid_broadcast(client, server, make_adapter, workdir, fault):
    """'killed': the trainer process dies after the first bucket. 'silent': it stays alive
    but sends nothing more, so the workers' group times out (5 s)."""
    client.push(make_adapter(seed=91), "survivor", transport="tensors")
    before = greedy(client, "survivor")
    make_adapter(seed=92).save(workdir / "dying")
    trainer = subprocess.Popen([sys.executable, "-c", DYING_TRAINER, server.url, server.engine,
                                str(workdir / "dying"), server.api_key], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert trainer.stdout.readline().strip() == "SENT-FIRST-BUCKET"
        # Mid-transfer, the engine keeps generating: the receive runs beside the engine loop.
        assert greedy(client, "survivor") == before
        if fault == "silent":
            wait_until_group_dropped(client)  # the group times out after 5 s
            assert trainer.poll() is None, "the stalled trainer should still be alive"
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    wait_until_group_dropped(client)  # 'killed': the receive fails once the peer is gone
    # The worker's receive fails (peer gone or timeout); the server keeps serving.
    assert greedy(client, "survivor") == before
    names = [a["name"] for a in client.adapters()[0]["adapters"]]
    assert "dying" not in names
    assert server.alive()
    # A new group can be formed and used.
    client.init_group()
    client.broadcast(make_adapter(seed=93), "survivor")
    assert greedy(client, "survivor") != before
    client.destroy_group()


@pytest.fixture(scope="module")
def vllm_tp2(model_dir):
    pytest.importorskip("vllm")
    from testbed.processes import vllm_server
    server = vllm_server(model_dir, extra_args=["--tensor-parallel-size", "2"],
                         env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    with server:
        yield server


@pytest.mark.extended  # CI time: a second vLLM topology (workers of one server, TP 2)
def test_tensor_parallel_2_broadcast_and_tensors_match_disk(vllm_tp2, make_adapter, workdir):
    adapter = make_adapter(seed=101)
    adapter.save(workdir / "disk-101")
    with LoRASyncClient(vllm_tp2.url) as c:
        c.load_from_disk(str(workdir / "disk-101"), "disk")
        group = c.init_group()
        assert group.world_size == 3  # trainer + 2 TP workers, each gets full tensors
        c.broadcast(adapter, "bc")
        c.destroy_group()
        c.push(adapter, "t", transport="tensors")
        [res] = c.push(adapter, "s", transport="shm")  # both TP ranks map the sealed lease
        assert res.transport == "shm"
        disk = greedy(c, "disk")
        assert greedy(c, "bc") == disk == greedy(c, "t") == greedy(c, "s") != greedy(c, "base")


def test_one_client_drives_vllm_and_sglang(vllm, sglang, make_adapter):
    """The same client calls work on both engines, with the same kind of replies; one
    broadcast group even spans both servers' workers."""
    adapter = make_adapter(seed=111)
    with LoRASyncClient([Server(vllm.url, "vllm"), Server(sglang.url, "sglang")],
                        api_key=vllm.api_key) as c:
        pushed = c.push(adapter, "both", transport="tensors")
        assert [r.name for r in pushed] == ["both-v1", "both-v1"]
        assert set(pushed[0].reply) == set(pushed[1].reply)
        leased = c.push(adapter, "both-shm", transport="shm")  # same replies as HTTP
        assert set(leased[0].reply) == set(leased[1].reply) == set(pushed[0].reply)
        c.init_group()
        cast = c.broadcast(make_adapter(seed=112), "both")
        assert [r.name for r in cast] == ["both-v2", "both-v2"]
        c.destroy_group()
        replies = [c.complete("the quick brown", "both", 12, server=i) for i in (0, 1)]
        assert [r["version"] for r in replies] == [2, 2]
        # Same weights, same fp32 math: the two engines generate the same tokens (they only
        # differ in whether a trailing incomplete UTF-8 byte is shown as U+FFFD).
        texts = [r["text"].rstrip("\ufffd") for r in replies]
        assert texts[0] == texts[1] != greedy(c, "base").rstrip("\ufffd")
        lists = c.adapters()
        assert [a["alias_target"] for a in lists[0]["adapters"] if a["name"] == "both"] == \
               [a["alias_target"] for a in lists[1]["adapters"] if a["name"] == "both"]
