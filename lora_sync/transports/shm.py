"""Same-host transport: the trainer writes the safetensors file straight into memory the server
leased to it, then commits. Only two small JSON calls cross the socket.

The lease is a Linux memfd owned by the server's API process. The trainer reaches it through
`/proc/<server pid>/fd/<n>` (so only a process on the same host and in the same PID namespace
can), checks a random probe the server wrote into it, writes the file into it and commits
with a one-time token. At commit the server seals the memfd (F_SEAL_WRITE, SHRINK, GROW):
from then on nobody, the trainer included, can change the bytes the served version is built
from. The trainer commits while its unmap still runs; the seal waits for it, and a writable
mapping still held after SEAL_WAIT_S gets a 409 instead. The server never takes a
path from the client: a commit names a lease id it granted."""
from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import hashlib
import hmac
import mmap
import os
import re
import secrets
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from .. import http, replies, wire
from ..errors import BadAdapter, BadRequest, Conflict, Forbidden, LoRASyncError, NotFound, TooBusy
from ..fields import field
from ..staging import StagedBody
from .base import PushResult, Received, Route, SendContext, Server, ServerContext, Staged, \
    Transport, staged_file
from .. import pages
from .device_copy import HostPin, copy_to_host, on_device

LEASE_ROUTE = "lora_sync_lease"
CANCEL_ROUTE = "lora_sync_lease_cancel"
RENEW_ROUTE = "lora_sync_lease_renew"
COMMIT_ROUTE = "load_lora_adapter_from_lease"
PROBE_BYTES = 16
_LEASE_ID = re.compile(r"[0-9a-f]{32}")
# What the trainer accepts in a grant: it opens `path` read-write, so only a descriptor of a
# process (never a file system path), and only a memfd of the server's lease table.
_TOKEN = re.compile(r"[0-9a-f]{16,128}")
_PROBE = re.compile(r"[0-9a-f]{%d}" % (2 * PROBE_BYTES))
_LEASE_PATH = re.compile(r"/proc/[1-9][0-9]{0,9}/fd/[0-9]{1,10}")
MEMFD_NAME = "lora-sync-lease"
_IOV_MAX = 512  # buffers per pwritev (the kernel allows 1024)
_SPLIT_BYTES = 8 << 20  # smaller copies are not worth a second thread
# After these, nobody can write, resize, map writable or unseal the memfd.
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


# -- typed messages ---------------------------------------------------------------------
@dataclass(frozen=True)
class LeaseRequest:
    nbytes: int
    # Who asks, as the client names itself: a label, never a bound (a client could mint
    # any number of ids); bounds rest on the server's totals (docs/security.md).
    client: str
    # For a push to come (transports/ready_lease.py), not this one: granted once the
    # versions being retired have given their memory back (`ShmTransport.grant`).
    ahead: bool = False

    @classmethod
    def from_json(cls, body: dict, max_bytes: int) -> "LeaseRequest":
        return cls(field(body, "nbytes", int, lo=PROBE_BYTES, hi=max_bytes, where="lease"),
                   field(body, "client", str, "anonymous", max_len=64, where="lease"),
                   field(body, "ahead", bool, False, where="lease"))


@dataclass(frozen=True)
class Lease:
    """The grant: where to write (`path`), what must be there before (`probe`), and the
    one-time `token` that commits it. Only this reply ever carries them."""
    lease_id: str
    token: str
    path: str
    probe: str
    nbytes: int
    expires_s: float

    def to_json(self) -> dict:
        return asdict(self)

    def ticket(self) -> dict:
        """What commits, cancels or renews it."""
        return {"lease_id": self.lease_id, "token": self.token}

    @classmethod
    def from_json(cls, d: dict, server: str = "the server",
                  nbytes: int | None = None) -> "Lease":
        """The grant as the trainer reads it: every field checked (`nbytes`, when given, must
        be the size asked for), and `path` a /proc/<pid>/fd/<n> name; else `bad_reply`."""
        def text(key: str, pattern: re.Pattern) -> str:
            value = replies.field(d, key, str, server=server, what="lease", max_len=128)
            if not pattern.fullmatch(value):
                raise replies.bad_reply(server, f"lease reply field {key!r} is malformed")
            return value
        size = replies.field(d, "nbytes", int, server=server, what="lease", lo=PROBE_BYTES)
        if nbytes is not None and size != nbytes:
            raise replies.bad_reply(server, f"the lease holds {size} bytes, not the {nbytes} "
                                    "asked for")
        return cls(text("lease_id", _LEASE_ID), text("token", _TOKEN), text("path", _LEASE_PATH),
                   text("probe", _PROBE), size,
                   replies.field(d, "expires_s", float, server=server, what="lease", lo=0))


