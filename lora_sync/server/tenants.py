"""Tenants: several training runs sharing one server, each with its own key, name scope and
quotas (docs/operations.md, "Shared servers"). Configured once, at start-up, from the TOML
file LORA_SYNC_TENANTS names; without one, nothing here changes anything.

  load_tenants   the file, checked whole: a bad one stops the server naming the line/tenant
  Tenancy        who a request's key is (`resolve`, the one function every route and
                 admission call), which names it owns and may see or generate on, and the
                 per-tenant ledger its quotas are checked against

A tenant's names are those its scope covers (a prefix such as "alice-", and/or a list of
exact names); the operator (LORA_SYNC_API_KEY) is over everything. A name outside a
caller's scope is answered exactly as a name that does not exist (`hide`): one code path,
one reply, so a tenant cannot probe another's names.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import re
import time
import tomllib
from dataclasses import dataclass, field

from ..errors import BadRequest, NotFound, TooBusy

MB = 2 ** 20
GENERATE_LEVELS = ("base", "own", "all")
# A prefix ends in a separator so that "alice-" never covers "alice2-..." by accident.
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}[._-]")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX = re.compile(r"[0-9a-f]{64}")
RATE_WINDOW_S = 60.0
# The tenants file's quota keys: key -> (Quotas field, the file's unit in the field's). The
# defaults are Quotas' own.
QUOTA_KEYS = {"max_names": ("names", 1), "keep_versions": ("keep_versions", 1),
              "max_staging_mb": ("staging_bytes", MB), "max_leases": ("leases", 1),
              "max_groups": ("groups", 1), "pushes_per_minute": ("pushes_per_minute", 1)}
TENANT_KEYS = {"key_sha256", "prefix", "names", "generate", *QUOTA_KEYS}


@dataclass(frozen=True)
class Quotas:
    names: int = 8
    keep_versions: int = 2
    staging_bytes: int = 512 * MB
    leases: int = 2
    groups: int = 1
    pushes_per_minute: int = 120


DEFAULT_QUOTAS = Quotas()


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: bytes = field(repr=False)
    prefix: str | None
    names: frozenset
    quotas: Quotas
    # base: the base model alone; own: + its names and the unscoped ones; all: + every name
    generate: str = "own"

    def covers(self, name: str) -> bool:
        """Letter case aside: a case variant of a tenant's name is that tenant's too (the
        engine's routes compare names without case; names are ASCII)."""
        folded = name.casefold()
        return folded in {n.casefold() for n in self.names} or \
            (self.prefix is not None and folded.startswith(self.prefix.casefold()))

    def scope_words(self) -> str:
        return " or ".join(([f"names starting with {self.prefix!r}"] if self.prefix else []) +
                           ([f"the names {sorted(self.names)}"] if self.names else []))


@dataclass(frozen=True)
class Caller:
    """Who a request is: the operator, a tenant, or nobody we know (no key, a wrong one, the
    engine's own generation key)."""
    kind: str                 # operator | tenant | anonymous
    tenant: Tenant | None = None

    @property
    def label(self) -> str:
        return self.tenant.name if self.tenant is not None else self.kind


OPERATOR = Caller("operator")
ANONYMOUS = Caller("anonymous")


def _bad(path: str, why: str) -> RuntimeError:
    return RuntimeError(f"lora-sync setting LORA_SYNC_TENANTS={path!r}: {why}")


def load_tenants(path: str, api_key: str | None = None) -> tuple[Tenant, ...]:
    """The tenants file, every rule checked; RuntimeError naming the line or tenant."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)  # duplicate keys or tables: an error naming the line
    except OSError as e:
        raise _bad(path, f"cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise _bad(path, f"is not valid TOML: {e}") from None
    if set(data) != {"tenants"} or not isinstance(data["tenants"], dict) or not data["tenants"]:
        raise _bad(path, "must hold one [tenants.<name>] table per tenant, and nothing else")
    tenants = [_tenant(path, name, spec) for name, spec in data["tenants"].items()]
    _check_apart(path, tenants, api_key)
    return tuple(tenants)


def _tenant(path: str, name: str, spec) -> Tenant:
    where = f"tenant {name!r}"
    if not _NAME.fullmatch(name):
        raise _bad(path, f"{where}: a tenant name is 1-128 ASCII letters, digits, '.', '_', '-'")
    if not isinstance(spec, dict):
        raise _bad(path, f"{where} must be a table")
    unknown = set(spec) - TENANT_KEYS
    if unknown:
        raise _bad(path, f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(TENANT_KEYS)}")
    key_hex = spec.get("key_sha256")
    if not isinstance(key_hex, str) or not _HEX.fullmatch(key_hex):
        raise _bad(path, f"{where}: key_sha256 must be the 64 lowercase hex digits of "
                   "sha256(key) (printf %s KEY | sha256sum)")
    prefix = spec.get("prefix")
    if prefix is not None and (not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix)):
        raise _bad(path, f"{where}: prefix {prefix!r} must be 2-64 name characters ending in "
                   "'-', '_' or '.' (an empty prefix would cover every name)")
    names = spec.get("names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and _NAME.fullmatch(n)
                                              for n in names):
        raise _bad(path, f"{where}: names must be a list of adapter names")
    if prefix is None and not names:
        raise _bad(path, f"{where} has no scope: give it a prefix and/or names")
    generate = spec.get("generate", "own")
    if generate not in GENERATE_LEVELS:
        raise _bad(path, f"{where}: generate must be one of {GENERATE_LEVELS}")
    quotas = {}
    for key, (attr, scale) in QUOTA_KEYS.items():
        default = getattr(DEFAULT_QUOTAS, attr)
        value = spec.get(key, default // scale)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 1e9 \
                or (scale == 1 and not isinstance(value, int)):
            raise _bad(path, f"{where}: {key} must be a{'n integer' if scale == 1 else ' number'}"
                       " in [1, 1e9]")
        quotas[attr] = int(value * scale)
    return Tenant(name, bytes.fromhex(key_hex), prefix, frozenset(names), Quotas(**quotas),
                  generate)


def _check_apart(path: str, tenants: list[Tenant], api_key: str | None) -> None:
    """No two tenants share a key (or the operator's), and no name is in two scopes (letter
    case aside: the engine's routes compare names without it)."""
    keys = {}
    if api_key:
        keys[hashlib.sha256(api_key.encode()).digest()] = "the operator (LORA_SYNC_API_KEY)"
    for t in tenants:
        if t.key_sha256 in keys:
            raise _bad(path, f"tenant {t.name!r} has the same key as {keys[t.key_sha256]}")
        keys[t.key_sha256] = f"tenant {t.name!r}"
    for i, a in enumerate(tenants):
        for b in tenants[i + 1:]:
            for x, y in ((a, b), (b, a)):
                clash = _overlap(x, y)
                if clash:
                    raise _bad(path, f"the scopes of tenants {x.name!r} and {y.name!r} "
                               f"overlap ({clash}): a name must have one owner")


def _overlap(a: Tenant, b: Tenant) -> str | None:
    fold = str.casefold
    if a.prefix and b.prefix and fold(b.prefix).startswith(fold(a.prefix)):
        return f"prefix {a.prefix!r} covers prefix {b.prefix!r}"
    for n in b.names:
        if (a.prefix and fold(n).startswith(fold(a.prefix))) or \
                fold(n) in {fold(m) for m in a.names}:
            return f"name {n!r}"
    return None


# Each per-tenant quota that has a server total: the Settings field of the total. The
# quotas must fit in it, so no tenant can take what another's quota promises.
TOTALS = {"names": "max_names", "staging_bytes": "max_staging_bytes", "leases": "max_leases",
          "groups": "max_groups"}


def check_fits(path: str, tenants: tuple[Tenant, ...], settings) -> None:
    for quota, total in TOTALS.items():
        used = sum(getattr(t.quotas, quota) for t in tenants)
        if used > getattr(settings, total):
            raise _bad(path, f"the tenants' {quota} quotas add up to {used}, above the "
                       f"server's total ({total} = {getattr(settings, total)}): one tenant "
                       "could then take what another's quota promises")
    for t in tenants:
        if t.quotas.keep_versions > settings.keep_versions:
            raise _bad(path, f"tenant {t.name!r}: keep_versions {t.quotas.keep_versions} is "
                       f"above LORA_SYNC_KEEP_VERSIONS ({settings.keep_versions})")


class Tenancy:
    """The server's tenants and what they hold. `enabled` False (no tenants file): everyone
    with the operator key is the operator, as before tenants existed."""

    def __init__(self, tenants: tuple[Tenant, ...] = (), api_key: str | None = None):
        self.tenants = {t.name: t for t in tenants}
        self.enabled = bool(tenants)
        self._api_key = api_key
        # The ledger: what each tenant holds now, keyed by the authenticated tenant only.
        self.leases: dict[str, str] = {}           # shm lease id -> tenant
        self.uploads: collections.Counter = collections.Counter()  # tenant -> bytes in flight
        self.pushes: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    # -- who ---------------------------------------------------------------------------
    def resolve(self, authorization: str | None) -> Caller:
        """The caller a request's `Authorization: Bearer <key>` names. Every key is compared,
        each in constant time, whichever matches: the time says nothing about which."""
        given = authorization or ""
        token = given[7:] if given[:7].lower() == "bearer " else None
        found = ANONYMOUS
        if self._api_key is not None and hmac.compare_digest(given.encode(),
                                                             f"Bearer {self._api_key}".encode()):
            found = OPERATOR
        digest = hashlib.sha256((token or "").encode("utf-8", "surrogateescape")).digest()
        for t in self.tenants.values():
            if hmac.compare_digest(digest, t.key_sha256) and token is not None:
                found = Caller("tenant", t)
        return found

    def owner_of(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants.values() if t.covers(name)), None)

    def sees(self, caller: Caller, name: str) -> bool:
        """Whether `caller` may create, read, retire or roll back `name`."""
        if not self.enabled or caller.kind == "operator":
            return True
        return caller.tenant is not None and caller.tenant.covers(name)

    def may_generate(self, caller: Caller, name: str) -> bool:
        """Whether `caller` may generate with adapter `name`, ours or one the engine loaded
        itself (the base model is the engine's business). Names outside every scope are the
        operator's, served as before tenants to every key but a `generate = "base"` one:
        base means the base model only, own adds its names, all every adapter."""
        if not self.enabled or caller.kind == "operator":
            return True
        owner = self.owner_of(name)
        if caller.tenant is None:
            return owner is None
        level = caller.tenant.generate
        return level == "all" or (level == "own" and owner in (None, caller.tenant))

    def check(self, caller: Caller, name: str, what: str = "adapter") -> None:
        """A name the caller may not see: the very reply a name that does not exist gets."""
        if not self.sees(caller, name):
            raise hide(name, what)

    def check_new_group(self, caller: Caller, name: str) -> None:
        """A group a tenant sets up is named in its scope; a name outside it gets a refusal
        that names the caller's own scope, the same whether such a group exists or not."""
        t = caller.tenant
        if t is not None and not t.covers(name):
            raise BadRequest(f"group {name!r} is outside tenant {t.name!r}'s scope: name its "
                             f"groups in it ({t.scope_words()}); init_group() does so by "
                             "default", code="no_group")

    # -- quotas ------------------------------------------------------------------------
    def count_push(self, caller: Caller) -> None:
        """Pushes per minute: a push beyond the tenant's rate is refused before anything is
        staged (429 quota_pushes); counted when it starts."""
        t = caller.tenant
        if t is None:
            return
        times, now = self.pushes[t.name], time.monotonic()
        while times and times[0] <= now - RATE_WINDOW_S:
            times.popleft()
        if len(times) >= t.quotas.pushes_per_minute:
            raise TooBusy(f"tenant {t.name!r} made {len(times)} pushes in the last minute "
                          f"(its pushes_per_minute quota); retry in "
                          f"{times[0] + RATE_WINDOW_S - now:.0f} s", code="quota_pushes")
        times.append(now)

    def open_leases(self, tenant: Tenant, pending: dict) -> list[str]:
        """The tenant's leases still open (expired, committed, cancelled ones drop out)."""
        for lease_id in [i for i in self.leases if i not in pending]:
            del self.leases[lease_id]
        return [i for i, owner in self.leases.items() if owner == tenant.name]

    def staged_bytes(self, tenant: Tenant, pending: dict) -> int:
        """Bytes the tenant holds in staging: its uploads in flight and its open leases."""
        return self.uploads[tenant.name] + sum(pending[i].nbytes
                                               for i in self.open_leases(tenant, pending))

    def check_staging(self, tenant: Tenant, pending: dict, nbytes: int) -> None:
        held = self.staged_bytes(tenant, pending)
        if held + nbytes > tenant.quotas.staging_bytes:
            raise TooBusy(f"tenant {tenant.name!r} holds {held} bytes in staging; {nbytes} more "
                          f"would pass its max_staging_mb quota ({tenant.quotas.staging_bytes} "
                          "bytes)", code="quota_staging")


def hide(name: str, what: str = "adapter"):
    """What a name that is not there gets, and so a name that is not the caller's."""
    if what == "model":  # admission's reply for a model nobody serves (strict_models)
        return NotFound(f"model {name[:140]!r} is not served here (neither a model nor an "
                        "adapter of this server)", code="model_not_found")
    if what == "group":
        return BadRequest(f"no LoRA update group {name!r} on this server; call "
                          "init_lora_update_group first", code="no_group")
    return NotFound(f"no adapter named {name!r}", code="not_found")
