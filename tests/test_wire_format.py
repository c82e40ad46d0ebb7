"""docs/wire_format.md is enough to write a client: tests/minimal_sender.py, written from it
alone (HTTP from the standard library, the group from torch.distributed, nothing of
lora_sync), pushes on every transport to the in-process FAKE engine (tests/engine_fakes.py),
and the server serves exactly its weights, as it serves the real client's. Its encoding is
checked byte for byte against the library's over random layouts, and the document's example
against both. And the protocol version: a request of another version is refused on every
POST route with a 400 that names both versions, before any worker is asked anything (no
collective, no timeout)."""
from __future__ import annotations

import ast
import glob
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lora_sync import LoRAAdapter, LoRASyncClient, collective, http, wire
from lora_sync.adapter import tensors_checksum
from lora_sync.transports import shared_copy
from lora_sync.transports.base import PROTOCOL_HEADER, PROTOCOL_VERSION

from . import minimal_sender as ms
from .engine_fakes import served_text
from .helpers import AUTH, greedy

DOC = Path(__file__).resolve().parents[1] / "docs" / "wire_format.md"
POST_ROUTES = ["init_lora_update_group", "load_lora_adapter_from_distributed",
               "destroy_lora_update_group", "load_lora_adapter_from_tensors",
               "lora_sync_lease", "load_lora_adapter_from_lease", "lora_sync_lease_cancel",
               "lora_sync_lease_renew", "load_lora_adapter_from_shared",
               "retire_lora_adapter", "lora_sync_alias"]


def sender(server, **kw) -> ms.MinimalSender:
    return ms.MinimalSender(server.url + "/v1", api_key=server.api_key, **kw)  # a vLLM fake


def built_digests(server, served: str) -> set:
    """What each fake worker built for a served version (its weights' digest)."""
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        entry = next(a for a in c.adapters()[0]["adapters"]
                     if any(v["served_name"] == served for v in a["versions"]))
    [adapter_id] = [v["adapter_id"] for v in entry["versions"] if v["served_name"] == served]
    return {w.engine.built[adapter_id] for w in server.bridge.workers}


def mixed(adapter: LoRAAdapter) -> LoRAAdapter:
    """The adapter with its lora_B tensors in bf16: two dtypes, so the bucket plan reorders."""
    return LoRAAdapter({k: v.to(torch.bfloat16) if "lora_B" in k else v
                        for k, v in adapter.tensors.items()}, adapter.config)


# -- the sender is a third party's ---------------------------------------------------------
def test_the_minimal_sender_uses_nothing_of_lora_sync():
    tree = ast.parse(Path(ms.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("lora_sync") or m.startswith(".") or m == ""
                   for m in imported), imported
    assert ms.PROTOCOL_VERSION == PROTOCOL_VERSION and ms.PROTOCOL_HEADER == PROTOCOL_HEADER
    assert ms.STORE_PREFIX == collective.STORE_PREFIX
    assert ms.SHARED_PREFIX == shared_copy.MEMFD_PREFIX and ms.SEALS == shared_copy.SEALS


# -- the bytes, against the library ------------------------------------------------------
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.sampled_from(sorted(DTYPES)),
                                 st.lists(st.integers(0, 40), min_size=0, max_size=3)),
                       min_size=1, max_size=8),
       bucket_bytes=st.sampled_from([4096, 5000, 1 << 20]), transfer_id=st.integers(1, 2**63 - 1),
       seed=st.integers(0, 99))
