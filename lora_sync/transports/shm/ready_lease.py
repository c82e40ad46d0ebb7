"""shm's trainer side, one push ahead: the lease for a name's next push, granted, opened
and mapped while the trainer computes its next step.

Writing 70 MB into a lease just granted costs a round trip for the grant and a page-table
entry per 4 KiB page, several times what the copy itself costs into memory already
mapped. So after each push the client asks the server for the next lease of that size,
maps it with its page tables filled (on a thread, off the push's path) and renews it at half
its time, for steps of any length; the next push of that name only commits, copies and
unmaps (the copy runs while the server waits for its seal). The server's rules are those of
any lease: sealed at commit, counted against LORA_SYNC_MAX_LEASES (and, with tenants, its
tenant's max_leases) and staging memory while it waits, gone at its time unless renewed.

The lease is asked for as `ahead`: the server grants it once the versions the push retired
have given their memory back (at the next pause in serving), so its pages are recycled ones
and readying them does not run beside the first requests on the version just pushed. A push
that comes before that grant does not wait for it: it leases the usual way (which frees the
retired versions at once) and the late grant is cancelled.

A push that comes while its lease is still being mapped waits for it (its priority lifted)
no longer than a fresh lease would cost it (`fresh_lease_s`): mapping a large one takes
seconds where huge pages must be assembled first, far more than writing into fresh pages.
It then cancels that lease (its staging memory back at once; the mapping is dropped when
done) and leases the usual way.

One ready lease per server: a push of another name or size finds none (the one it finds is
cancelled), and readies its own."""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

from ... import http, replies
from ...background import Yielding
from ...errors import LoRASyncError
from ..base import Server
from ..device_copy import HostPin
from .messages import CANCEL_ROUTE, LEASE_ROUTE, RENEW_ROUTE, Lease
from .trainer import map_lease

log = logging.getLogger(__name__)
# A background call (grant, renewal, cancel) gives up after this: nothing waits on it but
# the next push, which then takes the usual path.
CALL_TIMEOUT_S = 10.0
# The readying thread waits this long first, so that the push that asked for it returns
# before it: a thread that starts at once can hold the GIL from the returning push for a
# whole switch interval (`sys.getswitchinterval()`).
START_DELAY_S = 0.02
# What a fresh lease costs a push, beyond a round trip: writing into fresh 4 KiB pages runs
# at 2 GB/s or more on a host of two cores (a bound, not a measurement of this host).
FRESH_LEASE_S_PER_BYTE = 0.5e-9
FRESH_LEASE_MIN_S = 0.02


def fresh_lease_s(nbytes: int) -> float:
    """The longest a push waits for its lease being readied: what leasing afresh costs."""
    return FRESH_LEASE_MIN_S + nbytes * FRESH_LEASE_S_PER_BYTE


@dataclass
class _Slot:
    """A lease being readied (`future`: its ReadyLease, or None)."""
    future: Future | None = None
    granted: bool = False    # the server granted it: it is being mapped, soon ready
    abandoned: bool = False  # nobody waits for it: cancelled once granted
    lease: Lease | None = None      # once granted
    mapped: bool = False     # its mapping is done: a push takes it whatever it waited

    def abandon_if_ungranted(self) -> bool:
        """Under the owner's lock: True (and abandoned) while the server has not granted it."""
        self.abandoned = not self.granted and not self.future.done()
        return self.abandoned


@dataclass
class ReadyLease:
    server: Server
    name: str
    lease: Lease
    mapping: mmap.mmap            # shared, writable, page tables filled
    read_fd: int                  # the same memfd, read only (see shm.reopen_read_only)
    pin: HostPin | None = None    # registered with CUDA, for a GPU trainer's copy
    timer: threading.Timer | None = None

    def close(self) -> None:
        if self.pin is not None:
            self.pin.release()
        self.mapping.close()
        os.close(self.read_fd)


