"""Reference limits for moving N bytes on this machine: memcpy, a raw loopback HTTP POST,
and a raw gloo broadcast of one flat buffer (peers run as subprocesses, like a server would).

Every buffer is allocated once and reused, so the limits never pay for fresh pages (costly
on this VM, see docs/protocol.md): they are the best case for the bytes alone."""
from __future__ import annotations

import subprocess
import sys
import time

import torch

from lora_sync import collective, http
from lora_sync.processes import free_port

_HTTP_SINK = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
BUF = bytearray()
class Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        global BUF
        n = int(self.headers["Content-Length"])
        if len(BUF) < n:
            BUF = bytearray(n)
        view = memoryview(BUF)[:n]; got = 0
        while got < n:
            got += self.rfile.readinto(view[got:])
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
"""

_GLOO_PEER = r"""
import sys, torch
from lora_sync import collective
port, sizes = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
g = collective.create_group("127.0.0.1", port, 1, 2, "gloo", 120)
buf = torch.zeros(max(sizes), dtype=torch.uint8)
for n in sizes:
    g.broadcast(buf[:n], 0)
"""


def memcpy_s(nbytes: int, reps: int) -> list[float]:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    return out


class HttpSink:
    def __enter__(self):
        self.port, self.body = free_port(), b""
        self.proc = subprocess.Popen([sys.executable, "-c", _HTTP_SINK, str(self.port)])
        for _ in range(100):
            try:
                http.request("POST", f"http://127.0.0.1:{self.port}/", chunks=[b"x"])
                return self
            except Exception:
                time.sleep(0.1)
        raise RuntimeError("HTTP sink did not start")

    def post_s(self, nbytes: int) -> float:
        if len(self.body) != nbytes:  # one body per size, reused like the sink's buffer
            self.body = torch.ones(nbytes, dtype=torch.uint8).numpy().data
        body = self.body
        t0 = time.perf_counter()
        http.call("POST", f"http://127.0.0.1:{self.port}/", chunks=[body])
        return time.perf_counter() - t0

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def gloo_broadcast_s(sizes: list[int]) -> list[float]:
    """Times one raw broadcast per size, from rank 0 to a peer process."""
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", _GLOO_PEER, str(port),
                             ",".join(map(str, sizes))])
    try:
        g = collective.create_group("127.0.0.1", port, 0, 2, "gloo", 120)
        out, buf = [], torch.ones(max(sizes), dtype=torch.uint8)
        for n in sizes:
            t0 = time.perf_counter()
            g.broadcast(buf[:n], 0)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        peer.wait(timeout=60)
