"""shm leases: sealing at commit, abuse, expiry, the lease readied ahead for a name's next
push, renewals and the bounds on open leases and staging memory, in process on the FAKE
engine (tests/service_helpers.py says what these suites check)."""
from __future__ import annotations

import mmap
import os
import threading
import time
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import LoRASyncClient, LoRASyncError, host_copy, http, wire
from lora_sync.server import registry as registry_module
from lora_sync.transports import shm

from .engine_fakes import served_text
from .helpers import AUTH, Background, greedy, versions_of, wait_until
from .service_helpers import (KEEP, MAX_BODY, route, adapter_ids, error_of, open_leases,
                              retire_first, free_timing)
from .service_helpers import clean_slate  # noqa: F401  (autouse: it applies to this module)


def lease(client, nbytes: int) -> shm.Lease:
    return shm.Lease.from_json(http.call("POST", route(client, shm.LEASE_ROUTE),
                                         json_body={"nbytes": nbytes}, headers=AUTH)[0])


def commit(client, ticket) -> tuple[int, dict]:
    if not isinstance(ticket, dict):
        ticket = {"lease_id": ticket.lease_id, "token": ticket.token}
    status, reply, _ = http.request("POST", route(client, shm.COMMIT_ROUTE),
                                    json_body=ticket, headers=AUTH)
    return status, reply


def fill(granted: shm.Lease, parts: list) -> bool:
    """Writes `parts` into a lease as the trainer does; False where it cannot reach it."""
    read_fd = shm.write_lease(granted, parts)
    if read_fd is not None:
        os.close(read_fd)
    return read_fd is not None


def parts_of(adapter, name: str, version=None) -> list:
    return wire.layout(adapter.tensors, adapter.metadata(name, version))


def test_committed_bytes_cannot_change(fake_client, make_adapter):
    """A lease still mapped writable at commit is a 409 lease_mapped; a committed lease is
    sealed (no write, writable map or truncate through a descriptor kept open) and the
    version serves what was committed."""
    c = fake_client
    c.push(make_adapter(seed=811), "seal", transport="shm")
    before = greedy(c, "seal")
    parts = parts_of(make_adapter(seed=812), "seal")
    granted = lease(c, shm.total_bytes(parts))
    assert fill(granted, parts)
    fd = os.open(granted.path, os.O_RDWR)
    held = mmap.mmap(fd, granted.nbytes)  # still mapped writable at commit time
    status, reply = commit(c, granted)
    assert (status, error_of(reply)[1]) == (409, "lease_mapped"), reply
    held.close()
    os.close(fd)
    assert versions_of(c, "seal") == [1] and greedy(c, "seal") == before

    granted = lease(c, shm.total_bytes(parts))
    assert fill(granted, parts)
    fd = os.open(granted.path, os.O_RDWR)  # kept open across the commit
    try:
        status, reply = commit(c, granted)
        assert status == 200, reply
        after = greedy(c, "seal")
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 4096, 4096)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, granted.nbytes)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 8)
    finally:
        os.close(fd)
    assert greedy(c, "seal") == after == served_text(make_adapter(seed=812)) != before


def test_a_commit_waits_for_the_trainers_unmap_then_seals_what_is_there(fake_client,
                                                                        make_adapter):
    """The trainer commits while its unmap still runs (shm.write_then_unmap): the server's
    seal waits for the writable mapping to go (at most SEAL_WAIT_S; held longer: 409, see
    test_committed_bytes_cannot_change) and serves the bytes as they are then, sealed from
    there on."""
    c = fake_client
    parts = parts_of(make_adapter(seed=813), "unmap")
    granted = lease(c, shm.total_bytes(parts))
    fd = os.open(granted.path, os.O_RDWR)
    held = mmap.mmap(fd, granted.nbytes)
    os.close(fd)
    gate = threading.Event()  # the unmap waits behind it, on the client's unmap thread
    blocker = shm.trainer._UNMAPPER.submit(gate.wait, 30)
    threading.Timer(0.3, gate.set).start()
    try:
        unmapping = shm.write_then_unmap(held, parts)
        mapped_at_commit = not unmapping.done()
        status, reply = commit(c, granted)  # the old code: 409 lease_mapped at once
    finally:
        gate.set()
        blocker.result()
    unmapping.result()
    assert mapped_at_commit and status == 200, reply
    assert greedy(c, "unmap") == served_text(make_adapter(seed=813))
    fd = os.open(granted.path, os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, granted.nbytes)
    finally:
        os.close(fd)


