"""Bodies read from the socket past uvicorn (lora_sync/server/socket_body.py), on a real
uvicorn with httptools and uvloop, as both engines serve: invariants over random requests
(sizes, pieces, pipelined bytes, clients that vanish mid-body). That the engines' own
servers take this path is checked in test_tensors.py."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from starlette.requests import ClientDisconnect

from lora_sync.server import socket_body
from lora_sync.server.service import Settings

from .helpers import wait_until

MB = 1 << 20


class Recorder:
    """A bare ASGI app: reads each body (from the socket where it can), within `timeout_s`
    as staging's _paced bounds it, and replies with its length, digest and path; a body cut
    short or too slow is counted and refused."""

    def __init__(self, timeout_s: float = 2.0):
        self.timeout_s, self.disconnects, self.timeouts = timeout_s, 0, 0
        self.seen: list[dict] = []  # per request: n, sha, via, status

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        length = dict(scope["headers"]).get(b"content-length")
        chunks = socket_body.BodyChunks(receive, int(length) if length else None,
                                        _through_uvicorn(receive))
        # POST /into: read into a buffer of the body's length, as staging reads into a kept
        # file's mapping; every chunk must be the next stretch of it, in place.
        dest = memoryview(bytearray(int(length))) if scope["path"] == "/into" else None
        digest, n, status = hashlib.sha256(), 0, 200
        try:
            async with asyncio.timeout(self.timeout_s):
                async for chunk in chunks if dest is None else chunks.read_into(dest):
                    if dest is not None:
                        assert chunk.obj is dest.obj and chunk == dest[n:n + len(chunk)]
                    digest.update(chunk)
                    n += len(chunk)
        except ClientDisconnect:
            self.disconnects, status = self.disconnects + 1, 400
        except TimeoutError:
            self.timeouts, status = self.timeouts + 1, 408
        record = {"n": n, "sha": digest.hexdigest(), "status": status,
                  "via": "socket" if chunks.taken else "uvicorn"}
        self.seen.append(record)
        body = json.dumps(record).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


async def _through_uvicorn(receive):
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        yield message.get("body", b"")
        more = message.get("more_body", False)


@pytest.fixture(scope="module")
def server():
    import uvicorn
    app = Recorder()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="off",
                            log_level="warning", timeout_keep_alive=5)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started
    yield app, sock.getsockname()[1]
    srv.should_exit = True
    thread.join(10)


def _request(body: bytes, with_length: bool, extra: bytes = b"", into: bool = False
             ) -> list[bytes]:
    head = [b"POST /into HTTP/1.1" if into else b"POST /push HTTP/1.1", b"Host: t"]
    if with_length:
        head.append(b"Content-Length: %d" % len(body))
        payload = body
    else:  # chunked: uvicorn's path
        head.append(b"Transfer-Encoding: chunked")
        payload = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    return [b"\r\n".join(head) + b"\r\n\r\n", payload + extra]


def _read_reply(conn: socket.socket) -> tuple[dict, dict, bytes]:
    """One reply: (headers, JSON body, whatever came after it until the server closed or
    went quiet for 0.5 s)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(65536)
        assert part, f"connection closed before a reply: {data!r}"
        data += part
    head, rest = data.split(b"\r\n\r\n", 1)
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    n = int(headers[b"content-length"])
    while len(rest) < n:
        part = conn.recv(65536)
        assert part
        rest += part
    after = rest[n:]
    conn.settimeout(0.5)
    return headers, json.loads(rest[:n]), after + _until_closed(conn)


def _until_closed(conn: socket.socket) -> bytes:
    """What arrives until the server closes (then ending in b"<closed>") or goes quiet for
    the socket's timeout; a reset (it closed with our bytes unread) is a close."""
    data = b""
    try:
        while part := conn.recv(65536):
            data += part
    except TimeoutError:
        return data
    except ConnectionResetError:
        pass
    return data + b"<closed>"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


request_plans = st.lists(st.tuples(
    st.integers(0, 3 * MB),                 # body size
    st.booleans(),                          # Content-Length (else chunked)
    st.integers(1, 9),                      # pieces the client sends it in
    st.booleans(),                          # a pause after each piece (uvicorn not paused)
    st.sampled_from(["whole", "pipelined", "vanish"])), min_size=1, max_size=5)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=request_plans, seed=st.integers(0, 2 ** 32 - 1))
