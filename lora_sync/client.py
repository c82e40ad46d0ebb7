"""The trainer's client: the same calls for vLLM and SGLang servers, one or many."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from . import http
from .adapter import LoRAAdapter
from .collective import free_port
from .errors import LoRASyncError
from .transports import PER_SERVER, TRANSPORTS, broadcast
from .transports.base import PushResult, Server

# The engines' own routes for adapters on disk (the baseline lora-sync replaces).
NATIVE_ROUTES = {"vllm": {"load": "/v1/load_lora_adapter", "unload": "/v1/unload_lora_adapter"},
                 "sglang": {"load": "/load_lora_adapter", "unload": "/unload_lora_adapter"}}
TRANSPORT_CHOICES = ("auto", *TRANSPORTS)


def as_adapter(adapter) -> LoRAAdapter:
    """Accepts a LoRAAdapter, a PEFT model, or a PEFT directory path."""
    if isinstance(adapter, LoRAAdapter):
        return adapter
    if hasattr(adapter, "peft_config"):
        return LoRAAdapter.from_peft_model(adapter)
    return LoRAAdapter.from_dir(adapter)


class LoRASyncClient:
    def __init__(self, servers, engine: str = "vllm", api_key: str | None = None,
                 timeout: float = 300.0):
        if isinstance(servers, (str, Server)):
            servers = [servers]
        self.servers = [s if isinstance(s, Server) else Server(s, engine) for s in servers]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.servers)))
        self._group = None  # set by init_group (broadcast transport)
        self._same_host: dict[str, bool] = {}  # server url -> its shm leases reach us

    # -- pushes -------------------------------------------------------------------------
    def push(self, adapter, name: str, version: int | None = None, transport: str = "auto",
             checksum: bool = False) -> list[PushResult]:
        """Pushes a new version of `name` to every server. `transport`: 'auto' (shared memory
        where the server is on this host, else tensors over HTTP), 'shm', 'tensors' or
        'broadcast' (after init_group)."""
        if transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}, not {transport!r}")
        adapter = as_adapter(adapter)
        if transport == "broadcast":
            return self.broadcast(adapter, name, version, checksum)
        return self._each(lambda s: self._push_one(s, adapter, name, version, transport,
                                                   checksum))

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

    # -- collective broadcast -----------------------------------------------------------
    def init_group(self, master_address: str = "127.0.0.1", master_port: int | None = None,
                   backend: str = "gloo", group_name: str = "default",
                   timeout_s: float = 120.0, **kw):
        """Joins every worker of every server into a group with this process as rank 0."""
        self._group = broadcast.init_group(self, master_address, master_port or free_port(),
                                           backend, group_name, timeout_s, **kw)
        return self._group

    def broadcast(self, adapter, name: str, version: int | None = None,
                  checksum: bool = False) -> list[PushResult]:
        if self._group is None:
            raise RuntimeError("call init_group() before broadcast()")
        return broadcast.broadcast(self, self._group, as_adapter(adapter), name, version,
                                   checksum)

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
