"""A pushed body read straight from its connection's socket instead of through uvicorn.

Both engines serve HTTP with uvicorn (httptools), which hands a body to the app in pieces of
at most 256 KB, copying each piece four times on the way (its read buffer, the bytes it
makes of it, the parser's slice, the request's bytearray) plus once more into the message,
with an event-loop round trip per piece. Taking over the socket reads up to 4 MiB per call
with one copy: a 70 MB body took 37-49 ms through uvicorn and 22-23 ms this way in the same
process (docs/protocol.md, "Receiving a body").

uvicorn's request internals are private, so this module alone touches them, for the uvicorn
versions in KNOWN_UVICORN (checked at start-up). A connection it cannot take over (TLS, the
h11 parser, no Content-Length, a body already read whole) is read through uvicorn as before.
Every limit on a body applies alike: the caller reads these chunks like uvicorn's.

After a takeover uvicorn's parser has not seen the body's end, so the connection is closed
after the reply (the reply says `Connection: close`)."""
from __future__ import annotations

import asyncio
import functools
import os
import socket

from starlette.requests import ClientDisconnect

from ..errors import PayloadTooLarge

KNOWN_UVICORN = ("0.54.0",)
READ_SIZE = 4 << 20
# The scope key under which admission (the outermost middleware) leaves uvicorn's own
# `receive` for our routes: middlewares further in may wrap it.
RAW_RECEIVE = "lora_sync.raw_receive"


@functools.lru_cache(maxsize=1)  # looked up at every push
def _httptools_request():
    """uvicorn's request class under httptools, or None without httptools (then uvicorn
    parses with h11 and every body goes through it)."""
    try:
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    except ImportError:
        return None
    return RequestResponseCycle


def check() -> None:
    """Start-up: fails loudly where uvicorn is a version whose internals were not checked."""
    import uvicorn

    request = _httptools_request()
    if request is None:
        return
    names = ("flow", "transport", "body", "more_body", "keep_alive", "disconnected",
             "response_complete")
    missing = [n for n in names if n not in request.__init__.__code__.co_names]
    if uvicorn.__version__ not in KNOWN_UVICORN or missing:
        raise RuntimeError(
            f"lora-sync reads pushed bodies from the socket past uvicorn's internals, checked "
            f"on uvicorn {', '.join(KNOWN_UVICORN)}; this is uvicorn {uvicorn.__version__}"
            + (f" (its request has no {missing})" if missing else "")
            + ". Set LORA_SYNC_SOCKET_BODY=0 to read bodies through uvicorn instead.")


class BodyChunks:
    """A body's chunks (each valid until the next one): from the socket when, as reading
    starts, the connection can be taken over; else from `fallback`, uvicorn's own stream.
    Deciding only then means a body refused unread (too large, no room) keeps uvicorn's
    handling: it discards the body and the client gets its reply."""

    def __init__(self, raw_receive, length: int | None, fallback):
        self.cycle = getattr(raw_receive, "__self__", None)
        self.length, self.fallback = length, fallback
        self.taken = False

    def __aiter__(self):
        return self._chunks(None)

    def read_into(self, dest: memoryview):
        """The body landed in `dest`, as long as Content-Length says: each chunk yielded is
        the next stretch of `dest`, already in place. From the socket the bytes go straight
        in, one copy fewer than chunks written where they belong (a staged file's mapping:
        see staging.py); through uvicorn each chunk is copied in."""
        if self.length is None or len(dest) != self.length:
            raise ValueError("read_into needs a destination of the body's Content-Length")
        return self._chunks(dest)

    async def _chunks(self, dest: memoryview | None):
        landing = _Landing(dest)
        cycle = self.cycle
        if self.length is None or not _takeable(cycle):
            async for chunk in self.fallback:
                yield landing.put(chunk)
            return
        # From here uvicorn reads nothing more from this connection and closes it after
        # the reply. No await before the pause: uvicorn cannot read a piece in between.
        cycle.flow.pause_reading()
        cycle.keep_alive = False
        self.taken = True
        head, cycle.body = cycle.body, bytearray()  # what uvicorn parsed already
        if head:
            yield landing.put(head)
        left = self.length - len(head)
        # A socket object of our own on a duplicate descriptor: closing it leaves uvicorn's.
        sock = socket.socket(fileno=os.dup(cycle.transport.get_extra_info("socket").fileno()))
        try:
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            while left > 0:
                window = landing.window(left)
                try:
                    n = await loop.sock_recv_into(sock, window)
                except ConnectionError:
                    n = 0
                if n == 0:
                    raise ClientDisconnect()
                left -= n
                yield landing.took(n)
        finally:
            sock.close()


class _Landing:
    """Where a body's bytes land: a read buffer of ours, reused for every chunk, or `dest`,
    filled in order."""

    def __init__(self, dest: memoryview | None):
        self.dest, self.at = dest, 0
        self.buf: memoryview | None = None

    def window(self, left: int) -> memoryview:
        """Where the next read goes (at most READ_SIZE bytes, at most `left`)."""
        if self.dest is not None:
            return self.dest[self.at:self.at + min(left, READ_SIZE)]
        if self.buf is None:
            self.buf = memoryview(bytearray(min(READ_SIZE, max(left, 1))))
        return self.buf[:min(left, len(self.buf))]

    def took(self, n: int) -> memoryview:
        """The `n` bytes the last read put into its window."""
        if self.dest is None:
            return self.buf[:n]
        self.at += n
        return self.dest[self.at - n:self.at]

    def put(self, chunk) -> memoryview | bytes:
        """A chunk read by someone else (uvicorn), copied into `dest` when there is one."""
        if self.dest is None:
            return chunk
        if self.at + len(chunk) > len(self.dest):
            raise PayloadTooLarge(f"request body is longer than its Content-Length "
                                  f"({len(self.dest)} bytes)")
        self.dest[self.at:self.at + len(chunk)] = chunk
        return self.took(len(chunk))


def _takeable(cycle) -> bool:
    from uvicorn.protocols.utils import is_ssl

    return cycle is not None and type(cycle) is _httptools_request() and cycle.more_body \
        and not cycle.disconnected and not cycle.response_complete \
        and not is_ssl(cycle.transport) and cycle.transport.get_extra_info("socket") is not None