def test_the_documented_bytes_are_the_librarys(shapes, bucket_bytes, transfer_id, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}.é" if i == 1 else f"t{i}": torch.randn(shape, generator=g).to(DTYPES[dt])
               for i, (dt, shape) in enumerate(shapes)}
    specs = [wire.TensorSpec.of(k, v) for k, v in tensors.items()]
    doc_specs = [ms.spec(k, v) for k, v in tensors.items()]
    assert doc_specs == [s.to_json() for s in specs]
    transfer = collective.Transfer.plan(specs, transfer_id, bucket_bytes)
    layout = ms.layout_digest(doc_specs)
    assert layout == transfer.layout
    buckets = ms.plan_buckets(doc_specs, bucket_bytes)
    assert [[s["name"] for s in b] for b in buckets] == \
        [[s.name for s in b.specs] for b in transfer.buckets]
    assert ms.header_frame(transfer_id, buckets, bucket_bytes, layout) == transfer.header()
    frames = collective.frame_buffers(transfer, {})
    for i, (b, frame) in enumerate(zip(transfer.buckets, frames)):
        collective.pack_bucket(b, tensors, collective.payload(b, frame))
        frame[b.nbytes:b.trailer_at].zero_()  # padding: the library leaves it as it was
        frame[b.trailer_at:].copy_(torch.frombuffer(bytearray(transfer.trailer(i)),
                                                    dtype=torch.uint8))
        assert ms.bucket_frame(i, buckets[i], tensors, transfer_id, layout) == \
            bytes(frame.numpy())
    meta = {"lora_name": "x", "adapter_config": "{}", "version": "3",
            "checksum": ms.checksum(tensors)}
    assert ms.safetensors_file(tensors, meta) == wire.encode_bytes(tensors, meta)
    assert ms.checksum(tensors) == tensors_checksum(tensors)


def test_the_documents_example_is_the_librarys():
    """docs/wire_format.md 6.10: its digest, plan and frames, as the library makes them."""
    text = DOC.read_text()
    example = text[text.index("### 6.10"):text.index("## 7.")]
    rows = re.findall(r"\| `([\w.]+)` \| (\w+) \| \[(\d+), (\d+)\] \| (\d+) \|", example)
    specs = [wire.TensorSpec(n, dt, (int(a), int(b))) for n, dt, a, b, _ in rows]
    assert len(specs) == 3 and all(s.nbytes == int(r[4]) for s, r in zip(specs, rows))
    transfer = collective.Transfer.plan(specs, 7, 4096)
    assert f"`{transfer.layout:#018x}`" in example
    assert [b.frame_bytes for b in transfer.buckets] == [3136, 4160]
    dumps = re.findall(r"```\n((?:[0-9a-f]{16}[ \n])+)```", example)
    assert [bytes.fromhex(d.replace(" ", "").replace("\n", "")) for d in dumps] == \
        [transfer.header(), transfer.trailer(1)]


# -- pushes from the minimal sender --------------------------------------------------------
@pytest.mark.parametrize("streams", [1, 4])
def test_a_broadcast_from_the_minimal_sender_serves_its_weights(make_fake_server,
                                                                make_adapter, streams):
    """Two workers (ranks 1 and 2), several buckets, a declared push then one that names
    its layout; the fake engine built the same weights as from the real client's push."""
    server = make_fake_server(workers=2)
    first, second = make_adapter(seed=470), make_adapter(seed=471)
    s = sender(server)
    status, reply = s.init_group(streams=streams, timeout_s=30)
    assert status == 200 and reply["workers"] == 2, reply
    for adapter, version in ((first, 1), (second, 2)):
        status, reply = s.broadcast("third", adapter.tensors, adapter.config, version,
                                    bucket_bytes=8192, with_checksum=True)
        assert status == 200 and reply["name"] == f"third-v{version}", reply
    assert s.declared is not None  # the second push named the layout only
    assert s.destroy_group()[0] == 200
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.init_group(timeout_s=30, bucket_bytes=8192, streams=streams)
        c.broadcast(second, "ours", checksum=True)
        c.destroy_group()
        assert greedy(c, "third") == greedy(c, "ours") == served_text(second)
        assert greedy(c, "third-v1") == served_text(first)
    assert built_digests(server, "third-v2") == built_digests(server, "ours-v1")
    assert len(built_digests(server, "third-v2")) == 1


def test_two_dtypes_and_a_checksum(make_fake_server, make_adapter):
    """Buckets group the tensors by dtype; the checksum is over the declared order, from
    the minimal sender and from the real client alike."""
    server = make_fake_server()
    adapter = mixed(make_adapter(seed=480))
    s = sender(server)
    assert s.init_group(streams=2, timeout_s=30)[0] == 200
    status, reply = s.broadcast("two-dt", adapter.tensors, adapter.config, bucket_bytes=8192,
                                with_checksum=True)
    assert status == 200, reply
    s.destroy_group()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.init_group(timeout_s=30, bucket_bytes=8192)
        c.broadcast(adapter, "two-dt-ours", checksum=True)
        c.destroy_group()
        assert greedy(c, "two-dt") == greedy(c, "two-dt-ours") == served_text(adapter)


