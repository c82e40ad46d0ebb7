"""Hand-off of a received body from the HTTP process to engine workers through shared memory.

The HTTP process streams the body into a file in a tmpfs (/dev/shm: memory, never disk) while
counting bytes against the limit; each worker maps that file copy-on-write and views the
tensors in place. Only the file path crosses the engine's RPC, never the bytes."""
from __future__ import annotations

import asyncio
import json
import mmap
import os
import time
import uuid
from dataclasses import dataclass

from . import wire
from .errors import BadAdapter, PayloadTooLarge

SHM_DIR = os.environ.get("LORA_SYNC_SHM_DIR", "/dev/shm")


@dataclass
class StagedBody:
    path: str
    nbytes: int
    header: wire.Header

    def discard(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _too_large(n: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body of {n} bytes is above the limit of {limit} bytes "
                           "(LORA_SYNC_MAX_BODY_MB)")


async def stage_body(chunks, limit: int, content_length: int | None = None) -> StagedBody:
    """Writes an async stream of byte chunks to shared memory and checks its header.
    Refuses a body above `limit` before reading it when Content-Length says so."""
    if content_length is not None and content_length > limit:
        raise _too_large(content_length, limit)
    path = os.path.join(SHM_DIR, f"lora-sync-{uuid.uuid4().hex}.safetensors")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    n, head = 0, bytearray()
    try:
        async for chunk in chunks:
            if not chunk:
                continue
            n += len(chunk)
            if n > limit:
                raise _too_large(n, limit)
            if len(head) < 8 or len(head) < wire.header_length(head):
                head += chunk  # keep the first bytes in memory to parse the header
            os.write(fd, chunk)
        if n == 0:
            raise BadAdapter("request body is empty; send one safetensors file",
                             code="empty_body")
        header = wire.parse_header(memoryview(head), body_len=n)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return StagedBody(path, n, header)


def open_staged(path: str):
    """Maps a staged body copy-on-write; returns (header, tensors viewing the mapping).
    The mapping lives as long as the tensors do, even after the file is unlinked."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header = wire.parse_header(memoryview(buf))
    return header, wire.view_tensors(buf, header)


# -- completion notices -------------------------------------------------------------------
# A worker that receives in the background reports through a small file next to the staged
# bodies, so the API process can wait without keeping an engine RPC (and the engine loop)
# busy for the whole transfer.
def notice_paths(workers: int) -> list[str]:
    base = os.path.join(SHM_DIR, f"lora-sync-done-{uuid.uuid4().hex}")
    return [f"{base}-{rank}.json" for rank in range(workers)]


def write_notice(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)  # atomic: readers never see half a notice


async def wait_notices(paths: list[str], timeout_s: float, poll_s: float = 0.002) -> list[dict]:
    """Waits for every worker's notice; a missing one after `timeout_s` is a failure."""
    deadline = time.monotonic() + timeout_s
    results: dict[str, dict] = {}
    try:
        while len(results) < len(paths):
            for p in paths:
                if p not in results and os.path.exists(p):
                    with open(p) as f:
                        results[p] = json.load(f)
            if len(results) < len(paths):
                if time.monotonic() > deadline:
                    missing = len(paths) - len(results)
                    return [results.get(p, {"ok": False, "status": 502, "code": "transfer_failed",
                                            "message": f"{missing} worker(s) did not finish "
                                                       f"receiving within {timeout_s:.0f}s"})
                            for p in paths]
                await asyncio.sleep(poll_s)
        return [results[p] for p in paths]
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
