"""The lease's memfd: made, probed, sealed, and its header read once sealed."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import time

from ... import wire
from ...errors import LoRASyncError
from .messages import Lease, MEMFD_NAME, PROBE_BYTES

# After these, nobody can write, resize, map writable or unseal the memfd.
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

SEAL_WAIT_S = 1.0
SEAL_WAIT_BYTES_PER_S = 256 << 20  # each 256 MiB of lease: one second more


def open_pinned(path: str, flags: int, accept) -> int | None:
    """`path`, a /proc/<pid>/fd/<n> link another process controls, opened with `flags` only
    if `accept(pinned_fd, its stat)` takes the file it names: the file is pinned first with
    O_PATH (which opens nothing: a FIFO or a device swapped in by dup2 is never opened),
    checked on that descriptor, then opened through it, so what is opened is what was
    checked. None when it cannot be pinned or is not accepted; the final open's OSError
    propagates. No O_NOFOLLOW: the link is the kernel's, resolved to a descriptor's file."""
    try:
        pinned = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not accept(pinned, os.fstat(pinned)):
            return None
        return os.open(f"/proc/self/fd/{pinned}",
                       flags | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    finally:
        os.close(pinned)


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
