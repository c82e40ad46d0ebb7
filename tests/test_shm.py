"""The same-host transport (shm) on real vLLM and SGLang CPU servers: leases, commits, the
seal, automatic selection and its HTTP fallback, and every way a lease can be abused."""
from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import time

import pytest

from lora_sync import http, wire
from lora_sync.errors import TooBusy
from lora_sync.transports import shm

from .helpers import AUTH, disk_model, greedy, versions_of

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


def test_committed_bytes_cannot_change(client, make_adapter):
    """The trainer keeps the lease's path: after the commit it can neither write the bytes
    nor map them writable, and a commit while it still maps them is refused."""
    name = f"seal-{client.servers[0].engine}"
    client.push(make_adapter(seed=811), name, transport="shm")
    before = greedy(client, name)
    parts = parts_of(make_adapter(seed=812), name)
    granted = lease(client, shm.total_bytes(parts))
    assert shm.write_lease(granted, parts)
    fd = os.open(granted.path, os.O_RDWR)
    held = mmap.mmap(fd, granted.nbytes)  # still mapped writable at commit time
    status, reply = commit(client, granted)
    assert status == 409 and reply["error"]["code"] == "lease_mapped", reply
    held.close()
    os.close(fd)
    assert versions_of(client, name) == [1] and greedy(client, name) == before

    granted = lease(client, shm.total_bytes(parts))
    assert shm.write_lease(granted, parts)
    fd = os.open(granted.path, os.O_RDWR)  # kept open across the commit
    try:
        status, reply = commit(client, granted)
        assert status == 200, reply
        after = greedy(client, name)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 4096, 4096)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, granted.nbytes)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 8)
    finally:
        os.close(fd)
    assert greedy(client, name) == after != before


def test_abused_leases_are_refused_and_change_nothing(client, server, make_adapter):
    name = f"abuse-{server.engine}"
    client.push(make_adapter(seed=821), name, transport="shm")
    before = greedy(client, name)
    parts = parts_of(make_adapter(seed=822), name)
    size = shm.total_bytes(parts)

    granted = lease(client, size)
    assert shm.write_lease(granted, parts)
    forged = {"lease_id": granted.lease_id, "token": "0" * 64}
    status, reply = commit(client, forged)
    assert status == 403 and reply["error"]["code"] == "bad_token", reply
    for bad_id in ("../../etc/passwd", "/proc/1/fd/0", "0" * 31 + "g", granted.path):
        status, reply = commit(client, {"lease_id": bad_id, "token": granted.token})
        assert status == 400, (bad_id, reply)
    assert commit(client, granted)[0] == 200          # the real one still commits, once
    status, reply = commit(client, granted)            # reused token
    assert status == 404 and reply["error"]["code"] == "unknown_lease", reply
    assert versions_of(client, name) == [1, 2]
    after = greedy(client, name)

    wrong = lease(client, size + 4096)                 # a lease of the wrong size
    assert shm.write_lease(wrong, parts)
    status, reply = commit(client, wrong)
    assert status == 400 and reply["error"]["code"] == "bad_safetensors", reply
    short = lease(client, size - 4096)                 # the header promises more bytes
    assert shm.write_lease(short, parts[:1])
    status, reply = commit(client, short)
    assert status == 400, reply
    for nbytes in (0, -1, 2 ** 62, "10", 1.5):
        status, reply, _ = http.request("POST", client.servers[0].route(shm.LEASE_ROUTE),
                                        json_body={"nbytes": nbytes}, headers=AUTH)
        assert 400 <= status < 500, (nbytes, status, reply)
    status, _, _ = http.request("POST", client.servers[0].route(shm.LEASE_ROUTE),
                                json_body={"nbytes": 4096})  # no key
    assert status == 401
    keyless = lease(client, size)
    for route in (shm.COMMIT_ROUTE, shm.CANCEL_ROUTE):  # a token alone opens nothing
        status, _, _ = http.request("POST", client.servers[0].route(route), json_body={
            "lease_id": keyless.lease_id, "token": keyless.token})
        assert status == 401, route
    assert http.call("POST", client.servers[0].route(shm.CANCEL_ROUTE), headers=AUTH,
                     json_body={"lease_id": keyless.lease_id, "token": keyless.token})[0]
    for bad in ({"lease_id": 7, "token": "x"}, {"lease_id": "0" * 32}, {"token": ["x"]}):
        status, _, _ = http.request("POST", client.servers[0].route(shm.COMMIT_ROUTE),
                                    json_body=bad, headers=AUTH)
        assert status == 400, bad
    assert versions_of(client, name) == [1, 2] and greedy(client, name) == after
    assert greedy(client, f"{name}-v1") == before
    assert server.alive()


def test_leases_never_committed_expire(client, server):
    """The test servers set LORA_SYNC_LEASE_TTL_S=3: a lease left alone is freed."""
    granted = lease(client, 1 << 20)
    assert open_leases(client) >= 1
    deadline = time.time() + 30
    while open_leases(client) and time.time() < deadline:
        time.sleep(0.5)
    assert open_leases(client) == 0
    status, reply = commit(client, granted)
    assert status == 404 and reply["error"]["code"] == "unknown_lease", reply
    # Its descriptor is closed (the number may already name another file of the server's):
    # the lease can no longer be written.
    assert not shm.write_lease(granted, [b"late"])
    assert server.alive()


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


def test_open_leases_and_uploads_share_one_staging_budget(client, make_adapter):
    """The test servers allow 6 MB of staging: two open 3 MB leases leave no room for an HTTP
    body (429 staging_full), and cancelling them gives it back."""
    leases = [lease(client, 3 * 2 ** 20) for _ in range(2)]
    name = f"budget-{client.servers[0].engine}"
    try:
        with pytest.raises(TooBusy) as refused:
            client.push(make_adapter(seed=841), name, transport="tensors")
        assert refused.value.code == "staging_full"
    finally:
        for granted in leases:
            http.call("POST", client.servers[0].route(shm.CANCEL_ROUTE), headers=AUTH,
                      json_body={"lease_id": granted.lease_id, "token": granted.token})
    assert open_leases(client) == 0
    assert client.push(make_adapter(seed=841), name, transport="tensors")[0].version == 1
