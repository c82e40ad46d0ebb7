"""A pushed body read straight from its connection's socket instead of through uvicorn.

Both engines serve HTTP with uvicorn (httptools), which hands a body to the app in pieces of
at most 256 KB, copying each piece four times on the way (its read buffer, the bytes it
makes of it, the parser's slice, the request's bytearray) plus once more into the message,
with an event-loop round trip per piece. Taking over the socket reads up to 4 MiB per call
with one copy, in about half the time for a large body (docs/benchmarks.md; docs/protocol.md,
"Receiving a body").

The rule: bypassing uvicorn changes speed, never behaviour. Whatever a client sends, it gets
the same replies as through uvicorn (LORA_SYNC_SOCKET_BODY=0): the same status, the same
interim `100 Continue`, the same keep-alive or close, within the same time bounds
(tests/test_socket_body.py compares both paths request form by request form). So a takeover
does what uvicorn's `receive` and parser callbacks would have done while the body arrives:

  * `Expect: 100-continue`: the interim reply is written as the read starts, as uvicorn's
    first `receive` writes it (a conforming client waits for it before sending the body);
  * the body's end: the parser is told nothing of the bytes read here, so it is handed on
    (`_BodyTaken`) to drop whatever of the body the takeover leaves unread (a read cut by
    the caller's timeout) and then parse what follows, a pipelined or next request on a
    kept-alive connection, with a parser of its own as uvicorn would; the connection is
    kept alive or closed exactly as uvicorn decided from the request's head;
  * a client that closes or resets mid-body: uvicorn's connection is closed and marked
    disconnected at once, so the reply is dropped as uvicorn drops it;
  * framing: only a body framed by one Content-Length and no Transfer-Encoding is taken.

uvicorn's request internals are private, so this module alone touches them, for the uvicorn
versions in KNOWN_UVICORN (checked at start-up). A connection it cannot take over (TLS, the
h11 parser, no Content-Length, a body already read whole, an upgrade) is read through
uvicorn as before. Every limit on a body applies alike: the caller reads these chunks like
uvicorn's."""
from __future__ import annotations

import asyncio
import functools
import os
import socket

from starlette.requests import ClientDisconnect

from ..engines import UVICORN_PIN
from ..errors import PayloadTooLarge

KNOWN_UVICORN = (UVICORN_PIN,)
READ_SIZE = 4 << 20
# The scope key under which admission (the outermost middleware) leaves uvicorn's own
# `receive` for our routes: middlewares further in may wrap it.
RAW_RECEIVE = "lora_sync.raw_receive"
# What uvicorn's `receive` writes when the request said `Expect: 100-continue`.
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@functools.lru_cache(maxsize=1)  # looked up at every push
def _httptools_classes():
    """uvicorn's (protocol, request, parser) classes under httptools, or None without
    httptools (then uvicorn parses with h11 and every body goes through it)."""
    try:
        from httptools import HttpRequestParser
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    except ImportError:
        return None
    return HttpToolsProtocol, RequestResponseCycle, HttpRequestParser


def check() -> None:
    """Start-up: fails loudly where uvicorn is a version whose internals were not checked."""
    import uvicorn

    classes = _httptools_classes()
    if classes is None:
        return
    protocol, request, _ = classes
    uses = {request.__init__: ("flow", "transport", "body", "more_body", "keep_alive",
                               "disconnected", "response_complete", "message_event",
                               "waiting_for_100_continue"),
            protocol.__init__: ("parser", "cycle"),
            protocol.data_received: ("parser", "feed_data")}
    missing = [n for code, names in uses.items() for n in names
               if n not in code.__code__.co_names]
    if uvicorn.__version__ not in KNOWN_UVICORN or missing:
        raise RuntimeError(
            f"lora-sync reads pushed bodies from the socket past uvicorn's internals, checked "
            f"on uvicorn {', '.join(KNOWN_UVICORN)}; this is uvicorn {uvicorn.__version__}"
            + (f" (its HTTP protocol does not use {missing})" if missing else "")
            + f". Install uvicorn=={UVICORN_PIN} (lora-sync's server extras pin it), or set "
            "LORA_SYNC_SOCKET_BODY=0 to read bodies through uvicorn instead.")


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
        protocol = _takeable(cycle, self.length)
        if protocol is None:
            async for chunk in self.fallback:
                yield landing.put(chunk)
            return
        # No await from here to the parser's hand-over: uvicorn reads nothing in between.
        cycle.flow.pause_reading()
        self.taken = True
        if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
            cycle.transport.write(CONTINUE)
            cycle.waiting_for_100_continue = False
        head, cycle.body = cycle.body, bytearray()  # what uvicorn parsed already
        # From now on uvicorn's parser drops the rest of the body whenever it reads again
        # (after the reply, or if the app calls uvicorn's `receive`): the connection stays
        # in step with it however this generator ends, or is abandoned at a `yield`.
        taken = _BodyTaken(protocol, cycle, self.length - len(head))
        if head:
            yield landing.put(head)
        loop = asyncio.get_running_loop()
        while taken.left > 0:
            try:
                n = await _recv_into(loop, cycle.transport, landing.window(taken.left))
            except BaseException:  # cancelled: the caller's timeout gave up on the body
                _resume(cycle)  # uvicorn reads on while its app waits: a close is seen
                raise
            if n == 0:  # the client closed or reset: uvicorn would see it lose the connection
                _lose(cycle)
                raise ClientDisconnect()
            taken.read(n)
            yield landing.took(n)
        # The body is read. uvicorn would read on, and parse what came with its end before
        # the app replies (a pipelined request is queued, bytes that are no request are
        # answered 400 and the connection closed): so does this.
        _resume(cycle)
        _after_body(protocol, cycle.transport)


