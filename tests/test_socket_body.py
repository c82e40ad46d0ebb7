"""Bodies read from the socket past uvicorn (lora_sync/server/socket_body.py), on a real
uvicorn with httptools, as both engines serve: invariants over random requests (sizes,
pieces, pipelined bytes, clients that vanish mid-body), and the rule that bypassing uvicorn
changes speed, never behaviour: request forms from RFC 9110/9112 (Expect: 100-continue,
HTTP/1.0, keep-alive, pipelining, chunked, ambiguous framing, slow, silent and vanishing
clients) sent alike to a route reading from the socket and one reading through uvicorn,
everything observable compared. That the engines' own servers take this path is checked in
test_tensors.py."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from starlette.requests import ClientDisconnect

from lora_sync.server import socket_body
from lora_sync.server.admission import AdmissionMiddleware
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
def recorder():
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


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=request_plans, seed=st.integers(0, 2 ** 32 - 1))
@example(plans=[(2 * MB, True, 3, True, "pipelined"), (2 * MB, True, 5, False, "vanish"),
                (2 * MB + 1, False, 4, True, "pipelined"), (38, True, 6, True, "pipelined")],
         seed=1)
def test_bodies_arrive_exactly_or_not_at_all(recorder, plans, seed):
    """Whatever the sizes and pieces, read in chunks or into a buffer of the body's length:
    the app reads exactly the body's bytes (never a byte of what follows), the connection
    stays open after the reply and answers a pipelined request whichever way the body was
    read, a client vanishing mid-body is seen as a disconnect and gets no reply (as through
    uvicorn), and no descriptor is left behind."""
    app, port = recorder
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
            conn.sendall(head)
            for a, b in zip([0, *cuts], [*cuts, len(payload)]):
                conn.sendall(payload[a:b])
                time.sleep(0.02 if pause else 0)
            if how == "vanish":
                conn.shutdown(socket.SHUT_WR)
            conn.settimeout(0.5 if how != "vanish" else 10)
            reply = _until_closed(conn)
        wait_until(lambda: len(app.seen) > before, what="the body's record")
        record = app.seen[before]
        if how == "vanish":
            assert record["status"] == 400 and record["n"] <= size  # never taken as whole
            assert reply == b"<closed>"  # the reply dropped, as uvicorn drops it
            continue
        assert (record["n"], record["sha"], record["status"]) == \
            (size, hashlib.sha256(body).hexdigest(), 200)
        if with_length and size > MB:  # more than uvicorn reads before it pauses
            assert record["via"] == "socket"
        assert reply.count(b"HTTP/1.1 200") == 1 + (how == "pipelined"), reply[-300:]
        assert b"connection: close" not in reply and not reply.endswith(b"<closed>")
    wait_until(lambda: _open_fds() <= fds, what=f"descriptors back to {fds}")


def test_a_stalled_body_on_the_socket_is_cut_by_the_callers_timeout(recorder):
    """A body that stops half-way, its client still connected: the caller's timeout (the
    route's _paced) ends the socket read and the reply keeps the connection alive, as
    through uvicorn: the rest of the body, sent late, is dropped and the next request on
    the connection answered; nothing of it stays open."""
    app, port = recorder
    fds, timeouts = _open_fds(), app.timeouts
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        head, payload = _request(os.urandom(2 * MB), True)
        conn.sendall(head + payload[:MB + 123])
        headers, reply, after = _read_reply(conn)
        assert app.timeouts == timeouts + 1 and reply["via"] == "socket"
        assert b"connection" not in headers and after == b""
        conn.settimeout(10)
        conn.sendall(payload[MB + 123:] + b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n")
        headers, reply, after = _read_reply(conn)
    assert reply["n"] == 0 and reply["status"] == 200 and after == b""
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


# --- The rule: bypassing uvicorn changes speed, never behaviour. ----------------------------
# One uvicorn (httptools) serves the same push route twice, wired as the real one
# (routes.read_stream behind AdmissionMiddleware, bounded as staging's _paced bounds it): under
# /s it reads with BodyChunks, under /u through uvicorn alone (as with
# LORA_SYNC_SOCKET_BODY=0). Each request form below is sent to both from a raw socket, and
# everything a client or the app can observe must be the same: every reply in order (100
# Continue included) with its status, Connection header and body, whether the 100 came
# before the client sent its body, whether the connection then answers a next request, is
# closed, or stays silent, and what the app read.

# Bounds in seconds, loose enough that a loaded machine does not fake a difference (a late
# reply on one side only); a real difference shows whatever they are.
IDLE_S = 0.4      # the route's idle bound on a body (staging's _paced)
WAIT_100 = 3.0    # how long a client that sent Expect: 100-continue waits (curl: 1 s)
PAUSE = 0.03      # between head and body: the app is reading when the body comes
QUIET = 0.5       # a connection that answers nothing in this long is "silent"
LINGER = 0.4      # how long the app takes to reply after giving up on a body ("linger" cases)
TWIN_PATHS = frozenset({"/s/push", "/u/push"})


class Twin:
    """The app: the push route under both prefixes, recording per case (the query string)
    what it read and how; /ping answers any method."""

    def __init__(self):
        self.records: dict[str, list] = {}
        self.active: dict[str, int] = {}

    def app(self):
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.responses import JSONResponse, PlainTextResponse
        from starlette.routing import Route

        async def push(request):
            case = request.url.query
            self.active[case] = self.active.get(case, 0) + 1
            try:
                return await self._push(request, case, JSONResponse)
            finally:
                self.active[case] -= 1

        async def ping(request):
            return PlainTextResponse("pong")

        return Starlette(routes=[Route("/{mode}/push", push, methods=["POST"]),
                                 Route("/{mode}/ping", ping, methods=["GET", "POST"])],
                         middleware=[Middleware(AdmissionMiddleware, own_paths=TWIN_PATHS)])

    async def _push(self, request, case, JSONResponse):
        length = request.headers.get("content-length")  # as routes.read_stream reads it
        length = int(length) if length and length.isdigit() else None
        chunks = request.stream()
        if request.path_params["mode"] == "s":
            chunks = socket_body.BodyChunks(request.scope.get(socket_body.RAW_RECEIVE),
                                            length, chunks)
        digest, n, status = hashlib.sha256(), 0, 200
        try:
            async for chunk in _idle_bounded(chunks):
                digest.update(chunk)
                n += len(chunk)
        except ClientDisconnect:
            status = 400
        except TimeoutError:
            status = 408
            if case.endswith("linger"):  # the reply takes a while: a close meanwhile drops it
                await asyncio.sleep(LINGER)
        via = "socket" if getattr(chunks, "taken", False) else "uvicorn"
        self.records.setdefault(case, []).append((status, n, digest.hexdigest(), via))
        return JSONResponse({"n": n, "sha": digest.hexdigest()}, status_code=status)


async def _idle_bounded(chunks):
    """The route's bound on a body (staging._paced's idle bound), from the start of the
    read: a body with no byte in IDLE_S is cut (TimeoutError). Not _paced itself: it arms
    its first window with asyncio.timeout(<a loop time>), a delay, so a body whose first
    byte never comes is not cut there (either way)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(IDLE_S) as window:
        async for chunk in chunks:
            window.reschedule(loop.time() + IDLE_S)
            yield chunk


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def twin(request):
    """A real uvicorn (httptools) on an ephemeral port, in a thread, always stopped; on each
    event loop uvicorn may pick (its "auto": uvloop where installed, else asyncio)."""
    import uvicorn
    app = Twin()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app.app(), loop=request.param, http="httptools", lifespan="off",
                            log_level="critical", timeout_keep_alive=5)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started, timeout_s=20, what="uvicorn started")
        yield app, sock.getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(10)


