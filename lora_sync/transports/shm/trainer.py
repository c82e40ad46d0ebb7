"""The trainer's side of a lease: reach it, check it is ours, write the file into it."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ... import host_copy, http, pages, wire
from ..base import SendContext, Server, Unavailable
from ..device_copy import HostPin, copy_to_host, on_device
from .memfd import open_pinned
from .messages import Lease, MEMFD_NAME, PROBE_BYTES, _LEASE_PATH

_IOV_MAX = 512  # buffers per pwritev (the kernel allows 1024)
_SPLIT_BYTES = 8 << 20  # smaller copies are not worth a second thread


def open_lease(lease: Lease) -> int | None:
    """The lease's memfd opened read-write, or None when it is not reachable from here
    (another host or PID namespace) or is not the lease granted (wrong kind, size or probe)."""
    if not _LEASE_PATH.fullmatch(lease.path):
        return None
    try:
        # Only an anonymous memfd of a lease table is opened (open_pinned: a device or a
        # FIFO the server's process swaps in never is).
        fd = open_pinned(lease.path, os.O_RDWR, lambda pinned, _: _is_lease_memfd(pinned))
    except OSError:
        return None
    if fd is None:
        return None
    if os.fstat(fd).st_size == lease.nbytes \
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

    Host tensors go in by memcpy (host_copy.py: on a host with few cores, torch's copy from
    this thread was up to twice as slow), GPU tensors device to host in a few packed copies
    (device_copy.py)."""
    try:
        lead = _header_lead(chunks)
        anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address, while it lives
        base = ctypes.addressof(anchor)
        try:
            # `sources`: contiguous copies of strided tensors, alive until copied
            copies, sources, on_gpu = _runs_into(mapping, base, chunks) \
                or _each_into(mapping, base, chunks)
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


def _runs_into(mapping: mmap.mmap, base: int, chunks: list) -> tuple | None:
    """(copies, [], []) placing the file (header bytes, then host tensors) in the mapping at
    address `base`, a copy per run of tensors that lie back to back
    (`host_copy.host_runs`): a packed adapter is one copy. The header is written now, but
    its first 8 bytes. None where a tensor is not a contiguous host tensor."""
    head, tensors = chunks[0], chunks[1:]
    runs = host_copy.host_runs(tensors) \
        if all(isinstance(t, torch.Tensor) for t in tensors) else None
    if runs is None:
        return None
    if len(head) + sum(n for _, n in runs) > len(mapping):
        raise ValueError("the chunks do not fit the lease")
    mapping[8:len(head)] = head[8:]
    copies, at = [], base + len(head)
    for start, n in runs:
        copies.append((at, start, n))
        at += n
    return copies, [], []


def _each_into(mapping: mmap.mmap, base: int, chunks: list) -> tuple:
    """(copies, sources, on_gpu): chunk by chunk, bytes written now (but the header's first
    8), host tensors as copies (a contiguous copy made of the others, kept in `sources`
    until copied), GPU tensors as (offset, tensor) for `copy_to_host`."""
    offset, copies, sources, on_gpu = 0, [], [], []
    # One pass of cheap attribute reads per tensor: an MoE adapter has tens of thousands,
    # and detach() or device.type alone cost more than the rest.
    for chunk in chunks:
        n = _nbytes(chunk)
        if offset + n > len(mapping):
            raise ValueError("the chunks do not fit the lease")
        if isinstance(chunk, torch.Tensor):
            if not chunk.is_cpu:
                on_gpu.append((offset, chunk))
            else:
                if not chunk.is_contiguous():
                    chunk = chunk.contiguous()
                    sources.append(chunk)  # alive until copied
                copies.append((base + offset, chunk.data_ptr(), n))
        else:
            start = 8 if offset == 0 else 0  # the header's length is stored last
            mapping[offset + start:offset + n] = chunk[start:]
        offset += n
    return copies, sources, on_gpu


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
    thread, even on a host of two cores. Each half's neighbours are copied as one
    (`memmove_each`)."""
    if sum(n for _, _, n in copies) < _SPLIT_BYTES:
        host_copy.memmove_each(copies)
        return
    first, rest = host_copy.halves(copies)
    done = _COPY_HELPER.submit(host_copy.memmove_each, first)
    try:
        host_copy.memmove_each(rest)
    finally:
        done.result()


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
    """The file (`chunks`: its header's bytes, then CPU tensors) into `fd` from offset 0, a
    few hundred buffers per call."""
    head, *tensors = chunks  # the header's bytes, then the tensors
    views = [v for v in (memoryview(head), *wire.byte_views(tensors)) if v.nbytes]
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
    return chunk.nbytes if isinstance(chunk, torch.Tensor) else len(chunk)


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


class LeaseRefused(Unavailable):
    """The server granted no lease for want of room (429: too many open leases, staging
    full): `transport="auto"` sends this push over HTTP instead; the code is the server's."""
