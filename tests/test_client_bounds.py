"""The client against fake servers on 127.0.0.1 that stand in for hostile or broken ones
(tests/fakes.py; no vLLM or SGLang): every reply is read as a typed message with a size
limit, anything else is a LoRASyncError whose code and message name the server, and the
client's `timeout` bounds each whole call. Also: a client that fell behind recovers its
numbering, and `auto` falls back to HTTP when a server has no room for a lease."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import LoRAAdapter, LoRASyncClient, LoRASyncError, Server, VersionConflict, http
from lora_sync.errors import PushFailed, TooBusy, error_from_json
from lora_sync.transports import shm

from testbed.tiny_model import TINY_CONFIG

from .engine_fakes import FakeEngineServer
from .fakes import FakeServer, dead_url

MODULE = "base_model.model.model.layers.0.self_attn.q_proj"
HIDDEN = TINY_CONFIG["hidden_size"]  # the fake engine's model (FakeEngineServer)


def small_adapter(seed: int = 0) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoRAAdapter({f"{MODULE}.lora_A.weight": torch.randn(2, HIDDEN, generator=g),
                        f"{MODULE}.lora_B.weight": torch.randn(HIDDEN, 2, generator=g)},
                       {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})


def answering(status: int, body) -> FakeServer:
    """A fake that answers every request with `body` (bytes sent as they are)."""
    return FakeServer(lambda req: req.reply(status, body))


def raw(data: bytes) -> FakeServer:
    """A fake that writes `data` as its whole reply (HTTP or not) and closes."""
    return FakeServer(lambda req: req.send(data))


def push_error(url: str, **client_kw) -> LoRASyncError:
    with LoRASyncClient(url, **client_kw) as client:
        [r] = client.push(small_adapter(), "p", version=1, transport="tensors",
                          on_error="skip")
    assert not r.ok and isinstance(r.error, LoRASyncError), r
    return r.error


def assert_names_server(e: LoRASyncError, url: str, code: str):
    assert e.code == code, (e.code, e.message)
    assert e.server == url and url in str(e), (e.server, str(e))


# -- rule: every reply is a typed message, or a LoRASyncError naming the server ----------
@pytest.mark.parametrize("body", [
    {}, {"name": None}, {"name": "p-v1"}, {"name": "p-v1", "version": "1", "bytes": 1},
    {"name": "p-v1", "version": True, "bytes": 1}, {"name": "p-v1", "version": 1, "bytes": -1},
    {"name": "other-v1", "version": 1, "bytes": 1},     # not what was pushed
    {"name": "p-v2", "version": 2, "bytes": 1},         # not the version pushed
    {"name": "p-v1", "version": 1, "bytes": 1, "timings_ms": [1]},
    {"name": "p-v1", "version": 1, "bytes": 1, "instance_id": 7},
    [1, 2], "ok", None, 3.5])
def test_a_push_reply_that_is_not_a_push_reply_is_bad_reply(body):
    with answering(200, body) as fake:
        assert_names_server(push_error(fake.url), fake.url, "bad_reply")


@pytest.mark.parametrize("reply", [
    b"HELLO WORLD\r\n\r\n",                                            # bad status line
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n{}",      # 70 KB header line
    b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 150 + b"\r\n{}",           # too many headers
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"name\"",          # truncated body
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",     # bad chunk
    b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n\xff\xfe\x00\x01",   # not UTF-8 / JSON
])
def test_a_reply_that_is_not_http_or_json_is_bad_reply(reply):
    with raw(reply) as fake:
        assert_names_server(push_error(fake.url), fake.url, "bad_reply")
        with pytest.raises(LoRASyncError) as e:
            http.call("GET", fake.url + "/v1/lora_adapters", timeout=5)
        assert_names_server(e.value, fake.url, "bad_reply")


def test_no_reply_at_all_is_unreachable_naming_the_server():
    with raw(b"") as fake:  # accepts, reads the request, closes
        assert_names_server(push_error(fake.url), fake.url, "unreachable")
    url = dead_url()
    assert_names_server(push_error(url), url, "unreachable")


def test_error_replies_of_any_shape_become_errors_of_their_status():
    for status, body in [(500, {"error": {"code": ["x"], "message": 5}}),
                         (502, [1, 2]), (503, "down"), (429, {"error": "full"}),
                         (404, {"detail": "Not Found"}), (500, b"<html>proxy</html>")]:
        with answering(status, body) as fake:
            e = push_error(fake.url)
            assert e.status == status and isinstance(e.message, str), (status, e)
            assert e.server == fake.url and fake.url in str(e)
            assert isinstance(e, TooBusy) == (status == 429)
    e = error_from_json(418, {"error": {"code": {}, "message": ["m"], "server": 3}})
    assert e.code == "http_error" and e.server is None and isinstance(e.message, str)


def test_listing_info_health_and_completions_are_typed():
    bad = {"lora_adapters": {"adapters": [{"name": "p", "versions": [{"version": "1"}]}]},
           "lora_sync_info": {"workers": "1", "max_lora_rank": 8, "linear_modules": {}}}
    canned = {r: (200, b) for r, b in bad.items()}
    with FakeEngineServer(api_key=None, canned=canned) as fake, \
            LoRASyncClient(fake.url, timeout=5) as client:
        for call in (client.adapters, client.info, lambda: client.newest_versions("p")):
            try:
                result = call()
            except LoRASyncError as e:
                assert_names_server(e, fake.url, "bad_reply")
            else:
                assert result == [None]  # newest_versions: an unreadable listing is "none"
        fake.set_canned({**canned, "lora_sync_info": (200, {"instance_id": ["x"]})})
        [h] = client.health(timeout=2)
        assert not h["ok"] and h["error"].startswith("bad_reply") and fake.url in h["error"]
    completions = {"completions": (200, {"choices": []}, {"X-LoRA-Version": "1; drop"})}
    with FakeEngineServer(api_key=None, canned=completions) as fake, \
            LoRASyncClient(fake.url, timeout=5) as c:
        for call in (lambda: c.completions(prompt="x"), lambda: c.complete("x", "p")):
            with pytest.raises(LoRASyncError) as e:
                call()
            assert_names_server(e.value, fake.url, "bad_reply")


REPLY_KEYS = st.sampled_from(["name", "version", "bytes", "transport", "instance_id",
                              "timings_ms", "adapters", "versions", "error", "code",
                              "message", "status", "workers", "linear_modules"])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2 ** 70) | st.floats() |
    st.sampled_from(["p-v1", "p", "p-v0", "x" * 300, "-v1"]) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) |
    st.dictionaries(REPLY_KEYS | st.text(max_size=4), inner, max_size=5), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_generated_garbage_is_never_taken_for_success_nor_a_raw_exception(garbage_server, data):
    """Whatever a fake answers (any status, any JSON, any bytes), each call either returns
    what a well-formed reply means or raises LoRASyncError naming the server; a push is ok
    only for exactly the version pushed."""
    status = data.draw(st.sampled_from([200, 201, 204, 301, 400, 404, 409, 429, 500]))
    if data.draw(st.booleans()):
        body = data.draw(JSON)
        if data.draw(st.booleans()):  # close to a push reply, one field or more off
            body = {"name": "p-v1", "version": 1, "bytes": 3,
                    **(body if isinstance(body, dict) else {"x": body})}
        answer = lambda req: req.reply(status, json.dumps(body).encode())  # noqa: E731
    else:
        data_bytes = data.draw(st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n"])) + \
            data.draw(st.binary(max_size=200))
        answer = lambda req: req.send(data_bytes)  # noqa: E731
    GARBAGE.answer = answer
    client = GARBAGE.client
    [r] = client.push(small_adapter(), "p", version=1, transport="tensors", on_error="skip")
    if r.ok:
        assert (r.name, r.version, type(r.bytes)) == ("p-v1", 1, int)
    else:
        assert isinstance(r.error, LoRASyncError) and r.error.server == GARBAGE.fake.url
    for call, args in ((client.adapters, ()), (client.info, ()), (client.retire, ("p",)),
                       (client.complete, ("x", "p"))):
        try:
            call(*args)
        except LoRASyncError as e:
            assert e.server == GARBAGE.fake.url
    assert isinstance(client.health(timeout=2)[0]["ok"], bool)


class GARBAGE:
    """One fake and one client for every generated example (set up by the fixture)."""
    answer = None
    fake: FakeServer
    client: LoRASyncClient


@pytest.fixture(scope="module")
def garbage_server():
    with FakeServer(lambda req: GARBAGE.answer(req), max_connections=10_000) as fake, \
            LoRASyncClient(fake.url, timeout=3) as client:
        GARBAGE.fake, GARBAGE.client = fake, client
        yield


# -- rule: replies are bounded in size ----------------------------------------------------
def test_a_huge_reply_is_refused_without_reading_it():
    """768 MB announced: refused from Content-Length; 768 MB streamed without a length: read
    only up to the limit (the fake could send no more than that plus socket buffers)."""
    def announced(req):
        req.send(b"HTTP/1.1 200 OK\r\nContent-Length: 805306368\r\n\r\n")
        while req.send(b"\0" * (1 << 20)):
            pass

    def streamed(req):
        req.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        for _ in range(768):
            if not req.send(b"\0" * (1 << 20)):
                break

    for handler in (announced, streamed):
        with FakeServer(handler) as fake:
            t0 = time.monotonic()
            with pytest.raises(LoRASyncError) as e:
                http.call("GET", fake.url + "/v1/lora_adapters", timeout=30)
            assert_names_server(e.value, fake.url, "bad_reply")
            assert "limit" in e.value.message and time.monotonic() - t0 < 10
        assert fake.bytes_sent < http.MAX_REPLY_BYTES + (48 << 20), fake.bytes_sent


def test_the_reply_limit_is_exact():
    body = json.dumps({"pad": "x" * 1000}).encode()
    with answering(200, body) as fake:
        assert http.call("GET", fake.url + "/", max_reply_bytes=len(body))[0]["pad"]
        with pytest.raises(LoRASyncError) as e:
            http.call("GET", fake.url + "/", max_reply_bytes=len(body) - 1)
        assert e.value.code == "bad_reply"


# -- rule: `timeout` bounds the whole call ----------------------------------------------
def trickling_body(req):
    """Headers at once, then the body a byte every 50 ms: no socket read ever times out."""
    req.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n")
    req.trickle(b" " * 10000)


def trickling_headers(req):
    req.trickle(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10000)


def silent(req):
    req.server.closing.wait(30)  # reads the request, never answers


@pytest.mark.parametrize("handler", [trickling_body, trickling_headers, silent])
def test_timeout_bounds_push_health_and_listings(handler):
    with FakeServer(handler) as fake:
        with LoRASyncClient(fake.url, timeout=1.0) as client:
            t0 = time.monotonic()  # numbered: a listing first, then the push, in 1 s
            [r] = client.push(small_adapter(), "p", transport="tensors", on_error="skip")
            took = time.monotonic() - t0
            assert_names_server(r.error, fake.url, "unreachable")
            assert "timeout" in r.error.message and took < 1.0 + 1.0, took
            t0 = time.monotonic()
            [h] = client.health(timeout=0.5)
            assert not h["ok"] and time.monotonic() - t0 < 0.5 + 1.0
            t0 = time.monotonic()
            with pytest.raises(LoRASyncError) as e:
                client.adapters()
            assert e.value.code == "unreachable" and time.monotonic() - t0 < 1.0 + 1.0
        t0 = time.monotonic()
        with pytest.raises(LoRASyncError):
            http.request("GET", fake.url + "/", timeout=0.3)
        assert time.monotonic() - t0 < 0.3 + 1.0


def test_a_trickling_server_fails_alone_within_the_timeout():
    with FakeServer(trickling_body) as slow, FakeEngineServer(api_key=None) as good:
        with LoRASyncClient([good.url, slow.url], timeout=3) as client:
            t0 = time.monotonic()
            ok, late = client.push(small_adapter(), "p", on_error="skip")  # auto, numbered
            took = time.monotonic() - t0
        assert took < 3 + 1.5, took
        assert ok.ok and ok.version == 1 and ok.transport == "shared", ok  # auto, 2 on a host
        assert_names_server(late.error, slow.url, "unreachable")
        assert good.served() == {"p": [1]}


def test_a_whole_call_deadline_covers_every_request_inside_it():
    with FakeServer(trickling_body) as fake:
        t0 = time.monotonic()
        with http.within(time.monotonic() + 0.5), pytest.raises(LoRASyncError):
            http.call("GET", fake.url + "/", timeout=60)
        assert time.monotonic() - t0 < 0.5 + 1.0


# -- rule: a client that fell behind recovers its numbering --------------------------------
def test_a_client_behind_the_servers_numbers_above_them_once():
    with FakeEngineServer(api_key=None) as a, FakeEngineServer(api_key=None) as b:
        urls = [a.url, b.url]
        with LoRASyncClient(urls, timeout=5) as slow, LoRASyncClient(urls, timeout=5) as other:
            assert [r.version for r in slow.push(small_adapter(1), "pol")] == [1, 1]
            for _ in range(3):  # another client moves the name ahead
                other.push(small_adapter(2), "pol")
            assert (max(a.served()["pol"]), max(b.served()["pol"])) == (4, 4)
            # slow's own number (2) is refused everywhere: it re-reads the servers and
            # pushes 5 to both, then counts on from there.
            assert [r.version for r in slow.push(small_adapter(3), "pol")] == [5, 5]
            assert [st for m, _, st in a.seen if m == "POST"][-2:] == [409, 200]
            assert [r.version for r in slow.push(small_adapter(4), "pol")] == [6, 6]
            # An explicit version is the caller's: refused, never renumbered.
            with pytest.raises(PushFailed) as e:
                slow.push(small_adapter(5), "pol", version=3)
            assert all(r.error.code == "version_conflict" for r in e.value.results)
        with LoRASyncClient(a.url, timeout=5) as one:
            other_one = LoRASyncClient(a.url, timeout=5)
            one.push(small_adapter(), "solo")
            other_one.push(small_adapter(), "solo")
            other_one.close()
            assert one.push(small_adapter(), "solo")[0].version == 3
            with pytest.raises(VersionConflict):
                one.push(small_adapter(), "solo", version=1)


# -- rule: `auto` falls back to HTTP when a server has no room for a lease ----------------
def test_auto_falls_back_to_http_when_leases_are_refused_for_capacity():
    refuse = (429, {"error": {"code": "too_many_leases", "status": 429,
                              "message": "8 leases are already open"}})
    with FakeEngineServer(api_key=None, canned={shm.LEASE_ROUTE: refuse}) as fake, \
            LoRASyncClient(fake.url, timeout=5) as client:
        for version in (1, 2):
            [r] = client.push(small_adapter(), "cap")
            assert r.ok and r.version == version and r.transport == "tensors"
        # Only this push went over HTTP: the next one asks for a lease again.
        assert [p for _, p, _ in fake.seen].count(f"/v1/{shm.LEASE_ROUTE}") == 2
        with pytest.raises(TooBusy) as e:  # shm asked for by name: the refusal stands
            client.push(small_adapter(), "cap", transport="shm")
        assert e.value.code == "too_many_leases" and e.value.server == fake.url
        fake.set_canned({shm.LEASE_ROUTE: (429, {"error": {
            "code": "staging_full", "status": 429, "message": "full"}})})
        assert client.push(small_adapter(), "cap")[0].transport == "tensors"


def test_a_real_memfd_lease_is_written_and_committed():
    adapter = small_adapter(7)
    with FakeEngineServer(api_key=None) as fake, LoRASyncClient(fake.url, timeout=5) as client:
        [r] = client.push(adapter, "mem")
        assert r.ok and r.transport == "shm" and r.version == 1
        assert {"lease", "write"} <= set(r.reply["timings_ms"])
        assert not fake.service.contexts["shm"].state.pending  # the lease was redeemed


def test_a_lease_naming_anything_but_a_lease_memfd_is_never_written(tmp_path):
    """A hostile server that knows a file's first bytes and size could name it as its
    lease: the trainer only ever writes into a lora-sync memfd."""
    victim = tmp_path / "victim"
    held = []

    def hostile(body):
        nbytes = body["nbytes"]
        probe = os.urandom(shm.PROBE_BYTES)
        victim.write_bytes(probe + b"k" * (nbytes - len(probe)))
        fd = os.open(victim, os.O_RDONLY)
        held.append(fd)
        return 200, {"lease_id": "a" * 32, "token": "b" * 64, "probe": probe.hex(),
                     "path": f"/proc/{os.getpid()}/fd/{fd}", "nbytes": nbytes,
                     "expires_s": 30}
    try:
        with FakeEngineServer(api_key=None, canned={shm.LEASE_ROUTE: hostile}) as fake, \
                LoRASyncClient(fake.url, timeout=5) as c:
            with pytest.raises(LoRASyncError) as e:
                c.push(small_adapter(), "h", transport="shm")
            assert e.value.code == "shm_unreachable"
            data = victim.read_bytes()
            assert data[shm.PROBE_BYTES:] == b"k" * (len(data) - shm.PROBE_BYTES)  # untouched
            assert f"/v1/{shm.CANCEL_ROUTE}" in [p for _, p, _ in fake.seen]
            fake.set_canned({shm.LEASE_ROUTE: lambda body: (200, {
                "lease_id": "a" * 32, "token": "b" * 64, "probe": "00" * 16,
                "path": str(victim), "nbytes": body["nbytes"], "expires_s": 30})})
            with pytest.raises(LoRASyncError) as e:
                c.push(small_adapter(), "h2", transport="shm")
            assert_names_server(e.value, fake.url, "bad_reply")
            assert victim.read_bytes() == data
    finally:
        for fd in held:
            os.close(fd)


# -- the public API is unchanged ------------------------------------------------------------
def test_bad_server_urls_are_refused_when_the_client_is_made():
    for url in ("not a url", "ftp://host", "http://", "http://h:notaport", "http://h:99999"):
        with pytest.raises(ValueError):
            Server(url)
        with pytest.raises(ValueError):
            LoRASyncClient(url)
    with pytest.raises(ValueError):
        Server("http://127.0.0.1:8000", "triton")
    assert Server("http://127.0.0.1:8000/", "sglang").route("x") == "http://127.0.0.1:8000/x"


def test_a_server_refusing_to_join_a_group_fails_init_at_once():
    """The trainer does not wait out the rendezvous (here 8 s) for workers whose server
    already said no: the server's own error comes back at once."""
    refuse = (409, {"error": {"code": "group_exists", "status": 409,
                              "message": "group 'default' already exists"}})
    with FakeEngineServer(api_key=None, canned={"init_lora_update_group": refuse}) as fake, \
            LoRASyncClient(fake.url, timeout=90) as client:
        t0 = time.monotonic()
        with pytest.raises(LoRASyncError) as e:
            client.init_group(timeout_s=8)
        assert e.value.code == "group_exists" and time.monotonic() - t0 < 4
        assert client.states["broadcast"].group is None
    # The abandoned rendezvous ends on its own, at its timeout.
    for t in threading.enumerate():
        if t.name == "lora-sync-rendezvous":
            t.join(timeout=30)
            assert not t.is_alive()
