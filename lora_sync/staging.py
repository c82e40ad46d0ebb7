"""Hand-off of a received body from the HTTP process to engine workers through shared memory.

The HTTP process streams the body into a file in a tmpfs (/dev/shm: memory, never disk) while
counting bytes against the limit; each worker maps that file copy-on-write and views the
tensors in place. Only the file path crosses the engine's RPC, never the bytes."""
from __future__ import annotations

import mmap
import os
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