async def _recv_into(loop, transport, window: memoryview) -> int:
    """One read from the transport's socket into `window`: 0 at its end (closed or reset).

    Through a socket object of our own on a duplicate descriptor, opened for this read only:
    closing it leaves uvicorn's, and a generator abandoned between reads holds none (a
    duplicate held open would keep the connection open after uvicorn closed it). Only the
    wait is awaited, the read itself is not: a timeout that cancels it has taken no bytes
    (a cancelled loop.sock_recv_into may have read some), so `_BodyTaken` counts them all."""
    if transport.is_closing():
        return 0
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    try:
        sock.setblocking(False)
        while True:
            try:
                return sock.recv_into(window)
            except BlockingIOError:
                pass
            except ConnectionError:
                return 0
            ready = loop.create_future()
            loop.add_reader(sock.fileno(), _set_once, ready)
            try:
                await ready
            finally:
                loop.remove_reader(sock.fileno())
    finally:
        sock.close()


def _set_once(future) -> None:
    if not future.done():
        future.set_result(None)


def _resume(cycle) -> None:
    if not cycle.transport.is_closing():
        cycle.flow.resume_reading()


def _lose(cycle) -> None:
    """What uvicorn does when its connection is lost mid-body (its protocol's
    connection_lost, which is how its app learns of it): the request is marked
    disconnected, so the app's reply is dropped unwritten, and the connection closes."""
    if not cycle.response_complete:
        cycle.disconnected = True
    cycle.message_event.set()
    cycle.transport.close()


def _after_body(protocol, transport) -> None:
    """Bytes already in the socket after the body, handed to uvicorn's protocol as its
    transport would have handed them, with the body's end in one read. Not an end of the
    stream: uvicorn's transport sees that at its next read (a read that returns less than
    asked for is its last in a poll), so it is left to the transport, now reading again."""
    if transport.is_closing():
        return
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    try:
        sock.setblocking(False)
        data = sock.recv(1 << 16)
    except (BlockingIOError, ConnectionError):
        return
    finally:
        sock.close()
    if data:
        protocol.data_received(data)


class _BodyTaken:
    """Stands in for uvicorn's parser while a taken-over body's bytes are in the socket:
    uvicorn's parser still expects them, and a parser cannot be told they were read. It
    drops the first `left` bytes uvicorn reads (none once the takeover read them all), then
    hands on to a fresh parser for what follows, as uvicorn's parser would have parsed it;
    after a request that does not keep its connection alive, it drops everything, as
    uvicorn's parser does (its lenient_data_after_close)."""

    def __init__(self, protocol, cycle, left: int):
        self.protocol, self.cycle, self.left = protocol, cycle, left
        self.parser = protocol.parser  # for anything else uvicorn asks of its parser
        self.after = None
        if self.parser.should_keep_alive():
            self.after = _httptools_classes()[2](protocol)
            try:  # as uvicorn sets up each parser
                self.after.set_dangerous_leniencies(lenient_data_after_close=True)
            except AttributeError:
                pass
        protocol.parser = self

    def read(self, n: int) -> None:
        """`n` more bytes of the body were read from the socket (by us or by uvicorn)."""
        self.left -= n
        if self.left == 0:
            self.cycle.more_body = False  # as uvicorn's on_message_complete
            self.cycle.message_event.set()
            if self.after is not None and self.protocol.parser is self:
                self.protocol.parser = self.after

    def feed_data(self, data) -> None:
        skip = min(self.left, len(data))
        if skip:
            self.read(skip)
        if self.left == 0 and self.after is not None and len(data) > skip:
            self.after.feed_data(data[skip:])

    def __getattr__(self, name):
        return getattr(self.parser, name)


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


def _takeable(cycle, length: int | None):
    """uvicorn's protocol for `cycle` where its body can be read from the socket, else None.
    Where it cannot be, uvicorn reads it: a body already read whole, TLS, h11, a connection
    already lost or closing, an upgrade, and any framing but one Content-Length alone
    (uvicorn's parser refuses the ambiguous ones before the app runs; checked again here so
    a body is never read by a length uvicorn's parser does not go by)."""
    from uvicorn.protocols.utils import is_ssl

    classes = _httptools_classes()
    if length is None or cycle is None or classes is None or type(cycle) is not classes[1]:
        return None
    if not cycle.more_body or cycle.disconnected or cycle.response_complete:
        return None
    transport = cycle.transport
    if is_ssl(transport) or transport.is_closing() \
            or transport.get_extra_info("socket") is None:
        return None
    protocol = transport.get_protocol()
    if type(protocol) is not classes[0] or protocol.cycle is not cycle \
            or type(protocol.parser) is not classes[2] \
            or protocol.parser.should_upgrade():
        return None
    framing = [v for k, v in cycle.scope["headers"]
               if k in (b"content-length", b"transfer-encoding")]
    if framing != [str(length).encode()]:
        return None
    return protocol
