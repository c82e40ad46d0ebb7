"""The tensor route on real vLLM and SGLang CPU servers: token identity with the engine's own
disk load, and LRU eviction. Its rules (bodies, limits, versions) are checked with the fake
engine in test_service_pushes.py and test_service_versions.py."""
import json
import time
from urllib.parse import urlsplit

from lora_sync import LoRASyncClient, http

from .helpers import AUTH, disk_model, greedy, wait_until
from .test_socket_body import Peer


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


def test_adapter_survives_lru_eviction(vllm, make_adapter):
    """vLLM keeps 4 adapters in its CPU cache: the first one is evicted, then rebuilt from
    memory (it has no path) with identical output. Its slots are written by lora-sync's slot
    writer (lora_B scaled on the way), also when the adapter comes back."""
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
    assert lru0_id in info["worker_status"][0]["engine"]["slot_written"]
    assert greedy(client, "lru0") == first



def test_the_engines_own_unload_frees_the_worker_copy(vllm, make_adapter, workdir):
    """vLLM's /v1/unload_lora_adapter only forgets the name (vllm#54839): behind lora-sync
    the worker's cached copy goes too, so adapters unloaded by name do not pile up."""
    client = LoRASyncClient(vllm.url, api_key=vllm.api_key)

    def cached() -> set:
        return set(client.info()[0]["worker_status"][0]["cached_ids"])
    make_adapter(seed=43).save(workdir / "disk-43")
    before = cached()
    client.load_from_disk(str(workdir / "disk-43"), "disk-43")
    added = cached() - before
    assert len(added) == 1, added  # vLLM preloads what its disk route loads
    greedy(client, "disk-43")
    client.unload_from_disk("disk-43")
    wait_until(lambda: not added & cached(), what="the unloaded disk adapter evicted")


def test_a_large_body_is_read_from_the_socket(client, make_adapter, workdir):
    """On both engines our route gets uvicorn's own receive (admission is the outermost
    middleware), so a body larger than uvicorn reads ahead (1 MiB here) is read from the
    socket (server/socket_body.py), which the server counts; the connection stays open as
    through uvicorn, and the version serves exactly like the same adapter loaded from disk."""
    adapter = make_adapter(seed=12, rank=64)
    assert adapter.nbytes >= 1 << 20
    before = client.info()[0]["staged_bodies"]["from_socket"]
    status, raw, headers = http.exchange(
        "POST", client.servers[0].route("load_lora_adapter_from_tensors"),
        chunks=adapter.encode("sock64", 1),
        headers={**AUTH, "Content-Type": "application/octet-stream"})
    assert status == 200, raw[:300]
    assert {k.lower(): v for k, v in headers.items()}.get("connection") != "close"
    assert client.info()[0]["staged_bodies"]["from_socket"] == before + 1
    adapter.save(workdir / "disk-sock64")
    client.load_from_disk(str(workdir / "disk-sock64"), "disk-sock64")
    assert greedy(client, "sock64-v1") == greedy(client, disk_model(client, "disk-sock64"))


def test_bodies_land_in_a_kept_files_pages_and_serve_like_disk(client, make_adapter, workdir):
    """Once a retired version's staged file is kept and readied (staging.py), the next body
    of its size is read from the socket straight into that file's mapping: the server's
    count shows the path taken, and the version serves exactly like the adapter from disk."""
    adapter = make_adapter(seed=13, rank=64)

    def in_place() -> int:
        return client.info()[0]["staged_bodies"]["in_place"]

    def draining() -> list:
        return [v for a in client.adapters()[0]["adapters"] if a["name"] == "land"
                for v in a["draining"]]
    before, version = in_place(), 0
    for _ in range(8):  # the window fills, a version retires, its file is readied
        [res] = client.push(adapter, "land", transport="tensors")
        version = res.version
        if in_place() > before:
            break
        wait_until(lambda: not draining(), 30, "retired versions freed")
        time.sleep(0.5)  # the freed file is readied on a thread at the lowest priority
    assert in_place() > before, client.info()[0]["staged_bodies"]
    adapter.save(workdir / "disk-land")
    client.load_from_disk(str(workdir / "disk-land"), "disk-land")
    assert greedy(client, f"land-v{version}") == greedy(client, disk_model(client, "disk-land"))


def test_the_push_route_answers_expect_and_pipelining_as_uvicorn_does(client, make_adapter):
    """On one raw keep-alive connection (test_socket_body.py has the in-process forms): a push
    with `Expect: 100-continue` gets `100 Continue` before its body is sent, and its body is
    read from the socket (counted); a GET, a small push and a GET pipelined right after that
    body are all answered, in order, and the connection stays open."""
    server = client.servers[0]
    push, listing = (urlsplit(server.route(r)) for r in ("load_lora_adapter_from_tensors",
                                                         "lora_adapters"))
    auth = "".join(f"{k}: {v}\r\n" for k, v in AUTH.items())

    def head(method: str, path: str, body: bytes = b"", expect: bool = False) -> bytes:
        framing = f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n" \
            if method == "POST" else ""
        return (f"{method} {path} HTTP/1.1\r\nHost: t\r\n{auth}{framing}"
                + ("Expect: 100-continue\r\n" if expect else "") + "\r\n").encode()
    big, small = (b"".join(bytes(c) for c in make_adapter(seed, rank).encode(name, 1))
                  for seed, rank, name in ((15, 64, "expect64"), (16, 8, "pipelined")))
    before = client.info()[0]["staged_bodies"]["from_socket"]
    peer = Peer(push.port)
    try:
        peer.send(head("POST", push.path, big, expect=True))
        peer.read(lambda: peer.replies, 10)  # a conforming client waits a bounded time
        assert [code for code, _, _ in peer.replies] == [100], \
            f"no 100 Continue before the body: {peer.replies}"
        peer.send(big + head("GET", listing.path) + head("POST", push.path, small) + small
                  + head("GET", listing.path))
        peer.read(lambda: peer.finals() >= 4, 60)
        codes = [code for code, _, _ in peer.replies]
        assert codes == [100, 200, 200, 200, 200], [r[:2] + (r[2][:200],) for r in peer.replies]
        assert not peer.closed and all(c != b"close" for _, c, _ in peer.replies)
        replies = [json.loads(body) for _, _, body in peer.replies[1:]]
        names = [{a["name"] for a in r["adapters"]} for r in replies[1::2]]
        assert "expect64" in names[0] and "pipelined" not in names[0], names
        assert {"expect64", "pipelined"} <= names[1], names
        assert client.info()[0]["staged_bodies"]["from_socket"] > before
    finally:
        peer.conn.close()
        for name in ("expect64", "pipelined"):
            client.retire(name)