@pytest.mark.parametrize("transport", ["tensors", "shm"])
def test_a_file_push_from_the_minimal_sender_serves_its_weights(make_fake_server, make_adapter,
                                                                transport):
    server = make_fake_server()
    adapter = mixed(make_adapter(seed=490))
    push = getattr(sender(server), f"push_{transport}")
    status, reply = push("file", adapter.tensors, adapter.config, 5, with_checksum=True)
    assert status == 200 and reply["name"] == "file-v5" and reply["transport"] == transport, \
        reply
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(adapter, "file-ours", transport=transport, checksum=True)
        assert greedy(c, "file") == greedy(c, "file-ours") == served_text(adapter)


def shared_copies() -> set[tuple[int, int]]:
    """(fd, inode) of every shared copy this process holds open: the in-process fake
    servers' descriptors, and the sender's while it pushes."""
    held = set()
    for path in glob.glob("/proc/self/fd/*"):
        try:
            if os.readlink(path).startswith(f"/memfd:{shared_copy.MEMFD_PREFIX}"):
                held.add((int(path.rsplit("/", 1)[1]), os.stat(path).st_ino))
        except OSError:
            pass  # closed meanwhile
    return held


def test_a_shared_push_from_the_minimal_sender_serves_its_weights(make_fake_server,
                                                                 make_adapter):
    """One sealed file for two servers on this host: each answers for itself, each holds a
    descriptor of that one inode (the sender none once it returned), and both serve what
    the real client's shared push of the same adapter serves."""
    a, b = make_fake_server(), make_fake_server()
    adapter = mixed(make_adapter(seed=495))
    before = shared_copies()
    replies = sender(a).push_shared("file", adapter.tensors, adapter.config, 6,
                                    with_checksum=True, also=(sender(b),))
    for status, reply in replies:
        assert status == 200 and reply["name"] == "file-v6" and reply["transport"] == "shared", \
            reply
    held = shared_copies() - before
    assert len(held) == 2 and len({ino for _, ino in held}) == 1, held
    with LoRASyncClient([a.url, b.url], api_key=a.api_key) as c:
        assert [r.transport for r in c.push(adapter, "file-ours", transport="shared",
                                            checksum=True)] == ["shared"] * 2
        for server in range(2):
            assert c.complete("the quick brown", "file", 12, server=server)["text"] == \
                c.complete("the quick brown", "file-ours", 12, server=server)["text"] == \
                served_text(adapter)
    for server in (a, b):
        assert built_digests(server, "file-v6") == built_digests(server, "file-ours-v1")


# -- the protocol version ------------------------------------------------------------------
def test_replies_name_the_servers_protocol(fake_server):
    status, _, headers = http.request("GET", f"{fake_server.url}/v1/lora_sync_info",
                                      headers=AUTH)
    assert status == 200 and headers.get(PROTOCOL_HEADER.lower()) == str(PROTOCOL_VERSION)


@pytest.mark.parametrize("route", POST_ROUTES)
@pytest.mark.parametrize("said", ["2", "0", "abc"])
def test_another_protocol_is_refused_on_every_route_naming_both(fake_server, make_adapter,
                                                                route, said):
    """A 400 `protocol_mismatch` at once, naming both versions, and no worker asked."""
    adapter = make_adapter(seed=500)
    headers = {**AUTH, PROTOCOL_HEADER: said}
    kw = {"json_body": {"lora_name": "proto", "master_address": "127.0.0.1",
                        "master_port": collective.free_port(), "rank_offset": 1,
                        "world_size": 2, "tensors": [s.to_json() for s in adapter.specs()],
                        "adapter_config": adapter.config, "transfer_id": 1,
                        "group_token": "x", "nbytes": 4096}}
    if route == "load_lora_adapter_from_tensors":
        kw = {"chunks": adapter.encode("proto")}
        headers["Content-Type"] = "application/octet-stream"
    calls = len(fake_server.bridge.calls)
    t0 = time.monotonic()
    status, reply, reply_headers = http.request("POST", f"{fake_server.url}/v1/{route}",
                                                headers=headers, timeout=30, **kw)
    assert time.monotonic() - t0 < 5
    assert status == 400 and reply["error"]["code"] == "protocol_mismatch", reply
    message = reply["error"]["message"]
    assert f"speaks lora-sync protocol {PROTOCOL_VERSION}" in message
    assert (f"the request is protocol {said}" if said.isdigit() else repr(said)) in message
    assert reply_headers.get(PROTOCOL_HEADER.lower()) == str(PROTOCOL_VERSION)
    assert len(fake_server.bridge.calls) == calls, "a worker was asked"