@example(plans=[(2 * MB, True, 3, True, "pipelined"), (2 * MB, True, 5, False, "vanish"),
                (2 * MB + 1, False, 4, True, "pipelined"), (38, True, 6, True, "pipelined")],
         seed=1)
def test_bodies_arrive_exactly_or_not_at_all(server, plans, seed):
    """Whatever the sizes and pieces, read in chunks or into a buffer of the body's length:
    the app reads exactly the body's bytes (never a byte of what follows), a taken-over
    connection is closed after its reply, one read through uvicorn stays open (and answers a
    pipelined request), a client vanishing mid-body is seen as a disconnect, and no
    descriptor is left behind."""
    app, port = server
    fds = _open_fds()
    rng = random.Random(seed)
    for size, with_length, pieces, pause, how in plans:
        body = rng.randbytes(size)
        extra = b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n" if how == "pipelined" else b""
        head, payload = _request(body, with_length, extra, into=with_length and rng.random() < .5)
        if how == "vanish" and with_length and size == 0:
            how = "whole"  # nothing to cut
        if how == "vanish":
            payload = payload[:len(payload) // 2]
        cuts = sorted(rng.randrange(len(payload) + 1) for _ in range(pieces - 1))
        before = len(app.seen)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            try:
                conn.sendall(head)
                for a, b in zip([0, *cuts], [*cuts, len(payload)]):
                    conn.sendall(payload[a:b])
                    time.sleep(0.02 if pause else 0)
                if how == "vanish":
                    conn.shutdown(socket.SHUT_WR)
                conn.settimeout(0.5 if how != "vanish" else 10)
                reply = _until_closed(conn)
            # Closed with our pipelined bytes unread (a reset), or before we sent them all
            # (the server read the body, replied and closed while we were still sending).
            except (ConnectionResetError, BrokenPipeError):
                reply = b"<reset>"
        wait_until(lambda: len(app.seen) > before, what="the body's record")
        record = app.seen[before]
        if how == "vanish":
            assert record["status"] == 400 and record["n"] <= size  # never taken as whole
            assert reply.endswith(b"<closed>") and not reply.startswith(b"HTTP/1.1 200")
            continue
        assert (record["n"], record["sha"], record["status"]) == \
            (size, hashlib.sha256(body).hexdigest(), 200)
        if with_length and size > MB:  # more than uvicorn reads before it pauses
            assert record["via"] == "socket"
        if record["via"] == "socket":
            assert reply == b"<reset>" and how == "pipelined" or (
                b"\r\nconnection: close\r\n" in reply and reply.endswith(b"<closed>")
                and reply.count(b"HTTP/1.1") == 1), reply[-300:]
        else:
            assert reply.count(b"HTTP/1.1 200") == 1 + (how == "pipelined")
            assert b"connection: close" not in reply and not reply.endswith(b"<closed>")
    wait_until(lambda: _open_fds() <= fds, what=f"descriptors back to {fds}")


def test_a_stalled_body_on_the_socket_is_cut_by_the_callers_timeout(server):
    """A body that stops half-way, its client still connected: the caller's timeout (the
    route's _paced) ends the socket read, the reply closes the connection, and nothing of
    it stays open."""
    app, port = server
    fds, timeouts = _open_fds(), app.timeouts
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        head, payload = _request(os.urandom(2 * MB), True)
        conn.sendall(head + payload[:MB + 123])
        headers, reply, after = _read_reply(conn)
    assert app.timeouts == timeouts + 1 and reply["via"] == "socket"
    assert headers[b"connection"] == b"close" and after == b"<closed>"
    wait_until(lambda: _open_fds() <= fds, what="the stalled body's descriptors")


def test_an_unchecked_uvicorn_fails_at_start_up(monkeypatch):
    import uvicorn
    monkeypatch.setattr(uvicorn, "__version__", "0.0.1")
    with pytest.raises(RuntimeError, match="LORA_SYNC_SOCKET_BODY=0"):
        Settings.from_env()
    monkeypatch.setenv("LORA_SYNC_SOCKET_BODY", "0")
    assert Settings.from_env().socket_body is False
    for bad in ("false", "yes", " 1"):  # a malformed value stops the server, as any setting
        monkeypatch.setenv("LORA_SYNC_SOCKET_BODY", bad)
        with pytest.raises(RuntimeError, match="LORA_SYNC_SOCKET_BODY"):
            Settings.from_env()
