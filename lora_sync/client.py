"""The trainer's client: the same calls for vLLM and SGLang servers, one or many."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import http, naming, sharded
from .adapter import LoRAAdapter
from .collective import free_port
from .errors import LoRASyncError, PushFailed
from .fleet import FleetMemory
from .transports import PER_SERVER, TRANSPORTS, broadcast
from .transports.base import PushResult, Server

# The engines' own routes for adapters on disk (the baseline lora-sync replaces).
NATIVE_ROUTES = {"vllm": {"load": "/v1/load_lora_adapter", "unload": "/v1/unload_lora_adapter"},
                 "sglang": {"load": "/load_lora_adapter", "unload": "/unload_lora_adapter"}}
TRANSPORT_CHOICES = ("auto", *TRANSPORTS)
ON_ERROR = ("raise", "skip")


def as_adapter(adapter) -> LoRAAdapter:
    """Accepts a LoRAAdapter, a PEFT model, or a PEFT directory path."""
    if isinstance(adapter, LoRAAdapter):
        return adapter
    if hasattr(adapter, "peft_config"):
        return LoRAAdapter.from_peft_model(adapter)
    return LoRAAdapter.from_dir(adapter)


class LoRASyncClient:
    """`remember`: keep a copy of each name's newest adapter so a restarted server gets it
    back (`resync`); False keeps only version numbers (see lora_sync/fleet.py)."""

    def __init__(self, servers, engine: str = "vllm", api_key: str | None = None,
                 timeout: float = 300.0, remember: bool = True):
        if isinstance(servers, (str, Server)):
            servers = [servers]
        self.servers = [s if isinstance(s, Server) else Server(s, engine) for s in servers]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        # Listings before a push (numbering, resync): small JSON, so a hung server is given
        # up on sooner than a push.
        self.probe_timeout = min(timeout, 10.0)
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.servers)))
        self._group = None  # set by init_group (broadcast transport)
        self._same_host: dict[str, bool] = {}  # server url -> its shm leases reach us
        self.memory = FleetMemory(remember)
        self._name_locks: dict[str, threading.Lock] = {}

    # -- pushes -------------------------------------------------------------------------
    def push(self, adapter, name: str, version: int | None = None, transport: str = "auto",
             checksum: bool = False, on_error: str = "raise", dtype=None,
             group=None) -> list[PushResult]:
        """Pushes a new version of `name` to every server; returns one PushResult each.

        `transport`: 'auto' (shared memory where the server is on this host, else tensors
        over HTTP), 'shm', 'tensors' or 'broadcast' (after init_group; all or nothing).
        `version`: by default the next after the newest this client pushed, or for a fresh
        client the newest any server holds. `on_error`: 'raise' raises PushFailed naming
        every server that failed (the others keep the version; with a single server, that
        server's own error); 'skip' returns the results with `.error` set on the failed
        ones. Servers that restarted since they last answered first get each name's newest
        version back (see `resync`).

        `dtype` (e.g. torch.bfloat16) casts before sending: fp32 master weights as bf16
        halve the bytes. Sharded trainers (FSDP2, torch.distributed initialised with more
        than one rank in `group`, default WORLD): call it on every rank; the shards are
        gathered to rank 0, which alone talks to the servers, and every rank gets the
        results (or the same exception)."""
        if transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}, not {transport!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, not {on_error!r}")
        if sharded.multi_rank(group):
            results = [PushResult.from_json(r) for r in sharded.on_rank0(
                lambda full: [r.to_json() for r in self._push(full, name, version, transport,
                                                              checksum)],
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
        # number, and they reach the servers in that order.
        with self._name_locks.setdefault(name, threading.Lock()):
            return self._push_in_order(adapter, name, version, transport, checksum)

    def _push_in_order(self, adapter: LoRAAdapter, name, version, transport, checksum):
        if version is None:
            version = self.memory.next_version(name, self.newest_versions)
        if transport == "broadcast":
            if self._group is None:
                raise RuntimeError("call init_group() before pushing with transport='broadcast'")
            results = broadcast.broadcast(self, self._group, adapter, name, version, checksum)
        else:
            def push_one(server: Server) -> PushResult:
                if server.url in self.memory.stale:  # first what it lost (restart, failure)
                    self._resync_one(server)
                return self._push_one(server, adapter, name, version, transport, checksum)
            results = self._each_server(push_one, version)
        if any(r.ok for r in results):
            self.memory.pushed(name, version, adapter)
        restarted = {r.server for r in results if r.ok and self.memory.saw(r.server,
                                                                           r.instance_id)}
        self.memory.stale.update(r.server for r in results if not r.ok)
        self.resync(restarted)  # they lost every other name's newest version
        return results

    def _push_one(self, server: Server, adapter, name, version, transport, checksum):
        if transport == "auto":  # shm until a lease is out of reach, then HTTP for good
            if self._same_host.get(server.url, True):
                result = PER_SERVER["shm"](self, server, adapter, name, version, checksum)
                self._same_host[server.url] = result is not None
                if result is not None:
                    return result
            transport = "tensors"
        result = PER_SERVER[transport](self, server, adapter, name, version, checksum)
        if result is None:
            raise LoRASyncError(f"{server.url} cannot be reached through shared memory from "
                                "this process (another host or PID namespace); use "
                                "transport='tensors'", code="shm_unreachable", status=400)
        return result

    def push_tensors(self, adapter, name: str, version: int | None = None,
                     checksum: bool = False) -> list[PushResult]:
        """Sends the adapter as one safetensors body to every server (concurrently)."""
        return self.push(adapter, name, version, "tensors", checksum)

    def _each_server(self, push_one, version: int) -> list[PushResult]:
        """Runs `push_one(server)` on every server at once; a failure becomes that server's
        result instead of stopping the others. Each call is bounded by `timeout`."""
        def guarded(server: Server) -> PushResult:
            t0 = time.perf_counter()
            try:
                return push_one(server)
            except LoRASyncError as e:
                return PushResult.failed(server.url, version, e, time.perf_counter() - t0)
        return self._each(guarded)

    # -- restarts -------------------------------------------------------------------------
    def resync(self, urls=None) -> list[dict]:
        """Gives every server (or those in `urls`) each remembered name's newest version
        back, under its version number, where the server lacks it (a restart, a push it
        missed). Per server: {'server', 'pushed': [served names], 'error'}."""
        def one(server: Server) -> dict:
            try:
                pushed = self._resync_one(server)
                return {"server": server.url, "pushed": pushed, "error": None}
            except LoRASyncError as e:
                return {"server": server.url, "pushed": [], "error": f"{e.code}: {e.message}"}
        urls = {s.url for s in self.servers} if urls is None else set(urls)
        return list(self._pool.map(one, [s for s in self.servers if s.url in urls]))

    def _resync_one(self, server: Server) -> list[str]:
        listing, _ = http.call("GET", server.route("lora_adapters"), headers=self.headers,
                               timeout=self.probe_timeout)
        self.memory.saw(server.url, listing.get("instance_id"))
        held, pushed = _versions_by_name(listing), []
        for name, newest in list(self.memory.newest.items()):
            have = held.get(name, set())
            if newest.adapter is None or newest.version in have \
                    or max(have, default=0) > newest.version:
                continue
            self._push_one(server, newest.adapter, name, newest.version, "auto", False)
            pushed.append(naming.versioned(name, newest.version))
        self.memory.stale.discard(server.url)
        return pushed

    def newest_versions(self, name: str) -> list[int | None]:
        """Per server, the newest version of `name` it holds (None: none, or unreachable)."""
        def newest(server: Server):
            try:
                listing, _ = http.call("GET", server.route("lora_adapters"),
                                       headers=self.headers, timeout=self.probe_timeout)
            except LoRASyncError:
                return None  # the push will report this server
            return max(_versions_by_name(listing).get(name, ()), default=None)
        return self._each(newest)

    def health(self, timeout: float = 5.0) -> list[dict]:
        """Per server: {'server', 'ok', 'instance_id', 'restarted', 'ms', 'error'}; never
        waits longer than `timeout` on any one."""
        def one(server: Server) -> dict:
            t0 = time.perf_counter()
            try:
                info, _ = http.call("GET", server.route("lora_sync_info"), headers=self.headers,
                                    timeout=min(timeout, self.timeout))
                restarted = self.memory.saw(server.url, info.get("instance_id"))
                return {"server": server.url, "ok": True, "instance_id": info.get("instance_id"),
                        "restarted": restarted, "ms": (time.perf_counter() - t0) * 1e3,
                        "error": None}
            except LoRASyncError as e:
                return {"server": server.url, "ok": False, "instance_id": None,
                        "restarted": False, "ms": (time.perf_counter() - t0) * 1e3,
                        "error": f"{e.code}: {e.message}"}
        return self._each(one)

    # -- collective broadcast -----------------------------------------------------------
    def init_group(self, master_address: str = "127.0.0.1", master_port: int | None = None,
                   backend: str = "gloo", group_name: str = "default",
                   timeout_s: float = 120.0, **kw):
        """Joins every worker of every server into a group with this process as rank 0."""
        self._group = broadcast.init_group(self, master_address, master_port or free_port(),
                                           backend, group_name, timeout_s, **kw)
        return self._group

    def broadcast(self, adapter, name: str, version: int | None = None,
                  checksum: bool = False, dtype=None, group=None) -> list[PushResult]:
        """`push(..., transport="broadcast")`; on a sharded trainer's rank 0 only the
        group's rank 0 needs init_group (see `push`)."""
        return self.push(adapter, name, version, "broadcast", checksum, dtype=dtype,
                         group=group)

    def destroy_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            broadcast.destroy_group(self, group)

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
            http.call("POST", f"{s.url.rstrip('/')}{NATIVE_ROUTES[s.engine][action]}",
                      timeout=self.timeout, json_body=body, headers=self.headers)
            return time.perf_counter() - t0
        return self._each(one)

    # -- introspection and generation --------------------------------------------------
    def info(self) -> list[dict]:
        """Per server: worker count, max LoRA rank, target modules, retention window."""
        return self._each(lambda s: http.call("GET", s.route("lora_sync_info"),
                                              headers=self.headers, timeout=self.timeout)[0])

    def retire(self, name: str) -> list[dict]:
        """Takes every version of `name` out of service on every server (running requests
        finish on theirs); the name no longer counts against the server's name limit."""
        self.memory.newest.pop(name, None)  # its numbering may start again at 1
        return self._each(lambda s: http.call("POST", s.route("retire_lora_adapter"),
                                              json_body={"lora_name": name},
                                              headers=self.headers, timeout=self.timeout)[0])

    def adapters(self) -> list[dict]:
        return self._each(lambda s: http.call("GET", s.route("lora_adapters"),
                                              headers=self.headers, timeout=self.timeout)[0])

    def completions(self, server: int = 0, **request) -> dict:
        """An OpenAI /v1/completions call; the reply gains 'served_version': the adapter
        version that generated it (servers name the versioned adapter in 'model', also
        when the request used the alias), None for the base model."""
        s = self.servers[server]
        body, headers = http.call("POST", f"{s.url.rstrip('/')}/v1/completions",
                                  timeout=self.timeout, headers=self.headers, json_body=request)
        version = {k.lower(): v for k, v in headers.items()}.get("x-lora-version")
        body["served_version"] = int(version) if version else None
        return body

    def complete(self, prompt: str, model: str, max_tokens: int = 16, server: int = 0,
                 **params) -> dict:
        """A greedy completion: {'text', 'model', 'version', 'raw'}."""
        body = self.completions(server, model=model, prompt=prompt, max_tokens=max_tokens,
                                temperature=0.0, **params)
        return {"text": body["choices"][0]["text"], "model": body.get("model"),
                "version": body["served_version"], "raw": body}

    def _each(self, fn):
        return list(self._pool.map(fn, self.servers))

    def close(self):
        if self._group is not None:
            self.destroy_group()
        self._pool.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _versions_by_name(listing: dict) -> dict[str, set[int]]:
    """Servable versions per name in a `lora_adapters` reply."""
    return {entry["name"]: {v["version"] for v in entry.get("versions", [])}
            for entry in listing.get("adapters", [])}
