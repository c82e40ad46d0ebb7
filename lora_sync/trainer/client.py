"""The trainer's client: the same calls for vLLM and SGLang servers, one or many."""
from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import replace

from .. import full_gc, http, naming, replies
from . import sharded
from ..adapter import LoRAAdapter
from ..api import ADAPTERS_ROUTE, ALIAS_ROUTE, INFO_ROUTE, RETIRE_ROUTE
from ..collective import free_port
from ..engines import engine
from ..errors import LoRASyncError, PushFailed, TooBusy
from .fleet import FleetMemory, Newest, newest_of
from ..transports import TRANSPORTS
from ..transports.base import ClientConfig, PushResult, SendContext, Server, Transport, \
    Unavailable, send_reaching, with_protocol

# `relay`: one copy per node, through the relays the client was given (lora_sync/relay.py).
RELAY = "relay"
TRANSPORT_CHOICES = ("auto", *TRANSPORTS, RELAY)
# What `auto` tries on each server, in order: each transport says where it stands.
AUTO = sorted((t for t in TRANSPORTS.values() if t.auto_order is not None),
              key=lambda t: t.auto_order)
ON_ERROR = ("raise", "skip")
# How long past a call's deadline a server's thread may take to report before the call
# gives up on it (its HTTP calls already end at the deadline; this covers the rest).
LATE_GRACE_S = 1.0


def as_adapter(adapter) -> LoRAAdapter:
    """Accepts a LoRAAdapter, a PEFT model, or a PEFT directory path."""
    if isinstance(adapter, LoRAAdapter):
        return adapter
    if hasattr(adapter, "peft_config"):
        return LoRAAdapter.from_peft_model(adapter)
    return LoRAAdapter.from_dir(adapter)


class _BodiesOut:
    """How many servers' push bodies are still being sent. A push counts as sent when its
    transport says the body has left (`sent`), or at the latest when it ends."""

    def __init__(self, servers: int):
        self._left = servers
        self._changed = threading.Condition()
        self._mine = threading.local()  # whether this thread's push was counted

    @contextmanager
    def sending(self):
        self._mine.counted = False
        try:
            yield
        finally:
            self.sent()

    def sent(self) -> None:
        if getattr(self._mine, "counted", True):
            return
        self._mine.counted = True
        with self._changed:
            self._left -= 1
            self._changed.notify_all()

    def wait(self, deadline: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._left <= 0,
                                   max(0.0, deadline - time.monotonic()))


class _PreparedOnce:
    """What `auto` prepared for one push, per transport: each transport prepares once, in
    the first server's thread that takes it (the others wait), for every server it takes
    (a transport that writes the adapter once for all of them writes it once), and is
    finished once, after every server answered (`Transport.prepare`, `finish`)."""

    def __init__(self, adapter):
        self.adapter = adapter
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._made: dict[str, tuple[Transport, object]] = {}

    def of(self, transport: Transport, ctx: SendContext):
        with self._lock:
            lock = self._locks.setdefault(transport.name, threading.Lock())
        with lock:
            if transport.name not in self._made:
                self._made[transport.name] = (transport, transport.prepare(self.adapter, ctx))
            return self._made[transport.name][1]

    def finish(self, results: list) -> None:
        for transport, outgoing in self._made.values():
            packed = transport.finish(outgoing, results)
            if packed is not None:
                for r in results:
                    if r.ok and r.kept is None and r.transport == transport.name:
                        r.kept = packed


