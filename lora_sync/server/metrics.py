"""Prometheus metrics and the one-line push log, served by the engine's own `/metrics`.

Engine-agnostic: only prometheus_client, imported when a server starts its metrics
(`install`), never when this module is imported. SGLang switches prometheus_client to its
multiprocess mode through PROMETHEUS_MULTIPROC_DIR, which must be set before the library's
first import in the process; the plugins call `install` after the engine has set it.

Two kinds of metric (docs/metrics.md lists them all):
  * events -- pushes, bytes, failures, latency histograms: prometheus_client Counters and
    Histograms, updated when a route replies (`observe`). In multiprocess mode
    prometheus_client writes them to its per-process files; the engine's collector sums them.
  * state -- versions retained / draining per name, requests in flight per version, the
    alias target: read from the live services, so a version's series disappears when the
    version is freed (label cardinality stays bounded by LORA_SYNC_MAX_NAMES x versions held).
    Single-process registry (vLLM's one API server): a collector reads the state at every
    scrape. Multiprocess (SGLang --enable-metrics): prometheus_client cannot remove a
    series there, so the state is written as one snapshot file in PROMETHEUS_MULTIPROC_DIR,
    rewritten whole (then renamed over the old one) after each change; see `_Snapshot`.
"""
from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import sys
import tempfile
import time
import weakref

from .. import private_dir
from ..transports import TRANSPORTS

logger = logging.getLogger("lora_sync")

# Push phases (the reply's timings_ms, docs/protocol.md); any other key is not a label value.
PHASES = ("settle", "receive", "wait", "worker", "handoff", "register")
TRANSPORT_NAMES = tuple(TRANSPORTS)
# Seconds: a push of a small adapter takes milliseconds, a large broadcast seconds.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 60.0)
# Multiprocess mode: the state snapshot is rewritten at most this often (a rewrite is not
# free, and admission changes the state twice per generation request).
SNAPSHOT_INTERVAL_S = 0.1

# name, help, label names: the state gauges (the same on both registries).
STATE_GAUGES = (
    ("lora_sync_versions_retained",
     "Servable versions held per adapter name (the newest LORA_SYNC_KEEP_VERSIONS)", ("name",)),
    ("lora_sync_versions_draining",
     "Versions out of the window, not yet freed (finishing requests or being freed)",
     ("name",)),
    ("lora_sync_inflight_requests",
     "Admitted generation requests not yet finished, per adapter version",
     ("name", "version")),
    ("lora_sync_alias_version", "The version the alias <name> resolves to", ("name",)),
    ("lora_sync_tenant_quota_use",
     "What each tenant holds now, per quota (names, staging_bytes, leases, groups, "
     "pushes_per_minute)", ("tenant", "quota")),
    ("lora_sync_tenant_quota_limit", "Each tenant's quotas, from the tenants file",
     ("tenant", "quota")),
)

_services: "weakref.WeakSet" = weakref.WeakSet()   # the AdapterServices of this process
_metrics: "_Metrics | None" = None
_unavailable = False                                  # prometheus_client is not installed


def install(service) -> bool:
    """Starts lora-sync's metrics in this process (once) and adds `service`'s state to them;
    also makes sure the push log lines are written somewhere. False when prometheus_client
    is not installed (the log lines are still written)."""
    global _metrics, _unavailable
    _ensure_log_handler()
    _services.add(service)
    if _metrics is None and not _unavailable:
        try:
            _metrics = _Metrics()
        except ImportError:
            _unavailable = True
            logger.warning("prometheus_client is not installed: lora-sync metrics are off")
    state_changed()
    return _metrics is not None


def state_changed() -> None:
    """The service's bookkeeping calls this after a change the state gauges show (admit,
    finish, install, retire, free). Only the multiprocess snapshot needs telling; it is
    rewritten at most every SNAPSHOT_INTERVAL_S however many changes came."""
    snapshot = _metrics.snapshot if _metrics is not None else None
    if snapshot is not None:
        snapshot.schedule()


def observe(route: str, status: int, body: dict, seconds: float,
            transport: str | None = None, tenant: str | None = None) -> None:
    """Records a lora-sync route's reply. `transport`: the push this reply ends (a push
    route), or whose first step it refused (the shm lease); None for other routes.
    `tenant`: who asked, with tenants configured (a tenant's name, "operator"; bounded by
    the tenants file). Never raises: a metrics bug must not turn a push into an error."""
    try:
        error = body.get("error") if status != 200 else None
        code = error.get("code", "internal_error") if isinstance(error, dict) else None
        if transport is not None:
            _log_push(transport, status, code, body, seconds, error)
        if _metrics is not None:
            _metrics.observe(route, status, code, body, transport)
            if tenant is not None:
                _metrics.observe_tenant(tenant, status, code, body, transport)
    except Exception:
        logger.exception("lora-sync metrics: recording %s failed", route)


