"""Hand-off of a received body from the HTTP process to engine workers through shared memory.

The HTTP process streams the body into a file in a tmpfs (/dev/shm: memory, never disk) while
counting bytes against the limit; each worker maps that file and views the tensors in place.
Only the file path crosses the engine's RPC, never the bytes. Files are reused, in huge
pages from their first reuse on, and mapped writable ahead of the next body, which the
socket then reads straight into (`StagingArea.recycle`)."""
from __future__ import annotations

import asyncio
import atexit
import mmap
import os
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass


from . import pages, private_dir, wire
from .background import Yielding
from .errors import BadAdapter, PayloadTooLarge, TimedOut, TooBusy

SHM_DIR = "/dev/shm"  # the default root (Settings.shm_dir)


@dataclass(frozen=True)
class BodyLimits:
    """What one client may make the server hold while it uploads."""
    max_body: int                  # bytes in one body
    max_inflight: int              # bytes of all bodies being received at once
    idle_s: float = 10.0           # longest pause between two chunks
    min_rate: float = 1 << 20      # bytes/s a body must average after `grace_s`
    grace_s: float = 10.0

    def deadline(self, nbytes: int) -> float:
        return time.monotonic() + self.grace_s + nbytes / self.min_rate


@dataclass
class StagedBody:
    path: str
    nbytes: int
    header: wire.Header


@dataclass
class StagedFile:
    """A received body's file, held while a version is built from it."""
    area: "StagingArea"
    path: str

    def close(self) -> None:
        """Call once no worker maps the file any more: a later body may overwrite it."""
        self.area.recycle(self.path)


def staging_dir() -> str:
    """This API process's own private directory for staged bodies and notices
    (lora_sync/private_dir.py: unguessable, 0700, checked), under its StagingArea's root."""
    return private_dir.private_dir(private_dir.current_root(SHM_DIR))


def _too_large(n: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body of {n} bytes is above the limit of {limit} bytes "
                           "(LORA_SYNC_MAX_BODY_MB)")