class ReadyLeases:
    """Per client: for each server, at most one lease readied for the next push."""

    def __init__(self, headers: dict, client_id: str, timeout: float = CALL_TIMEOUT_S):
        self.headers, self.client_id = headers, client_id
        self.timeout = min(timeout, CALL_TIMEOUT_S)
        self._slots: dict[str, _Slot] = {}    # server url -> the lease being readied
        self._wanted: dict[str, tuple] = {}   # server url -> (server, name, nbytes, pin)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-sync-ready-lease")
        # Readying runs while the server serves the version just pushed: at full priority
        # it made vLLM's first completion on it clearly slower than after a disk load;
        # niced, about as fast (the push itself unchanged).
        self._priority = Yielding()
        self._closed = False

    def take(self, server: Server, name: str, nbytes: int) -> ReadyLease | None:
        """The lease readied for this push (waiting for one being mapped), or None: none,
        one the server has not granted yet (abandoned: the push leases the usual way), or
        one readied for another name or size (cancelled)."""
        with self._lock:
            slot = self._slots.pop(server.url, None)
            if slot is not None and slot.abandon_if_ungranted():
                return None
        if slot is not None and not slot.future.done():
            self._priority.lift()  # this push waits for it now, as long as a fresh one costs
            if not self._wait_mapped(slot, nbytes):
                self._priority.drop()  # the rest of its mapping yields to this push again
                self._cancel(server, slot.lease)  # its staging back now; _ready unmaps it
                return None
        ready = slot.future.result() if slot is not None else None  # time-bounded calls
        if ready is None:
            return None
        self._stop_renewing(ready)
        if ready.name == name and ready.lease.nbytes == nbytes:
            return ready
        self._discard(ready)
        return None

    def _wait_mapped(self, slot: _Slot, nbytes: int) -> bool:
        """False, with the slot abandoned, when its mapping is not done within what a fresh
        lease of `nbytes` would cost."""
        try:
            slot.future.result(timeout=fresh_lease_s(nbytes))
            return True
        except FutureTimeout:
            with self._lock:
                slot.abandoned = not slot.mapped
                return not slot.abandoned

    def want(self, server: Server, name: str, nbytes: int, pin: bool = False) -> None:
        """Asks for the next lease of `name` on `server`, readied once `start` is called:
        the client calls it when its push has returned, so that the push never waits on
        the work it starts (70 MB of fresh pages to fill). `pin`: register it with CUDA
        too (a GPU trainer's: see device_copy.py)."""
        with self._lock:
            self._wanted[server.url] = (server, name, nbytes, pin)

    def start(self) -> None:
        """Readies what was wanted, in the background."""
        with self._lock:
            wanted, self._wanted = self._wanted, {}
            for url, want in wanted.items():
                if not self._closed and url not in self._slots:  # one per server
                    slot = self._slots[url] = _Slot()
                    slot.future = self._pool.submit(self._ready, slot, *want)

    def ready_for(self, server_url: str) -> ReadyLease | None:
        """The lease ready on that server now (None: none, or still being readied)."""
        with self._lock:
            slot = self._slots.get(server_url)
        return slot.future.result() if slot is not None and slot.future.done() else None

    def count(self) -> int:
        """How many leases are ready (once those being readied are)."""
        with self._lock:
            slots = list(self._slots.values())
        return sum(slot.future.result() is not None for slot in slots)

    def release(self) -> None:
        """Unmaps and cancels every ready lease (each cancel bounded by the call timeout),
        and those not granted yet once they are; later pushes ready new ones."""
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
            slots = [slot for slot in slots if not slot.abandon_if_ungranted()]
        for slot in slots:
            ready = None if slot.future.cancelled() else slot.future.result()
            if ready is not None:
                self._stop_renewing(ready)
                self._discard(ready)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.release()
        self._pool.shutdown(wait=True)

    # -- on the pool's thread ------------------------------------------------------------
    def _ready(self, slot: _Slot, server: Server, name: str, nbytes: int,
               pin: bool) -> ReadyLease | None:
        """None where no lease could be readied: the next push takes the usual path."""
        self._priority.lower()
        time.sleep(START_DELAY_S)
        try:
            # the server may hold it until the retired versions are freed (3 s at most):
            # given up sooner, it would be granted to nobody and held until its time
            granted = self._post(server, LEASE_ROUTE, {"nbytes": nbytes, "ahead": True,
                                                       "client": self.client_id},
                                 timeout=CALL_TIMEOUT_S)
            lease = Lease.from_json(granted, server.url, nbytes)
        except LoRASyncError as e:  # refused (room, auth) or unreachable
            log.debug("no lease readied on %s: %s", server.url, e)
            return None
        with self._lock:
            slot.granted = not slot.abandoned
            slot.lease = lease
        if not slot.granted:  # a push went on without it
            self._cancel(server, lease)
            return None
        try:
            mapped = map_lease(lease, huge_pages=True)  # off the push's path
        except OSError as e:  # out of memory or address space
            log.warning("could not map a lease of %d bytes from %s: %s", nbytes,
                        server.url, e)
            mapped = None
        if mapped is None:
            self._cancel(server, lease)
            return None
        ready = ReadyLease(server, name, lease, *mapped, HostPin.of(mapped[0]) if pin else None)
        with self._lock:
            slot.mapped = not slot.abandoned
        if not slot.mapped:  # the push waited no longer and cancelled it
            ready.close()
            return None
        self._renew_later(ready)
        return ready

    def _renew_later(self, ready: ReadyLease) -> None:
        ready.timer = threading.Timer(ready.lease.expires_s / 2, self._renew, (ready,))
        ready.timer.daemon = True
        ready.timer.start()

    def _renew(self, ready: ReadyLease) -> None:
        """On the timer's thread: keeps the lease while it is still the server's ready one."""
        try:
            reply = self._post(ready.server, RENEW_ROUTE, ready.lease.ticket())
            expires_s = replies.field(reply, "expires_s", float, server=ready.server.url,
                                      what="lease renewal", lo=0)
        except LoRASyncError as e:
            log.debug("ready lease on %s lapsed: %s", ready.server.url, e)
            if self._unslot(ready):
                ready.close()
            return
        with self._lock:
            if self._current(ready):
                ready.lease = replace(ready.lease, expires_s=expires_s)
                self._renew_later(ready)

    # -- helpers ---------------------------------------------------------------------------
    def _current(self, ready: ReadyLease) -> bool:
        slot = self._slots.get(ready.server.url)
        return slot is not None and slot.future.done() and slot.future.result() is ready

    def _unslot(self, ready: ReadyLease) -> bool:
        with self._lock:
            if not self._current(ready):
                return False  # a push took it: the push owns the mapping now
            del self._slots[ready.server.url]
            return True

    @staticmethod
    def _stop_renewing(ready: ReadyLease) -> None:
        if ready.timer is not None:
            ready.timer.cancel()

    def _discard(self, ready: ReadyLease) -> None:
        ready.close()
        self._cancel(ready.server, ready.lease)

    def _cancel(self, server: Server, lease: Lease) -> None:
        try:
            self._post(server, CANCEL_ROUTE, lease.ticket())
        except LoRASyncError:
            pass  # it goes at its time on the server anyway

    def _post(self, server: Server, route: str, body: dict,
              timeout: float | None = None) -> dict:
        return http.call("POST", server.route(route), headers=self.headers,
                         timeout=timeout or self.timeout, json_body=body)[0]