class _TrainerDied(Exception):
    pass


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(copied=st.integers(0, 200), seed=st.integers(0, 2 ** 16))
def test_a_commit_ahead_of_its_copy_serves_only_a_whole_file(fake_client, make_adapter,
                                                             copied, seed):
    """A push into a ready lease commits first and copies while the server waits for its
    seal (ShmTransport._commit). Whenever the copy stops (`copied` tensors in: it failed, or
    the trainer died and its mapping went with it) the server seals a lease whose header
    length was never stored (the last store) and refuses it: the push fails with the copy's
    own error, the previous version keeps serving and the next push lands."""
    c = fake_client
    c.push(make_adapter(seed=seed), "ahead", transport="shm")  # readies the next lease
    ready_ticket(c)  # granted once what that push retired is freed
    before, held = greedy(c, "ahead"), versions_of(c, "ahead")
    new = make_adapter(seed=seed + 1)
    stores, refusals = [0], []
    real_memmove, real_post = host_copy.memmove_each, shm.transport._post

    def dies_midway(copies):
        for copy in copies:
            if stores[0] >= copied:
                raise _TrainerDied(f"stopped after {copied} tensors")
            real_memmove([copy])
            stores[0] += 1

    def post(server, route, ctx, body, on_sent=None):
        try:
            return real_post(server, route, ctx, body, on_sent)
        except LoRASyncError as e:
            refusals.append((route, on_sent is not None, e.code))
            raise
    whole = copied >= len(new.tensors)
    with mock.patch.object(host_copy, "memmove_each", dies_midway), \
            mock.patch.object(shm.transport, "_post", post):
        if whole:
            c.push(new, "ahead", transport="shm")
        else:
            with pytest.raises(_TrainerDied):
                c.push(new, "ahead", transport="shm")
    if whole:
        assert greedy(c, "ahead") == served_text(new) and not refusals
        return
    assert refusals == [(shm.COMMIT_ROUTE, True, "bad_safetensors")]
    assert versions_of(c, "ahead") == held and greedy(c, "ahead") == before
    c.push(new, "ahead", transport="shm")
    assert greedy(c, "ahead") == served_text(new)


def test_abused_leases_are_refused_and_change_nothing(fake_client, make_adapter):
    """Wrong or reused tokens, malformed or path-like lease ids, leases of the wrong size,
    bad sizes and calls without the admin key are refused, and change nothing."""
    c = fake_client
    c.push(make_adapter(seed=821), "abuse", transport="shm")
    before = greedy(c, "abuse")
    parts = parts_of(make_adapter(seed=822), "abuse")
    size = shm.total_bytes(parts)

    granted = lease(c, size)
    assert fill(granted, parts)
    status, reply = commit(c, {"lease_id": granted.lease_id, "token": "0" * 64})
    assert (status, error_of(reply)[1]) == (403, "bad_token"), reply
    for bad_id in ("../../etc/passwd", "/proc/1/fd/0", "0" * 31 + "g", granted.path):
        status, reply = commit(c, {"lease_id": bad_id, "token": granted.token})
        assert status == 400, (bad_id, reply)
    assert commit(c, granted)[0] == 200          # the real one still commits, once
    status, reply = commit(c, granted)            # reused token
    assert (status, error_of(reply)[1]) == (404, "unknown_lease"), reply
    assert versions_of(c, "abuse") == [1, 2]
    after = greedy(c, "abuse")

    wrong = lease(c, size + 4096)                 # a lease of the wrong size
    assert fill(wrong, parts)
    status, reply = commit(c, wrong)
    assert (status, error_of(reply)[1]) == (400, "bad_safetensors"), reply
    short = lease(c, size - 4096)                 # the header promises more bytes
    assert fill(short, parts[:1])
    status, reply = commit(c, short)
    assert status == 400, reply
    for nbytes in (0, -1, 2 ** 62, "10", 1.5, MAX_BODY + 1):
        status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE),
                                        json_body={"nbytes": nbytes}, headers=AUTH)
        assert 400 <= status < 500, (nbytes, status, reply)
    status, _, _ = http.request("POST", route(c, shm.LEASE_ROUTE), json_body={"nbytes": 4096})
    assert status == 401
    keyless = lease(c, size)
    for r in (shm.COMMIT_ROUTE, shm.CANCEL_ROUTE, shm.RENEW_ROUTE):  # a token alone: nothing
        status, _, _ = http.request("POST", route(c, r), json_body={
            "lease_id": keyless.lease_id, "token": keyless.token})
        assert status == 401, r
    assert http.call("POST", route(c, shm.CANCEL_ROUTE), headers=AUTH,
                     json_body={"lease_id": keyless.lease_id, "token": keyless.token})[0]
    for bad in ({"lease_id": 7, "token": "x"}, {"lease_id": "0" * 32}, {"token": ["x"]}):
        status, _, _ = http.request("POST", route(c, shm.COMMIT_ROUTE), json_body=bad,
                                    headers=AUTH)
        assert status == 400, bad
    assert versions_of(c, "abuse") == [1, 2] and greedy(c, "abuse") == after
    assert greedy(c, "abuse-v1") == before
    assert c.states["shm"].ready.count() == open_leases(c)


