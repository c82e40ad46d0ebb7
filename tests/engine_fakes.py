"""FAKES of an inference engine, so the whole lora-sync server stack runs in-process in tests.

These are fakes: they stand in for the two things only a real engine does, building LoRA
weights into a model and generating text with them. `FakeWorkerEngine.build` does not build
anything into a model, it hashes the adapter's tensors and config; the fake completion route
does not run a model, its text is that hash (of the weights the workers hold at request time).
So a test on the fake server says nothing about whether vLLM or SGLang serve the right
weights, compute the right tokens, cache correctly or survive a worker crash: the tests on
real servers (pytest marker `server`) are the only evidence for that.

What is real here is all of lora-sync's own code between the client and the engine: the
client, the routes (lora_sync.server.routes), admission (AdmissionMiddleware, configured as
vllm_ext/plugin.py configures it), AdapterService, the transports' server and worker sides,
staging, leases and the shared worker dispatcher (LoRASyncWorker). The fakes sit behind the
same two seams the real engines implement: EngineBridge (the engine's API process) and
WorkerEngine (one engine worker).

  FakeWorkerEngine   one worker's engine: build = digest, register/unload/cached_ids = a dict
  FakeBridge         the API process's view: N in-process LoRASyncWorkers, the engine's name
                     table (publish/unpublish), requests in flight per adapter (in_use)
  FakeEngineServer   a FastAPI app on uvicorn (a thread, 127.0.0.1 unless told) with
                     lora-sync's routes and admission, plus fake /v1/completions, /v1/models,
                     /health and the engine's own disk routes /v1/load_lora_adapter,
                     /v1/unload_lora_adapter;
                     the same surface tests use on a real ServerProcess (url, engine, api_key,
                     alive(), log_tail(), a context manager).

The fake also checks what a real engine would crash or misbehave on, and records it in
`FakeBridge.violations` (tests assert it stays empty): an adapter freed while a request
still runs on it, a request on a version the workers no longer hold, weights that changed
under a live version (a staged file reused too early), workers that disagree.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from unittest import mock

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from lora_sync import LoRAAdapter, ModelSpec, check_adapter
from lora_sync.engines import ENGINES
from lora_sync.server import applied
from lora_sync.server.admission import AdmissionMiddleware, NativeRoute
from lora_sync.messages import check_replies
from lora_sync.server.bridge import EngineBridge
from lora_sync.server.routes import build_router, own_paths
from lora_sync.server.service import AdapterService, Settings
from worker_extensions.dispatcher import LoRASyncWorker, WorkerEngine

from .conftest import SERVER_ENV

BASE_MODEL = "base"          # the served model name, as the real test servers use
MAX_LORA_RANK = 64           # testbed.processes' --max-lora-rank
BASE_TEXT = "base-model-says-hello"
TEXT_CHARS = 24              # completion text: this many hex digits of the weights' digest
MAX_FAKE_DELAY_S = 30.0
BASE_ONLY_ROUTE = "/fake/base_only"  # reads `model`, always runs the base model
# The fake serves lora-sync's routes and the engine's own disk routes where vLLM does.
VLLM = ENGINES["vllm"]


# -- the weights' fingerprint -------------------------------------------------------------
def weights_digest(tensors: dict[str, torch.Tensor], config: dict) -> str:
    """sha256 of the tensors (names, dtypes, shapes and bytes, in sorted-name order) and the
    adapter config: what the fake engine "builds" and what its completions say."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()


def text_of(digest: str) -> str:
    return digest[:TEXT_CHARS]


@lru_cache(maxsize=None)
def tiny_model_spec(max_rank: int = MAX_LORA_RANK) -> ModelSpec:
    """The linear layers of testbed.tiny_model's model (what conftest's `model_dir` builds),
    read the way the real bridges read them (ModelSpec.from_hf_config)."""
    from transformers import LlamaConfig

    from testbed.tiny_model import TINY_CONFIG
    return ModelSpec.from_hf_config(LlamaConfig(**TINY_CONFIG), max_rank)


def served_text(adapter: LoRAAdapter) -> str:
    """What the fake engine answers for these weights (whatever name they are pushed under)."""
    cfg = check_adapter(adapter.specs(), adapter.config, tiny_model_spec())
    return text_of(weights_digest(adapter.tensors, cfg))