@dataclass(frozen=True)
class CommitRequest:
    lease_id: str
    token: str

    @classmethod
    def from_json(cls, body: dict) -> "CommitRequest":
        lease_id = field(body, "lease_id", str, max_len=64, where="lease commit")
        if not _LEASE_ID.fullmatch(lease_id):
            raise BadRequest("lease_id must be the 32 hex digits the lease reply gave",
                             code="bad_request")
        return cls(lease_id, field(body, "token", str, max_len=128, where="lease commit"))


# -- server side (API process) ----------------------------------------------------------
@dataclass
class _Pending:
    fd: int
    nbytes: int
    token_digest: bytes
    client: str = "anonymous"
    timer: asyncio.TimerHandle | None = None


class SealedBody:
    """A committed lease: its memfd stays open while the version lives (workers map it)."""

    def __init__(self, fd: int, nbytes: int):
        self.fd, self.nbytes = fd, nbytes
        self.path = f"/proc/{os.getpid()}/fd/{fd}"

    def close(self) -> None:
        os.close(self.fd)  # the pages go once the workers' mappings do


class LeaseTable:
    """Leases granted and not yet committed. Each is bounded in time (`ttl_s`, then freed)
    and counts against the staging bytes a server may hold (`budget`)."""

    def __init__(self, ttl_s: float = 30.0, max_pending: int = 8):
        self.ttl_s, self.max_pending = ttl_s, max_pending
        self.pending: dict[str, _Pending] = {}

    @property
    def held_bytes(self) -> int:
        """Staging memory the open leases hold (shared with HTTP uploads' budget)."""
        return sum(p.nbytes for p in self.pending.values())

    def grant(self, nbytes: int, budget: int, client: str = "anonymous") -> Lease:
        if len(self.pending) >= self.max_pending:
            raise TooBusy(f"{self.max_pending} leases are already open; commit or cancel "
                          "one first", code="too_many_leases")
        if self.held_bytes + nbytes > budget:
            raise TooBusy(f"open leases hold {self.held_bytes} bytes; {nbytes} more would "
                          f"pass LORA_SYNC_MAX_STAGING_MB ({budget} bytes)", code="staging_full")
        fd, lease = new_lease(nbytes, self.ttl_s)
        self.pending[lease.lease_id] = _Pending(fd, nbytes, _digest(lease.token), client)
        self._arm(lease.lease_id)
        return lease

    async def take(self, req: CommitRequest) -> tuple[SealedBody, wire.Header]:
        """Redeems a lease (once), seals it (the bytes are fixed from here on) and returns
        it with its checked header (`seal_and_read_header`)."""
        held = self._redeemable(req)
        self._close_pending(req.lease_id, keep_fd=True)
        try:
            header = await asyncio.to_thread(seal_and_read_header, held.fd, held.nbytes)
        except BaseException as e:
            os.close(held.fd)
            if not isinstance(e, OSError):
                raise
            if e.errno == errno.EBUSY:  # a writable shared mapping still exists
                raise Conflict("the lease is still mapped writable by some process; unmap "
                               "it before committing", code="lease_mapped") from None
            raise BadRequest(f"could not seal the lease ({e})", code="bad_lease") from None
        return SealedBody(held.fd, held.nbytes), header

    def cancel(self, req: CommitRequest) -> None:
        held = self.pending.get(req.lease_id)
        if held is None or not hmac.compare_digest(held.token_digest, _digest(req.token)):
            raise NotFound("no open lease with this id and token", code="unknown_lease")
        self._close_pending(req.lease_id)

    def renew(self, req: CommitRequest) -> float:
        """Restarts an open lease's time (a trainer keeping one ready for its next push);
        returns its seconds. It still counts against the open leases and the budget."""
        self._redeemable(req)
        self._arm(req.lease_id)
        return self.ttl_s

    def close(self) -> None:
        for lease_id in list(self.pending):
            self._close_pending(lease_id)

    def _redeemable(self, req: CommitRequest) -> _Pending:
        held = self.pending.get(req.lease_id)
        if held is None:
            raise NotFound("no open lease with this id: it expired, was committed or "
                           "cancelled, or was never granted", code="unknown_lease")
        if not hmac.compare_digest(held.token_digest, _digest(req.token)):
            raise Forbidden("wrong token for this lease", code="bad_token")
        return held

    def _arm(self, lease_id: str) -> None:
        held = self.pending[lease_id]
        if held.timer is not None:
            held.timer.cancel()
        held.timer = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, lease_id)

    def _expire(self, lease_id: str) -> None:
        if lease_id in self.pending:
            self._close_pending(lease_id)

    def _close_pending(self, lease_id: str, keep_fd: bool = False) -> None:
        held = self.pending.pop(lease_id)
        if held.timer is not None:
            held.timer.cancel()
        if not keep_fd:
            os.close(held.fd)


