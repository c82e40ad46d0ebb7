"""Who a request is and what it may do and hold: the admin key, the engine's keys, the
tenants' scopes, and their quotas on staging bytes, leases, groups and push rate (the names
quota is checked where a version is reserved, `Registry.reserve`)."""
from __future__ import annotations

import dataclasses
import hmac

from .. import naming
from ..errors import Forbidden, NotFound, TooBusy, Unauthorized
from ..staging import StagedBody, StagingArea
from ..transports import TRANSPORTS
from ..transports.base import RawBody, ServerContext
from .registry import Registry
from .settings import Settings
from .tenants import OPERATOR, Caller, Tenancy, hide


def opens(request) -> str | None:
    """What a transport request holds for its client once granted ("lease", "group"), if
    anything: the request class says so (LeaseRequest.opens, InitGroupRequest.opens)."""
    return getattr(type(request), "opens", None)


class Access:
    def __init__(self, settings: Settings, registry: Registry, staging: StagingArea,
                 states: dict):
        self.settings = settings
        self.tenancy = Tenancy(settings.tenants, settings.api_key)
        self._registry = registry
        self._staging = staging
        self._states = states  # transport name -> its server state (what tenants hold)

    # -- who -------------------------------------------------------------------------------
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
        if isinstance(name, str) and self._registry.owns(name):
            raise Forbidden(f"{name[:140]!r} is managed by lora-sync: push, retire and list it "
                            "with lora-sync's routes", code="reserved_name")

    def check_generate(self, requested: str, caller: Caller) -> None:
        """With tenants, a name in a tenant's scope is answered by lora-sync whatever it is:
        served if `caller` may generate on it, else the reply a name that is not served gets
        (hide), there or not; so is a name of ours outside every scope to a key that may not
        generate on it (generate = "base")."""
        if not self.tenancy.enabled:
            return
        name = naming.split_versioned(requested)[0]
        scoped = self.tenancy.owner_of(name) is not None
        reg = self._registry
        if not self.tenancy.may_generate(caller, name) and (scoped or reg.knows(name)):
            raise hide(requested, "model")
        if scoped and reg.book.alias(name) is None and name not in reg.retired_names \
                and requested not in reg.records:
            raise hide(requested, "model")  # ours to answer: never the engine's guess

    # -- what tenants hold -----------------------------------------------------------------
    def _leases(self) -> dict:
        """Every open lease, whichever transport holds it (lease id -> its staged body)."""
        return {i: held for n, t in TRANSPORTS.items()
                for i, held in t.leases(self._states[n]).items()}

    def tenant_leases(self, tenant) -> list[str]:
        return self.tenancy.open_leases(tenant, self._leases())

    def usage(self, tenant) -> dict:
        """What a tenant holds now, quota by quota (the info reply and the metrics)."""
        groups = [g for n, t in TRANSPORTS.items() for g in t.groups(self._states[n])]
        return {"names": sum(1 for n in self._registry.book.names() if tenant.covers(n)),
                "staging_bytes": self.tenancy.staged_bytes(tenant, self._leases()),
                "leases": len(self.tenant_leases(tenant)),
                "groups": sum(1 for g in groups if tenant.covers(g)),
                "pushes_per_minute": len(self.tenancy.pushes.get(tenant.name, ()))}

    # -- the tenants' gate: what a request may do before its transport runs ---------------
    def gate(self, caller: Caller, request, pushes: bool = False) -> None:
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
        if lease_id is not None and lease_id not in self.tenant_leases(caller.tenant):
            raise NotFound("no open lease with this id: it expired, was committed or "
                           "cancelled, or was never granted", code="unknown_lease")
        if pushes:
            self.tenancy.count_push(caller)

    async def tenant_call(self, handler, request, ctx: ServerContext, caller: Caller):
        """A transport route that is not a push (a lease, a group's set-up or end), for a
        tenant: its quotas on leases, staging bytes and groups are checked under one lock
        per tenant (two requests of one tenant cannot both take its last lease), and what
        it gets is written down as its own."""
        opened = opens(request)  # a push's first step (shm's lease, broadcast's group)
        self.gate(caller, request, pushes=opened == "lease")
        tenant = caller.tenant
        if tenant is None or opened is None:
            return await handler(request, ctx)
        async with self._registry.locks.hold(f"tenant:{tenant.name}"):  # ':' in no name
            if opened == "lease":
                leases = self._leases()
                held = self.tenancy.open_leases(tenant, leases)
                if len(held) >= tenant.quotas.leases:
                    raise TooBusy(f"tenant {tenant.name!r} has {len(held)} open leases (its "
                                  "max_leases quota); commit or cancel one first",
                                  code="quota_leases")
                self.tenancy.check_staging(tenant, leases, request.nbytes)
                reply = await handler(request, ctx)
                self.tenancy.leases[reply["lease_id"]] = tenant.name
                return reply
            status = await ctx.workers.status()  # set-ups still timing out count too
            held = [g for g in status[0].get("groups", []) if tenant.covers(g)]
            if len(held) >= tenant.quotas.groups:
                raise TooBusy(f"tenant {tenant.name!r} has {len(held)} update groups (its "
                              "max_groups quota); destroy one first", code="quota_groups")
            return await handler(request, ctx)

    async def receive_body(self, raw: RawBody, caller: Caller = OPERATOR) -> StagedBody:
        """Streams an upload into staging; uploads and open shm leases share one budget, and
        a tenant's share of it is bounded by its own quota as well."""
        held = sum(t.held_bytes(self._states[n]) for n, t in TRANSPORTS.items())
        tenant = caller.tenant
        if tenant is None:
            return await self._staging.receive_body(raw.chunks, self.settings.body_limits,
                                                    raw.content_length, held_elsewhere=held)
        # What the body may be: the tenant's quota less what it holds (a body without a
        # Content-Length is cut off there, as one above LORA_SYNC_MAX_BODY_MB would be).
        leases = self._leases()
        left = tenant.quotas.staging_bytes - self.tenancy.staged_bytes(tenant, leases)
        claimed = raw.content_length if raw.content_length is not None else max(left, 0)
        self.tenancy.check_staging(tenant, leases, max(claimed, 1))
        limits = self.settings.body_limits
        limits = dataclasses.replace(limits, max_body=min(limits.max_body, claimed))
        self.tenancy.uploads[tenant.name] += claimed
        try:
            return await self._staging.receive_body(raw.chunks, limits, raw.content_length,
                                                    held_elsewhere=held)
        finally:
            self.tenancy.uploads[tenant.name] -= claimed