# -- the worker side ------------------------------------------------------------------------
class FakeWorkerEngine(WorkerEngine):
    """One fake engine worker. `refuse(adapter_id, stored) -> reason or None` lets a test
    make the engine refuse an adapter at build (a ValueError, as a real engine's loader
    raises); by default it refuses nothing."""
    maps_read_only = True  # it only hashes the weights: a sealed lease is mapped, as on vLLM

    def __init__(self, rank: int = 0, world_size: int = 1, refuse=None):
        self._rank = (rank, world_size)
        self.refuse = refuse
        self.built: dict[int, str] = {}        # adapter id -> digest at build
        self.registered: dict[int, str] = {}   # adapter id -> the registration's identity
        self.unloaded: list[int] = []

    def rank(self) -> tuple[int, int]:
        return self._rank

    def build(self, adapter_id: int, stored, take_buffer):
        if self.refuse is not None:
            reason = self.refuse(adapter_id, stored)
            if reason:
                raise ValueError(reason)
        digest = weights_digest(stored.tensors, stored.config)
        self.built[adapter_id] = digest
        return digest

    def register(self, adapter_id: int, stored, lora_id: str) -> None:
        self.registered[adapter_id] = lora_id

    def unload(self, adapter_id: int) -> None:
        self.built.pop(adapter_id, None)
        self.registered.pop(adapter_id, None)
        self.unloaded.append(adapter_id)

    def cached_ids(self) -> list[int]:
        return list(self.registered)


# -- the API-process side -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FakeHandle:
    """What `activate` returns and the engine's name table holds (vLLM: a LoRARequest)."""
    adapter_id: int
    digest: str
    lora_id: str


class FakeBridge(EngineBridge):
    """The fake engine's API process: `workers` in-process LoRASyncWorkers (ranks 0..N-1),
    each reached one call at a time (a real worker runs one RPC at a time), with arguments
    and replies copied as an RPC would."""

    def __init__(self, workers: int = 1, base_names=(BASE_MODEL,), max_rank: int = MAX_LORA_RANK):
        self.workers = [LoRASyncWorker(FakeWorkerEngine(rank, workers)) for rank in range(workers)]
        self._worker_locks = [threading.Lock() for _ in self.workers]
        self.base_names = set(base_names)
        self.max_rank = max_rank
        self._ids = itertools.count(1)            # shared with the disk route, as in vLLM
        self.table: dict[str, FakeHandle] = {}    # served name -> handle (published)
        self.disk: dict[str, tuple[int, str]] = {}  # names the engine loaded itself
        self.running: collections.Counter = collections.Counter()  # adapter id -> requests
        self.pinned: collections.Counter = collections.Counter()   # held by a test
        self.freed: list[int] = []
        self.evicted: list[int] = []              # disk adapters evicted after an unload
        self.calls: list[str] = []                # every worker op, in order
        self.violations: list[str] = []           # what a real engine would crash on
        # What the disk route registers for a loaded adapter (a benchmark may read less).
        self.disk_weights = weights_digest

    # EngineBridge -----------------------------------------------------------------------
    def engine_names(self) -> set[str]:
        return self.base_names | set(self.disk)

    async def model_spec(self) -> ModelSpec:
        spec = await asyncio.to_thread(tiny_model_spec, self.max_rank)
        return spec

    def new_adapter_id(self) -> int:
        return next(self._ids)

    async def call_workers(self, op: str, **args):
        self.calls.append(op)
        replies = await asyncio.gather(*(asyncio.to_thread(self._call_one, i, op, args)
                                         for i in range(len(self.workers))))
        return check_replies(list(replies))

    def _call_one(self, i: int, op: str, args: dict):
        with self._worker_locks[i]:
            return copy.deepcopy(self.workers[i].call(op, copy.deepcopy(args)))

    async def worker_count(self) -> int:
        return len(self.workers)

    async def activate(self, served_name: str, adapter_id: int) -> FakeHandle:
        lora_id = self.identity(adapter_id)
        await self.call_workers("register", adapter_id=adapter_id, lora_id=lora_id)
        digests = {w.engine.built.get(adapter_id) for w in self.workers}
        if len(digests) != 1 or None in digests:
            self.violations.append(f"activate {served_name}: workers built {digests}")
            raise ValueError(f"fake engine: workers disagree on adapter {adapter_id}")
        return FakeHandle(adapter_id, digests.pop(), lora_id)

    def publish(self, served_name: str, handle) -> None:
        self.table[served_name] = handle

    async def unpublish(self, served_name: str) -> None:
        self.table.pop(served_name, None)

    async def in_use(self, adapter_id: int) -> bool:
        return self.running[adapter_id] > 0 or self.pinned[adapter_id] > 0

    async def free(self, adapter_ids: list[int]) -> None:
        for i in adapter_ids:
            if self.running[i] or self.pinned[i]:
                self.violations.append(f"adapter {i} freed while {self.running[i]} requests "
                                       f"(+{self.pinned[i]} pinned) still use it")
        self.freed.extend(adapter_ids)
        await self.call_workers("free", adapter_ids=list(adapter_ids))

    def engine_adapter_id(self, name: str) -> int | None:
        return self.disk[name][0] if name in self.disk else None

    async def evict(self, adapter_id: int) -> None:
        if await self.in_use(adapter_id):
            self.violations.append(f"disk adapter {adapter_id} evicted while in use")
        self.evicted.append(adapter_id)

    # what tests use ---------------------------------------------------------------------
    @contextmanager
    def engine_busy(self, adapter_id: int):
        """The engine has a request on `adapter_id` that admission never counted (one that
        reached it by another path): the version must not be freed meanwhile."""
        self.pinned[adapter_id] += 1
        try:
            yield
        finally:
            self.pinned[adapter_id] -= 1

    def held_ids(self) -> list[set[int]]:
        """Per worker, the adapter ids it holds in memory."""
        return [set(w.state.adapters) for w in self.workers]

    def live_digest(self, adapter_id: int) -> str | None:
        """The digest of the weights the workers hold now for `adapter_id` (None: some
        worker does not hold it). Records a violation if they changed since the build or
        the workers disagree."""
        digests = set()
        for w in self.workers:
            stored = w.state.adapters.get(adapter_id)
            if stored is None:
                return None
            digests.add(weights_digest(stored.tensors, stored.config))
            built = w.engine.built.get(adapter_id)
            if built is not None and built not in digests:
                self.violations.append(f"adapter {adapter_id}: weights changed since build")
        if len(digests) != 1:
            self.violations.append(f"adapter {adapter_id}: workers hold different weights")
        return digests.pop()