@dataclass(frozen=True)
class Form:
    """One way to send a push (RFC 9110 / RFC 9112 request forms)."""
    version: str = "1.1"
    connection: str | None = None  # the Connection header
    expect: str | None = None      # Expect: 100-continue; "wait": the body only after the 100
    #                                (or WAIT_100), "eager": the body at once
    framing: str = "length"        # "length", "chunked", "length+chunked", "length twice"
    size: int = 1000
    delivery: str = "whole"        # "whole"; "slow": pieces, pauses within the idle bound;
    #                                "stall": half, the rest after the reply; "half-close":
    #                                half, then no more (shutdown); "silent": no body;
    #                                "close-after": whole, then shutdown; "close-late": no
    #                                body, shutdown once the app gave up, before it replies
    then: str | None = None        # right after the body: "pipelined" (a request), "junk"


def _form_bytes(form: Form, path: str, body: bytes) -> tuple[bytes, bytes]:
    head = [f"POST {path} HTTP/{form.version}".encode(), b"Host: t",
            b"Content-Type: application/octet-stream"]
    chunked = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
    payload = body
    if form.framing in ("length", "length+chunked", "length twice"):
        head.append(b"Content-Length: %d" % len(body))
    if form.framing == "length twice":
        head.append(b"Content-Length: %d" % len(body))
    if "chunked" in form.framing:
        head.append(b"Transfer-Encoding: chunked")
        payload = chunked + b"0\r\n\r\n"
    if form.connection:
        head.append(b"Connection: " + form.connection.encode())
    if form.expect:
        head.append(b"Expect: 100-continue")
    return b"\r\n".join(head) + b"\r\n\r\n", payload