class StagingArea:
    """The HTTP process's files for received bodies, in a directory of its own.

    A body's file lives as long as the adapter built from it (the workers map it) and is then
    reused for a later body. Rewriting pages that are already allocated is several times
    cheaper than filling fresh ones where freed memory goes back to the host (a VM): see
    docs/protocol.md, "Why memory is reused"."""

    def __init__(self, spare: int = 2, root: str = SHM_DIR, map_kept: bool = True):
        """`map_kept`: keep a writable mapping of each kept file for bodies read straight
        into it (only bodies read from the socket are: False when none is)."""
        private_dir.check_root(root)  # before the sweep lists and removes anything there
        private_dir.remove_orphans(root)
        self.root, self.dir = root, private_dir.private_dir(root)
        self.spare, self.free, self.map_kept = spare, [], map_kept
        # Each kept file's size when it was last given huge pages (or sent on its way to
        # them), lowered when a body shrinks it: bytes past it are in small pages.
        self.huge: dict[str, int] = {}
        # Each kept file's writable mapping, its page tables filled off a push's path
        # (`recycle`): a body then lands in it straight from the socket.
        self.mapped: dict[str, Future] = {}
        self.inflight = 0  # bytes claimed by bodies being received now
        # How the bodies staged so far landed: read into a kept mapping, or written; and how
        # many were read from the socket past uvicorn (socket_body.py).
        self.landed = {"in_place": 0, "written": 0, "from_socket": 0}
        atexit.register(self.close)

    async def receive_body(self, chunks, limits: BodyLimits, content_length: int | None = None,
                           held_elsewhere: int = 0) -> StagedBody:
        """Writes an async stream of byte chunks into a file and checks its header. Refuses
        a body above the limit before reading it when Content-Length says so, a body that
        would take the bytes in flight (with `held_elsewhere`: open shm leases) past their
        bound, and a body that stalls."""
        if content_length is not None and content_length > limits.max_body:
            raise _too_large(content_length, limits.max_body)
        claimed = content_length if content_length is not None else limits.max_body
        if self.inflight + held_elsewhere + claimed > limits.max_inflight:
            raise TooBusy(f"{self.inflight + held_elsewhere} bytes of other uploads and leases "
                          "are held; this "
                          f"body would pass LORA_SYNC_MAX_STAGING_MB "
                          f"({limits.max_inflight} bytes): retry later", code="staging_full")
        self.inflight += claimed
        path = self.free.pop() if self.free else os.path.join(self.dir, uuid.uuid4().hex)
        mapped = self._mapping_of(path, content_length)
        fd = _open_own(path, os.O_WRONLY)
        source = chunks  # a socket_body.BodyChunks says whether it took the socket
        n, head, dest = 0, bytearray(), None
        try:
            if mapped is not None and hasattr(chunks, "read_into"):
                # into the file's pages: the socket's copy is the only one. The file is the
                # body's length first: a store past its end would kill the process (SIGBUS)
                os.ftruncate(fd, content_length)
                dest = memoryview(mapped)[:content_length]  # the mapping stays open
                chunks = chunks.read_into(dest)
            else:
                self._forget_mapping(path)
            async for chunk in _paced(chunks, limits, claimed):
                n += len(chunk)
                if n > limits.max_body:
                    raise _too_large(n, limits.max_body)
                if dest is not None:
                    continue  # already in place
                if len(head) < 8 or len(head) < wire.header_length(head):
                    head += chunk  # keep the first bytes in memory to parse the header
                os.write(fd, chunk)
            if dest is None:
                os.ftruncate(fd, n)  # a reused file may have been longer
            if n == 0:
                raise BadAdapter("request body is empty; send one safetensors file",
                                 code="empty_body")
            # Off the event loop: a large header takes a while to parse, and generation
            # requests must not wait for it.
            header = await asyncio.to_thread(
                wire.parse_header, memoryview(head) if dest is None else dest[:n], n)
        except BaseException:
            self.recycle(path)
            raise
        finally:
            os.close(fd)
            self.inflight -= claimed
        self.landed["written" if dest is None else "in_place"] += 1
        self.landed["from_socket"] += bool(getattr(source, "taken", False))
        return StagedBody(path, n, header)

    def _mapping_of(self, path: str, nbytes: int | None) -> mmap.mmap | None:
        """The kept file's writable mapping, where it is ready and spans `nbytes` (a body's
        length changes by a few bytes with its metadata); a longer body is written, and the
        mapping dropped, as in a new file."""
        ready = self.mapped.get(path)
        if not nbytes or ready is None or not ready.done():
            return None
        mapping = ready.result()
        return mapping if mapping is not None and nbytes <= len(mapping) else None

    def _forget_mapping(self, path: str) -> None:
        """Drops a file's kept mapping: unmapped once nothing views it (a readying thread
        still at work keeps its own until it ends)."""
        self.mapped.pop(path, None)

    def recycle(self, path: str) -> None:
        """Call once no worker uses the file (its adapter was freed or never built).

        A file kept for later bodies is put in huge pages on a thread, the first time and
        whenever a body made it longer than it then was (the bytes a file grows by are new
        small pages): a worker then maps a 70 MB body in 35 faults, not 17,000 page-table
        entries, which cuts an engine's intake at rank 64 to under half. It is cheap with
        free memory at hand but costs more than a whole push where the host took the memory
        back (docs/protocol.md), so never on a push's path. A body written meanwhile is safe:
        the kernel locks each page it moves.

        The same thread then maps the file writable with its page tables filled, kept until
        the file grows past it or goes: the next body the mapping spans is read from the
        socket straight into it, one copy fewer than through a buffer and `os.write` (a
        faster push on both engines at rank 64). Mapped per body instead, its page faults
        cost more than the copy saves."""
        if len(self.free) < self.spare and os.path.exists(path):
            size, held = os.path.getsize(path), self.huge.get(path)
            self.huge[path] = size
            huge = held is None or size > held
            if huge or (self.map_kept and self._mapping_of(path, size) is None):
                ready = self.mapped[path] = Future()
                threading.Thread(target=_ready_kept, args=(path, huge, self.map_kept, ready),
                                 daemon=True, name="lora-sync-staging-ready").start()
            self.free.append(path)
        else:
            self.huge.pop(path, None)
            self._forget_mapping(path)
            discard(path)

    def close(self) -> None:
        self.mapped.clear()
        private_dir.forget(self.root)


