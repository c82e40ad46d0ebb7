"""The push flow, the same on both engines and every transport: stage, check, install
(reserve, the workers' intake, activate, publish), retire what falls out of the window; and
the admin routes' other answers (alias, retire, list, info). Who may do what is `Access`'s,
which versions exist and who uses them the `Registry`'s."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid

from .. import adapter_dir, full_gc, naming
from ..adapter import ModelSpec, check_adapter, check_finite, lora_weights
from ..errors import BadRequest, Conflict, LoRASyncError, NotFound
from ..messages import IntakeRequest, WorkerReply
from ..staging import StagingArea
from ..transports import TRANSPORTS
from ..transports.base import Route, ServerContext, Staged, Transport
from .access import Access, opens
from .bridge import EngineBridge
from .registry import AdapterRecord, Registry
from .settings import Settings
from .tenants import OPERATOR, Caller, hide
from . import metrics

logger = logging.getLogger("lora_sync")


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
        self._spec: ModelSpec | None = None
        self._unsupported: tuple[str | None] | None = None  # (reason,) once workers said
        self.registry = Registry(bridge)
        self.staging = StagingArea(root=self.settings.shm_dir, map_kept=self.settings.socket_body)
        self.workers = Workers(bridge)
        states = {name: t.new_state(self.settings) for name, t in TRANSPORTS.items()}
        self.access = Access(self.settings, self.registry, self.staging, states)
        # Per transport, what it may use: its own state between requests (shm: the open
        # leases; broadcast: the groups) and what the service lends it. A push gets its own
        # copy, whose uploads count against its caller (`push`).
        self.contexts = {name: ServerContext(self.settings, states[name], self.staging,
                                             self.workers, self.access.receive_body,
                                             self.registry.retired_freed)
                         for name in TRANSPORTS}

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

    # -- transport routes: a push, or a step that readies one ------------------------------
    async def transport_call(self, transport: Transport, route: Route, request,
                             caller: Caller = OPERATOR):
        """A request on one of `transport`'s routes: a push (`route.handler` None), or a
        step of one (a lease, a group), which the caller's quotas bound (Access)."""
        if route.handler is None:
            return await self.push(transport, request, caller)
        if opens(request) is not None:  # a push's first step (shm's lease, broadcast's group)
            await self.refuse_if_unsupported()
        return await self.access.tenant_call(route.handler, request,
                                             self.contexts[transport.name], caller)

    async def push(self, transport: Transport, request, caller: Caller = OPERATOR) -> dict:
        """stage (the transport) -> check -> install: reserve the version, the workers'
        intake, activate, publish, retire what falls out of the window. Any failure leaves
        the previous versions exactly as they were. `caller`: its quotas are checked before
        anything is staged, its scope once the name is known. Full collections wait until
        the push ends (full_gc); those that ran anyway are its `gc` time."""
        with full_gc.during_push(freeze=self.bridge.freezes_heap) as collections:
            reply = await self._push(transport, request, caller)
        reply["timings_ms"]["gc"] = collections.ms
        return reply

    async def _push(self, transport: Transport, request, caller: Caller) -> dict:
        t0 = time.perf_counter()
        ctx = dataclasses.replace(self.contexts[transport.name], receive_body=functools.partial(
            self.access.receive_body, caller=caller))
        await self.refuse_if_unsupported()
        self.access.gate(caller, request, pushes=transport.start_path is None)
        settle_ms = await self.registry.settle()
        staged = await transport.stage(request, ctx)
        kept = False
        try:
            self.access.tenancy.check(caller, staged.name)  # before the workers see a byte
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
        name, registry = staged.name, self.registry
        t_in = time.perf_counter()
        owner = self.access.tenancy.owner_of(name)  # its quotas hold whoever pushes
        async with registry.locks.hold(name):
            version = registry.reserve(name, staged.version, self.settings.max_names, owner)
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
                registry.book.unreserve(name, version)
                await asyncio.shield(registry.free_engine_copies([adapter_id]))
                raise
            t3 = time.perf_counter()
            # The engine's table gets the version only; the alias lives here and admission
            # resolves it, so no engine route can use it uncounted.
            self.bridge.publish(served, handle)
            keep = owner.quotas.keep_versions if owner is not None else \
                self.settings.keep_versions
            rec = AdapterRecord(name, version, served, adapter_id, staged.nbytes,
                                int(cfg["r"]), transport, (t3 - t0) * 1e3, hold=staged.hold,
                                handle=handle)
            registry.add(rec, keep)
            metrics.state_changed()
        return {"name": served, "lora_name": name, "version": version, "bytes": staged.nbytes,
                "load_ms": rec.load_ms, "transport": transport,
                "timings_ms": {**slowest.data.get("timings_ms", {}),
                               "wait": (t1 - t_in) * 1e3, "worker": worker_ms,
                               "handoff": (t2 - t1) * 1e3 - worker_ms,
                               "register": (t3 - t2) * 1e3}}

    # -- generation: admission's questions -------------------------------------------------
    def admit(self, requested: str, caller: Caller = OPERATOR) -> AdapterRecord | None:
        """The record a generation request naming `requested` will use (counted in flight
        until `registry.release`), or None when the name is not ours; a name the caller may
        not generate on gets the reply an unknown model gets (Access.check_generate)."""
        self.access.check_generate(requested, caller)
        return self.registry.acquire(requested)

    @contextlib.asynccontextmanager
    async def using(self, requested: str, caller: Caller = OPERATOR):
        """Generation that does not come through HTTP (a framework's Ray method calling the
        engine itself): the version `requested` (an alias or `name-vN`) serves now, with
        the engine's request for it (`.handle`), counted in flight until the block ends so
        it is never freed under the request. A name that is not one of ours, or not the
        caller's to generate on, raises NotFound."""
        rec = self.admit(requested, caller)
        if rec is None:
            raise hide(requested, "model")
        try:
            yield rec
        finally:
            self.registry.release(rec.served_name)

    # -- the admin routes' other answers ---------------------------------------------------
    async def retire_name(self, body: dict, caller: Caller = OPERATOR) -> dict:
        """Takes every version of a name out of service at once (the name no longer counts
        against LORA_SYNC_MAX_NAMES); running requests finish on their version."""
        name = naming.check_name(body.get("lora_name"))
        self.access.tenancy.check(caller, name)
        async with self.registry.locks.hold(name):
            versions = self.registry.retire_name(name)
            if not versions:
                raise hide(name)  # the reply a name outside the caller's scope gets
        draining = sorted(r.version for r in self.registry.records.values() if r.name == name)
        return {"lora_name": name, "retired": versions, "draining": draining}

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
                "staged_bodies": {}, "open_leases": len(self.access.tenant_leases(tenant)),
                "tenant": {"name": tenant.name, "prefix": tenant.prefix,
                           "names": sorted(tenant.names), "generate": tenant.generate,
                           "quotas": dataclasses.asdict(q), "usage": self.access.usage(tenant)}}

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
        self.access.tenancy.check(caller, name)
        book = self.registry.book
        async with self.registry.locks.hold(name):
            if book.latest(name) is None:
                raise hide(name)
            try:
                target = book.point(name, version, pin and version is not None)
            except KeyError:
                raise NotFound(f"{naming.versioned(name, version)} is not a retained version; "
                               f"versions available: {book.versions.get(name, [])}",
                               code="version_retired") from None
            metrics.state_changed()
        return {"lora_name": name, "version": target,
                "alias_target": naming.versioned(name, target),
                "pinned": name in book.pinned}

    def list_adapters(self, caller: Caller = OPERATOR) -> dict:
        """Per name: its servable versions (and retired ones requests still run on), the
        alias target, requests in flight, and the versions still being freed. A tenant
        sees its own names only."""
        out = self.registry.listing(lambda name: self.access.tenancy.sees(caller, name))
        keep = caller.tenant.quotas.keep_versions if caller.tenant is not None \
            else self.settings.keep_versions
        return {"adapters": list(out.values()), "keep_versions": keep}
