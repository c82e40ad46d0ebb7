"""The tensor route on real vLLM and SGLang CPU servers."""
import pytest

from lora_sync import LoRASyncClient, http
from lora_sync.errors import VersionConflict

from .helpers import AUTH, bad_bodies, disk_model, greedy, post_body


def test_tensors_match_disk_and_differ_from_base(client, make_adapter, workdir):
    adapter = make_adapter(seed=11)
    adapter.save(workdir / "disk-11")
    client.load_from_disk(str(workdir / "disk-11"), "disk-11")
    [res] = client.push(adapter, "t11", transport="tensors")
    assert res.name == "t11-v1" and res.version == 1 and res.bytes == adapter.nbytes
    assert res.reply["load_ms"] > 0
    from_disk = greedy(client, disk_model(client, "disk-11"))
    assert greedy(client, "t11-v1") == from_disk
    assert greedy(client, "t11") == from_disk
    assert greedy(client, "base") != from_disk


def test_versions_and_alias(client, make_adapter):
    v1, v2 = make_adapter(seed=21), make_adapter(seed=22)
    assert client.push(v1, "ver", transport="tensors")[0].name == "ver-v1"
    out_v1 = greedy(client, "ver-v1")
    assert greedy(client, "ver") == out_v1
    assert client.push(v2, "ver", transport="tensors")[0].name == "ver-v2"
    out_v2 = greedy(client, "ver-v2")
    assert out_v2 != out_v1
    assert greedy(client, "ver") == out_v2
    assert greedy(client, "ver-v1") == out_v1
    # Explicit versions must go up.
    assert client.push(v1, "ver", version=7, transport="tensors")[0].name == "ver-v7"
    with pytest.raises(VersionConflict):
        client.push(v2, "ver", version=7, transport="tensors")
    assert greedy(client, "ver") == out_v1


def test_bad_inputs_are_refused_and_previous_version_keeps_serving(client, make_adapter, server):
    good = make_adapter(seed=31)
    client.push(good, "bad", transport="tensors")
    before = greedy(client, "bad")
    route = client.servers[0].route("load_lora_adapter_from_tensors")
    max_rank = http.call("GET", client.servers[0].route("lora_sync_info"),
                         headers=AUTH)[0]["max_lora_rank"]
    seen = {}
    for case, body, ctype in bad_bodies(make_adapter(seed=32), max_rank):
        status, reply = post_body(route, body, ctype or "application/octet-stream")
        seen[case] = (status, reply.get("error", {}).get("code"))
        assert 400 <= status < 500, (case, status, reply)
        assert reply["error"]["message"], case
        assert greedy(client, "bad") == before, case
    assert server.alive()
    # Nothing half-registered: still exactly one version of 'bad'.
    [entry] = [a for a in client.adapters()[0]["adapters"] if a["name"] == "bad"]
    assert [v["version"] for v in entry["versions"]] == [1]
    print("\nbad-input replies:", seen)


def test_body_above_limit_is_refused(client):
    route = client.servers[0].route("load_lora_adapter_from_tensors")
    status, reply = post_body(route, b"\0" * (5 * 2 ** 20))  # server limit: 4 MB
    assert status == 413 and "limit" in reply["error"]["message"]


def test_1gb_body_refused_before_it_is_read(client):
    """Content-Length says 1 GB (limit 4 MB): the server answers 413 at once, without
    waiting for (or buffering) the body."""
    import socket
    from urllib.parse import urlsplit
    u = urlsplit(client.servers[0].route("load_lora_adapter_from_tensors"))
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall((f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}\r\n"
                      f"Authorization: {AUTH['Authorization']}\r\n"
                      "Content-Type: application/octet-stream\r\n"
                      f"Content-Length: {2 ** 30}\r\n\r\n").encode() + b"\0" * 65536)
        head = sock.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head[:200]


def test_adapter_survives_lru_eviction(vllm, make_adapter):
    """vLLM keeps 4 adapters in its CPU cache: the first one is evicted, then rebuilt from
    memory (it has no path) with identical output."""
    client = LoRASyncClient(vllm.url, api_key=vllm.api_key)
    client.push(make_adapter(seed=41), "lru0", transport="tensors")
    first = greedy(client, "lru0")
    for i in range(1, 6):
        client.push(make_adapter(seed=41 + i), f"lru{i}", transport="tensors")
        greedy(client, f"lru{i}")
    info = http.call("GET", client.servers[0].route("lora_sync_info"), headers=AUTH)[0]
    lru0_id = next(v["adapter_id"] for a in client.adapters()[0]["adapters"]
                   if a["name"] == "lru0" for v in a["versions"])
    assert lru0_id not in info["worker_status"][0]["cached_ids"], "lru0 was not evicted"
    assert greedy(client, "lru0") == first


def test_wrong_content_type_names_safe_format(client):
    status, reply = post_body(client.servers[0].route("load_lora_adapter_from_tensors"),
                              b"{}", "application/json")
    assert status == 415 and "safetensors" in reply["error"]["message"]