def test_leases_never_committed_expire(make_fake_server):
    """A lease never committed expires (a server of its own: 0.3 s TTL): its commit is then a
    404 unknown_lease and its descriptor is closed."""
    server = make_fake_server(lease_ttl_s=0.3)
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        granted = lease(c, 1 << 20)
        assert open_leases(c) == 1
        wait_until(lambda: open_leases(c) == 0, timeout_s=5, what="the lease expired")
        status, reply = commit(c, granted)
        assert (status, error_of(reply)[1]) == (404, "unknown_lease"), reply
        assert not fill(granted, [b"late"])  # its descriptor is closed


def ready_ticket(client) -> dict:
    client.states["shm"].ready.count()  # waits for the one being readied
    ready = client.states["shm"].ready.ready_for(client.servers[0].url)
    assert ready is not None, "no lease was readied"
    return ready.lease.ticket()


def test_a_push_readies_the_next_lease_and_the_next_push_fills_it(make_fake_server,
                                                                  make_adapter):
    """After an shm push the client holds one lease ready for that name (granted, mapped);
    the next push of the name commits that one. Another name's push cancels it."""
    server = make_fake_server()
    small, large = make_adapter(seed=851), make_adapter(seed=852, rank=16)
    assert small.nbytes != large.nbytes
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(small, "ahead", transport="shm")
        first = ready_ticket(c)
        assert c.states["shm"].ready.count() == open_leases(c) == 1
        c.push(make_adapter(seed=853), "ahead", transport="shm")
        assert greedy(c, "ahead") == served_text(make_adapter(seed=853))
        assert commit(c, first)[0] == 404  # committed by the push: it is gone
        second = ready_ticket(c)
        assert second != first and open_leases(c) == 1
        c.push(large, "other", transport="shm")  # another size: the ready one is cancelled
        assert commit(c, second)[0] == 404
        assert ready_ticket(c) not in (first, second) and open_leases(c) == 1
        assert status_of_renew(c, second) == 404
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        assert open_leases(c) == 0  # the closed client cancelled what it held


def ahead_grant(client) -> Background:
    """A lease asked for ahead (as the client readies one), on its own thread."""
    return Background("POST", route(client, shm.LEASE_ROUTE),
                      {"nbytes": 4096, "ahead": True, "client": "ahead-test"}, AUTH)


def cancel(client, granted) -> None:
    """Cancels a lease: a Lease, or a Background grant's reply."""
    if isinstance(granted, Background):
        granted = shm.Lease.from_json(granted.result["reply"])
    http.call("POST", route(client, shm.CANCEL_ROUTE), headers=AUTH, json_body=granted.ticket())


def test_a_lease_readied_ahead_takes_the_memory_retired_versions_give_back(
        fake_server, fake_client, make_adapter, monkeypatch):
    """A lease asked for ahead is granted once the versions being retired are freed (at the
    next pause in serving, not sooner); a push's own lease frees them first; the wait is
    bounded in time and in how many wait at once."""
    free_timing(monkeypatch, quiet_s=60.0, max_s=120.0)
    c = fake_client
    v1_id = retire_first(c, make_adapter, "recycle", seed=880)
    waiting = ahead_grant(c)
    time.sleep(0.3)
    assert not waiting.result and v1_id not in fake_server.bridge.freed
    cancel(c, lease(c, 4096))  # a push's own lease: v1 is freed first
    assert v1_id in fake_server.bridge.freed
    assert waiting.join(10)["status"] == 200
    cancel(c, waiting)
    monkeypatch.setattr(registry_module, "FREES_WAIT_S", 0.5)
    monkeypatch.setattr(registry_module, "FREES_WAITERS", 1)
    v2_id = retire_first(c, make_adapter, "recycle-b", seed=890)
    first = ahead_grant(c)
    wait_until(lambda: fake_server.service.registry._waiting_for_frees == 1, what="one waiting")
    second = ahead_grant(c)
    assert second.join(10)["status"] == 200 and not first.result  # granted at once
    assert first.join(10)["status"] == 200  # at the time bound
    assert v2_id not in fake_server.bridge.freed
    for done in (first, second):
        cancel(c, done)
    for bad in ("yes", 1, [True]):
        status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE), headers=AUTH,
                                        json_body={"nbytes": 4096, "ahead": bad})
        assert (status, error_of(reply)[1]) == (400, "bad_request"), reply


