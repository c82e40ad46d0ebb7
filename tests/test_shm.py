"""The same-host transport (shm) on real vLLM and SGLang CPU servers: token identity with the
disk load, automatic selection, and the HTTP fallback from another PID namespace. The lease
rules (seal, tokens, expiry, budgets, abuse) are checked with the fake engine in
test_service_shm.py. Also: one sealed copy shared by a vLLM and an SGLang server (the
shared transport; its rules in test_shared_copy.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from lora_sync import http, wire
from lora_sync.transports import shm

from .helpers import AUTH, disk_model, greedy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lease(client, nbytes):
    return shm.Lease.from_json(http.call("POST", client.servers[0].route(shm.LEASE_ROUTE),
                                         json_body={"nbytes": nbytes}, headers=AUTH)[0])


def commit(client, lease_or_ticket):
    ticket = lease_or_ticket if isinstance(lease_or_ticket, dict) else \
        {"lease_id": lease_or_ticket.lease_id, "token": lease_or_ticket.token}
    status, reply, _ = http.request("POST", client.servers[0].route(shm.COMMIT_ROUTE),
                                    json_body=ticket, headers=AUTH)
    return status, reply


def parts_of(adapter, name, version=None):
    return wire.layout(adapter.tensors, adapter.metadata(name, version))


def open_leases(client):
    return client.info()[0]["open_leases"]


def test_shm_matches_disk_and_is_chosen_on_the_same_host(client, make_adapter, workdir):
    adapter = make_adapter(seed=801)
    adapter.save(workdir / "disk-801")
    client.load_from_disk(str(workdir / "disk-801"), "disk-801")
    [res] = client.push(adapter, "shm801")  # transport="auto"
    assert res.transport == "shm" and res.version == 1 and res.bytes == adapter.nbytes
    from_disk = greedy(client, disk_model(client, "disk-801"))
    assert greedy(client, "shm801") == from_disk
    [res2] = client.push(make_adapter(seed=802), "shm801", transport="shm")
    assert res2.version == 2 and greedy(client, "shm801") != from_disk
    assert greedy(client, "shm801-v1") == from_disk
    # The reply and the listing never show a lease, token or path.
    listed = json.dumps(client.adapters()[0]) + json.dumps(res2.reply)
    assert "/proc/" not in listed and "token" not in listed and "lease_id" not in listed


PUSH_FROM_ELSEWHERE = """
import sys
from lora_sync import LoRASyncClient, LoRAAdapter
url, engine, key, path = sys.argv[1:5]
with LoRASyncClient(url, engine=engine, api_key=key) as c:
    [res] = c.push(LoRAAdapter.from_dir(path), "elsewhere")
print(res.transport, res.version)
"""


def test_auto_falls_back_to_http_where_the_lease_is_out_of_reach(client, server, make_adapter,
                                                                  workdir):
    """A trainer in its own PID namespace cannot see the server's /proc: like one on another
    host, it gets HTTP from transport='auto'."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give the trainer its own PID namespace")
    adapter = make_adapter(seed=831)
    adapter.save(workdir / "elsewhere")
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", PUSH_FROM_ELSEWHERE,
         server.url, server.engine, server.api_key, str(workdir / "elsewhere")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-2000:]
    transport, version = out.stdout.split()[-2:]
    assert transport == "tensors" and int(version) >= 1
    assert open_leases(client) == 0  # the unreachable lease was cancelled, not left behind
    assert greedy(client, "elsewhere") == greedy(client, f"elsewhere-v{version}")


def test_one_copy_serves_a_real_vllm_and_a_real_sglang_server_like_disk(vllm, sglang,
                                                                        make_adapter, workdir):
    """Real engines: one sealed copy, mapped by a vLLM and an SGLang server on this host,
    chosen by `auto` for the two, serves on each exactly what the same adapter loaded from
    disk serves there."""
    from lora_sync import LoRASyncClient, Server
    adapter = make_adapter(seed=4601)
    adapter.save(workdir / "disk-4601")
    servers = [Server(vllm.url, "vllm"), Server(sglang.url, "sglang")]
    with LoRASyncClient(servers, api_key=vllm.api_key) as both:
        both.load_from_disk(str(workdir / "disk-4601"), "disk-4601")
        try:
            results = both.push(adapter, "shared4601")  # transport="auto"
            assert [r.transport for r in results] == ["shared", "shared"], results
            for i, server in enumerate(both.servers):
                one = LoRASyncClient(server, api_key=vllm.api_key)
                with one:
                    assert greedy(one, "shared4601") == \
                        greedy(one, disk_model(one, "disk-4601")), server.engine
        finally:
            both.retire("shared4601")
            both.unload_from_disk("disk-4601")
