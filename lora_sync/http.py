"""Minimal HTTP calls on the standard library: the trainer side needs no web framework, and a
push streams tensor memory straight into the socket.

This is the one place the client reads server replies, and it bounds them by construction:
  * time: `timeout` is a deadline for the whole call (connect, send, status line, headers,
    body), not per socket operation; a watchdog shuts the socket at the deadline, so a
    server that trickles its reply a byte at a time is cut off. `within(deadline)` puts an
    earlier deadline on every call a thread makes inside it (a push and its resync share one);
  * memory: a reply longer than `max_reply_bytes` is refused (from Content-Length before
    reading, else as soon as it passes the limit); header lines are capped by http.client;
  * meaning: every failure is a LoRASyncError naming the server: `unreachable` (no
    connection, or no complete reply by the deadline) or `bad_reply` (not HTTP, truncated,
    too long, or from `call`: a success that is not a JSON object). Never a raw exception."""
from __future__ import annotations

import contextvars
import heapq
import http.client
import itertools
import json
import socket
import ssl
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

from .errors import LoRASyncError, error_from_json

MAX_REPLY_BYTES = 16 << 20  # JSON replies are small; a generation reply well below this
_READ_CHUNK = 1 << 16
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "lora_sync_http_deadline", default=None)


@contextmanager
def within(deadline: float | None):
    """Every request this thread makes inside ends by `deadline` (time.monotonic()), or
    earlier by its own `timeout`; nested scopes keep the earliest deadline."""
    if deadline is None:
        yield
        return
    outer = _deadline.get()
    token = _deadline.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _deadline.reset(token)


def origin(url: str) -> str:
    """The server a URL names (scheme://host:port), as errors name it."""
    try:
        u = urlsplit(url)
        return f"{u.scheme}://{u.netloc}" if u.netloc else str(url)[:200]
    except (ValueError, TypeError):
        return str(url)[:200]


def check_url(url) -> str:
    """`url` if it is an http(s) URL with a host (and a valid port, if any); else ValueError."""
    try:
        u = urlsplit(url) if isinstance(url, str) else None
        ok = u is not None and u.scheme in ("http", "https") and bool(u.hostname) \
            and (u.port is None or 0 < u.port < 65536) and url.isprintable() \
            and " " not in url
    except ValueError:  # a port that is not a number
        ok = False
    if not ok:
        raise ValueError(f"{str(url)[:200]!r} is not a server URL like http://HOST:PORT")
    return url


def _connection(url: str, timeout: float):
    try:
        check_url(url)
    except ValueError as e:
        raise LoRASyncError(str(e), code="bad_request", status=400) from None
    u = urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    target = u.path or "/"
    if u.query:
        target += f"?{u.query}"
    return cls(u.hostname, u.port, timeout=timeout), target


