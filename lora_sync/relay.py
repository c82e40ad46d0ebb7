"""One copy per node (transport `relay`): a relay on each node of servers takes the adapter
once, passes it on to the next node's relay while it arrives, and fans it out to the
servers on its own node through the `shared` transport (one sealed copy every server maps).

    trainer --body--> relay A --body--> relay B --body--> relay C       (one copy per link)
                      |shared           |shared           |shared
                      servers of A      servers of B      servers of C

The trainer's link carries one copy whatever the number of nodes and servers; each node
receives one and forwards one. The push is pipelined: a relay forwards each piece of the
body as it lands, so a chain costs about one copy's time at the link rate plus a piece's
time per hop, not one copy per hop.

    python -m lora_sync.relay --host 10.0.0.5 --port 9100     # on each node, beside its servers

`POST /lora_sync_relay`: the body is the tensors transport's (a safetensors file whose
metadata carries name, version and config: docs/wire_format.md); the header CHAIN_HEADER is
the chain from this relay on, as JSON [{"relay": URL, "servers": [{"url": URL, "engine":
"vllm" | "sglang"}, ...]}, ...]. The reply
is {"results": [PushResult.to_json(), ...]}, one per server of the chain, in its order.

Every server still judges the push for itself (its key, its checks, its verdict); the relay
forwards the caller's Authorization to them. The relay holds nothing between pushes but its
receive buffer, and bounds what a caller can make it hold: it wants the admin key
(LORA_SYNC_API_KEY, the servers' own) before it reads a byte, one push at a time, bodies up to
LORA_SYNC_MAX_BODY_MB, a chain of at most MAX_HOPS hops of MAX_SERVERS servers, MAX_CONNECTIONS
connections, and a socket idle for IDLE_S seconds is dropped."""
from __future__ import annotations

import argparse
import hmac
import json
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import http, naming
from .adapter import META_NAME, META_VERSION, LoRAAdapter
from .api import API_KEY_ENV
from .errors import BadRequest, ClientDisconnected, LoRASyncError, PayloadTooLarge, TimedOut, \
    TooBusy, Unauthorized
from .transports import TRANSPORTS
from .transports.base import PushResult, SendContext, Server, send_reaching, with_protocol
from .transports.shared_copy import sealed_copy
from .transports.shm.memfd import read_header

RELAY_PATH = "/lora_sync_relay"
MAX_BODY_ENV = "LORA_SYNC_MAX_BODY_MB"
CHAIN_HEADER = "X-LoRA-Sync-Relay-Chain"
MAX_HOPS = 64
MAX_SERVERS = 256            # per hop
MAX_CHAIN_BYTES = 256 << 10  # the chain header
MAX_CONNECTIONS = 8
IDLE_S = 30.0
PIECE = 1 << 20              # the most forwarded at once (what has landed is, at once)


@dataclass(frozen=True)
class Hop:
    relay: str               # the relay's URL
    servers: tuple           # the servers on its node (Server: URL and engine)

    def to_json(self) -> dict:
        return {"relay": self.relay,
                "servers": [{"url": s.url, "engine": s.engine} for s in self.servers]}


def parse_chain(raw: str | None) -> list[Hop]:
    """The chain header, checked field by field (BadRequest naming what is wrong)."""
    if not raw or len(raw) > MAX_CHAIN_BYTES:
        raise BadRequest(f"{CHAIN_HEADER} is missing or longer than {MAX_CHAIN_BYTES} bytes")
    try:
        hops = json.loads(raw)
    except ValueError:
        raise BadRequest(f"{CHAIN_HEADER} is not JSON") from None
    if not isinstance(hops, list) or not 1 <= len(hops) <= MAX_HOPS:
        raise BadRequest(f"{CHAIN_HEADER} must be a list of 1 to {MAX_HOPS} hops")
    chain = []
    for i, hop in enumerate(hops):
        servers = hop.get("servers") if isinstance(hop, dict) else None
        if not isinstance(servers, list) or not 1 <= len(servers) <= MAX_SERVERS or \
                not all(isinstance(s, dict) for s in servers):
            raise BadRequest(f"hop {i} of {CHAIN_HEADER}: 'servers' must list 1 to "
                             f"{MAX_SERVERS} servers, each {{\"url\", \"engine\"}}")
        try:
            chain.append(Hop(http.check_url(hop.get("relay")),
                             tuple(Server(s.get("url"), s.get("engine")) for s in servers)))
        except (ValueError, TypeError) as e:
            raise BadRequest(f"hop {i} of {CHAIN_HEADER}: {e}") from None
    return chain


def results_of(reply: dict, hops: list[Hop], version: int, where: str) -> list[PushResult]:
    """One PushResult per server of `hops`, from a relay's reply; a server the reply leaves
    out is that server's failure (`bad_reply`)."""
    expected = [s.url for h in hops for s in h.servers]
    got = {}
    for item in reply.get("results", []) if isinstance(reply.get("results"), list) else []:
        try:
            r = PushResult.from_json(item)
        except (TypeError, ValueError, KeyError, LoRASyncError):
            continue
        if r.server in expected:
            got.setdefault(r.server, r)
    missing = LoRASyncError(f"{where} gave no result for this server", code="bad_reply",
                            status=502)
    return [got.get(s) or PushResult.failed(s, version, missing, 0.0) for s in expected]