def test_a_push_before_its_ready_lease_is_granted_leases_the_usual_way(
        make_fake_server, make_adapter, monkeypatch):
    """The lease readied after a push that retired a version waits for that version to be
    freed; the next push does not wait for it: it leases the usual way (freeing the
    retired version at once), and the late grant is cancelled, leaving no lease behind."""
    free_timing(monkeypatch, quiet_s=60.0, max_s=120.0)
    monkeypatch.setattr(registry_module, "FREES_WAIT_S", 3.0)  # within the client's timeout
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(make_adapter(seed=900), "early", transport="shm")
        [v1_id] = adapter_ids(c, "early")
        for i in range(KEEP):  # the last push retires v1: the next lease waits for it
            c.push(make_adapter(seed=901 + i), "early", transport="shm")
        wait_until(lambda: server.service.registry._waiting_for_frees == 1, what="the lease waits")
        [res] = c.push(make_adapter(seed=950), "early", transport="shm")
        assert "copy" not in res.reply["timings_ms"]  # not into a ready lease
        assert v1_id in server.bridge.freed
        assert greedy(c, "early") == served_text(make_adapter(seed=950))
        assert c.states["shm"].ready.count() == open_leases(c) <= 1  # the late one was cancelled
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        assert open_leases(c) == 0


def test_a_push_waits_for_its_ready_lease_no_longer_than_a_fresh_one_costs(
        make_fake_server, make_adapter, monkeypatch):
    """A lease readied ahead whose mapping is slow (huge pages being assembled: seconds for
    a 1 GB lease) holds the next push no longer than leasing afresh would cost: the push
    leases the usual way and serves its adapter, and the slow lease is cancelled at once,
    its mapping dropped when done, no lease left behind."""
    from lora_sync.transports.shm import ready_lease
    real = ready_lease.map_lease
    slow, mapping, mapped = threading.Event(), threading.Event(), threading.Event()

    def map_lease(lease, **kw):  # called once the client knows the lease is granted
        if slow.is_set():
            mapping.set()
            time.sleep(3.0)
            mapped.set()
        return real(lease, **kw)
    monkeypatch.setattr(ready_lease, "map_lease", map_lease)
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(make_adapter(seed=980), "slow", transport="shm")
        wait_until(lambda: c.states["shm"].ready.count() == 1, what="a lease ready")
        slow.set()
        c.push(make_adapter(seed=981), "slow", transport="shm")  # into it; the next is slow
        assert mapping.wait(10)  # the next lease: granted, being mapped
        [res] = c.push(make_adapter(seed=982), "slow", transport="shm")
        assert not mapped.is_set()  # it did not wait for that mapping to end
        assert "copy" not in res.reply["timings_ms"]  # a fresh lease, written before commit
        assert greedy(c, "slow") == served_text(make_adapter(seed=982))
        slow.clear()
        wait_until(lambda: c.states["shm"].ready.count() == open_leases(c) == 1,
                   timeout_s=10, what="the slow one gone, the next one ready")
        [res] = c.push(make_adapter(seed=983), "slow", transport="shm")
        assert "copy" in res.reply["timings_ms"]  # into the lease readied since
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        assert open_leases(c) == 0


def test_a_ready_lease_held_for_the_frees_outlasts_a_short_client_timeout(
        make_fake_server, make_adapter, monkeypatch):
    """The server may hold a lease asked for ahead until the retired versions go: a client
    whose own calls time out sooner still waits for it (else the server would grant it to
    nobody, holding it until its time)."""
    free_timing(monkeypatch, quiet_s=1.0, max_s=5.0)
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key, timeout=2.0) as c:
        assert c.states["shm"].ready.timeout < 1.0
        for i in range(KEEP):
            c.push(make_adapter(seed=960 + i), "patient", transport="tensors")
        c.push(make_adapter(seed=970), "patient", transport="shm")  # retires v1: 1 s to go
        assert c.states["shm"].ready.count() == open_leases(c) == 1


