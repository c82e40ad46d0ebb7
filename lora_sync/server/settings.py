"""Every operator setting of a lora-sync server, in one table: its environment variable, type,
default and range. Read once, at start-up, in the API process (`Settings.from_env`); a value
out of range stops the server with a message naming the variable. Workers get what they
need in each request, never from the environment. docs/operations.md lists the same table
(a test keeps the two alike)."""
from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass

from ..api import API_KEY_ENV  # noqa: F401 - the operator's key, named once (lora_sync/api.py)
from .. import full_gc
from ..staging import BodyLimits

MB = 2 ** 20


@dataclass(frozen=True)
class Setting:
    env: str
    field: str
    kind: type            # int, float, bool, str or tuple (comma-separated)
    default: object
    lo: float | None = None
    hi: float | None = None
    scale: int = 1        # the variable's unit in the field's (MB -> bytes)
    doc: str = ""


SETTINGS = (
    Setting("LORA_SYNC_API_KEY", "api_key", str, None,
            doc="the admin key of lora-sync's routes and the engine's adapter routes"),
    Setting("LORA_SYNC_KEEP_VERSIONS", "keep_versions", int, 2, 1, 1000,
            doc="newest versions kept servable per name"),
    Setting("LORA_SYNC_MAX_NAMES", "max_names", int, 64, 1, 100_000,
            doc="adapter names a server holds at once"),
    Setting("LORA_SYNC_MAX_BODY_MB", "max_body_bytes", int, 2048, 1e-3, 1 << 20, MB,
            doc="bytes of one pushed adapter"),
    Setting("LORA_SYNC_MAX_STAGING_MB", "max_staging_bytes", int, 4096, 1e-3, 1 << 20, MB,
            doc="bytes of uploads in flight and open shm leases together"),
    Setting("LORA_SYNC_BODY_IDLE_S", "body_idle_s", float, 10.0, 0.1, 3600,
            doc="longest pause in an upload before it is dropped (408)"),
    Setting("LORA_SYNC_MIN_BODY_MBPS", "min_body_rate", float, 1.0, 1e-3, 1 << 20, MB,
            doc="slowest average upload rate after a 10 s grace (408 below it)"),
    Setting("LORA_SYNC_MAX_REQUEST_MB", "max_request_bytes", int, 32, 1e-3, 1 << 14, MB,
            doc="bytes of a JSON request body (generation bodies admission reads included)"),
    Setting("LORA_SYNC_ALLOWED_TRAINERS", "allowed_trainers", tuple,
            ("127.0.0.0/8", "::1/128"),
            doc="addresses or networks a broadcast group's trainer may be at"),
    Setting("LORA_SYNC_MAX_GROUPS", "max_groups", int, 8, 1, 64,
            doc="broadcast groups a server holds at once, pending set-ups included"),
    Setting("LORA_SYNC_MAX_LEASES", "max_leases", int, 8, 1, 256,
            doc="open shm leases a server holds at once"),
    Setting("LORA_SYNC_LEASE_TTL_S", "lease_ttl_s", float, 30.0, 0.1, 3600,
            doc="an shm lease not committed or renewed by then is freed"),
    Setting("LORA_SYNC_CHECK_FINITE", "check_finite", bool, False,
            doc="refuse NaN/Inf weights (a full pass over the weights at each push)"),
    Setting("LORA_SYNC_SOCKET_BODY", "socket_body", bool, True,
            doc="read pushed bodies from the socket instead of through uvicorn"),
    Setting("LORA_SYNC_SHM_DIR", "shm_dir", str, "/dev/shm",
            doc="where the API process makes its private staging directory (a tmpfs)"),
    Setting("LORA_SYNC_TENANTS", "tenants_file", str, None,
            doc="a TOML file of tenants: per-tenant keys, name scopes and quotas"),
)
BY_ENV = {s.env: s for s in SETTINGS}


def _parse(setting: Setting, raw: str):
    """The variable's value as the field's type, or a RuntimeError naming it."""
    def bad(why: str):
        return RuntimeError(f"lora-sync setting {setting.env}={raw[:80]!r} {why}")
    if setting.kind is str:
        return raw
    if setting.kind is bool:
        if raw not in ("0", "1"):
            raise bad("must be 0 or 1")
        return raw == "1"
    if setting.kind is tuple:
        items = tuple(t.strip() for t in raw.split(",") if t.strip())
        for net in items:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise bad(f"lists {net[:60]!r}, which is not an address or network") from None
        return items
    try:
        value = float(raw) if setting.scale != 1 or setting.kind is float else int(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not setting.lo <= value <= setting.hi:
        raise bad(f"must be a{'n integer' if setting.kind is int and setting.scale == 1 else ' number'}"
                  f" in [{setting.lo:g}, {setting.hi:g}]")
    return setting.kind(value * setting.scale)


@dataclass
class Settings:
    """The server's settings (`SETTINGS` says what each is), plus two facts of the engine."""
    api_key: str | None = None
    keep_versions: int = 2
    max_names: int = 64
    max_body_bytes: int = 2048 * MB
    max_staging_bytes: int = 4096 * MB
    body_idle_s: float = 10.0
    min_body_rate: float = 1.0 * MB   # bytes/s
    max_request_bytes: int = 32 * MB
    allowed_trainers: tuple = ("127.0.0.0/8", "::1/128")
    max_groups: int = 8
    max_leases: int = 8
    lease_ttl_s: float = 30.0
    check_finite: bool = False
    socket_body: bool = True
    shm_dir: str = "/dev/shm"
    tenants_file: str | None = None
    tenants: tuple = ()              # tenants.Tenant, read from tenants_file at start-up
    engine_has_key: bool = False     # the engine guards generation with its own key
    generation_keys: tuple = ()      # the engine's keys (for routes its middleware skips)

    @classmethod
    def from_env(cls, engine_has_key: bool = False,
                 engine_admin_key: str | None = None) -> "Settings":
        """`engine_admin_key`: the engine's own admin key, which is then ours too (SGLang's
        --admin-api-key; it must equal LORA_SYNC_API_KEY when both are set)."""
        values = {}
        for setting in SETTINGS:
            raw = os.environ.get(setting.env)
            if raw not in (None, ""):
                values[setting.field] = _parse(setting, raw)
        settings = cls(**values, engine_has_key=engine_has_key)
        if settings.api_key is None:
            settings.api_key = engine_admin_key
        if settings.tenants_file is not None:
            from .tenants import check_fits, load_tenants
            if settings.api_key is None:  # else anyone would be the operator
                raise RuntimeError("lora-sync setting LORA_SYNC_TENANTS needs "
                                   "LORA_SYNC_API_KEY, the operator's key")
            settings.tenants = load_tenants(settings.tenants_file, settings.api_key)
            check_fits(settings.tenants_file, settings.tenants, settings)
        if settings.socket_body:
            from .socket_body import check
            check()  # fails at start-up on a uvicorn we did not check
        full_gc.mode()  # LORA_SYNC_FULL_GC: a value it does not know fails at start-up
        return settings

    @property
    def body_limits(self) -> BodyLimits:
        return BodyLimits(self.max_body_bytes, self.max_staging_bytes, self.body_idle_s,
                          self.min_body_rate)


def read(env: str):
    """One setting, typed and checked, for code that needs it before the server's Settings
    exist (a launcher, a middleware attached first); None when unset."""
    setting, raw = BY_ENV[env], os.environ.get(env)
    return None if raw in (None, "") else _parse(setting, raw)