async def _paced(chunks, limits: BodyLimits, nbytes: int):
    """The non-empty chunks of `chunks`, failing when the client pauses longer than
    `idle_s` or falls behind `min_rate` (a stalled upload must not hold its bytes forever).
    One timeout, moved on at each chunk: a timer per chunk (wait_for) cost more than the
    chunk's own write on a 70 MB body."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (limits.deadline(nbytes) - time.monotonic())
    try:
        async with asyncio.timeout_at(min(loop.time() + limits.idle_s, deadline)) as window:
            async for chunk in chunks:
                window.reschedule(min(loop.time() + limits.idle_s, deadline))
                if chunk:
                    yield chunk
    except TimeoutError:
        raise TimedOut(f"the body arrived too slowly (no data for {limits.idle_s:g} s, or "
                       f"below {limits.min_rate / 2 ** 20:g} MB/s); the upload was dropped",
                       code="body_timeout") from None


def _ready_kept(path: str, huge: bool, mapped: bool, ready: Future) -> None:
    """A kept file readied for its next body: in huge pages (`huge`), then (`mapped`) mapped
    writable with its page tables filled (`ready`'s result; None if it is not). A body that
    comes before it is done is written as before, and this mapping is dropped; its bytes
    are safe meanwhile: the kernel locks each page it moves, and filling page tables writes
    nothing. At the lowest CPU priority: it runs while the engine serves the version just
    pushed, and nothing waits for it."""
    Yielding().lower()
    mapping = None
    try:
        fd = os.open(path, os.O_RDWR | private_dir.NOFOLLOW)
    except FileNotFoundError:  # the server stopped meanwhile
        ready.set_result(None)
        return
    try:
        size = os.fstat(fd).st_size
        if huge:
            pages.give_huge_pages(fd, size)
        if size and mapped:
            mapping = pages.map_filled(fd, size)
    except (OSError, ValueError):  # no memory or address space, or the file was resized
        mapping = None                # meanwhile: bodies are written as before
    finally:
        os.close(fd)
        ready.set_result(mapping)


def discard(path: str) -> None:
    """Unlinks a file; workers that map it keep their pages until they free the adapter."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _open_own(path: str, flags: int) -> int:
    """A staging file of ours: created here (mode 0600) or reused, never through a link."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | private_dir.NOFOLLOW, 0o600)
    except FileExistsError:
        return os.open(path, flags | private_dir.NOFOLLOW)
    return True


def open_staged(path: str, read_only: bool) -> tuple[wire.Header, dict]:
    """Maps a staged body; returns (header, tensors viewing the mapping). The mapping lives
    as long as the tensors do, even after the file is unlinked.

    `read_only` (the engine never writes the tensors it gets): shared and read-only at a
    huge page's boundary, one mapping of the file's pages for every worker, one fault per
    huge page (`pages.map_read_only`). Otherwise private: each page the engine writes (its
    lora_B scaling) faults and is copied, so the file stays as received."""
    with open(os.open(path, os.O_RDONLY | private_dir.NOFOLLOW), "rb") as f:
        if read_only:
            fd = f.fileno()
            return wire.view_mapped(pages.map_read_only(fd, os.fstat(fd).st_size))
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header = wire.parse_header(memoryview(buf))
    return header, wire.view_tensors(buf, header)