def status_of_renew(client, ticket: dict) -> int:
    return http.request("POST", route(client, shm.RENEW_ROUTE), json_body=ticket,
                        headers=AUTH)[0]


def test_a_ready_lease_is_renewed_and_one_that_lapsed_is_replaced(make_fake_server,
                                                                  make_adapter):
    """A ready lease outlives its time while the client renews it (a trainer step may be
    longer than the TTL); one that lapsed anyway makes the push take a fresh lease."""
    server = make_fake_server(lease_ttl_s=0.4)
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(make_adapter(seed=861), "renewed", transport="shm")
        ticket = ready_ticket(c)
        time.sleep(1.4)  # three times the TTL
        assert open_leases(c) == 1 and ready_ticket(c) == ticket
        c.push(make_adapter(seed=862), "renewed", transport="shm")
        assert commit(c, ticket)[0] == 404
        assert greedy(c, "renewed") == served_text(make_adapter(seed=862))

        c.states["shm"].ready.count()
        c.states["shm"].ready.ready_for(server.url).timer.cancel()  # its renewals stop
        wait_until(lambda: open_leases(c) == 0, timeout_s=5, what="the ready lease lapsed")
        [res] = c.push(make_adapter(seed=863), "renewed", transport="shm")
        assert res.version == 3 and greedy(c, "renewed") == served_text(make_adapter(seed=863))
    bad = {"lease_id": "0" * 32, "token": "ab" * 32}
    with LoRASyncClient(server.url, api_key=server.api_key, lease_ahead=False) as c:
        granted = lease(c, 4096)
        assert status_of_renew(c, {**granted.ticket(), "token": "0" * 64}) == 403
        assert status_of_renew(c, bad) == 404
        assert status_of_renew(c, {"lease_id": 5, "token": "x"}) == 400
        assert status_of_renew(c, granted.ticket()) == 200
        c.push(make_adapter(seed=864), "plain", transport="shm")
        # No lease readied: at most the one granted above (its 0.4 s TTL may lapse while a
        # loaded machine pushes)
        assert c.states["shm"].ready is None and open_leases(c) <= 1


def test_lease_bounds_rest_on_no_client_declared_id(fake_client):
    """A client id is self-declared, so it bounds nothing: leases asked under ever new ids
    still stop at the server's total (8), and every id gets the same 429 there."""
    c = fake_client
    c.states["shm"].ready.release()
    held = []
    try:
        for i in range(12):
            status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE), headers=AUTH,
                                            json_body={"nbytes": 4096, "client": f"id-{i}"})
            if status != 200:
                break
            held.append(shm.Lease.from_json(reply))
        assert len(held) == 8, f"{len(held)} leases: the total bound is 8, whatever the ids"
        assert (status, error_of(reply)[1]) == (429, "too_many_leases"), reply
        status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE), headers=AUTH,
                                        json_body={"nbytes": 4096, "client": "id-0"})
        assert status == 429, "an id that already holds one is refused alike"
    finally:
        for granted in held:
            cancel(c, granted)
    assert c.states["shm"].ready.count() == open_leases(c)


def test_open_leases_and_uploads_share_one_staging_budget(fake_client, make_adapter):
    """Open leases and uploads share one staging budget (6 MB): while leases hold it, a
    tensors push and another lease are a 429 staging_full, and an auto push fails too."""
    c = fake_client
    c.states["shm"].ready.release()  # a lease readied by an earlier push holds budget too
    leases = [lease(c, 3 * 2 ** 20) for _ in range(2)]
    try:
        with pytest.raises(LoRASyncError) as refused:
            c.push(make_adapter(seed=841), "budget", transport="tensors")
        assert (refused.value.status, refused.value.code) == (429, "staging_full")
        status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE), headers=AUTH,
                                        json_body={"nbytes": 2 ** 20})
        assert (status, error_of(reply)[1]) == (429, "staging_full"), reply
        # transport="auto" falls back to HTTP when a lease is refused for room: refused too.
        with pytest.raises(LoRASyncError):
            c.push(make_adapter(seed=841), "budget")
    finally:
        for granted in leases:
            cancel(c, granted)
    assert open_leases(c) == 0
    assert c.push(make_adapter(seed=841), "budget", transport="tensors")[0].version == 1
