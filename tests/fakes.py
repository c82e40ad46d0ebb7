"""Fake servers on 127.0.0.1 for the client's own tests: they stand in for a hostile or broken
lora-sync server (which is what the attacks used), so these tests need no vLLM or SGLang.

`FakeServer(handler)` hands each request to `handler(req)`, which may answer anything at
all (`req.send` writes raw bytes). `FakeLoRASync` is a small well-behaved lora-sync server
(listing, info, tensor pushes with version checks, leases) whose routes a test can replace.
Both are bounded: at most `max_connections` connections, every socket has a timeout, and
leaving the `with` block closes every connection (trickling handlers stop then)."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from lora_sync.transports import shm


class Request:
    def __init__(self, server: "FakeServer", sock: socket.socket, method: str, path: str,
                 headers: dict, body: bytes):
        self.server, self.sock = server, sock
        self.method, self.path, self.headers, self.body = method, path, headers, body

    def send(self, data: bytes) -> bool:
        """Writes raw bytes; False once the client is gone or the fake is closing."""
        if self.server.closing.is_set():
            return False
        try:
            self.sock.sendall(data)
        except OSError:
            return False
        self.server.bytes_sent += len(data)
        return True

    def reply(self, status: int, body, headers: dict | None = None) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(raw)}",
                "Content-Type: application/json", "Connection: close",
                *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self.send(("\r\n".join(head) + "\r\n\r\n").encode() + raw)

    def json(self):
        return json.loads(self.body) if self.body else None

    def trickle(self, data: bytes, every_s: float = 0.05) -> None:
        """Sends `data` a byte at a time: each socket read on the client succeeds."""
        for i in range(len(data)):
            if not self.send(data[i:i + 1]):
                return
            time.sleep(every_s)


class FakeServer:
    def __init__(self, handler, max_connections: int = 200):
        self.handler = handler
        self.max_connections = max_connections
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request
        self.bytes_sent = 0
        self.closing = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True, name="fake-server")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.closing.set()
        try:  # wakes the accept at once
            socket.create_connection(self.listener.getsockname(), timeout=1).close()
        except OSError:
            pass
        self._thread.join(5)
        for s in list(self._socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.listener.close()

    def _accept(self):
        served = 0
        while not self.closing.is_set() and served < self.max_connections:
            try:
                sock, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            served += 1
            sock.settimeout(10)
            self._socks.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name="fake-server-conn").start()

    def _serve(self, sock: socket.socket):
        try:
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 1 << 16:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (line.partition(":") for line in lines[1:])}
            length = min(int(headers.get("content-length", 0)), 64 << 20)
            while len(body) < length:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    return
                body += chunk
            self.seen.append((method, path))
            self.handler(Request(self, sock, method, path, headers, body))
        except OSError:
            pass
        finally:
            try:
                sock.close()
            except OSError:
                pass


def safetensors_metadata(body: bytes) -> dict:
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + n]).get("__metadata__", {})


class FakeLoRASync(FakeServer):
    """A minimal, honest lora-sync server: enough of the protocol for the client's logic
    (numbering, conflicts, lease fall-back, engine detection). `routes` maps a route name
    (e.g. "lora_adapters") to a handler(req) that replaces the honest one. `lease`:
    "refuse" (429 too_many_leases: every lease taken), "memfd" (a real memfd lease, as the
    real server grants) or a handler(req)."""

    def __init__(self, engine: str = "vllm", api_key: str | None = None, lease="refuse",
                 routes: dict | None = None):
        super().__init__(self._route)
        self.engine, self.api_key, self.lease = engine, api_key, lease
        self.routes = dict(routes or {})
        self.instance_id = uuid.uuid4().hex
        self.versions: dict[str, list[int]] = {}   # name -> versions it took
        self.refused: list[tuple[str, int]] = []   # (name, version) refused with 409
        self.leases: dict[str, tuple[int, int]] = {}  # lease id -> (memfd, nbytes)
        self.lock = threading.Lock()

    def newest(self, name: str) -> int:
        return max(self.versions.get(name, [0]))

    def _route(self, req: Request):
        prefix = "/v1/" if self.engine == "vllm" else "/"
        if not req.path.startswith(prefix) or (self.engine == "sglang"
                                               and req.path.startswith("/v1/")):
            return req.reply(404, {"detail": "Not Found"})
        route = req.path[len(prefix):]
        if self.api_key and req.headers.get("authorization") != f"Bearer {self.api_key}":
            return req.reply(401, {"error": {"code": "unauthorized", "status": 401,
                                             "message": "missing or wrong admin key"}})
        if route in self.routes:
            return self.routes[route](req)
        honest = {"lora_sync_info": self._info, "lora_adapters": self._listing,
                  "load_lora_adapter_from_tensors": self._push,
                  shm.LEASE_ROUTE: self._lease, shm.COMMIT_ROUTE: self._commit,
                  shm.CANCEL_ROUTE: self._cancel}
        if route not in honest:
            return req.reply(404, {"detail": "Not Found"})
        return honest[route](req)

    def ok(self, req: Request, body: dict):
        req.reply(200, {**body, "instance_id": self.instance_id})

    def _info(self, req):
        self.ok(req, {"workers": 1, "worker_status": [], "max_lora_rank": 16,
                      "linear_modules": {"model.layers.0.self_attn.q_proj": [8, 8]},
                      "keep_versions": 2, "max_body_bytes": 1 << 20, "max_names": 8,
                      "open_leases": len(self.leases)})

    def _listing(self, req):
        self.ok(req, {"keep_versions": 2, "adapters": [
            {"name": n, "alias_target": f"{n}-v{max(vs)}", "inflight": 0, "draining": [],
             "versions": [{"version": v, "served_name": f"{n}-v{v}", "inflight": 0}
                          for v in vs[-2:]]}
            for n, vs in self.versions.items()]})

    def install(self, req: Request, body: bytes, transport: str):
        meta = safetensors_metadata(body)
        name, version = meta["lora_name"], int(meta["version"])
        with self.lock:
            if version <= self.newest(name):
                self.refused.append((name, version))
                return req.reply(409, {"error": {
                    "code": "version_conflict", "status": 409,
                    "message": f"version {version} is not above the newest version "
                               f"{self.newest(name)}"}})
            self.versions.setdefault(name, []).append(version)
        self.ok(req, {"name": f"{name}-v{version}", "lora_name": name, "version": version,
                      "bytes": len(body), "load_ms": 1.0, "transport": transport,
                      "timings_ms": {"receive": 1.0, "worker": 1.0}})

    def _push(self, req):
        self.install(req, req.body, "tensors")

    def _lease(self, req):
        if callable(self.lease):
            return self.lease(req)
        if self.lease == "refuse":
            return req.reply(429, {"error": {"code": "too_many_leases", "status": 429,
                                             "message": "8 leases are already open"}})
        nbytes = req.json()["nbytes"]
        fd = os.memfd_create(shm.MEMFD_NAME, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        probe = os.urandom(shm.PROBE_BYTES)
        os.pwrite(fd, probe, 0)
        lease_id, token = uuid.uuid4().hex, uuid.uuid4().hex * 2
        self.leases[lease_id] = (fd, nbytes)
        self.ok(req, {"lease_id": lease_id, "token": token, "probe": probe.hex(),
                      "path": f"/proc/{os.getpid()}/fd/{fd}", "nbytes": nbytes,
                      "expires_s": 30.0})

    def _commit(self, req):
        fd, nbytes = self.leases.pop(req.json()["lease_id"])
        shm.seal_and_read_header(fd, nbytes)  # as a server: waits for the trainer's copy
        body = os.pread(fd, nbytes, 0)
        os.close(fd)
        self.install(req, body, "shm")

    def _cancel(self, req):
        held = self.leases.pop(req.json()["lease_id"], None)
        if held is not None:
            os.close(held[0])
        self.ok(req, {"cancelled": True})


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connections are refused at once)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"http://127.0.0.1:{s.getsockname()[1]}"
