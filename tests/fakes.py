"""Fake servers on 127.0.0.1 for the client's own tests: they stand in for a hostile or broken
lora-sync server (which is what the attacks used), so these tests need no vLLM or SGLang.

`FakeServer(handler)` hands each request to `handler(req)`, which may answer anything at
all (`req.send` writes raw bytes). A well-behaved server is never written here: tests that
need one use lora-sync's own stack on the fake engine (engine_fakes.FakeEngineServer, whose
`canned` replies stand in for a server that answers garbage on some routes). It is bounded: at most `max_connections` connections, every socket has a timeout, and
leaving the `with` block closes every connection (trickling handlers stop then)."""
from __future__ import annotations

import json
import socket
import threading
import time


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


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connections are refused at once)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"http://127.0.0.1:{s.getsockname()[1]}"