# -- the fake engine's HTTP app ------------------------------------------------------------
def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    """vLLM's error shape (its `code` is the HTTP status, not a lora-sync code)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


def build_app(service: AdapterService, bridge: FakeBridge, engine_keys: tuple = (),
              prefix: str = VLLM.route_prefix) -> FastAPI:
    """lora-sync's routes and admission as vllm_ext/plugin.py attaches them, on a fake
    engine's routes. `engine_keys`: the engine's own --api-key (vLLM's middleware guards
    /v1 with it, and lets lora-sync's admin key through). `prefix`: where lora-sync's
    routes go (the engine's `route_prefix`: a client finds the engine by it)."""
    from vllm_ext.engine_api import KEY_GUARDED_PREFIXES, NATIVE_ADAPTER_ROUTES

    app = FastAPI()
    app.include_router(build_router(prefix))
    app.add_middleware(
        AdmissionMiddleware, own_paths=own_paths(prefix),
        native_routes=[NativeRoute(*r) for r in NATIVE_ADAPTER_ROUTES],
        engine_guards=lambda path: path.startswith(KEY_GUARDED_PREFIXES))
    if engine_keys:
        keys = {f"Bearer {k}" for k in (*engine_keys, service.settings.api_key) if k}

        @app.middleware("http")
        async def engine_key(request: Request, call_next):  # vLLM's --api-key middleware
            if request.url.path.startswith(KEY_GUARDED_PREFIXES) and \
                    request.headers.get("authorization") not in keys:
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)
    app.state.lora_sync = service
    _mount_metrics(app)

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.post(BASE_ONLY_ROUTE)
    async def base_only(request: Request):
        """A route that reads `model` but always runs the base model (as vLLM's /invocations
        did after its SageMaker decorator rewrote `model`, and SGLang's /v1/messages)."""
        applied.engine_request([None])
        return {"text": BASE_TEXT}

    @app.get("/v1/models")
    async def models():
        names = sorted(bridge.base_names | set(bridge.disk) | set(bridge.table))
        return {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        # vLLM's SageMaker routes serve the adapter the header names, over `model`
        model = request.headers.get("x-amzn-sagemaker-adapter-identifier") or \
            body.get("model") or BASE_MODEL
        if not isinstance(model, str):
            return _error(400, "model must be a string")
        handle = bridge.table.get(model)
        if handle is None and model in bridge.disk:
            handle = FakeHandle(*bridge.disk[model], lora_id=model)
        if handle is None and model not in bridge.base_names:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        # The engine seam (as vLLM's AsyncLLM.add_request): what this request carries.
        applied.engine_request([None if handle is None else model])
        delay = body.get("fake_delay_s", 0)
        delay = min(float(delay), MAX_FAKE_DELAY_S) if isinstance(delay, (int, float)) else 0
        if handle is None:
            await asyncio.sleep(delay)
            text = BASE_TEXT
        else:
            bridge.running[handle.adapter_id] += 1
            try:
                if model in bridge.disk:
                    digest = handle.digest
                else:
                    digest = bridge.live_digest(handle.adapter_id)
                    if digest is None:
                        bridge.violations.append(f"request on {model}: the workers no longer "
                                                 f"hold adapter {handle.adapter_id}")
                        return _error(500, f"adapter {handle.adapter_id} is gone (a real "
                                      "engine would have crashed)", "InternalServerError")
                await asyncio.sleep(delay)
            finally:
                bridge.running[handle.adapter_id] -= 1
            text = text_of(digest)
        return {"id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion",
                "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

    @app.post(VLLM.native_load)
    async def load_lora_adapter(request: Request):
        """The engine's own disk route (the baseline): reads a PEFT directory."""
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return _error(400, "lora_name and lora_path are required")
        if name in bridge.disk or name in bridge.table or name in bridge.base_names:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        try:
            adapter = await asyncio.to_thread(LoRAAdapter.from_dir, path)
            cfg = check_adapter(adapter.specs(), adapter.config, await bridge.model_spec())
        except Exception as e:  # noqa: BLE001 - the engine's own error reply
            return _error(400, f"could not load {path}: {e}")
        bridge.disk[name] = (bridge.new_adapter_id(), bridge.disk_weights(adapter.tensors, cfg))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post(VLLM.native_unload)
    async def unload_lora_adapter(request: Request):
        body = await request.json()
        name = body.get("lora_name")
        if not isinstance(name, str):  # vLLM's request model refuses it
            return _error(400, "lora_name must be a string")
        if bridge.disk.pop(name, None) is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return app


def _mount_metrics(app: FastAPI) -> None:
    """prometheus_client's registry at /metrics, mounted as vLLM mounts it (its regex serves
    any path that starts with /metrics); lora-sync's series are there once a test calls
    metrics.install(service), as the plugins do at start-up."""
    try:
        from prometheus_client import make_asgi_app
    except ImportError:
        return
    import re

    from starlette.routing import Mount
    route = Mount("/metrics", make_asgi_app())
    route.path_regex = re.compile("^/metrics(?P<path>.*)$")
    app.routes.append(route)


def settings_like_test_servers(env: dict | None = None, **overrides) -> Settings:
    """The Settings a real test server gets from tests/conftest.py's SERVER_ENV (read by
    Settings.from_env, so the two stay alike), with `overrides` on top."""
    with mock.patch.dict(os.environ, {**SERVER_ENV, **(env or {})}):
        settings = Settings.from_env()
    return dataclasses.replace(settings, **overrides)


class _LogBuffer(logging.Handler):
    def __init__(self, n: int = 2000):
        super().__init__(logging.INFO)
        self.lines: collections.deque = collections.deque(maxlen=n)
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def emit(self, record):
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never fail a test
            pass


LOGGERS = ("lora_sync", "uvicorn.error", "uvicorn.asgi")


class CannedReplies:
    """ASGI: a path in `replies` gets a fixed reply instead of the app's, so the client's
    tests meet a broken or hostile server in front of an honest one. A reply is (status,
    JSON body, headers) or a callable(JSON body of the request) that returns one. The dict
    is read at every request (a test may change it as it goes), and `seen` records each
    request's (method, path, status), the last 1000."""

    def __init__(self, app, replies: dict):
        self.app, self.replies = app, replies
        self.seen: collections.deque = collections.deque(maxlen=1000)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = (scope["method"], scope["path"])
        canned = self.replies.get(scope["path"])
        if canned is None:
            async def noting(message):
                if message["type"] == "http.response.start":
                    self.seen.append((*key, message["status"]))
                await send(message)
            return await self.app(scope, receive, noting)
        if callable(canned):
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            canned = canned(json.loads(body or b"null"))
        status, reply, *headers = canned
        self.seen.append((*key, status))
        await JSONResponse(reply, status_code=status, headers=(headers or [None])[0])(
            scope, receive, send)


class FakeEngineServer:
    """lora-sync on the fake engine, served by uvicorn on a thread of this process.

    `settings`: AdapterService settings (default: like the real test servers, see
    settings_like_test_servers; `**overrides` change single fields, e.g. max_names=3).
    `workers`: fake engine workers (ranks). `engine_keys`: the engine's own API keys.
    `check_finite`: Settings.check_finite (default: as the test servers, which set it).
    `host`, `port`: the address to bind (default 127.0.0.1, a free port; tests/
    fake_server_main.py binds a network namespace's address and a given port).
    `engine`: whose place lora-sync's routes take (the fake engine's own routes stay
    vLLM's). `canned`: route name (as `Server.route` takes it) -> a reply in place of the
    honest one (see CannedReplies); `set_canned` changes them while it runs."""

    def __init__(self, settings: Settings | None = None, workers: int = 1,
                 check_finite: bool | None = None, engine_keys: tuple = (),
                 host: str = "127.0.0.1", port: int = 0, engine: str = VLLM.name,
                 canned: dict | None = None, **overrides):
        self.settings = settings or settings_like_test_servers(**overrides)
        self.api_key = self.settings.api_key
        if check_finite is not None:
            self.settings.check_finite = check_finite
        if engine_keys:
            self.settings.engine_has_key = True
            self.settings.generation_keys = tuple(engine_keys)
        self.bridge = FakeBridge(workers)
        self.service = AdapterService(self.bridge, self.settings)
        self.engine = engine
        self._canned: dict = {}
        self.set_canned(canned or {})
        self._front = None
        self.app = build_app(self.service, self.bridge, tuple(engine_keys),
                             ENGINES[engine].route_prefix)
        self.host = host
        self.url = ""
        self.port = port
        self._server = None
        self._thread: threading.Thread | None = None
        self._logs = _LogBuffer()

    def set_canned(self, canned: dict) -> None:
        self._canned.clear()
        self._canned.update({ENGINES[self.engine].route("", name): reply
                             for name, reply in canned.items()})

    @property
    def seen(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of the requests it answered, oldest first (last 1000)."""
        return list(self._front.seen)

    @property
    def instance_id(self) -> str:
        return self.service.instance_id

    def served(self) -> dict[str, list[int]]:
        """Name -> the versions it serves now (the registry's own view)."""
        out: dict[str, list[int]] = {}
        for rec in self.service.registry.records.values():
            if not rec.retired:
                out.setdefault(rec.name, []).append(rec.version)
        return {n: sorted(vs) for n, vs in out.items()}

    # the ServerProcess surface ------------------------------------------------------------
    def start(self) -> "FakeEngineServer":
        import uvicorn
        # The fake's model, read now (it imports transformers, seconds the first time): a
        # real engine knows its model before it serves, and a client's first push with a
        # short timeout must not pay for the fake.
        tiny_model_spec(self.bridge.max_rank)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # bound before the thread starts: no port race
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        for name in LOGGERS:
            logging.getLogger(name).addHandler(self._logs)
        self._front = CannedReplies(self.app, self._canned)
        config = uvicorn.Config(self._front, log_level="warning", lifespan="off",
                                access_log=False, timeout_graceful_shutdown=2,
                                timeout_keep_alive=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"fake-engine-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the fake engine server did not start:\n" + self.log_tail())
            time.sleep(0.01)
        self._sock = sock
        return self

    def healthy(self) -> bool:
        import urllib.request
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001
            return False

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.healthy()

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(list(self._logs.lines)[-n:])

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(self._logs)
        # What the service holds outside the loop: open leases (memfds) and staged files.
        # (The staging directory is shared by every fake server of this process: the files
        # go, the directory stays.)
        for ctx in self.service.contexts.values():
            close = getattr(ctx.state, "close", None)
            if callable(close):
                close()
        for rec in list(self.service.registry.records.values()):
            if rec.hold is not None:
                rec.hold.close()
                rec.hold = None
        for path in list(getattr(self.service.staging, "free", [])):
            try:
                os.unlink(path)
            except OSError:
                pass
        self._server = None

    def __enter__(self) -> "FakeEngineServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