class LoRASyncClient:
    """`servers`: URLs or `Server(url, engine)`s. `api_key`: the servers' admin key
    (LORA_SYNC_API_KEY), sent as `Authorization: Bearer`. `timeout`: seconds any one call
    (push, resync, info, ...) may take in all, every server, retry and resync included; a
    server that has not answered by then is that server's failure (`unreachable`).
    `remember`: keep a copy of each name's newest adapter so a restarted server gets it
    back (`resync`); False keeps only version numbers (see lora_sync/trainer/fleet.py).
    `lease_ahead`: a transport may ready what the next push of a name will use ahead of it
    (shm: the next lease, on a thread; transports/shm/ready_lease.py): the next push only
    copies. False: nothing is held between pushes.
    `relays`: server URL -> the URL of the relay on that server's node (lora_sync/relay.py),
    for `transport='relay'`: the trainer sends one copy, each node's relay passes it on to
    the next and shares it with its own servers.

    Every reply is read as its route's typed message, at most 16 MiB; anything else is a
    LoRASyncError `bad_reply` naming the server (`e.server`)."""

    def __init__(self, servers, engine: str = "vllm", api_key: str | None = None,
                 timeout: float = 300.0, remember: bool = True, lease_ahead: bool = True,
                 relays: dict | None = None):
        if isinstance(servers, (str, Server)):
            servers = [servers]
        self.servers = [s if isinstance(s, Server) else Server(s, engine) for s in servers]
        self.headers = with_protocol({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.timeout = timeout
        self.relays = dict(relays or {})
        # Listings before a push (numbering, resync): small JSON, so a hung server is given
        # up on sooner, and leaves most of the call's time to the push itself.
        self.probe_timeout = min(timeout / 4, 10.0)
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.servers)))
        self.memory = FleetMemory(remember)
        self._name_locks: dict[str, threading.Lock] = {}
        self.client_id = uuid.uuid4().hex  # a label in the servers' logs, never a bound
        config = ClientConfig(self.headers, self.client_id, self.probe_timeout, lease_ahead,
                              tuple(self.servers))
        # What each transport keeps between pushes (readied leases, an update group).
        self.states = {name: t.new_client_state(config) for name, t in TRANSPORTS.items()}

    # -- pushes -------------------------------------------------------------------------
    def push(self, adapter, name: str, version: int | None = None, transport: str = "auto",
             checksum: bool = False, on_error: str = "raise", dtype=None,
             group=None) -> list[PushResult]:
        """Pushes a new version of `name` to every server; returns one PushResult each.

        `transport`: 'auto' (one sealed copy shared by every server on this host when two
        or more may be here, else shared memory where the server is on this host, else
        tensors over HTTP), 'shared', 'shm', 'tensors' or 'broadcast' (after init_group;
        all or nothing).
        `version`: by default the next after the newest this client pushed, or for a fresh
        client the newest any server holds; if a server already holds a newer one (another
        client pushed), the push is made once more, above the servers' newest. `on_error`:
        'raise' raises PushFailed naming every server that failed (the others keep the
        version; with a single server, that server's own error); 'skip' returns the results
        with `.error` set on the failed ones. Servers that restarted since they last
        answered first get each name's newest version back (see `resync`). The client's
        `timeout` bounds the whole call (the broadcast itself: the group's timeout).

        `dtype` (e.g. torch.bfloat16) casts before sending: fp32 master weights as bf16
        halve the bytes. Sharded trainers (FSDP2, torch.distributed initialised with more
        than one rank in `group`, default WORLD): call it on every rank; the shards are
        gathered to rank 0, which alone talks to the servers, and every rank gets the
        results (or the same exception)."""
        if transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}, not {transport!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")
        with full_gc.during_push():  # a full collection of the trainer's heap waits too
            if sharded.multi_rank(group):
                results = [PushResult.from_json(r) for r in sharded.on_rank0(
                    lambda full: [r.to_json() for r in self._push(full, name, version,
                                                                  transport, checksum)],
                    adapter, group, dtype)]
            else:
                adapter = as_adapter(adapter)
                if dtype is not None:
                    adapter = sharded.gather_adapter(adapter, dtype=dtype)  # one rank: a cast
                results = self._push(adapter, name, version, transport, checksum)
        failed = [r.error for r in results if not r.ok]
        if on_error == "raise" and failed:
            # One server: its own error (VersionConflict, Unauthorized, ...); several: all.
            raise failed[0] if len(results) == 1 else PushFailed(results)
        return results

    def _push(self, adapter: LoRAAdapter, name, version, transport, checksum):
        # Pushes of one name from this client go one after another: each takes the next
        # number, and they reach the servers in that order. The timeout counts from the call.
        deadline = time.monotonic() + self.timeout
        lock = self._name_locks.setdefault(name, threading.Lock())
        if not lock.acquire(timeout=self.timeout):
            raise TooBusy(f"an earlier push of {name!r} from this client still ran after "
                          f"{self.timeout:g} s (the client's timeout)")
        try:
            return self._push_in_order(adapter, name, version, transport, checksum, deadline)
        finally:
            lock.release()
            for name, t in TRANSPORTS.items():
                t.after_push(self.states[name])

    def _push_in_order(self, adapter: LoRAAdapter, name, version, transport, checksum,
                       deadline: float):
        chosen = version is None
        if chosen:
            version = self.memory.next_version(
                name, lambda n: self.newest_versions(n, deadline=deadline))
        # What the client keeps of the push, for a resync: what the push itself left where
        # it leaves one (shm: the sealed lease; broadcast on CPU: the packed frames), else a
        # copy made while the servers work on the push.
        viewed = self.memory.remember and transport != RELAY and all(
            t.keeps_copy(self.states[t.name]) for t in
            ([TRANSPORTS[transport]] if transport != "auto" else
             [self._auto_choices(s)[0] for s in self.servers]))
        copied = []

        def kept_of(results) -> Newest | None:
            kept = next((r.kept for r in results if r.ok and r.kept is not None), None)
            if kept is not None:
                return newest_of(kept, adapter)
            if not copied:  # shm fell back to HTTP: copy now, before the call returns
                copied.append(self.memory.snapshot(name, adapter))
            return copied[0]
        results = self._send(adapter, name, version, transport, checksum, deadline,
                             alongside=None if viewed else lambda: copied.append(
                                 self.memory.snapshot(name, adapter)), keep=viewed)
        if chosen and (transport in ("auto", RELAY) or TRANSPORTS[transport].per_server) \
                and any(r.error.code == "version_conflict" for r in results if not r.ok):
            # A server holds a newer version (another client or the CLI pushed): number
            # above the servers' newest and push once more, to every server alike.
            if any(r.ok for r in results):
                self.memory.pushed(name, version, kept_of(results))
            held = [v for v in self.newest_versions(name, deadline=deadline) if v]
            version = max(held + [version]) + 1
            results = self._send(adapter, name, version, transport, checksum, deadline,
                                 keep=viewed)
        if any(r.ok for r in results):
            self.memory.pushed(name, version, kept_of(results))
        elif copied:
            self.memory.unused(name, copied[0])
        restarted = {r.server for r in results if r.ok and self.memory.saw(r.server,
                                                                           r.instance_id)}
        self.memory.stale.update(r.server for r in results if not r.ok)
        self._resync(restarted, deadline)  # they lost every other name's newest version
        return results

    def _send(self, adapter: LoRAAdapter, name, version, transport, checksum, deadline,
              alongside=None, keep: bool = False):
        """One push to every server: the transport prepares it once, the client sends it to
        each server at once (a stale server first gets what it lost), the transport
        finishes it."""
        if transport == RELAY:
            return self._send_by_relay(adapter, name, version, checksum, deadline, alongside)
        bodies = _BodiesOut(len(self.servers))
        ctx = SendContext(name, version, checksum, self.headers, self.timeout, self.client_id,
                          self.states.get(transport), True, keep,
                          self.memory.spare(name) if keep else None, bodies.sent)
        sender = TRANSPORTS.get(transport)  # None: "auto", chosen per server
        outgoing = sender.prepare(adapter, ctx) if sender else None
        prepared = _PreparedOnce(adapter) if sender is None else None
        needs = sender.send_timeout(ctx) if sender else None
        if needs is not None:
            deadline = max(deadline, time.monotonic() + needs)

        def push_one(server: Server) -> PushResult:
            with bodies.sending():
                if server.url in self.memory.stale:
                    self._resync_one(server)
                if sender is None:
                    return self._push_auto(server, adapter, ctx, prepared)
                return send_reaching(sender, outgoing, server, ctx)

        def once_sent():
            # The copy kept for a resync is made once every body has left, while the
            # servers build: beside the sending it took a core from it (on a host with few
            # cores that made the whole push measurably slower).
            bodies.wait(deadline)
            alongside()
        results: list[PushResult] = []
        try:
            results = self._each_server(push_one, version, deadline,
                                        once_sent if alongside is not None else None)
        finally:  # what auto prepared goes once every server answered (or failed)
            if prepared is not None:
                prepared.finish(results)
        packed = sender.finish(outgoing, results) if sender is not None else None
        if packed is not None:
            for r in results:
                if r.ok:
                    r.kept = packed
        return results

    def _send_by_relay(self, adapter: LoRAAdapter, name, version, checksum, deadline,
                       alongside=None) -> list[PushResult]:
        """One push through the relays' chain (one copy on this host's link); the results in
        the client's order of servers."""
        from .. import relay  # here: `python -m lora_sync.relay` imports this module first
        hops = relay.chain_of(self.servers, self.relays)
        results = relay.push_chain(adapter, name, version, hops, self.headers,
                                   max(deadline - time.monotonic(), 1.0), checksum)
        if alongside is not None:
            alongside()
        by_server = {r.server: r for r in results}
        return [by_server[s.url] for s in self.servers]

    def _auto_choices(self, server: Server) -> list[Transport]:
        """What `auto` tries on `server`, in order; the last always reaches it."""
        return [t for t in AUTO[:-1] if t.reaches(server, self.states[t.name])] + AUTO[-1:]

    def _push_auto(self, server: Server, adapter, ctx: SendContext,
                   prepared: _PreparedOnce) -> PushResult:
        """Each transport in `auto`'s order that reaches the server, until one takes the
        push: one that finds it cannot (None), or has no room now (Unavailable), passes it
        on; the last one's answer stands. Each is prepared once per push (`prepared`)."""
        *first, last = self._auto_choices(server)
        for t in first:
            mine = replace(ctx, state=self.states[t.name])
            try:
                result = t.send(prepared.of(t, mine), server, mine)
            except Unavailable:
                continue
            if result is not None:
                return result
        mine = replace(ctx, state=self.states[last.name])
        return send_reaching(last, prepared.of(last, mine), server, mine)

    def _each_server(self, push_one, version: int, deadline: float,
                     alongside=None) -> list[PushResult]:
        """Runs `push_one(server)` on every server at once; a failure becomes that server's
        result instead of stopping the others. All of it ends by `deadline`; `alongside()`
        runs here meanwhile."""
        t0 = time.perf_counter()

        def guarded(server: Server) -> PushResult:
            try:
                return push_one(server)
            except LoRASyncError as e:
                return PushResult.failed(server.url, version, e, time.perf_counter() - t0)
        return self._each(guarded, deadline, late=lambda server, e: PushResult.failed(
            server.url, version, e, time.perf_counter() - t0), alongside=alongside)

    # -- restarts -------------------------------------------------------------------------
    def resync(self, urls=None) -> list[dict]:
        """Gives every server (or those in `urls`) each remembered name's newest version
        back, under its version number, where the server lacks it (a restart, a push it
        missed). Per server: {'server', 'pushed': [served names], 'error'}."""
        return self._resync(urls, time.monotonic() + self.timeout)

    def _resync(self, urls, deadline: float) -> list[dict]:
        def one(server: Server) -> dict:
            try:
                pushed = self._resync_one(server)
                return {"server": server.url, "pushed": pushed, "error": None}
            except LoRASyncError as e:
                return failed(server, e)

        def failed(server: Server, e: LoRASyncError) -> dict:
            self.memory.stale.add(server.url)  # the next push tries again
            return {"server": server.url, "pushed": [], "error": f"{e.code}: {e.message}"}
        urls = {s.url for s in self.servers} if urls is None else set(urls)
        return self._each(one, deadline, late=failed,
                          servers=[s for s in self.servers if s.url in urls])

    def _listing(self, server: Server, timeout: float) -> replies.Listing:
        body, _ = http.call("GET", server.route(ADAPTERS_ROUTE), headers=self.headers,
                            timeout=timeout)
        return replies.Listing.from_json(server.url, body)

    def _resync_one(self, server: Server) -> list[str]:
        listing = self._listing(server, self.probe_timeout)
        self.memory.saw(server.url, listing.instance_id)
        held, pushed = listing.versions_by_name(), []

        def lost(name: str, version: int) -> bool:
            have = held.get(name, set())
            return version not in have and max(have, default=0) <= version
        for name, newest in self.memory.newest_copies(lost):
            prepared = _PreparedOnce(newest.adapter)
            result = None
            try:
                result = self._push_auto(server, newest.adapter, SendContext(
                    name, newest.version, False, self.headers, self.timeout, self.client_id,
                    ahead=False), prepared)
            finally:
                prepared.finish([result] if result is not None else [])
            pushed.append(naming.versioned(name, newest.version))
        self.memory.stale.discard(server.url)
        return pushed

    def newest_versions(self, name: str, deadline: float | None = None) -> list[int | None]:
        """Per server, the newest version of `name` it holds (None: none, or unreachable)."""
        def newest(server: Server):
            try:
                listing = self._listing(server, self.probe_timeout)
            except LoRASyncError:
                return None  # the push will report this server
            return max(listing.versions_by_name().get(name, ()), default=None)
        soon = time.monotonic() + self.probe_timeout
        return self._each(newest, soon if deadline is None else min(deadline, soon),
                          late=lambda server, e: None)

    def health(self, timeout: float = 5.0) -> list[dict]:
        """Per server: {'server', 'ok', 'instance_id', 'restarted', 'ms', 'error'}; returns
        within `timeout` (or the client's, if shorter), whatever the servers do."""
        timeout = min(timeout, self.timeout)
        t0 = time.perf_counter()

        def one(server: Server) -> dict:
            try:
                info, _ = http.call("GET", server.route(INFO_ROUTE), headers=self.headers,
                                    timeout=timeout)
                instance = replies.instance_of(info, server=server.url, what="lora_sync_info")
                restarted = self.memory.saw(server.url, instance)
                return {"server": server.url, "ok": True, "instance_id": instance or None,
                        "restarted": restarted, "ms": (time.perf_counter() - t0) * 1e3,
                        "error": None}
            except LoRASyncError as e:
                return failed(server, e)

        def failed(server: Server, e: LoRASyncError) -> dict:
            return {"server": server.url, "ok": False, "instance_id": None, "restarted": False,
                    "ms": (time.perf_counter() - t0) * 1e3, "error": f"{e.code}: {e.message}"}
        return self._each(one, time.monotonic() + timeout, late=failed)

    # -- collective broadcast -----------------------------------------------------------
    def init_group(self, master_address: str = "127.0.0.1", master_port: int | None = None,
                   backend: str = "gloo", group_name: str | None = None,
                   timeout_s: float = 120.0, **kw):
        """Joins every worker of every server into a group with this process as rank 0.
        `group_name` by default: "default", or with a tenant's key a name in its scope
        (`default_group_name`), where a tenant's groups must be."""
        infos = self.info()
        return TRANSPORTS["broadcast"].open_group(
            self.states["broadcast"], self.servers, self.headers, infos, master_address,
            master_port or free_port(), backend, group_name or default_group_name(infos),
            timeout_s, **kw)

    def broadcast(self, adapter, name: str, version: int | None = None,
                  checksum: bool = False, dtype=None, group=None) -> list[PushResult]:
        """`push(..., transport="broadcast")`; on a sharded trainer's rank 0 only the
        group's rank 0 needs init_group (see `push`)."""
        return self.push(adapter, name, version, "broadcast", checksum, dtype=dtype,
                         group=group)

    def destroy_group(self) -> None:
        TRANSPORTS["broadcast"].close_group(self.states["broadcast"], self.servers,
                                            self.headers, self.timeout)

    # -- disk (the engines' own route; the baseline) -----------------------------------
    def load_from_disk(self, path: str, served_name: str) -> list[float]:
        """Loads a PEFT directory with the engine's native route; returns seconds per server."""
        return self._native("load", {"lora_name": served_name, "lora_path": str(path)})

    def unload_from_disk(self, served_name: str) -> list[float]:
        """Unloads an adapter loaded by `load_from_disk` (native route)."""
        return self._native("unload", {"lora_name": served_name})

    def _native(self, action: str, body: dict) -> list[float]:
        def one(s: Server):
            t0 = time.perf_counter()
            route = getattr(engine(s.engine), f"native_{action}")
            http.call("POST", f"{s.url.rstrip('/')}{route}",
                      timeout=self.timeout, json_body=body, headers=self.headers,
                      json_reply=False)  # vLLM answers in text
            return time.perf_counter() - t0
        return self._each(one, self._deadline())

    # -- introspection and generation --------------------------------------------------
    def info(self) -> list[dict]:
        """Per server: worker count, max LoRA rank, target modules, retention window."""
        return [i.raw for i in self._each(self._info, self._deadline())]

    def _info(self, server: Server) -> replies.Info:
        body, _ = http.call("GET", server.route(INFO_ROUTE), headers=self.headers,
                            timeout=self.timeout)
        return replies.Info.from_json(server.url, body)

    def retire(self, name: str) -> list[dict]:
        """Takes every version of `name` out of service on every server (running requests
        finish on theirs); the name no longer counts against the server's name limit."""
        self.memory.forget(name)  # its numbering may start again at 1
        return self._each(lambda s: http.call("POST", s.route(RETIRE_ROUTE),
                                              json_body={"lora_name": name},
                                              headers=self.headers, timeout=self.timeout)[0],
                          self._deadline())

    def rollback(self, name: str, version: int | None, pin: bool = False) -> list[dict]:
        """Points `name`'s alias at `version` (one the servers still hold) on every server:
        requests on `name` admitted from then on get that version, requests running finish
        on theirs. The next push moves the alias to the new version, unless `pin` (then it
        stays, and that version is kept, until rollback is called again); `version` None
        makes the alias follow the newest version again. Per server: {'lora_name',
        'version', 'alias_target', 'pinned'}."""
        body = {"lora_name": name, "version": version, "pin": pin}
        return self._each(lambda s: http.call("POST", s.route(ALIAS_ROUTE),
                                              json_body=body, headers=self.headers,
                                              timeout=self.timeout)[0],
                          self._deadline())

    def adapters(self) -> list[dict]:
        """Per server, its `lora_adapters` listing (docs/protocol.md)."""
        return [listing.raw for listing in self._each(
            lambda s: self._listing(s, self.timeout), self._deadline())]

    def completions(self, server: int = 0, **request) -> dict:
        """An OpenAI /v1/completions call; the reply gains 'served_version': the adapter
        version that generated it (servers name the versioned adapter in 'model', also
        when the request used the alias), None for the base model."""
        s = self.servers[server]
        body, headers = http.call("POST", f"{s.url.rstrip('/')}/v1/completions",
                                  timeout=self.timeout, headers=self.headers, json_body=request)
        body["served_version"] = replies.served_version(s.url, headers)
        return body

    def complete(self, prompt: str, model: str, max_tokens: int = 16, server: int = 0,
                 **params) -> dict:
        """A greedy completion: {'text', 'model', 'version', 'raw'}."""
        body = self.completions(server, model=model, prompt=prompt, max_tokens=max_tokens,
                                temperature=0.0, **params)
        return {"text": replies.completion_text(self.servers[server].url, body),
                "model": body.get("model"), "version": body["served_version"], "raw": body}

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _each(self, fn, deadline: float | None = None, late=None, servers=None,
              alongside=None) -> list:
        """`fn(server)` for every server at once, in order. With a `deadline`, every HTTP
        call inside ends by it, and a server whose `fn` has not returned shortly after is
        `late(server, error)` (or that error is raised). `alongside()` runs in this thread
        while they do."""
        servers = self.servers if servers is None else servers

        def scoped(server: Server):
            with http.within(deadline):
                return fn(server)
        futures = [self._pool.submit(scoped, s) for s in servers]
        if alongside is not None:
            alongside()
        if deadline is None:
            return [f.result() for f in futures]
        wait(futures, timeout=max(0.0, deadline - time.monotonic()) + LATE_GRACE_S)
        out = []
        for server, f in zip(servers, futures):
            if f.done():
                out.append(f.result())
                continue
            err = LoRASyncError(f"{server.url} did not answer within the client's timeout",
                                code="unreachable", status=504)
            err.server = server.url
            if late is None:
                raise err
            out.append(late(server, err))
        return out

    def close(self):
        self.destroy_group()
        for name, t in TRANSPORTS.items():
            t.close_client_state(self.states[name])
        self._pool.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def default_group_name(infos: list[dict]) -> str:
    """init_group's group name when given none: "default"; with a tenant's key (its
    lora_sync_info names the tenant), the tenant's prefix + "default", else the first of its
    names. Servers whose scopes for this key give different names need `group_name` given."""
    names = set()
    for info in infos:
        tenant = info.get("tenant")
        if not tenant:
            names.add("default")
        else:
            names.add(f"{tenant['prefix']}default" if tenant.get("prefix")
                      else sorted(tenant["names"])[0])
    if len(names) > 1:
        raise ValueError(f"init_group: this key's scopes differ between the servers (default "
                         f"group names {sorted(names)}); pass group_name=")
    return names.pop()
