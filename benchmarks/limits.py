"""Reference limits for moving N bytes on this machine: memcpy, a raw loopback HTTP POST,
the same POST through the ASGI stack both engines serve with, and a raw gloo broadcast of one
flat buffer (peers run as subprocesses, like a server would).

Every buffer is allocated once and reused, so the limits never pay for fresh pages (costly
under a hypervisor that takes freed memory back: docs/protocol.md, "Why memory is reused"):
they are the best case for the bytes alone. Each transfer may start from an idle pause
(`idle_s`), as every push of the benchmark does: a transfer from an idle machine is slower
than one back to back (docs/benchmarks.md, "What each piece bought"), and a limit must
start where the push does."""
from __future__ import annotations

import subprocess
import sys
import time

import torch

from lora_sync import collective, http
from lora_sync.collective import free_port

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

# uvicorn (uvloop, httptools) + FastAPI, as in vLLM and SGLang: the body streamed into a
# reused file in /dev/shm, which is all our route does with it before parsing the header.
_ASGI_SINK = r"""
import os, sys, tempfile, uvicorn
from fastapi import FastAPI, Request
app = FastAPI()
fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="lora-sync-asgi-sink-")
os.unlink(path)  # the file lives as long as this process holds it
@app.post("/")
async def sink(request: Request):
    os.lseek(fd, 0, os.SEEK_SET)
    async for chunk in request.stream():
        os.write(fd, chunk)
    return {}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop="uvloop",
            http="httptools")
"""

# Each transfer is announced by its size, as a push's transfer is by its header: the peer
# posts the bucket receives once it has the size, and the next size's receive at once after.
_GLOO_PEER = r"""
import sys, torch
from lora_sync import collective
g = collective.create_group("127.0.0.1", int(sys.argv[1]), 1, 2, "gloo", 120)
size, buf = torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.uint8)
while True:
    g.broadcast(size, 0)
    n = int(size)
    if n <= 0:
        break
    if buf.numel() < n:
        buf = torch.zeros(n, dtype=torch.uint8)
    for w in [g.start_broadcast(b, 0) for b in buf[:n].split(collective.DEFAULT_BUCKET_BYTES)]:
        w.wait()
g.shutdown()
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
    """A loopback HTTP server that takes POST bodies: the standard library's, reading into one
    reused buffer (`asgi=False`), or uvicorn + FastAPI like the engines (`asgi=True`)."""

    def __init__(self, asgi: bool = False):
        self.script = _ASGI_SINK if asgi else _HTTP_SINK

    def __enter__(self):
        self.port, self.body = free_port(), b""
        self.proc = subprocess.Popen([sys.executable, "-c", self.script, str(self.port)])
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


class GlooPeer:
    """A peer process in a gloo group of two with this one, receiving raw broadcasts from
    rank 0 (this process) until closed: the transfer alone, with no lora-sync code on either
    side. Kept open across a benchmark's rounds, it measures the floor at the moment of each
    push (`broadcast_s` in the same round), from the same trainer process."""

    def __enter__(self):
        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", _GLOO_PEER, str(port)])
        try:
            self.group = collective.create_group("127.0.0.1", port, 0, 2, "gloo", 120)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.buf = torch.ones(0, dtype=torch.uint8)
        return self

    def broadcast_s(self, nbytes: int) -> float:
        """One raw broadcast of `nbytes`: its size first (a push's header), then the bytes
        in the transport's buckets, all queued at once on the group's default streams."""
        if self.buf.numel() < nbytes:  # one buffer, reused like the peer's
            self.buf = torch.ones(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        self.group.broadcast(torch.tensor([nbytes], dtype=torch.int64), 0)
        for w in [self.group.start_broadcast(b, 0)
                  for b in self.buf[:nbytes].split(collective.DEFAULT_BUCKET_BYTES)]:
            w.wait()
        return time.perf_counter() - t0

    def __exit__(self, *exc):
        try:
            self.group.broadcast(torch.zeros(1, dtype=torch.int64), 0)  # the peer's end
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.group.shutdown()


def gloo_broadcast_s(sizes: list[int], idle_s: float = 0.0) -> list[float]:
    """Times one raw broadcast per size (`GlooPeer.broadcast_s`), each after `idle_s` (the
    peer waits in its receive meanwhile, as a worker does)."""
    with GlooPeer() as peer:
        out = []
        for n in sizes:
            time.sleep(idle_s)
            out.append(peer.broadcast_s(n))
        return out
