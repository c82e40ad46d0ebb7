"""What the client keeps of each push for a resync (FleetMemory): the sealed lease of an shm
push, a broadcast's packed frames, a tensors push's copy once every body has left, and the
buffers reused across transports, in process on the FAKE engine
(tests/service_helpers.py says what these suites check)."""
from __future__ import annotations

import random
import socket

import pytest
import torch

from lora_sync import LoRAAdapter, LoRASyncClient, http
from lora_sync.trainer.fleet import FleetMemory

from .engine_fakes import served_text
from .helpers import greedy
from .service_helpers import clean_slate  # noqa: F401  (autouse: it applies to this module)


def test_what_an_shm_push_keeps_for_a_resync_is_the_sealed_lease(make_fake_server,
                                                                 make_adapter):
    """After an shm push the client's resync copy views the sealed lease (no copy of its
    own): the bytes as pushed, whatever the trainer does next, and still there after the
    server that holds the lease is gone."""
    adapter = make_adapter(seed=871)
    pushed = {k: t.clone() for k, t in adapter.tensors.items()}
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(adapter, "kept", transport="shm")
        kept = c.memory.newest["kept"]
        assert kept.flat is None and kept.sealed is not None  # nothing copied on the client
        for t in adapter.tensors.values():
            t.add_(1.0)  # the optimizer step after the push
        server.stop()  # closes the server's descriptor of the lease
        [(_, lent)] = c.memory.newest_copies(lambda name, version: True)
        assert all(torch.equal(lent.adapter.tensors[k], pushed[k]) for k in pushed)
    other = make_fake_server()
    with LoRASyncClient(other.url, api_key=other.api_key) as c:
        c.push(lent.adapter, "kept", version=1, transport="tensors")
        assert greedy(c, "kept") == served_text(LoRAAdapter(pushed, adapter.config))


def test_what_a_broadcast_keeps_for_a_resync_is_its_packed_frames(make_fake_server,
                                                                   make_adapter, monkeypatch):
    """On CPU the frames a broadcast packs are the client's resync copy: no second copy
    (FleetMemory.snapshot never runs); each push packs into a buffer that is not the newest,
    so a copy already kept never changes; and a resync gives back the bytes as pushed."""
    monkeypatch.setattr(FleetMemory, "snapshot", lambda *a: pytest.fail("copied twice"))
    a, b = make_adapter(seed=881), make_adapter(seed=882)
    pushed = {k: t.clone() for k, t in a.tensors.items()}
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.init_group(bucket_bytes=64 * 1024, timeout_s=20)  # several buckets per push
        c.broadcast(a, "packed")
        first = c.memory.newest["packed"]
        for t in a.tensors.values():
            t.add_(1.0)  # the optimizer step after the push
        c.broadcast(b, "packed")
        second = c.memory.newest["packed"]
        assert second.flat.data_ptr() != first.flat.data_ptr()
        assert all(torch.equal(first.adapter.tensors[k], pushed[k]) for k in pushed)
        assert all(torch.equal(second.adapter.tensors[k], b.tensors[k]) for k in b.tensors)
        c.broadcast(a, "packed")  # the first push's buffer, a spare now, is packed again
        assert c.memory.newest["packed"].flat.data_ptr() == first.flat.data_ptr()
        server.stop()
        [(_, lent)] = c.memory.newest_copies(lambda name, version: True)
        assert all(torch.equal(lent.adapter.tensors[k], a.tensors[k]) for k in a.tensors)
    monkeypatch.undo()  # a tensors push copies alongside
    other = make_fake_server()
    with LoRASyncClient(other.url, api_key=other.api_key) as c:
        c.push(lent.adapter, "packed", version=3, transport="tensors")
        assert greedy(c, "packed") == served_text(a)


def test_the_resync_copy_waits_until_every_body_has_left(make_fake_server, make_adapter,
                                                         monkeypatch):
    """A tensors push to two servers and one that is down: the client copies the adapter
    for a resync only once both bodies have left (beside the sending, the copy took a core
    from it), a server that never takes its body does not hold the copy back, and the
    copy kept is the adapter as pushed."""
    events = []
    real_exchange, real_snapshot = http.exchange, FleetMemory.snapshot

    def exchange(*args, on_sent=None, **kw):
        def sent():
            events.append("sent")
            on_sent()
        return real_exchange(*args, on_sent=sent if on_sent else None, **kw)

    def snapshot(memory, *args):
        events.append("copy")
        return real_snapshot(memory, *args)
    monkeypatch.setattr(http, "exchange", exchange)
    monkeypatch.setattr(FleetMemory, "snapshot", snapshot)
    one, two = make_fake_server(), make_fake_server()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{unused.getsockname()[1]}"
    adapter = make_adapter(seed=901)
    with LoRASyncClient([one.url, down, two.url], api_key=one.api_key, timeout=20) as c:
        results = c.push(adapter, "late-copy", transport="tensors", on_error="skip")
        assert [r.ok for r in results] == [True, False, True]
        assert events == ["sent", "sent", "copy"]
        kept = c.memory.newest["late-copy"].lent().adapter
        assert all(torch.equal(kept.tensors[k], adapter.tensors[k]) for k in adapter.tensors)
        assert greedy(c, "late-copy") == served_text(adapter)


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_copies_kept_across_mixed_transports_reuse_three_buffers(make_fake_server,
                                                                 make_adapter, seed):
    """Any sequence of tensors, shm and broadcast pushes of one name: what the client keeps
    is always the newest push, as pushed, and no buffer is ever dropped to take another:
    three at most (the newest and two spares) serve every layout in turn (a buffer dropped
    and allocated again costs fresh pages, several ms at rank 64 here)."""
    kinds = ["tensors", "shm", "broadcast"]
    rng = random.Random(seed)  # None: the benchmark's order, round after round
    order = kinds * 4 if seed is None else kinds + [rng.choice(kinds) for _ in range(9)]
    server = make_fake_server()
    seen: list = []  # every copy buffer the client held, kept alive so none is mistaken
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.init_group(bucket_bytes=64 * 1024, timeout_s=20)
        for i, transport in enumerate(order):
            adapter = make_adapter(seed=900 + i)
            c.push(adapter, "mixed", transport=transport)
            newest = c.memory.newest["mixed"]
            held = newest.lent().adapter.tensors
            assert all(torch.equal(held[k], adapter.tensors[k]) for k in adapter.tensors)
            buffers = [newest.flat, *c.memory._spares.get("mixed", [])]
            seen += [b for b in buffers if b is not None and all(b is not s for s in seen)]
            assert len(seen) <= 3, (i, transport, order)