# How long a commit waits for the trainer's writable mapping to go: the trainer commits
# first and copies meanwhile (`write_then_unmap`), so the wait grows with the lease (the
# allowance, 1 s per 256 MiB more, is far above what a copy from host or device takes). A
# waiting commit holds one thread of the event loop's default pool; leases (so commits) are
# bounded in number (`LeaseTable.max_pending`).
SEAL_WAIT_S = 1.0
SEAL_WAIT_BYTES_PER_S = 256 << 20  # each 256 MiB of lease: one second more


def seal_wait_s(nbytes: int) -> float:
    """How long a commit of an `nbytes` lease waits for the trainer's copy and unmap."""
    return SEAL_WAIT_S + nbytes / SEAL_WAIT_BYTES_PER_S


def seal_and_read_header(fd: int, nbytes: int) -> wire.Header:
    """Seals a lease's memfd and returns its checked header. The trainer commits before its
    copy into the lease (`ShmTransport._commit`): while its writable mapping exists (EBUSY)
    the seal is retried at short intervals (a small fraction of the copy it waits for) for
    at most `seal_wait_s`, then the EBUSY stands. A
    header readable meanwhile is parsed ahead (its length is the trainer's last store, so
    that is while the unmap runs); it is used only if the sealed file holds those very
    header bytes, so what is served is what was sealed."""
    if _try_seal(fd):
        return read_header(fd, nbytes)
    deadline = time.monotonic() + seal_wait_s(nbytes)
    raw = ahead = None
    while not _try_seal(fd):
        if time.monotonic() > deadline:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        if ahead is None:
            try:
                raw = _raw_header(fd)
                ahead = wire.parse_header(raw, nbytes)
            except LoRASyncError:  # not written yet: checked again once sealed
                raw = ahead = None
        time.sleep(0.0002)
    sealed = _raw_header(fd)
    return ahead if sealed == raw else wire.parse_header(sealed, nbytes)