class Peer:
    """A raw client connection: every reply it read, in order (interim ones too)."""

    def __init__(self, port: int):
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf, self.replies, self.closed = b"", [], False

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self.conn.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True

    def shutdown(self) -> None:
        """No more to send (a FIN): the server may have closed already."""
        try:
            self.conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def read(self, until, timeout: float) -> None:
        """Reads until `until()`, the server closes, or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not until() and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.conn.settimeout(left)
            try:
                part = self.conn.recv(65536)
            except TimeoutError:
                return
            except ConnectionResetError:
                part = b""
            self.closed = not part
            self.buf += part
            self._parse()

    def _parse(self) -> None:
        while b"\r\n\r\n" in self.buf:
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
            code = int(lines[0].split()[1])
            n = int(headers.get(b"content-length", 0))
            if len(rest) < n:
                return
            self.replies.append((code, headers.get(b"connection"), rest[:n]))
            self.buf = rest[n:]

    def finals(self) -> int:
        return sum(code >= 200 for code, _, _ in self.replies)


def _observe(port: int, mode: str, form: Form, case: str, body: bytes) -> dict:
    """Sends `form` with `body` to /<mode>/push and returns all the client observed."""
    head, payload = _form_bytes(form, f"/{mode}/push?{case}", body)
    after = {None: b"", "pipelined": f"GET /{mode}/ping HTTP/1.1\r\nHost: t\r\n\r\n".encode(),
             "junk": b"NOT HTTP\r\n\r\n"}[form.then]
    half = len(payload) // 2
    peer = Peer(port)
    try:
        peer.send(head)
        if form.expect == "wait":
            peer.read(lambda: peer.replies, WAIT_100)
        else:
            time.sleep(PAUSE)
        # Interim replies only: a final one may come with it (a body of Content-Length 0 is
        # whole with the head), in the same read or the next, as it happens.
        before_body = [code for code, _, _ in peer.replies if code < 200]
        if form.delivery in ("whole", "close-after"):
            peer.send(payload + after)
        elif form.delivery == "slow":
            for i in range(4):
                peer.send(payload[i * len(payload) // 4:(i + 1) * len(payload) // 4])
                time.sleep(IDLE_S / 10)
            peer.send(after)
        elif form.delivery in ("stall", "half-close"):
            peer.send(payload[:half])
        if form.delivery == "close-late":
            time.sleep(IDLE_S + LINGER / 2)
        if form.delivery in ("half-close", "close-after", "close-late"):
            peer.shutdown()
        want = 1 + (form.then is not None)
        peer.read(lambda: peer.finals() >= want, 3 * IDLE_S + 2)
        peer.read(lambda: False, 0.05)  # a close that follows the last reply
        if form.delivery == "stall":
            peer.send(payload[half:] + after)  # late: dropped where the body was given up
        # Does the connection answer a next request, close, or stay silent?
        finals = peer.finals()
        peer.send(f"GET /{mode}/ping HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        peer.read(lambda: peer.finals() > finals, QUIET)
        next_request = "closed" if peer.closed and peer.finals() == finals else \
            "answered" if peer.finals() > finals else "silent"
    finally:
        peer.conn.close()
    return {"interim before the body": before_body,
            "replies": peer.replies, "next request": next_request}


def _compare(twin, form: Form) -> dict:
    """Both paths' observations of `form`, asserted equal; the socket path's records."""
    app, port = twin
    case, body = os.urandom(6).hex(), os.urandom(form.size)
    if form.delivery == "close-late":
        case += "-linger"
    with ThreadPoolExecutor(2) as pool:  # both at once: half the wall time
        seen = dict(zip(("s", "u"), pool.map(
            lambda mode: _observe(port, mode, form, f"{mode}-{case}", body), ("s", "u"))))
    for mode in seen:
        wait_until(lambda: app.active.get(f"{mode}-{case}", 0) == 0, timeout_s=5,
                   what="the app done with the case")
        seen[mode]["app read"] = [r[:3] for r in app.records.get(f"{mode}-{case}", [])]
    assert seen["s"] == seen["u"], form
    return {"records": app.records.get(f"s-{case}", []), **seen["s"]}


# Each form with the path the socket side must take: "socket" where the body cannot have
# arrived whole before the app reads it (so the takeover is what is compared), "uvicorn"
# where the takeover must decline; None where either may happen.
FORMS = {
    "expect 100-continue, waiting for it": (Form(expect="wait", size=200_000), "socket"),
    "expect 100-continue, not waiting": (Form(expect="eager", size=200_000), None),
    "expect 100-continue, HTTP/1.0": (Form(version="1.0", expect="wait"), "socket"),
    "HTTP/1.0": (Form(version="1.0", size=200_000), None),
    "HTTP/1.0 keep-alive": (Form(version="1.0", connection="keep-alive", size=200_000,
                                 then="pipelined"), None),
    "Connection: close, pipelined": (Form(connection="close", expect="wait",
                                          then="pipelined"), "socket"),
    "keep-alive, pipelined": (Form(expect="wait", size=200_000, then="pipelined"), "socket"),
    "keep-alive, junk after the body": (Form(expect="wait", then="junk"), "socket"),
    "chunked": (Form(framing="chunked", expect="wait", size=200_000), "uvicorn"),
    "Content-Length and chunked": (Form(framing="length+chunked"), None),
    "Content-Length twice": (Form(framing="length twice"), None),
    "slow client": (Form(delivery="slow", size=200_000), None),
    "stalled, the rest late": (Form(expect="wait", delivery="stall"), "socket"),
    "half the body, then closed": (Form(expect="wait", delivery="half-close"), "socket"),
    "whole body, then closed": (Form(expect="wait", delivery="close-after"), "socket"),
    "silent client": (Form(delivery="silent"), "socket"),
    "silent after 100-continue": (Form(expect="wait", delivery="silent"), "socket"),
    "closed after the app gave up": (Form(delivery="close-late"), "socket"),
}


@pytest.mark.parametrize("name", FORMS)
def test_socket_path_behaves_as_uvicorn(twin, name):
    """Each request form gets the same replies, interim 100 included, the same connection
    handling and the same bounds whether its body is read from the socket or by uvicorn."""
    form, path = FORMS[name]
    seen = _compare(twin, form)
    if path is not None:
        assert [r[3] for r in seen["records"]] == [path], seen["records"]
    if form.expect == "wait" and path == "socket":  # what the bug was: curl waited 1 s
        assert seen["interim before the body"] == [100]


forms = st.builds(
    Form, version=st.sampled_from(["1.1", "1.0"]),
    connection=st.sampled_from([None, "keep-alive", "close"]),
    expect=st.sampled_from([None, "wait", "eager"]),
    framing=st.sampled_from(["length", "length", "chunked", "length+chunked"]),
    size=st.sampled_from([0, 1, 1000, 200_000]),
    delivery=st.sampled_from(["whole", "slow", "stall", "half-close", "silent", "close-after",
                              "close-late"]),
    then=st.sampled_from([None, "pipelined", "junk"])).filter(
    # Bytes after a request that closes the connection race uvicorn's own close (under
    # asyncio its reply was sometimes lost, on a body it read itself): no behaviour to match.
    # So do bytes the client follows with its own shutdown ("close-after"): whether the
    # pipelined request is answered races the server's read of the end of the stream (a CI
    # run saw the socket path's answer missing once, and there the next time).
    lambda f: f.then is None or not (f.connection == "close" or f.delivery == "close-after" or
                                     (f.version == "1.0" and f.connection != "keep-alive")))


@settings(max_examples=10, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(form=forms)
def test_random_request_forms_behave_as_through_uvicorn(twin, form):
    """Any combination of the forms above: the same observations either way."""
    _compare(twin, form)