# -- the trainer's side ---------------------------------------------------------------------
def chain_of(servers: list[Server], relays: dict) -> list[Hop]:
    """The chain for `servers`: one hop per relay (`relays`: server URL -> its node's relay),
    in the order its first server comes, each with the servers on its node. A server without
    a relay is the caller's error."""
    missing = [s.url for s in servers if s.url not in relays]
    if missing:
        raise ValueError(f"transport 'relay' needs a relay for every server; none for "
                         f"{missing[:3]}")
    hops: dict[str, list[Server]] = {}
    for s in servers:
        hops.setdefault(http.check_url(relays[s.url]), []).append(s)
    return [Hop(r, tuple(ss)) for r, ss in hops.items()]


def push_chain(adapter: LoRAAdapter, name: str, version: int, hops: list[Hop], headers: dict,
               timeout: float, checksum: bool = False) -> list[PushResult]:
    """Sends the adapter once, to the first relay of the chain; every server's result."""
    url = hops[0].relay + RELAY_PATH
    try:
        reply, _ = http.call("POST", url, chunks=adapter.encode(name, version, checksum),
                             timeout=timeout, headers={
                                 **with_protocol(headers), "Content-Type":
                                 "application/octet-stream",
                                 CHAIN_HEADER: json.dumps([h.to_json() for h in hops])})
    except LoRASyncError as e:
        return [PushResult.failed(s.url, version, e, 0.0) for h in hops for s in h.servers]
    return results_of(reply, hops, version, url)