def _try_seal(fd: int) -> bool:
    """Seals the memfd; False while a writable shared mapping of it exists."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return True
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
        return False


def _raw_header(fd: int) -> bytes:
    """The 8-byte length and the header it announces, as bytes (BadAdapter: no header)."""
    return os.pread(fd, wire.header_length(os.pread(fd, 8, 0)), 0)


def new_lease(nbytes: int, ttl_s: float) -> tuple[int, Lease]:
    """A new memfd of `nbytes`, its probe written, and the grant that names it (reachable
    through this process's /proc). The caller owns the descriptor."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    probe = secrets.token_bytes(PROBE_BYTES)
    os.pwrite(fd, probe, 0)
    return fd, Lease(secrets.token_hex(16), secrets.token_hex(32),
                     f"/proc/{os.getpid()}/fd/{fd}", probe.hex(), nbytes, ttl_s)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


# -- trainer side ---------------------------------------------------------------------
def open_lease(lease: Lease) -> int | None:
    """The lease's memfd opened read-write, or None when it is not reachable from here
    (another host or PID namespace) or is not the lease granted (wrong kind, size or probe)."""
    if not _LEASE_PATH.fullmatch(lease.path):
        return None
    try:
        fd = os.open(lease.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None
    if _is_lease_memfd(fd) and os.fstat(fd).st_size == lease.nbytes \
            and os.pread(fd, PROBE_BYTES, 0) == bytes.fromhex(lease.probe):
        return fd
    os.close(fd)  # a file of that name, but not our lease
    return None


def reopen_read_only(fd: int) -> int:
    """The same file through a read-only descriptor: a mapping of it does not stop the
    server's seal, and it is the file this process checked, whatever the server does with
    its descriptor numbers."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def map_lease(lease: Lease, huge_pages: bool = False) -> tuple[mmap.mmap, int] | None:
    """The lease mapped shared and writable, its page tables filled now, and a read-only
    descriptor of it (None: unreachable). Filling the page tables is most of a write's cost:
    done ahead of a push, the push only copies. `huge_pages`: in huge pages first, for a
    lease readied off the push's path (see `pages.give_huge_pages` for what they cost)."""
    return _with_lease(lease, lambda fd: pages.map_filled(fd, lease.nbytes, huge_pages))


def _with_lease(lease: Lease, use) -> tuple | None:
    """`use(fd)` on the lease opened writable; (its result, a read-only descriptor of the
    lease), or None when the lease is not reachable from here."""
    fd = open_lease(lease)
    if fd is None:
        return None
    try:
        read_fd = reopen_read_only(fd)
        try:
            return use(fd), read_fd
        except BaseException:
            os.close(read_fd)
            raise
    finally:
        os.close(fd)


def write_mapped(mapping: mmap.mmap, chunks: list, pin: HostPin | None = None) -> None:
    """Copies the safetensors file (`chunks`) into a mapped lease, then unmaps it (and lets
    go of its CUDA registration, `pin`, first): the server cannot seal a lease that is
    still mapped writable."""
    write_then_unmap(mapping, chunks, pin).result()


def write_then_unmap(mapping: mmap.mmap, chunks: list, pin: HostPin | None = None) -> Future:
    """Copies the safetensors file (`chunks`: header bytes first) into a mapped lease and
    returns once every byte is in, with the unmap (and the release of its CUDA
    registration, `pin`) still running on the client's unmap thread: the returned future is
    done once the mapping is gone. The server's seal waits for the unmap
    (`seal_and_read_header`): off the push's path (in the huge pages of a lease readied
    ahead, over an order of magnitude cheaper than in 4 KiB pages).

    The file's first 8 bytes, its header's length, are stored last. Until then the lease
    starts with the server's random probe and zeros, which no parse takes for a header: a
    lease that loses its mapping before the copy is complete (the copy failed, the trainer
    died) is refused at commit, never served half-written. That is what lets the client
    commit while it copies (`ShmTransport._commit`).

    Host tensors go in with plain memcpy (ctypes.memmove, which lets go of the GIL), not
    torch's copy: on a thread other than the trainer's, torch starts a second OpenMP team
    whose threads then spin against the trainer's own (on a host with few cores, up to
    twice as slow as a memcpy). GPU tensors go device to host in a few packed copies
    (device_copy.py)."""
    try:
        lead = _header_lead(chunks)
        anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address, while it lives
        base = ctypes.addressof(anchor)
        try:
            offset, copies, sources, on_gpu = 0, [], [], []
            for chunk in chunks:
                n = _nbytes(chunk)
                if offset + n > len(mapping):
                    raise ValueError("the chunks do not fit the lease")
                if on_device(chunk):
                    on_gpu.append((offset, chunk))
                elif isinstance(chunk, torch.Tensor):
                    src = chunk.detach().contiguous()
                    sources.append(src)  # alive until copied
                    copies.append((base + offset, src.data_ptr(), n))
                else:
                    start = len(lead) if offset == 0 else 0
                    mapping[offset + start:offset + n] = chunk[start:]
                offset += n
            if on_gpu:
                # a view of the address, not of the mapping: it must not pin the mapping open
                view = (ctypes.c_ubyte * len(mapping)).from_address(base)
                copy_to_host(torch.frombuffer(view, dtype=torch.uint8), on_gpu)
            _memmove_all(copies)
            mapping[:len(lead)] = lead  # last: the file is whole from here on
        finally:
            del anchor
    except BaseException:
        _unmap(mapping, pin)
        raise
    return _UNMAPPER.submit(_unmap, mapping, pin)


def _header_lead(chunks: list) -> bytes:
    """The file's first 8 bytes (the header's length), from its first chunk: header bytes."""
    first = chunks[0] if chunks else b""
    if isinstance(first, torch.Tensor) or len(first) < 8:
        raise ValueError("a lease's file starts with its header's bytes")
    return bytes(first[:8])


def _unmap(mapping: mmap.mmap, pin: HostPin | None) -> None:
    if pin is not None:
        pin.release()  # CUDA's registration must go before the mapping does
    mapping.close()


_COPY_HELPER = ThreadPoolExecutor(1, thread_name_prefix="lora-sync-copy")  # starts on use
_UNMAPPER = ThreadPoolExecutor(1, thread_name_prefix="lora-sync-unmap")


def _memmove_all(copies: list[tuple[int, int, int]]) -> None:
    """Every (destination, source, bytes) copy, in two halves at once: a thread of the
    client's copies the first while this one copies the rest. The trainer waits for the push
    meanwhile, so a second core is free for it: copy and unmap finish sooner than on one
    thread, even on a host of two cores."""
    total = sum(n for _, _, n in copies)
    cut, done = 0, 0
    while cut < len(copies) and done < total // 2:
        done += copies[cut][2]
        cut += 1
    if total < _SPLIT_BYTES or not 0 < cut < len(copies):
        _memmove(copies)
        return
    first = _COPY_HELPER.submit(_memmove, copies[:cut])
    try:
        _memmove(copies[cut:])
    finally:
        first.result()


def _memmove(copies) -> None:
    for dst, src, n in copies:
        ctypes.memmove(dst, src, n)


def write_lease(lease: Lease, chunks: list) -> int | None:
    """Writes the safetensors file (`chunks`: header bytes, then tensors) into a lease just
    granted; returns a read-only descriptor of it, or None when it is not reachable from
    here (the caller falls back to HTTP). Host memory goes in with `pwritev`, straight from
    the tensors (filling a mapping's page tables costs about what the copy does); tensors on
    a GPU are copied device to host into a mapping of the lease."""
    if not any(on_device(c) for c in chunks):
        written = _with_lease(lease, lambda fd: _pwrite_all(fd, chunks))
        return None if written is None else written[1]
    mapped = map_lease(lease)
    if mapped is None:
        return None
    mapping, read_fd = mapped
    write_mapped(mapping, chunks)
    return read_fd


def _pwrite_all(fd: int, chunks: list) -> None:
    """Host bytes and CPU tensors into the file from offset 0, a few hundred per call."""
    views = [memoryview(c.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
             if isinstance(c, torch.Tensor) else memoryview(c) for c in chunks]
    views = [v for v in views if v.nbytes]
    offset = 0
    for first in range(0, len(views), _IOV_MAX):
        group = views[first:first + _IOV_MAX]
        while group:
            n = os.pwritev(fd, group, offset)
            if n <= 0:
                raise OSError(errno.EIO, "the lease took no bytes")
            offset += n
            while group and n >= group[0].nbytes:  # a short write resumes where it stopped
                n -= group[0].nbytes
                group = group[1:]
            if group and n:
                group[0] = group[0][n:]


def _is_lease_memfd(fd: int) -> bool:
    """Only an anonymous memfd of a lease table is ever written: never a file on disk a
    hostile server named (its probe and size known), nor any other descriptor."""
    try:
        st = os.fstat(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 0 \
        and target.startswith(f"/memfd:{MEMFD_NAME}")


def _nbytes(chunk) -> int:
    return chunk.numel() * chunk.element_size() if isinstance(chunk, torch.Tensor) \
        else len(chunk)


def total_bytes(chunks: list) -> int:
    return sum(_nbytes(c) for c in chunks)


def _post(server: Server, route: str, ctx: SendContext, body: dict,
          on_sent=None) -> tuple[dict, dict]:
    return http.call("POST", server.route(route), headers=ctx.headers, timeout=ctx.timeout,
                     json_body=body, on_sent=on_sent)


class _CopyOnSent:
    """The copy into a ready lease, run once the commit request has left (`run`, called by
    the HTTP call); `finish` waits for the unmap and raises the copy's own error. A copy
    that never ran unmaps untouched: the server then refuses the lease (no header)."""

    def __init__(self, mapping: mmap.mmap, chunks: list, pin: HostPin | None):
        self.mapping, self.chunks, self.pin = mapping, chunks, pin
        self.unmapping: Future | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.unmapping = write_then_unmap(self.mapping, self.chunks, self.pin)
        except BaseException as e:  # noqa: BLE001 - raised by finish, after the reply
            self.error = e  # write_then_unmap has unmapped: the lease has no header
        self.seconds = time.perf_counter() - t0

    def finish(self) -> None:
        """Waits for the unmap, then raises the copy's error."""
        if self.unmapping is None and self.error is None:
            self.unmapping = _UNMAPPER.submit(_unmap, self.mapping, self.pin)  # never ran
        if self.unmapping is not None:
            self.unmapping.result()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class LeaseRefused(TooBusy):
    """The server granted no lease for want of room (429: too many open leases, staging
    full): `transport="auto"` sends this push over HTTP instead; the code is the server's."""


class ShmTransport(Transport):
    name = "shm"
    push_path = f"/{COMMIT_ROUTE}"
    start_path = f"/{LEASE_ROUTE}"

    def routes(self):
        def ticket(body, limits):
            return CommitRequest.from_json(body)
        return {self.start_path: Route(lambda body, limits: LeaseRequest.from_json(
                    body, limits.max_body_bytes), self.grant),
                f"/{CANCEL_ROUTE}": Route(ticket, self.cancel),
                f"/{RENEW_ROUTE}": Route(ticket, self.renew),
                self.push_path: Route(ticket)}

    def keeps_copy(self, group) -> bool:
        return True  # the sealed lease, where the server is reachable (else HTTP, no copy)

    # trainer side
    def prepare(self, adapter, ctx: SendContext) -> list:
        return wire.layout(adapter.tensors, adapter.metadata(ctx.name, ctx.version,
                                                              ctx.checksum))

    def send(self, parts: list, server: Server, ctx: SendContext) -> PushResult | None:
        """Into the lease the client readied for this name (`ctx.ready`, see ready_lease.py)
        if it has one, else lease, write, commit. None (after cancelling the lease) when the
        server's memory is not reachable from this process: the caller falls back to HTTP.
        After a push, it asks for the next lease of this size to be readied."""
        nbytes = total_bytes(parts)
        result = None
        if ctx.ready is not None:
            result = self._send_ready(parts, server, ctx, nbytes)
        if result is None:
            result = self._send_fresh(parts, server, ctx, nbytes)
        if result is not None and ctx.ready is not None:
            ctx.ready.want(server, ctx.name, nbytes, pin=any(on_device(p) for p in parts))
        return result

    def _send_ready(self, parts, server, ctx, nbytes) -> PushResult | None:
        t0 = time.perf_counter()
        ready = ctx.ready.take(server, ctx.name, nbytes)
        if ready is None:
            return None
        copy = _CopyOnSent(ready.mapping, parts, ready.pin)
        try:
            return self._commit(ready.lease, ready.read_fd, server, ctx, t0,
                                time.perf_counter(), copy)
        except NotFound:  # it expired (the trainer slept through its renewals) or restarted
            return None
        finally:
            os.close(ready.read_fd)
            copy.finish()  # its error, not the server's refusal of the incomplete lease

    def _send_fresh(self, parts, server, ctx, nbytes) -> PushResult | None:
        t0 = time.perf_counter()
        try:
            granted, _ = _post(server, LEASE_ROUTE, ctx, {"nbytes": nbytes,
                                                          "client": ctx.client_id})
        except TooBusy as e:
            refused = LeaseRefused(e.message, code=e.code, status=e.status)
            refused.server = e.server
            raise refused from e
        lease = Lease.from_json(granted, server.url, nbytes)
        t1 = time.perf_counter()
        read_fd = write_lease(lease, parts)
        if read_fd is None:
            _post(server, CANCEL_ROUTE, ctx, lease.ticket())
            return None
        try:
            return self._commit(lease, read_fd, server, ctx, t0, t1)
        finally:
            os.close(read_fd)

    @staticmethod
    def _commit(lease: Lease, read_fd: int, server, ctx, t0: float, t1: float,
                copy: "_CopyOnSent | None" = None) -> PushResult:
        """The commit call (`t0`-`t1` was getting the lease). Without `copy` the lease is
        written already; with it, the copy into the mapped lease runs once the request has
        left, while the server takes it up to the seal, which waits for the unmap (see
        `write_then_unmap` for why a commit ahead of its bytes is safe). With `ctx.keep`,
        the result keeps the file as the server holds it (`kept`): the sealed lease mapped
        read-only, no copy (its tensors: `view_mapped`)."""
        t2 = time.perf_counter()
        reply, _ = _post(server, COMMIT_ROUTE, ctx, lease.ticket(),
                         on_sent=copy.run if copy is not None else None)
        result = PushResult.from_reply(server.url, reply, time.perf_counter() - t0, ctx.name,
                                       ctx.version)
        timings = reply.setdefault("timings_ms", {})  # a dict: checked by from_reply
        # trainer side: `write`, before the commit went out; `copy`, after (the server's
        # `receive` waited for it)
        timings.update(lease=(t1 - t0) * 1e3, write=(t2 - t1) * 1e3)
        if copy is not None:
            timings["copy"] = copy.seconds * 1e3
        if ctx.keep:
            result.kept = map_read_only(read_fd)
        return result

    # server side
    def new_state(self, limits) -> LeaseTable:
        return LeaseTable(limits.lease_ttl_s, limits.max_leases)

    def held_bytes(self, state: LeaseTable) -> int:
        return state.held_bytes

    def info(self, state: LeaseTable) -> dict:
        return {"open_leases": len(state.pending)}

    async def grant(self, req: LeaseRequest, ctx: ServerContext) -> dict:
        """A lease's pages come from the retired versions' memory where they can: a push's
        own lease frees them now, as the push would at its commit; a lease readied ahead
        waits for them to go as they would, at the next pause in serving. Fresh pages cost
        a VM's host many times the work of recycled ones, and that work ran beside the first
        requests on the version just pushed (SGLang's first completion measurably slower)."""
        await ctx.retired_freed(hasten=not req.ahead)
        budget = ctx.limits.max_staging_bytes - ctx.staging.inflight
        return ctx.state.grant(req.nbytes, budget, req.client).to_json()

    async def cancel(self, req: CommitRequest, ctx: ServerContext) -> dict:
        ctx.state.cancel(req)
        return {"cancelled": True}

    async def renew(self, req: CommitRequest, ctx: ServerContext) -> dict:
        return {"expires_s": ctx.state.renew(req)}

    async def stage(self, req: CommitRequest, ctx: ServerContext) -> Staged:
        t0 = time.perf_counter()
        sealed, header = await ctx.state.take(req)
        # receive: the seal (with its wait for the trainer's unmap) and the header
        return staged_file(StagedBody(sealed.path, sealed.nbytes, header), sealed,
                           receive=(time.perf_counter() - t0) * 1e3)

    # worker side
    def receive(self, intake, pool) -> Received:
        """A sealed body is mapped read-only where the engine never writes what it is given
        (`pool.maps_read_only`), else read into a reused buffer (see `read_sealed`)."""
        path = intake.args["path"]
        if pool.maps_read_only:
            sealed = map_sealed(path)
            if sealed is not None:
                header, tensors = sealed
                return Received(tensors, header.total_bytes - header.data_start,
                                read_only=True)
        else:
            sealed = read_sealed(path, lambda n: pool.take_buffer(torch.uint8, n, "cpu"))
            if sealed is not None:
                header, tensors, buf = sealed
                return Received(tensors, header.total_bytes - header.data_start, [buf])
        raise BadRequest("the committed lease is not sealed", code="bad_lease")


def read_sealed(path: str, take_buffer) -> tuple[wire.Header, dict, torch.Tensor] | None:
    """A sealed body (a committed shm lease) copied, for an engine that may write what it is
    given: a read-only mapping would kill it, and a private one costs a fault per page plus
    a fresh page per page written. One read into `take_buffer(nbytes)`, a reused buffer,
    costs about a memcpy. Returns None when `path` is not sealed."""
    with open(path, "rb") as f:
        fd = f.fileno()
        if not is_sealed(fd):
            return None
        header = read_header(fd, os.fstat(fd).st_size)
        buf = take_buffer(header.total_bytes - header.data_start)
        view = memoryview(buf.numpy())
        done = 0
        while done < len(view):  # a read may return less than asked
            n = os.preadv(fd, [view[done:]], header.data_start + done)
            if n <= 0:
                raise BadAdapter("the sealed body ended early", code="bad_safetensors")
            done += n
    return header, wire.view_tensors(view, header, data_only=True), buf


def map_sealed(path: str) -> tuple[wire.Header, dict] | None:
    """A sealed body mapped shared and read-only: no copy. Its page tables fill as the
    engine first reads each part (a read fault maps 16 pages at once). Filling them up
    front cost the same in all (vLLM, rank 64: intake, build and register took as long
    either way) but held the intake's reply; an engine that first reads at a
    request has them filled on a thread (`fill_page_tables`). Returns None when `path` is
    not sealed."""
    with open(path, "rb") as f:
        return view_sealed(f.fileno())


def view_sealed(fd: int) -> tuple[wire.Header, dict] | None:
    """The tensors of a sealed file, viewing a read-only shared mapping of it: nobody, this
    process included, can write those bytes. None when the file is not sealed."""
    mapped = map_read_only(fd)
    return None if mapped is None else wire.view_mapped(mapped)


def map_read_only(fd: int) -> memoryview | None:
    """A sealed file mapped shared and read-only, at a huge page's boundary (None when it is
    not sealed): see `pages.map_read_only`."""
    if not is_sealed(fd):
        return None
    return pages.map_read_only(fd, os.fstat(fd).st_size)


def is_sealed(fd: int) -> bool:
    """Whether a file is a write-sealed memfd (a committed shm lease): nobody may write it
    or map it writable any more."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE)
    except OSError:  # not a memfd: seals do not apply
        return False


def read_header(fd: int, nbytes: int) -> wire.Header:
    """Checks the safetensors header of a file of `nbytes` without mapping it."""
    return wire.parse_header(_raw_header(fd), nbytes)
