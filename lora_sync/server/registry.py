"""Which versions exist and who is using them: one owner for a served version's life.

Identity (the version book and one record per served version), the requests in flight on
each (`acquire` / `release`), and retirement that never blocks on those requests: a retired
version is unlisted at once and its engine copy freed once nothing uses it (as SGLang's
`lora_registry` pairs identity with in-flight counts and `wait_for_unload`)."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields

from .. import naming
from ..errors import Conflict, NotFound, TooBusy
from . import metrics
from .bridge import EngineBridge

# How often a drained version asks the engine whether a request still uses it.
DRAIN_POLL_S = 0.05
# A retired version's engine copy is freed off the path of the requests that follow a push
# (`_requests_pause`): once none of ours has been in flight since FREE_QUIET_S after it
# retired, at the latest FREE_DEFER_MAX_S after, and before the next push in any case.
FREE_QUIET_S = 0.2
FREE_DEFER_MAX_S = 1.0
# `retired_freed` without hastening (a lease readied ahead) waits at most this long for
# the frees (deferred by FREE_DEFER_MAX_S at most, then the engine's own time), and at most
# this many requests wait at once.
FREES_WAIT_S = 3.0
FREES_WAITERS = 8
# Retired names remembered so a request on one gets `version_retired`, never another model.
RETIRED_NAMES_KEPT = 4096


class NameLocks:
    """One lock per adapter name, kept only while a request holds or waits for it: a request
    on a name, found or not, leaves nothing behind once it ends."""

    def __init__(self):
        self._held: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, name: str):
        lock, users = self._held.setdefault(name, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._held[name]

    def __len__(self) -> int:
        return len(self._held)


@dataclass
class AdapterRecord:
    name: str
    version: int
    served_name: str
    adapter_id: int
    bytes: int
    rank: int
    transport: str
    load_ms: float
    loaded_at: float = field(default_factory=time.time)
    inflight: int = 0          # admitted requests not yet finished
    retired: bool = False      # out of the window: no new requests, freed when idle
    hold: object = field(default=None, repr=False)  # the staged body workers map
    handle: object = field(default=None, repr=False)  # the engine's request for it

    def listed(self) -> dict:
        """Its fields for a listing (what it holds stays inside: asdict would copy it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("hold", "handle")}