def test_a_push_of_another_protocol_on_a_live_group_fails_at_once(make_fake_server,
                                                                 make_adapter):
    """The issue's case: a sender of another version gets the 400 in its push, not the
    group's timeout; the server's group is untouched (its owner can destroy it)."""
    server = make_fake_server()
    adapter = make_adapter(seed=510)
    s = sender(server)
    assert s.init_group(timeout_s=60)[0] == 200
    s.headers[PROTOCOL_HEADER] = "2"
    t0 = time.monotonic()
    status, reply = s.broadcast("v2", adapter.tensors, adapter.config)
    assert time.monotonic() - t0 < 10  # the group's timeout is 60 s
    assert status == 400 and reply["error"]["code"] == "protocol_mismatch", reply
    assert "protocol 1" in reply["error"]["message"] and "protocol 2" in reply["error"]["message"]
    assert "intake" not in server.bridge.calls
    s.headers[PROTOCOL_HEADER] = "1"
    assert s.destroy_group()[0] == 200


def test_a_request_without_the_header_is_protocol_1(make_fake_server, make_adapter):
    server = make_fake_server()
    adapter = make_adapter(seed=520)
    s = sender(server, protocol=None)
    assert PROTOCOL_HEADER not in s.headers
    assert s.push_tensors("bare", adapter.tensors, adapter.config)[0] == 200
    assert s.init_group(timeout_s=30)[0] == 200
    assert s.broadcast("bare", adapter.tensors, adapter.config)[0] == 200
    assert s.destroy_group()[0] == 200


def test_the_client_sends_its_protocol(fake_client, make_adapter, monkeypatch):
    """Every request of the real client's tensors and broadcast pushes says protocol 1."""
    seen, exchange = [], http.exchange

    def recording(method, url, **kw):
        if method == "POST":
            seen.append((url.rsplit("/", 1)[1], (kw.get("headers") or {}).get(PROTOCOL_HEADER)))
        return exchange(method, url, **kw)
    monkeypatch.setattr(http, "exchange", recording)
    fake_client.push(make_adapter(seed=530), "says", transport="tensors")
    fake_client.init_group(timeout_s=30)
    fake_client.broadcast(make_adapter(seed=531), "says")
    fake_client.destroy_group()
    fake_client.retire("says")
    sent = dict(seen)
    for route in ("load_lora_adapter_from_tensors", "init_lora_update_group",
                  "load_lora_adapter_from_distributed", "destroy_lora_update_group"):
        assert sent.get(route) == str(PROTOCOL_VERSION), seen


def test_a_trainer_named_by_host_name_forms_its_group(make_fake_server, make_adapter):
    """The store prefix is the same on every member, whatever name each dialled the trainer
    by (the workers dial the address the server resolved `master_address` to)."""
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.init_group(master_address="localhost", timeout_s=30)
        c.broadcast(make_adapter(seed=540), "by-name")
        c.destroy_group()
        assert greedy(c, "by-name") == served_text(make_adapter(seed=540))


def test_the_doc_names_every_post_route():
    text = DOC.read_text()
    section = text[text.index("## 1. Protocol version"):text.index("## 2. HTTP")]
    assert [r for r in POST_ROUTES if f"`{r}`" not in section] == []
    from lora_sync.server.routes import build_router
    served = {r.path.lstrip("/") for r in build_router("").routes if "POST" in r.methods}
    assert served == set(POST_ROUTES)
    assert json.dumps(PROTOCOL_VERSION) in section