# -- the relay --------------------------------------------------------------------------------
class _Body:
    """The request body, a piece at a time through one reused buffer into the node's shared
    copy (`fd`); `pieces()` yields each piece as it lands (what the next hop is sent), `rest()`
    reads what nobody consumed."""

    def __init__(self, rfile, piece: memoryview, fd: int, length: int):
        self.rfile, self.piece, self.fd, self.length, self.got = rfile, piece, fd, length, 0
        self.done = threading.Event()
        self.failed: LoRASyncError | None = None

    def pieces(self):
        try:
            while self.got < self.length:
                # what has arrived, up to a piece: passed on at once, not once a piece is full
                n = self.rfile.readinto1(self.piece[:min(len(self.piece),
                                                         self.length - self.got)])
                if not n:
                    raise ClientDisconnected(f"the body ended after {self.got} of "
                                             f"{self.length} bytes")
                _pwrite(self.fd, self.piece[:n], self.got)
                yield self.piece[:n]  # sent before the next read reuses the buffer
                self.got += n
        except OSError as e:  # the idle timeout, a reset
            self.failed = ClientDisconnected(f"the body stopped after {self.got} of "
                                             f"{self.length} bytes: {e}")
            raise self.failed from e
        except LoRASyncError as e:
            self.failed = e
            raise
        finally:
            self.done.set()

    def rest(self) -> None:
        for _ in self.pieces():
            pass
        if self.failed is not None:
            raise self.failed


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class Relay:
    """Serves RELAY_PATH: one push at a time. The body goes straight into this node's shared
    copy (a memfd, sealed once it is in: transports/shared_copy.py) as it is passed on, so
    the node's servers map it without another copy."""

    def __init__(self, api_key: str, max_body_bytes: int, push_timeout_s: float = 600.0):
        if not api_key:
            raise ValueError(f"a relay needs the servers' admin key ({API_KEY_ENV})")
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.push_timeout_s = push_timeout_s
        self._one = threading.Lock()
        self._piece = memoryview(bytearray(PIECE))

    def serve(self, path: str, headers, rfile) -> dict:
        if path != RELAY_PATH:
            raise LoRASyncError(f"no route {path[:100]!r} (a relay serves {RELAY_PATH})",
                                code="not_found", status=404)
        given = headers.get("Authorization") or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise Unauthorized("missing or wrong API key for this relay")
        try:
            length = int(headers.get("Content-Length") or "")
        except ValueError:
            raise BadRequest("a push through a relay needs a Content-Length") from None
        if not 0 < length <= self.max_body_bytes:
            raise PayloadTooLarge(f"a body of {length} bytes: this relay takes 1 to "
                                  f"{self.max_body_bytes} (LORA_SYNC_MAX_BODY_MB)")
        hops = parse_chain(headers.get(CHAIN_HEADER))
        if not self._one.acquire(blocking=False):
            raise TooBusy("another push is running through this relay")
        try:
            return {"results": [r.to_json() for r in self._push(headers, rfile, length,
                                                                hops)]}
        finally:
            self._one.release()

    def _push(self, headers, rfile, length: int, hops: list[Hop]) -> list[PushResult]:
        deadline = time.monotonic() + self.push_timeout_s
        downstream = None
        forward = {"Authorization": headers["Authorization"],
                   CHAIN_HEADER: json.dumps([h.to_json() for h in hops[1:]])}

        def receive(fd: int) -> None:
            nonlocal downstream
            body = _Body(rfile, self._piece, fd, length)
            downstream = self._forward(body, hops[1:], forward, deadline)
            # The next hop's thread reads the body as it forwards it; if that hop fails,
            # the rest is read here (nobody reads it while the thread still does).
            while downstream is not None and not body.done.wait(0.05) and \
                    not downstream.done():
                if time.monotonic() > deadline:
                    raise TimedOut(f"the body was not in within {self.push_timeout_s:g} s")
            body.rest()
        shared = sealed_copy(length, receive)
        try:
            meta = read_header(shared.fd, length).metadata
            version = naming.parse_version(meta.get(META_VERSION))
            if version is None:
                raise BadRequest("a push through a relay names its version (metadata "
                                 f"{META_VERSION})")
            local = self._fan_out(shared, naming.check_name(meta.get(META_NAME)), version,
                                  hops[0].servers, headers["Authorization"], deadline)
        finally:
            shared.close()  # the servers that took it hold their own descriptors
        return local + self._results_downstream(downstream, hops[1:], version, deadline)

    @staticmethod
    def _forward(body: _Body, hops: list[Hop], headers: dict, deadline: float):
        """The next hop's push, sent from the pieces as they land (on a thread)."""
        if not hops:
            return None
        done: Future = Future()

        def run():
            try:
                done.set_result(http.call(
                    "POST", hops[0].relay + RELAY_PATH, chunks=body.pieces(),
                    content_length=body.length, timeout=max(deadline - time.monotonic(), 1),
                    headers={**with_protocol(headers),
                             "Content-Type": "application/octet-stream"})[0])
            except BaseException as e:  # noqa: BLE001 - every hop's failure is its servers'
                done.set_exception(e)
        threading.Thread(target=run, name="lora-sync-relay-forward", daemon=True).start()
        return done

    @staticmethod
    def _fan_out(shared, name: str, version: int, servers, authorization: str,
                 deadline: float) -> list[PushResult]:
        """This node's servers, each told of the sealed copy at once (transport `shared`);
        each server's verdict is its own."""
        transport = TRANSPORTS["shared"]
        ctx = SendContext(name, version, False, with_protocol({"Authorization": authorization}),
                          max(deadline - time.monotonic(), 1), "lora-sync-relay")

        def one(server: Server) -> PushResult:
            t0 = time.perf_counter()
            try:
                return send_reaching(transport, shared, server, ctx,
                                     hint="list it under its own node's relay")
            except LoRASyncError as e:
                return PushResult.failed(server.url, version, e, time.perf_counter() - t0)
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            return list(pool.map(one, servers))

    @staticmethod
    def _results_downstream(downstream, hops: list[Hop], version: int,
                            deadline: float) -> list[PushResult]:
        if downstream is None:
            return []
        where = hops[0].relay + RELAY_PATH
        try:
            reply = downstream.result(timeout=max(deadline - time.monotonic(), 1) + 5)
        except LoRASyncError as e:
            return [PushResult.failed(s.url, version, e, 0.0) for h in hops for s in h.servers]
        except Exception as e:  # noqa: BLE001 - the thread's own failure, or a timeout
            err = LoRASyncError(f"{where}: {type(e).__name__}: {e}", code="unreachable",
                                status=503)
            return [PushResult.failed(s.url, version, err, 0.0) for h in hops
                    for s in h.servers]
        return results_of(reply, hops, version, where)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_S  # every socket read and write

    def do_POST(self):  # noqa: N802 - http.server's name
        try:
            status, reply = 200, self.server.relay.serve(self.path, self.headers, self.rfile)
        except LoRASyncError as e:
            status, reply = e.status, e.to_json()
            self.close_connection = True  # the body may be unread
        except Exception as e:  # noqa: BLE001 - a bad body (malformed safetensors, ...)
            status, reply = 400, BadRequest(f"{type(e).__name__}: {str(e)[:300]}").to_json()
            self.close_connection = True
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):  # one line per push on stderr, not per piece
        sys.stderr.write("lora-sync relay: " + fmt % args + "\n")


class RelayServer(ThreadingHTTPServer):
    """The relay on HOST:PORT; at most MAX_CONNECTIONS connections at once."""
    daemon_threads = True

    def __init__(self, address, relay: Relay):
        super().__init__(address, _Handler)
        self.relay = relay
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100)
    p.add_argument("--push-timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    raw = os.environ.get(MAX_BODY_ENV) or "2048"  # the servers' own setting and default
    try:
        max_body = int(float(raw) * (1 << 20))
    except ValueError:
        max_body = 0
    if not 0 < max_body <= 1 << 40:
        raise SystemExit(f"{MAX_BODY_ENV}={raw!r}: a number of MB, more than 0")
    server = RelayServer((args.host, args.port), Relay(os.environ.get(API_KEY_ENV, ""),
                                                       max_body, args.push_timeout_s))
    print(f"lora-sync relay ready {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