class Registry:
    def __init__(self, bridge: EngineBridge):
        self.bridge = bridge
        self.book = naming.VersionBook()
        self.records: dict[str, AdapterRecord] = {}     # served name -> record
        self.locks = NameLocks()
        self._draining: dict[str, asyncio.Task] = {}  # served name -> waits, then frees
        self._evicting: set[asyncio.Task] = set()  # engine adapters unloaded by name
        self._freeing: set[asyncio.Task] = set()      # engine copies being freed now
        self._deferred: set[asyncio.Event] = set()    # frees waiting for requests to pause
        self._waiting_for_frees = 0                    # requests in `retired_freed`
        self.retired_names: OrderedDict[str, None] = OrderedDict()  # oldest first, bounded

    # -- names ---------------------------------------------------------------------------
    def names(self) -> set[str]:
        return self.book.names() | {r.name for r in self.records.values()}

    def knows(self, name: str) -> bool:
        """A name of ours, live, draining or retired (a request on it is ours to answer)."""
        return name in self.names() or name in self.retired_names

    def owns(self, name: str) -> bool:
        """Our names: an alias, any `-v<N>` name (lora-sync's namespace, so nobody can squat
        a version a trainer will push next), and anything we registered, in any letter case
        (the engine's routes must not add a case variant beside ours)."""
        base, version = naming.split_versioned(name.rsplit(":", 1)[-1])
        return version is not None or base.casefold() in {n.casefold() for n in self.names()} \
            or name in self.records

    def serves(self, name: str) -> bool:
        """Whether the engine itself serves `name` (a model or one of its own adapters)."""
        return name in self.bridge.engine_names()

    def check_disjoint(self, name: str) -> None:
        """Disjointness rule: no name we serve (the alias, any `name-v<N>`) equals a name the
        engine serves (its served model names, adapters it loaded itself), compared without
        letter case; names are ASCII (naming.check_name), so no Unicode form can alias."""
        ours = name.casefold()
        for engine_name in self.bridge.engine_names():
            theirs = engine_name.casefold()
            if ours in (theirs, naming.split_versioned(theirs)[0]):
                raise Conflict(f"{name!r} would shadow {engine_name!r}, which the engine "
                               "already serves; push under another name", code="name_taken")

    # -- versions: reserve, then add or give back ------------------------------------------
    def reserve(self, name: str, requested: int | None, max_names: int, owner) -> int:
        """The names quotas (the server's `max_names`, and the owner tenant's) checked and
        the version reserved in one step. Synchronous on purpose: no await can fall between
        the count and the reservation, and a reservation is counted by the next push's check
        (book.names() holds names with a push in flight), so pushes of new names, however
        many at once and each under its own name's lock, never pass a quota together."""
        live = self.book.names()  # a retired name stops counting at once, drained or not
        if name not in live and len(live) >= max_names:
            raise TooBusy(f"this server already holds {max_names} adapter "
                          "names (LORA_SYNC_MAX_NAMES); retire one with "
                          "retire_lora_adapter first", code="too_many_names")
        if owner is not None and name not in live:
            held = sum(1 for n in live if owner.covers(n))
            if held >= owner.quotas.names:
                raise TooBusy(f"tenant {owner.name!r} already holds {held} adapter names "
                              "(its max_names quota); retire one first",
                              code="quota_names")
        self.check_disjoint(name)
        return self.book.reserve(name, requested)

    def add(self, rec: AdapterRecord, keep: int) -> None:
        """A reserved version is served: it becomes the alias's target (unless pinned), and
        what falls out of the `keep` window retires."""
        retired = self.book.commit(rec.name, rec.version, keep)
        self.records[rec.served_name] = rec
        self.retired_names.pop(rec.name, None)
        self._retire(rec.name, retired, by_push=True)

    def retire_name(self, name: str) -> list[int]:
        """Every version of `name` out of service at once (the name stops counting against
        the names quotas); running requests finish on theirs. Returns the versions retired
        (none: the name is not served)."""
        versions = self.book.forget(name)
        if not versions:
            return versions
        self._retire(name, versions)
        self.retired_names[name] = None
        while len(self.retired_names) > RETIRED_NAMES_KEPT:
            # its version floor goes with it: both are bounded by the same count
            self.book.floors.pop(self.retired_names.popitem(last=False)[0], None)
        return versions

    def listing(self, sees) -> dict:
        """Per name that `sees(name)`: its servable versions (and retired ones requests
        still run on), the alias target, requests in flight, the versions being freed."""
        out = {}
        for rec in self.records.values():
            if not sees(rec.name):
                continue
            entry = out.setdefault(rec.name, {"name": rec.name, "alias_target": None,
                                              "versions": [], "inflight": 0, "draining": []})
            if rec.retired:
                entry["draining"].append(rec.served_name)
            if not rec.retired or rec.inflight:
                entry["versions"].append(rec.listed())
            target = self.book.alias(rec.name)
            entry["alias_target"] = naming.versioned(rec.name, target) if target else None
            entry["pinned"] = rec.name in self.book.pinned
            entry["inflight"] += rec.inflight
        return out

    # -- requests: acquire and release -----------------------------------------------------
    def acquire(self, requested: str) -> AdapterRecord | None:
        """The record a generation request naming `requested` will use (counted in flight),
        or None when the name is not ours. A retired or unknown version of one of our names,
        or a retired name, raises NotFound: never another model."""
        name, version = naming.split_versioned(requested)
        if version is None:
            latest = self.book.alias(requested)
            if latest is None:
                if requested in self.retired_names:
                    raise NotFound(f"{requested} was retired", code="version_retired")
                return None
            rec = self.records[naming.versioned(requested, latest)]
        else:
            if not self.knows(name):
                return None
            rec = self.records.get(requested)
            if rec is None or rec.retired:
                available = [naming.versioned(name, v) for v in self.book.versions.get(name, [])]
                raise NotFound(f"{requested} is not servable (retired or never loaded); "
                               f"versions available: {available}", code="version_retired")
        rec.inflight += 1
        metrics.state_changed()
        return rec

    def release(self, served_name: str) -> None:
        rec = self.records.get(served_name)
        if rec is None:
            return
        rec.inflight -= 1
        metrics.state_changed()
        if rec.retired and rec.inflight == 0:
            self._free_when_idle(rec)

    # -- retirement: unlisted now, freed when nothing uses it ------------------------------
    def _retire(self, name: str, versions: list[int], by_push: bool = False) -> None:
        """Never waits for generation: idle versions go now, busy ones when their last
        request finishes (see `release`). `by_push`: a push retired them, and the requests
        on its new version come first (_requests_pause); a name retired whole has none to
        wait for."""
        for v in versions:
            rec = self.records.get(naming.versioned(name, v))
            if rec is not None:
                rec.retired = True
                if rec.inflight == 0:
                    self._free_when_idle(rec, by_push)
        metrics.state_changed()

    def _free_when_idle(self, rec: AdapterRecord, by_push: bool = False) -> None:
        """Unlists a version now; frees its engine copies in the background, once the engine
        itself has no request on it (`by_push`: and once requests pause, _requests_pause)."""
        if self.records.get(rec.served_name) is not rec or rec.served_name in self._draining:
            return  # already going
        retired_at = time.monotonic() if by_push else -math.inf  # -inf: no pause to wait
        task = asyncio.get_running_loop().create_task(self._free(rec, retired_at))
        self._draining[rec.served_name] = task
        task.add_done_callback(lambda _: self._draining.pop(rec.served_name, None))

    async def _free(self, rec: AdapterRecord, retired_at: float) -> None:
        await self.bridge.unpublish(rec.served_name)
        # Our count says no admitted request is left. The engine is asked too: a request
        # that reached it by a path admission did not count must finish before the adapter
        # goes, or the engine would fail on a missing adapter.
        await self._engine_done_with(rec.adapter_id)
        async with self._settled_before_pushes():
            await self._requests_pause(retired_at)
            self.records.pop(rec.served_name, None)
            metrics.state_changed()  # the version's series go
            if rec.name not in self.book.names():
                # A retired name's numbering stays above its versions still present only:
                # once they are all gone it may start again at 1.
                present = [r.version for r in self.records.values() if r.name == rec.name]
                if present:
                    self.book.floors[rec.name] = max(present)
                else:
                    self.book.floors.pop(rec.name, None)
            freed = await self.free_engine_copies([rec.adapter_id])
            # What the version held is reused only once no worker serves from it; if the
            # workers could not be told, it stays until the server stops (rare: a broken
            # engine RPC), never overwritten under a version still in use.
            if rec.hold is not None and freed:
                rec.hold.close()

    async def _requests_pause(self, retired_at: float) -> None:
        """Waits until requests on our versions pause (FREE_QUIET_S past `retired_at`, none
        in flight), FREE_DEFER_MAX_S at most; a push cuts it short (`settle`), and a version
        retired otherwise (its name retired, its last request ended) does not wait.
        Freeing takes the engine's own thread: SGLang zeroes the version's memory-pool slot
        (70 MB at rank 64), and freed at once it ran into the first request on the new
        version, which then came slower than after a disk load (whose old version a trainer
        unloads after)."""
        wake = asyncio.Event()
        self._deferred.add(wake)
        try:
            while True:
                now = time.monotonic()
                left = retired_at + FREE_DEFER_MAX_S - now
                paused = now >= retired_at + FREE_QUIET_S and \
                    not any(r.inflight for r in self.records.values())
                if left <= 0 or paused:
                    return
                try:
                    await asyncio.wait_for(wake.wait(), min(DRAIN_POLL_S, left))
                    return
                except TimeoutError:
                    pass
        finally:
            self._deferred.discard(wake)

    def evict_when_idle(self, adapter_id: int) -> None:
        """An adapter the engine loaded itself was unloaded by name: its cached copy goes once
        no request uses it (as for our retired versions), off the unload's path."""
        async def evict():
            await self._engine_done_with(adapter_id)
            async with self._settled_before_pushes():
                try:
                    await self.bridge.evict(adapter_id)
                except Exception:  # best effort: the engine's LRU evicts it in the end
                    pass
        task = asyncio.get_running_loop().create_task(evict())
        self._evicting.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._evicting.discard)

    async def _engine_done_with(self, adapter_id: int) -> None:
        while await self.bridge.in_use(adapter_id):
            await asyncio.sleep(DRAIN_POLL_S)

    @contextlib.asynccontextmanager
    async def _settled_before_pushes(self):
        """An engine call that frees memory: a push that starts meanwhile waits for it
        (`settle`), so it can reuse that memory and the two never race in the engine."""
        task = asyncio.current_task()
        self._freeing.add(task)
        try:
            yield
        finally:
            self._freeing.discard(task)

    async def settle(self) -> float:
        """Waits until retired versions are freed (overlaps the trainer's step in practice),
        so the push can reuse their memory; returns the milliseconds waited. Versions still
        busy in the engine are not waited for."""
        t0 = time.perf_counter()
        for wake in list(self._deferred):  # frees waiting for requests to pause go now
            wake.set()
        if self._freeing:
            await asyncio.gather(*list(self._freeing), return_exceptions=True)
        return (time.perf_counter() - t0) * 1e3

    async def retired_freed(self, hasten: bool) -> None:
        """Returns once the versions being retired have given their memory back, so that
        memory the caller allocates next reuses their pages. `hasten`: they go now
        (`settle`, as at a push); else when they would, at the next pause in serving.
        Bounded: FREES_WAIT_S, and beyond FREES_WAITERS waiting requests the others go on
        at once."""
        if hasten:
            await self.settle()
            return
        going = {*self._draining.values(), *self._freeing}
        if not going or self._waiting_for_frees >= FREES_WAITERS:
            return
        self._waiting_for_frees += 1
        try:
            await asyncio.wait(going, timeout=FREES_WAIT_S)
        finally:
            self._waiting_for_frees -= 1

    async def free_engine_copies(self, adapter_ids: list[int]) -> bool:
        try:
            await self.bridge.free(adapter_ids)
            return True
        except Exception:  # best effort: nothing was published for these ids
            return False
