"""What the added routes do, the same on both engines: check, stage, load, publish."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hmac
import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, fields

from .. import adapter_dir, naming
from ..adapter import ModelSpec, check_adapter, check_finite, lora_weights
from ..errors import BadRequest, Conflict, Forbidden, LoRASyncError, NotFound, TooBusy, \
    Unauthorized
from ..messages import IntakeRequest, WorkerReply
from ..staging import StagedBody, StagingArea
from ..transports import TRANSPORTS
from ..transports.base import RawBody, ServerContext, Staged, Transport
from . import metrics
from .bridge import EngineBridge
from .settings import Settings
from .tenants import OPERATOR, Caller, Tenancy, hide

logger = logging.getLogger("lora_sync")

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
# The caller of the push being staged: the service's upload budget is per tenant too, and
# the transport that streams the body is not told who sent it.
_PUSHING = contextvars.ContextVar("lora_sync_pushing", default=OPERATOR)


def opens(request) -> str | None:
    """What a transport request holds for its client once granted ("lease", "group"), if
    anything: the request class says so (LeaseRequest.opens, InitGroupRequest.opens)."""
    return getattr(type(request), "opens", None)


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


class Workers:
    """The worker ops the service and the transports' routes use, on every worker of the
    engine (through its bridge); a refusal raises the matching LoRASyncError."""

    def __init__(self, bridge: EngineBridge):
        self._bridge = bridge

    async def call(self, op: str, **args) -> list[WorkerReply]:
        return await self._bridge.call_workers(op, **args)

    async def call_in_background(self, op: str, wait_s: float, **args) -> list[WorkerReply]:
        return await self._bridge.call_workers_in_background(op, wait_s, **args)

    async def intake(self, request: IntakeRequest,
                     background_s: float | None = None) -> list[WorkerReply]:
        """A new adapter into every worker; with `background_s`, on the workers' threads
        (a long transfer must not hold the engine loop), waiting that long at most."""
        if background_s is None:
            return await self.call("intake", request=request.to_json())
        return await self.call_in_background("intake", background_s,
                                             request=request.to_json())

    async def status(self) -> list[dict]:
        """One dict per worker: rank, world_size, the adapter ids it holds/caches, groups."""
        return await self._bridge.worker_status()


class AdapterService:
    def __init__(self, bridge: EngineBridge, settings: Settings | None = None):
        self.bridge = bridge
        self.settings = settings or Settings.from_env()
        # New at every start: a trainer that sees it change knows the server lost its
        # adapters (restart) and re-pushes the newest ones (client.resync).
        self.instance_id = uuid.uuid4().hex
        self.book = naming.VersionBook()
        self.records: dict[str, AdapterRecord] = {}     # served name -> record
        self._locks = NameLocks()
        self._spec: ModelSpec | None = None
        self._unsupported: tuple[str | None] | None = None  # (reason,) once workers said
        self.staging = StagingArea(root=self.settings.shm_dir, map_kept=self.settings.socket_body)
        self.workers = Workers(bridge)
        # Per transport, what it may use: its own state between requests (shm: the open
        # leases; broadcast: the groups) and what the service lends it.
        self.contexts = {name: ServerContext(self.settings, t.new_state(self.settings),
                                             self.staging, self.workers, self._receive_body,
                                             self.retired_freed)
                         for name, t in TRANSPORTS.items()}
        self._draining: dict[str, asyncio.Task] = {}  # served name -> waits, then frees
        self._evicting: set[asyncio.Task] = set()  # engine adapters unloaded by name
        self._freeing: set[asyncio.Task] = set()      # engine copies being freed now
        self._deferred: set[asyncio.Event] = set()    # frees waiting for requests to pause
        self._waiting_for_frees = 0                    # requests in `retired_freed`
        self.retired_names: OrderedDict[str, None] = OrderedDict()  # oldest first, bounded
        self.tenancy = Tenancy(self.settings.tenants, self.settings.api_key)

    async def model_spec(self) -> ModelSpec:
        if self._spec is None:
            self._spec = await self.bridge.model_spec()
        return self._spec

    # -- the model: whether its LoRA forward runs here at all -----------------------------
    async def model_unsupported(self, status: list[dict] | None = None) -> str | None:
        """Why this engine cannot run its model's LoRA forward pass here (the workers' own
        `model_unsupported` fact, e.g. MoE experts that need Triton on a CPU build), or None.
        Asked of the workers once (from `status`, their info replies, when given) and kept:
        the model does not change while the server runs. Logged loudly when first known."""
        if self._unsupported is None:
            if status is None:
                status = await self.workers.status()
            reasons = sorted({w["model_unsupported"] for w in status
                              if isinstance(w.get("model_unsupported"), str)})
            reason = "; ".join(reasons) or None
            if self._unsupported is None:
                self._unsupported = (reason,)
                if reason is not None:
                    logger.warning("lora-sync: this server refuses every adapter push (409 "
                                   "model_unsupported): %s", reason)
        return self._unsupported[0]

    async def refuse_if_unsupported(self) -> None:
        """Rule: until the model's LoRA path runs, every push is refused (each transport's
        first step, and the engine's own load routes) with a 409 saying why; nothing is
        staged or sent to a worker. An adapter whose first request kills the engine is never
        taken."""
        reason = await self.model_unsupported()
        if reason is not None:
            raise Conflict(f"this server cannot serve LoRA adapters for its model, so it "
                           f"refuses every push: {reason}", code="model_unsupported")

    async def check_native_load(self, path) -> None:
        """The engine's own load route on this server: the adapter at `path` gets the
        verdict a push of it gets (check_adapter on its config and tensor header), before
        the engine reads a byte of it; the same refusal when the model's LoRA path cannot
        run. A path lora-sync cannot check (not a local directory, pickle weights) is
        refused: no adapter reaches the engine without a verdict. With check_finite, the
        weights are read too, as a push's are in the workers."""
        await self.refuse_if_unsupported()
        limit = self.settings.max_body_bytes if self.settings.check_finite else None
        specs, config, tensors = await asyncio.to_thread(adapter_dir.read, path, limit)
        check_adapter(specs, config, await self.model_spec())
        if tensors is not None:  # a pass over every byte: off the event loop, as the read
            await asyncio.to_thread(check_finite, lora_weights(tensors), True)

    # -- access ------------------------------------------------------------------------
    def authorize(self, authorization: str | None) -> Caller:
        """Admin routes (ours, and the engine's adapter routes): the lora-sync key when set
        (or, with tenants, a tenant's key: the caller says which); closed when only the
        engine has a key (its generation key never opens them)."""
        if self.settings.api_key is None:
            if self.settings.engine_has_key:
                raise Forbidden("lora-sync admin routes are closed: the engine has an API key "
                                "but LORA_SYNC_API_KEY is not set", code="admin_closed")
            return OPERATOR
        caller = self.tenancy.resolve(authorization)
        if caller.kind == "anonymous":
            raise Unauthorized("missing or wrong API key for lora-sync admin routes")
        return caller

    def caller(self, authorization: str | None) -> Caller:
        """Who a generation request is (admission): the operator, a tenant, or anonymous
        (no key, a wrong one, the engine's own key). The same resolution as `authorize`."""
        return self.tenancy.resolve(authorization)

    def authorize_generation(self, authorization: str | None, caller: Caller) -> None:
        """A request on our adapters through an engine route the engine's key does not
        guard (vLLM's /invocations): it needs one of the engine's keys, ours, or a tenant's
        (`caller`, resolved by admission; its key opens the engine's guarded routes too,
        and admission already checked what it may generate on)."""
        keys = [k for k in (*self.settings.generation_keys, self.settings.api_key) if k]
        given = (authorization or "").encode()
        if self.settings.generation_keys and caller.kind != "tenant" and \
                not any(hmac.compare_digest(given, f"Bearer {k}".encode()) for k in keys):
            raise Unauthorized("this route is not guarded by the engine's API key; requests "
                               "on lora-sync adapters need it", code="unauthorized")

    def authorize_metrics(self, authorization: str | None) -> None:
        """The engine's /metrics (admission): with tenants, the operator's alone, on both
        engines. Its labels name adapters (lora-sync's per name and version, the engine's own
        such as vLLM's vllm:lora_requests_info), and a tenant sees only its own names: one
        rule for every label, whoever adds it. 401 without the operator's or a tenant's key,
        403 with a tenant's. Without tenants: as the engine serves it."""
        if not self.tenancy.enabled:
            return
        if self.authorize(authorization).kind != "operator":
            raise Forbidden("with tenants, /metrics is the operator's (LORA_SYNC_API_KEY): its "
                            "labels name every tenant's adapters", code="forbidden")

    def authorize_native(self, authorization: str | None, name) -> None:
        """The engine's own adapter routes: guarded like ours, the operator's alone, and
        never on our names."""
        if self.authorize(authorization).kind != "operator":
            raise Forbidden("the engine's own adapter routes are the operator's: a tenant "
                            "pushes with lora-sync's routes", code="forbidden")
        if isinstance(name, str) and self.owns(name):
            raise Forbidden(f"{name[:140]!r} is managed by lora-sync: push, retire and list it "
                            "with lora-sync's routes", code="reserved_name")

    def owns(self, name: str) -> bool:
        """Our names: an alias, any `-v<N>` name (lora-sync's namespace, so nobody can squat
        a version a trainer will push next), and anything we registered, in any letter case
        (the engine's routes must not add a case variant beside ours)."""
        base, version = naming.split_versioned(name.rsplit(":", 1)[-1])
        return version is not None or base.casefold() in {n.casefold() for n in self._names()} \
            or name in self.records

    def _names(self) -> set[str]:
        return self.book.names() | {r.name for r in self.records.values()}

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

    def serves(self, name: str) -> bool:
        """Whether the engine itself serves `name` (a model or one of its own adapters)."""
        return name in self.bridge.engine_names()

    # -- pushes: the one flow every transport's push goes through -----------------------
    async def push(self, transport: Transport, request, caller: Caller = OPERATOR) -> dict:
        """stage (the transport) -> check -> install: reserve the version, the workers'
        intake, activate, publish, retire what falls out of the window. Any failure leaves
        the previous versions exactly as they were. `caller`: its quotas are checked before
        anything is staged, its scope once the name is known."""
        t0 = time.perf_counter()
        ctx = self.contexts[transport.name]
        await self.refuse_if_unsupported()
        self.gate(caller, request, ctx, pushes=transport.start_path is None)
        settle_ms = await self.settle()
        token = _PUSHING.set(caller)
        try:
            staged = await transport.stage(request, ctx)
        finally:
            _PUSHING.reset(token)
        kept = False
        try:
            self.tenancy.check(caller, staged.name)  # before the workers see a byte
            cfg = check_adapter(staged.specs, staged.config, await self.model_spec())
            reply = await self._install(transport.name, staged, cfg, t0)
            kept = True  # the workers may use what the version holds: it goes with it
            if staged.on_success is not None:
                staged.on_success()
        except LoRASyncError as e:
            if staged.on_failure is not None:
                staged.on_failure(e)
            raise
        finally:
            if not kept:
                staged.release()
        reply["timings_ms"].update(staged.timings_ms, settle=settle_ms,
                                   server=(time.perf_counter() - t0) * 1e3)
        return reply

    async def _install(self, transport: str, staged: Staged, cfg: dict, t0: float) -> dict:
        name = staged.name
        t_in = time.perf_counter()
        owner = self.tenancy.owner_of(name)  # its quotas hold whoever pushes
        async with self._locks.hold(name):
            version = self._reserve(name, staged.version, owner)
            adapter_id = self.bridge.new_adapter_id()
            t1 = time.perf_counter()
            try:
                served = naming.versioned(name, version)
                intake = staged.intake(transport, adapter_id, cfg,
                                       self.settings.check_finite)
                replies = await self.workers.intake(intake, staged.background_s)
                slowest = max(replies, key=lambda r: r.ms)
                worker_ms = slowest.ms
                t2 = time.perf_counter()
                handle = await self.bridge.activate(served, adapter_id)
            except BaseException:
                self.book.unreserve(name, version)
                await asyncio.shield(self._free_engine_copies([adapter_id]))
                raise
            t3 = time.perf_counter()
            # The engine's table gets the version only; the alias lives here and admission
            # resolves it, so no engine route can use it uncounted.
            self.bridge.publish(served, handle)
            keep = owner.quotas.keep_versions if owner is not None else \
                self.settings.keep_versions
            retired = self.book.commit(name, version, keep)
            rec = AdapterRecord(name, version, served, adapter_id, staged.nbytes,
                                int(cfg["r"]), transport, (t3 - t0) * 1e3, hold=staged.hold)
            self.records[served] = rec
            self.retired_names.pop(name, None)
            self._retire(name, retired, by_push=True)
            metrics.state_changed()
        return {"name": served, "lora_name": name, "version": version, "bytes": staged.nbytes,
                "load_ms": rec.load_ms, "transport": transport,
                "timings_ms": {**slowest.data.get("timings_ms", {}),
                               "wait": (t1 - t_in) * 1e3, "worker": worker_ms,
                               "handoff": (t2 - t1) * 1e3 - worker_ms,
                               "register": (t3 - t2) * 1e3}}

    def _reserve(self, name: str, requested: int | None, owner) -> int:
        """The names quotas (the server's, and the owner tenant's) checked and the version
        reserved in one step. Synchronous on purpose: no await can fall between the count
        and the reservation, and a reservation is counted by the next push's check
        (book.names() holds names with a push in flight), so pushes of new names, however
        many at once and each under its own name's lock, never pass a quota together."""
        live = self.book.names()  # a retired name stops counting at once, drained or not
        if name not in live and len(live) >= self.settings.max_names:
            raise TooBusy(f"this server already holds {self.settings.max_names} adapter "
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

    async def _receive_body(self, raw: RawBody) -> StagedBody:
        """Streams an upload into staging; uploads and open shm leases share one budget, and
        a tenant's share of it is bounded by its own quota as well."""
        held = sum(t.held_bytes(self.contexts[n].state) for n, t in TRANSPORTS.items())
        tenant = _PUSHING.get().tenant
        if tenant is None:
            return await self.staging.receive_body(raw.chunks, self.settings.body_limits,
                                                   raw.content_length, held_elsewhere=held)
        # What the body may be: the tenant's quota less what it holds (a body without a
        # Content-Length is cut off there, as one above LORA_SYNC_MAX_BODY_MB would be).
        left = tenant.quotas.staging_bytes - self.tenancy.staged_bytes(tenant, self._leases())
        claimed = raw.content_length if raw.content_length is not None else max(left, 0)
        self.tenancy.check_staging(tenant, self._leases(), max(claimed, 1))
        limits = self.settings.body_limits
        limits = dataclasses.replace(limits, max_body=min(limits.max_body, claimed))
        self.tenancy.uploads[tenant.name] += claimed
        try:
            return await self.staging.receive_body(raw.chunks, limits, raw.content_length,
                                                   held_elsewhere=held)
        finally:
            self.tenancy.uploads[tenant.name] -= claimed

    def _leases(self) -> dict:
        """The open shm leases (lease id -> what it holds), for the tenants' ledger."""
        return getattr(self.contexts.get("shm") and self.contexts["shm"].state, "pending", {})

    async def retire_name(self, body: dict, caller: Caller = OPERATOR) -> dict:
        """Takes every version of a name out of service at once (the name no longer counts
        against LORA_SYNC_MAX_NAMES); running requests finish on their version."""
        name = naming.check_name(body.get("lora_name"))
        self.tenancy.check(caller, name)
        async with self._locks.hold(name):
            versions = self.book.forget(name)
            if not versions:
                raise hide(name)  # the reply a name outside the caller's scope gets
            self._retire(name, versions)
            self.retired_names[name] = None
            while len(self.retired_names) > RETIRED_NAMES_KEPT:
                # its version floor goes with it: both are bounded by the same count
                self.book.floors.pop(self.retired_names.popitem(last=False)[0], None)
        draining = sorted(r.version for r in self.records.values() if r.name == name)
        return {"lora_name": name, "retired": versions, "draining": draining}

    # -- admission (see admission.py) -------------------------------------------------
    def admit(self, requested: str, caller: Caller = OPERATOR) -> AdapterRecord | None:
        """The record a generation request naming `requested` will use (counted in flight),
        or None when the name is not ours. A retired or unknown version of one of our names,
        or a retired name, raises NotFound: never another model. With tenants, a name in a
        tenant's scope is answered here whatever it is: served if `caller` may generate on
        it, else the reply a name that is not served gets (hide), there or not; so is a name
        of ours outside every scope to a key that may not generate on it (generate = "base")."""
        name, version = naming.split_versioned(requested)
        if self.tenancy.enabled:
            scoped = self.tenancy.owner_of(name) is not None
            if not self.tenancy.may_generate(caller, name) and \
                    (scoped or name in self._names() or name in self.retired_names):
                raise hide(requested, "model")
            if scoped and self.book.alias(name) is None and name not in self.retired_names \
                    and requested not in self.records:
                raise hide(requested, "model")  # ours to answer: never the engine's guess
        if version is None:
            latest = self.book.alias(requested)
            if latest is None:
                if requested in self.retired_names:
                    raise NotFound(f"{requested} was retired", code="version_retired")
                return None
            rec = self.records[naming.versioned(requested, latest)]
        else:
            if name not in self._names() and name not in self.retired_names:
                return None
            rec = self.records.get(requested)
            if rec is None or rec.retired:
                available = [naming.versioned(name, v) for v in self.book.versions.get(name, [])]
                raise NotFound(f"{requested} is not servable (retired or never loaded); "
                               f"versions available: {available}", code="version_retired")
        rec.inflight += 1
        metrics.state_changed()
        return rec

    def finish_request(self, served_name: str) -> None:
        rec = self.records.get(served_name)
        if rec is None:
            return
        rec.inflight -= 1
        metrics.state_changed()
        if rec.retired and rec.inflight == 0:
            self._free_when_idle(rec)

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
            freed = await self._free_engine_copies([rec.adapter_id])
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

    async def _free_engine_copies(self, adapter_ids: list[int]) -> bool:
        try:
            await self.bridge.free(adapter_ids)
            return True
        except Exception:  # best effort: nothing was published for these ids
            return False

    def _retire(self, name: str, versions: list[int], by_push: bool = False) -> None:
        """Never waits for generation: idle versions go now, busy ones when their last
        request finishes (see `finish_request`). `by_push`: a push retired them, and the
        requests on its new version come first (_requests_pause); a name retired whole
        has none to wait for."""
        for v in versions:
            rec = self.records.get(naming.versioned(name, v))
            if rec is not None:
                rec.retired = True
                if rec.inflight == 0:
                    self._free_when_idle(rec, by_push)
        metrics.state_changed()

    async def info(self, caller: Caller = OPERATOR) -> dict:
        """What a trainer needs before it broadcasts: worker count and the model's limits,
        so it can refuse a bad adapter before any collective call. A tenant sees its own
        groups, leases, quotas and their use, nothing of the others'."""
        spec = await self.model_spec()
        status = await self.workers.status()
        info = {"instance_id": self.instance_id, "workers": len(status),
                "worker_status": status, **spec.info(),
                "model_unsupported": await self.model_unsupported(status),
                "keep_versions": self.settings.keep_versions,
                "max_body_bytes": self.settings.max_body_bytes,
                "max_names": self.settings.max_names,
                "staged_bodies": dict(self.staging.landed),
                **{k: v for n, t in TRANSPORTS.items()
                   for k, v in t.info(self.contexts[n].state).items()}}
        tenant = caller.tenant
        if tenant is None:
            return info
        q = tenant.quotas
        return {**info, "keep_versions": q.keep_versions, "max_names": q.names,
                "max_body_bytes": min(self.settings.max_body_bytes, q.staging_bytes),
                "worker_status": [{"rank": w.get("rank"), "world_size": w.get("world_size"),
                                   "groups": [g for g in w.get("groups", [])
                                              if tenant.covers(g)]} for w in status],
                "staged_bodies": {}, "open_leases": len(self._tenant_leases(tenant)),
                "tenant": {"name": tenant.name, "prefix": tenant.prefix,
                           "names": sorted(tenant.names), "generate": tenant.generate,
                           "quotas": dataclasses.asdict(q), "usage": self.usage(tenant)}}

    def usage(self, tenant) -> dict:
        """What a tenant holds now, quota by quota (the info reply and the metrics)."""
        groups = self.contexts["broadcast"].state.tokens if "broadcast" in self.contexts else {}
        return {"names": sum(1 for n in self.book.names() if tenant.covers(n)),
                "staging_bytes": self.tenancy.staged_bytes(tenant, self._leases()),
                "leases": len(self._tenant_leases(tenant)),
                "groups": sum(1 for g in groups if tenant.covers(g)),
                "pushes_per_minute": len(self.tenancy.pushes.get(tenant.name, ()))}

    def _tenant_leases(self, tenant) -> list[str]:
        return self.tenancy.open_leases(tenant, self._leases())

    # -- the tenants' gate: what a request may do before its transport runs ---------------
    def gate(self, caller: Caller, request, ctx: ServerContext, pushes: bool = False) -> None:
        """A tenant's request on a transport route, checked before anything is staged: the
        names it carries against its scope, the lease it redeems against its own, and
        (`pushes`: the request starts a push) its push rate. Leases and groups are checked
        where they are made (`tenant_call`). The operator passes; no tenants: nothing."""
        if caller.tenant is None:
            return
        for attr, what in (("lora_name", "adapter"), ("group_name", "group")):
            value = getattr(request, attr, None)
            if isinstance(value, str):
                if what == "group" and opens(request) == "group":
                    self.tenancy.check_new_group(caller, value)
                self.tenancy.check(caller, value, what)
        lease_id = getattr(request, "lease_id", None)
        if lease_id is not None and lease_id not in self._tenant_leases(caller.tenant):
            raise NotFound("no open lease with this id: it expired, was committed or "
                           "cancelled, or was never granted", code="unknown_lease")
        if pushes:
            self.tenancy.count_push(caller)

    async def tenant_call(self, handler, request, ctx: ServerContext, caller: Caller):
        """A transport route that is not a push (a lease, a group's set-up or end), for
        `caller`: its quotas on leases, staging bytes and groups are checked under one lock
        per tenant (two requests of one tenant cannot both take its last lease), and what
        it gets is written down as its own."""
        opened = opens(request)  # a push's first step (shm's lease, broadcast's group)
        is_lease = opened == "lease"
        if opened is not None:
            await self.refuse_if_unsupported()
        self.gate(caller, request, ctx, pushes=is_lease)
        tenant = caller.tenant
        if tenant is None or opened is None:
            return await handler(request, ctx)
        async with self._locks.hold(f"tenant:{tenant.name}"):  # ':' is in no adapter name
            if is_lease:
                held = self._tenant_leases(tenant)
                if len(held) >= tenant.quotas.leases:
                    raise TooBusy(f"tenant {tenant.name!r} has {len(held)} open leases (its "
                                  "max_leases quota); commit or cancel one first",
                                  code="quota_leases")
                self.tenancy.check_staging(tenant, self._leases(), request.nbytes)
                reply = await handler(request, ctx)
                self.tenancy.leases[reply["lease_id"]] = tenant.name
                return reply
            status = await self.workers.status()  # set-ups still timing out count too
            held = [g for g in status[0].get("groups", []) if tenant.covers(g)]
            if len(held) >= tenant.quotas.groups:
                raise TooBusy(f"tenant {tenant.name!r} has {len(held)} update groups (its "
                              "max_groups quota); destroy one first", code="quota_groups")
            return await handler(request, ctx)

    # -- the alias: rollback and pinning ---------------------------------------------------
    async def point_alias(self, body: dict, caller: Caller = OPERATOR) -> dict:
        """Points a name's alias at one of its retained versions (a rollback), at once for
        every request admitted after it; requests admitted before finish on the version
        they got. `pin`: pushes leave it there (and keep that version) until it is pointed
        again; `version` null: back to following the newest version."""
        name = naming.check_name(body.get("lora_name"))
        raw = body.get("version")
        version = None if raw is None else naming.parse_version(raw)
        pin = body.get("pin", False)
        if not isinstance(pin, bool):
            raise BadRequest("pin must be true or false", code="bad_request")
        self.tenancy.check(caller, name)
        async with self._locks.hold(name):
            if self.book.latest(name) is None:
                raise hide(name)
            try:
                target = self.book.point(name, version, pin and version is not None)
            except KeyError:
                raise NotFound(f"{naming.versioned(name, version)} is not a retained version; "
                               f"versions available: {self.book.versions.get(name, [])}",
                               code="version_retired") from None
            metrics.state_changed()
        return {"lora_name": name, "version": target,
                "alias_target": naming.versioned(name, target),
                "pinned": name in self.book.pinned}

    def list_adapters(self, caller: Caller = OPERATOR) -> dict:
        """Per name: its servable versions (and retired ones requests still run on), the
        alias target, requests in flight, and the versions still being freed. A tenant
        sees its own names only."""
        out = {}
        for rec in self.records.values():
            if not self.tenancy.sees(caller, rec.name):
                continue
            entry = out.setdefault(rec.name, {"name": rec.name, "alias_target": None,
                                              "versions": [], "inflight": 0, "draining": []})
            if rec.retired:
                entry["draining"].append(rec.served_name)
            if not rec.retired or rec.inflight:
                # paths and leases stay inside (asdict would deep-copy the hold too)
                entry["versions"].append({f.name: getattr(rec, f.name) for f in fields(rec)
                                          if f.name != "hold"})
            target = self.book.alias(rec.name)
            entry["alias_target"] = naming.versioned(rec.name, target) if target else None
            entry["pinned"] = rec.name in self.book.pinned
            entry["inflight"] += rec.inflight
        keep = caller.tenant.quotas.keep_versions if caller.tenant is not None \
            else self.settings.keep_versions
        return {"adapters": list(out.values()), "keep_versions": keep}

