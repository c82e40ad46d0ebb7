"""The API process's leases: granted memfds not yet committed, each bounded in time and
counting against the staging bytes."""
from __future__ import annotations

import asyncio
import errno
import hmac
import os
from dataclasses import dataclass


from ... import wire
from ...errors import BadRequest, Conflict, Forbidden, NotFound, TooBusy
from .messages import CommitRequest, Lease
from .memfd import _digest, new_lease, seal_and_read_header


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