def state_samples():
    """(metric, help, label names, [(label values, value)]) for each state gauge, summed
    over this process's services (one in practice)."""
    retained, draining, inflight, alias, use, limit = {}, {}, {}, {}, {}, {}
    for service in list(_services):
        access = getattr(service, "access", None)  # (tests register stand-ins too)
        for tenant in (access.tenancy.tenants.values() if access is not None else ()):
            for quota, value in access.usage(tenant).items():
                use[(tenant.name, quota)] = value
                limit[(tenant.name, quota)] = getattr(tenant.quotas, quota)
        for rec in list(service.registry.records.values()):
            key = (rec.name,)
            retained.setdefault(key, 0)
            draining.setdefault(key, 0)
            if rec.retired:
                draining[key] += 1
            else:
                retained[key] += 1
            vkey = (rec.name, str(rec.version))
            inflight[vkey] = inflight.get(vkey, 0) + rec.inflight
            latest = service.registry.book.alias(rec.name)
            if latest is not None:
                alias[key] = max(alias.get(key, 0), latest)
    values = (retained, draining, inflight, alias, use, limit)
    return [(name, help_text, labels, sorted(v.items()))
            for (name, help_text, labels), v in zip(STATE_GAUGES, values)]


# -- internals -------------------------------------------------------------------------
class _Metrics:
    def __init__(self):
        import prometheus_client as pc
        from prometheus_client import values
        # Multiprocess mode is fixed when prometheus_client is first imported (its
        # ValueClass), so ask the library rather than the environment.
        self.multiprocess = bool(getattr(values.ValueClass, "_multiprocess", False))
        if not self.multiprocess and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            logger.warning("PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was "
                           "imported: lora-sync's metrics stay in this process's registry")
        self.pushes = pc.Counter("lora_sync_pushes", "Adapter versions installed by a push",
                                 ["transport"])
        self.push_bytes = pc.Counter("lora_sync_push_bytes",
                                     "Tensor bytes of the adapters installed by pushes",
                                     ["transport"])
        self.failures = pc.Counter("lora_sync_push_failures",
                                   "Pushes refused or failed, by error code", ["transport", "code"])
        self.route_errors = pc.Counter("lora_sync_route_errors",
                                       "Error replies of every lora-sync route, by code",
                                       ["route", "code"])
        self.push_seconds = pc.Histogram("lora_sync_push_seconds",
                                         "Server time of a successful push (its load_ms)",
                                         ["transport"], buckets=BUCKETS)
        self.phase_seconds = pc.Histogram("lora_sync_push_phase_seconds",
                                          "Server time of each phase of a successful push",
                                          ["transport", "phase"], buckets=BUCKETS)
        # Per tenant (with tenants configured): label values are the tenants file's names and
        # "operator", codes those of ErrorCode: bounded.
        self.tenant_pushes = pc.Counter("lora_sync_tenant_pushes",
                                        "Adapter versions installed, per caller", ["tenant"])
        self.tenant_bytes = pc.Counter("lora_sync_tenant_push_bytes",
                                       "Tensor bytes installed by pushes, per caller", ["tenant"])
        self.tenant_refusals = pc.Counter("lora_sync_tenant_refusals",
                                          "Error replies of lora-sync routes, per caller and "
                                          "code", ["tenant", "code"])
        for t in TRANSPORT_NAMES:  # zero series from the start: rate() works at once
            self.pushes.labels(t)
            self.push_bytes.labels(t)
        self.snapshot = None
        if self.multiprocess:
            self.snapshot = _Snapshot(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        else:
            pc.REGISTRY.register(_StateCollector())

    def observe_tenant(self, tenant: str, status: int, code: str | None, body: dict,
                       transport: str | None) -> None:
        if code is not None:
            self.tenant_refusals.labels(tenant, code).inc()
        elif transport is not None and status == 200 and "transport" in body:
            self.tenant_pushes.labels(tenant).inc()
            self.tenant_bytes.labels(tenant).inc(max(0, int(body.get("bytes", 0))))

    def observe(self, route: str, status: int, code: str | None, body: dict,
                transport: str | None) -> None:
        if code is not None:
            self.route_errors.labels(route.strip("/"), code).inc()
        if transport is None:
            return
        if code is not None:
            self.failures.labels(transport, code).inc()
            return
        if status != 200 or "transport" not in body:
            return  # a granted shm lease: the push has not happened yet
        t = body["transport"] if body["transport"] in TRANSPORT_NAMES else transport
        self.pushes.labels(t).inc()
        self.push_bytes.labels(t).inc(max(0, int(body.get("bytes", 0))))
        self.push_seconds.labels(t).observe(max(0.0, float(body.get("load_ms", 0.0))) / 1e3)
        for phase, ms in (body.get("timings_ms") or {}).items():
            if phase in PHASES:
                self.phase_seconds.labels(t, phase).observe(max(0.0, float(ms)) / 1e3)


class _StateCollector:
    """The state gauges, read at scrape time (single-process registry)."""

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        for name, help_text, labels, samples in state_samples():
            family = GaugeMetricFamily(name, help_text, labels=labels)
            for label_values, value in samples:
                family.add_metric(label_values, value)
            yield family

    def describe(self):
        return []  # nothing to check at registration; the names are ours alone


class _Snapshot:
    """The state gauges in multiprocess mode, where prometheus_client can neither remove a
    series nor run a collector in the process that serves /metrics: a file
    `gauge_livesum_lorasync<pid>.db` in PROMETHEUS_MULTIPROC_DIR that holds exactly the
    current series. Written by prometheus_client's own MmapedDict (the format its
    MultiProcessCollector reads) under a name the collector ignores, then renamed over the
    old one, so a scrape reads the old state or the new one, never a mix. 'livesum': the
    collector drops the pid label and sums over processes (one serving process holds the
    adapters). The file goes when the process exits.

    The directory is shared with the engine and may be shared with other users, and the
    snapshot's name is predictable; prometheus_client opens the path it is given following
    links. So a snapshot is written only where no other user can swap our entries (the rule
    of private_dir.check_root: owned by us or root, sticky if others may write; SGLang's own
    default is a fresh mkdtemp), else refused with one warning; and it is filled in a file
    made here with O_EXCL|O_NOFOLLOW under a random name, which prometheus_client reaches
    through the descriptor's /proc link, never by a name someone else could plant."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, f"gauge_livesum_lorasync{os.getpid()}.db")
        self.refused: str | None = None   # why the directory is not private (warned once)
        self.pending = False
        self.written_at = 0.0
        atexit.register(self.remove)

    def schedule(self) -> None:
        """The first change after a quiet spell is written on the next loop pass, later
        ones together, SNAPSHOT_INTERVAL_S after the last write."""
        if self.pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a test, a thread): write now
            return self.write()
        self.pending = True
        loop.call_later(max(0.0, self.written_at + SNAPSHOT_INTERVAL_S - time.monotonic()),
                        self.write)

    def write(self) -> None:
        self.pending = False
        self.written_at = time.monotonic()
        if not os.path.lexists(self.directory):
            return  # gone (shutdown): nothing to serve
        try:
            private_dir.check_root(self.directory,
                                   f"PROMETHEUS_MULTIPROC_DIR {self.directory!r}")
        except private_dir.NotPrivate as e:
            if self.refused is None:
                logger.warning("lora-sync's state gauges are not written: %s", e)
            self.refused = str(e)
            self._unlink(self.path)  # an older snapshot would show a stale state
            return
        try:
            # Not *.db: the collector never reads it half-written.
            fd, tmp = tempfile.mkstemp(prefix=f"lorasync{os.getpid()}-", suffix=".tmp",
                                       dir=self.directory)
            try:
                self._fill(fd)
                os.replace(tmp, self.path)
            except BaseException:
                self._unlink(tmp)
                raise
            finally:
                os.close(fd)
        except OSError as e:  # the directory went away (shutdown): nothing to serve
            logger.debug("lora-sync metrics snapshot not written: %s", e)

    @staticmethod
    def _fill(fd: int) -> None:
        """The state gauges, written by prometheus_client's MmapedDict into the file `fd`."""
        from prometheus_client.mmap_dict import MmapedDict, mmap_key
        file = MmapedDict(f"/proc/self/fd/{fd}")  # this very file, whatever is at its name
        try:
            for name, help_text, labels, samples in state_samples():
                for label_values, value in samples:
                    file.write_value(mmap_key(name, name, list(labels), list(label_values),
                                              help_text), float(value), 0.0)
        finally:
            file.close()

    def remove(self) -> None:
        self._unlink(self.path)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _log_push(transport: str, status: int, code: str | None, body: dict, seconds: float,
              error) -> None:
    """One JSON line per push (its outcome), through the `lora_sync` logger; also attached
    to the record as `lora_sync_push` for structured handlers."""
    ok = code is None
    if ok and "transport" not in body:
        return  # a granted shm lease, not a push yet
    record = {"event": "lora_sync_push", "outcome": "ok" if ok else "error",
              "transport": transport, "status": status, "code": code,
              "ms": round(seconds * 1e3, 3)}
    if ok:
        record.update(name=body.get("lora_name"), version=body.get("version"),
                      served_name=body.get("name"), transport=body.get("transport", transport),
                      bytes=body.get("bytes"), load_ms=_round(body.get("load_ms")),
                      phases={k: _round(v) for k, v in (body.get("timings_ms") or {}).items()})
    else:
        record.update(name=None, version=None,
                      message=str(error.get("message", ""))[:300] if isinstance(error, dict)
                      else "")
    line = json.dumps(record, sort_keys=False, default=str)
    level = logging.WARNING if status >= 500 else logging.INFO
    logger.log(level, line, extra={"lora_sync_push": record})


def _round(value):
    return round(value, 3) if isinstance(value, float) else value


def _ensure_log_handler() -> None:
    """Push lines are INFO. SGLang configures the root logger (its --log-level); vLLM
    configures only its own loggers, so there the lines would be dropped: give `lora_sync`
    a stdout handler at INFO when nothing would write them."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s",
                                           datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False  # a root handler added later would print every line twice
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