class _Watchdog:
    """One thread for every call: at a call's deadline it shuts the call's socket, which ends
    whatever blocking read or write the call is in. Armed and disarmed under one lock, so it
    never touches a socket after its call disarmed it (the descriptor may be reused)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._heap: list = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._disarmed = 0  # disarmed entries still in the heap

    def arm(self, deadline: float, sock) -> list:
        entry = [deadline, next(self._seq), sock, False]  # [.., .., socket|None, fired]
        with self._cv:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                 name="lora-sync-http-deadlines")
                self._thread.start()
            self._cv.notify()
        return entry

    def disarm(self, entry: list) -> bool:
        """Returns True when the deadline had already fired."""
        with self._cv:
            if entry[2] is not None:
                entry[2] = None
                self._disarmed += 1
                if self._disarmed > 64 and 2 * self._disarmed > len(self._heap):
                    self._heap = [e for e in self._heap if e[2] is not None]  # bounded
                    heapq.heapify(self._heap)
                    self._disarmed = 0
            return entry[3]

    def _run(self):
        with self._cv:
            while True:
                while self._heap and self._heap[0][2] is None:
                    heapq.heappop(self._heap)
                    self._disarmed = max(0, self._disarmed - 1)
                if not self._heap:
                    self._cv.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                entry = heapq.heappop(self._heap)
                entry[3] = True
                try:
                    entry[2].shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                entry[2] = None  # popped: never counted as disarmed


_watchdog = _Watchdog()


class _Expired(Exception):
    pass


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Expired
    return left


def _read_body(resp, max_bytes: int, deadline: float, where: str) -> bytes:
    declared = resp.length  # None: chunked or until close
    if declared is not None and declared > max_bytes:
        raise LoRASyncError(f"{where}: the reply announces {declared} bytes, above the "
                            f"client's limit of {max_bytes}", code="bad_reply", status=502)
    parts, got = [], 0
    while True:
        _remaining(deadline)
        chunk = resp.read(min(_READ_CHUNK, max_bytes + 1 - got))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
        if got > max_bytes:
            raise LoRASyncError(f"{where}: the reply is longer than the client's limit of "
                                f"{max_bytes} bytes", code="bad_reply", status=502)
    if declared is not None and got < declared:
        raise LoRASyncError(f"{where}: the reply ended after {got} of the {declared} bytes "
                            "it announced", code="bad_reply", status=502)
    return b"".join(parts)


# Buffers per sendmsg (the kernel takes up to 1024): a call per chunk cost more than the
# bytes for an adapter of thousands of small tensors.
_SEND_BATCH = 512


def _send_body(sock: socket.socket, chunks, deadline: float) -> None:
    """Every chunk in order: a list a few hundred chunks per sendmsg; an iterator (a relay
    forwarding what it receives) each chunk as it comes."""
    if not isinstance(chunks, list):
        for view in map(_byte_view, chunks):
            if view.nbytes:
                _send_all(sock, [view], deadline)
        return
    views = [v for v in map(_byte_view, chunks) if v.nbytes]
    for first in range(0, len(views), _SEND_BATCH):
        _send_all(sock, views[first:first + _SEND_BATCH], deadline)


def _byte_view(chunk) -> memoryview:
    view = memoryview(chunk)
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


def _send_all(sock: socket.socket, views: list, deadline: float) -> None:
    """`views` (1-D byte views) whole, in order, each sendmsg within what is left of the
    deadline."""
    if isinstance(sock, ssl.SSLSocket):  # TLS has no sendmsg: one buffer per call
        for view in views:
            sock.settimeout(_remaining(deadline))
            sock.sendall(view)
        return
    i = 0
    while i < len(views):
        sock.settimeout(_remaining(deadline))
        sent = sock.sendmsg(views[i:])
        while sent:
            n = views[i].nbytes
            if sent < n:
                views[i], sent = views[i][sent:], 0
            else:
                sent -= n
                i += 1


def exchange(method: str, url: str, *, chunks=None, json_body=None, headers=None,
             timeout: float = 120.0, max_reply_bytes: int = MAX_REPLY_BYTES, on_sent=None,
             content_length: int | None = None) -> tuple[int, bytes, dict]:
    """Sends a request; the body is either `json_body` or an iterable of byte chunks (given
    `content_length`, an iterator consumed while it sends: a relay forwarding what it
    receives). Returns (status, reply bytes, reply headers), all of it within `timeout`
    seconds (and the deadline of an enclosing `within`). `on_sent()` is called once the
    whole body has left, before the reply is read."""
    deadline = time.monotonic() + timeout
    scoped = _deadline.get()
    if scoped is not None:
        deadline = min(deadline, scoped)
    where = f"{method} {url}"
    headers = dict(headers or {})
    if json_body is not None:
        chunks = [json.dumps(json_body).encode()]
        headers["Content-Type"] = "application/json"
    if content_length is None:
        chunks = list(chunks or [])
        content_length = sum(len(c) for c in chunks)
    headers["Content-Length"] = str(content_length)
    conn, path = _connection(url, timeout)
    guard = None
    try:
        try:
            conn.timeout = _remaining(deadline)
            conn.connect()
            guard = _watchdog.arm(deadline, conn.sock)
            conn.putrequest(method, path)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            _send_body(conn.sock, chunks, deadline)
            if on_sent is not None:
                on_sent()
            conn.sock.settimeout(_remaining(deadline))
            resp = conn.getresponse()
            raw = _read_body(resp, max_reply_bytes, deadline, where)
            return resp.status, raw, dict(resp.getheaders())
        finally:
            fired = guard is not None and _watchdog.disarm(guard)
    except LoRASyncError as e:
        e.server = origin(url)
        raise
    except Exception as e:  # noqa: BLE001 - every failure gets a code and the server's name
        if fired or isinstance(e, (_Expired, TimeoutError)) or time.monotonic() >= deadline:
            err = LoRASyncError(f"{where}: no complete reply within {timeout:.3g} s "
                                "(the client's timeout for the whole call)",
                                code="unreachable", status=504)
        elif isinstance(e, OSError):
            err = LoRASyncError(f"{where} failed: {e}", code="unreachable", status=503)
        else:  # http.client.HTTPException (bad status line, header too long, ...), ...
            err = LoRASyncError(f"{where}: not a valid HTTP reply ({type(e).__name__}: "
                                f"{str(e)[:300]})", code="bad_reply", status=502)
        err.server = origin(url)
        raise err from e
    finally:
        conn.close()


def _decode(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, absurdly deep
        return None


def request(method: str, url: str, **kw) -> tuple[int, dict, dict]:
    """Like `exchange`, with the reply as a dict: its JSON object, or for any other body
    (a stream, a proxy's page) {"error": {"message": the text, cut}}; {} when empty."""
    status, raw, headers = exchange(method, url, **kw)
    body = _decode(raw) if raw else {}
    if not isinstance(body, dict):
        body = {"error": {"message": raw.decode(errors="replace")[:2000]}}
    return status, body, headers


def call(method: str, url: str, *, json_reply: bool = True, **kw) -> tuple[dict, dict]:
    """Raises the server's LoRASyncError on a non-2xx reply, `bad_reply` on a success that is
    not a JSON object; else returns (the object, reply headers). `json_reply=False` (the
    engines' own routes, which may answer in text): any success body, as `request` gives it."""
    status, raw, headers = exchange(method, url, **kw)
    body = _decode(raw) if raw else None
    if status >= 300:
        err = error_from_json(status, body if body is not None else
                              {"error": {"message": raw.decode(errors="replace")[:2000]}})
    elif not json_reply:
        return body if isinstance(body, dict) else {"text": raw.decode(errors="replace")[:2000]}, \
            headers
    elif not isinstance(body, dict):
        shown = raw[:80].decode(errors="replace")
        err = LoRASyncError(f"{method} {url}: the reply (status {status}) is not a JSON object: "
                            f"{shown!r}{'...' if len(raw) > 80 else ''}", code="bad_reply",
                            status=502)
    else:
        return body, headers
    err.server = origin(url)
    raise err
