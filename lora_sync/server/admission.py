"""Admission: every request that reaches the engine passes here first (ASGI middleware).

A generation request may name a lora-sync adapter in several places, and the engines have
many routes that read them (vLLM: every OpenAI, Anthropic, SageMaker and token route reads
`model`; SGLang also reads `lora_path`, a list of them, or `parameters.lora_path`). So
admission does not go by route: on every route it reads the places an adapter can be named,
resolves the alias to the newest servable version, rewrites the request to name exactly that
version and counts it in flight until the response ends. A retired version is freed from
the engine only when its last request finishes (and the engine itself has none left on it).

Two more jobs, because they sit on the same path:
  * the engines' own adapter routes (load/unload by name or path) are guarded like ours and
    never act on our names (`NativeRoute`); a load is refused, as our pushes are, while the
    model's LoRA path cannot run (`service.refuse_if_unsupported`);
  * SGLang's internal `lora_id` field is refused: it skips the engine's own checks.
Every reply on an adapter carries `X-LoRA-Version` / `X-LoRA-Name` headers, and is computed
with that adapter: the engine's seam checks each request the route makes (applied.py), and a
route that dropped the name is answered with a 400 instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .. import naming
from ..errors import BadRequest, LoRASyncError, NotFound, PayloadTooLarge
from ..fields import loads
from . import applied
from .tenants import hide
from .socket_body import RAW_RECEIVE

# The request header SageMaker routes read the adapter from (vLLM's /invocations).
SAGEMAKER_ADAPTER_HEADER = b"x-amzn-sagemaker-adapter-identifier"
# Fields that name adapters, at the top level of a JSON body and inside `parameters`.
NAME_FIELDS = ("model", "lora_path")
NESTED = ("parameters",)
INTERNAL_FIELDS = ("lora_id",)  # SGLang's engine ids: never taken from a client
BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
# The engines' model listings (OpenAI's GET /v1/models, on both): with tenants, each caller
# sees only the models and the adapters it may generate on (`listed_for`).
MODEL_LISTS = ("/v1/models",)
# The engines' Prometheus endpoint (both mount it at /metrics, matching any path that starts
# so: vLLM's and SGLang's route regex is ^/metrics(.*)$). Its labels name adapters (ours,
# and the engine's own, e.g. vLLM's vllm:lora_requests_info), so with tenants it is the
# operator's alone (`service.authorize_metrics`).
METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class NativeRoute:
    """An engine route that loads or unloads adapters by name: `field` names it in the JSON
    body, or `path_prefix` + name is the path (SageMaker's DELETE /adapters/<name>).
    `unloads`: a 2xx reply takes the name away, so the engine's copy is evicted too.
    `path_field`: where a load names the adapter's directory (it gets a push's verdict)."""
    method: str
    path: str
    field: str | None = None
    unloads: bool = False
    path_field: str | None = None


class _Named(list):
    """The versions of ours a request names, admitted (counted in flight); `engine`: the
    engine's own adapters it names."""

    def __init__(self):
        super().__init__()
        self.engine: list[str] = []


class AdmissionMiddleware:
    def __init__(self, app, own_paths: frozenset = frozenset(), native_routes=(),
                 also_set: tuple[str, ...] = (), engine_guards=None, model_adapter=None,
                 strict_models: bool = False, cache_key_fields: dict | None = None,
                 model_names: frozenset = frozenset(), reads_adapter_header: bool = True):
        self.app = app
        # reads_adapter_header: the engine serves the adapter the SageMaker header names
        # (vLLM). Where it does not (SGLang), a request naming one there is refused: the
        # engine would answer it with the base model.
        self.reads_adapter_header = reads_adapter_header
        # model_names: the names in engine_names() that are models, not adapters.
        self.model_names = model_names
        # model_adapter(model): the adapter name the engine itself reads from `model` (SGLang:
        # "base:adapter"); admission must see what the engine will, no more, no less.
        self.model_adapter = model_adapter or (lambda model: model)
        # strict_models: a `model` that is neither the engine's nor ours is a 404 here
        # (SGLang would serve the base model for it: an RL trainer would never know).
        self.strict_models = strict_models
        # cache_key_fields: {field: marker} client fields the engine folds into a cache key
        # beside our adapter ids (SGLang's extra_key): a value carrying the marker is refused.
        self.cache_key_fields = cache_key_fields or {}
        # engine_guards(path): whether the engine's own key middleware covers `path`; where
        # it does not, requests on our adapters are checked against its keys here.
        self.engine_guards = engine_guards
        self.own_paths = own_paths      # our admin routes: they check their own input
        self.native = {(r.method, r.path): r for r in native_routes}
        self.native_prefixes = [r for r in native_routes if r.path.endswith("/")]
        self.also_set = also_set        # fields to set when `model` names ours (SGLang)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _route_path(scope).startswith(METRICS_PATH):
            service = getattr(scope["app"].state, "lora_sync", None)
            try:
                if service is not None:
                    service.access.authorize_metrics(_header(scope, b"authorization"))
            except LoRASyncError as e:
                return await _json_reply(send, e.status, e.to_json())
        if scope["type"] == "http" and scope.get("method") == "GET" \
                and scope.get("path") in MODEL_LISTS:
            service = getattr(scope["app"].state, "lora_sync", None)
            if service is not None and service.access.tenancy.enabled:
                return await _list_models_for(service, self.app, scope, receive, send,
                                              self.listed_for)
        if scope["type"] != "http" or scope.get("method") not in BODY_METHODS:
            return await self.app(scope, receive, send)
        if scope.get("path") in self.own_paths:  # uvicorn's receive, for a socket body
            return await self.app({**scope, RAW_RECEIVE: receive}, receive, send)
        service = getattr(scope["app"].state, "lora_sync", None)
        if service is None:  # the server is still starting
            return await self.app(scope, receive, send)
        try:
            body = await _read_body(receive, service.settings.max_request_bytes)
            request = _parse(body, scope)
            native = self._native_route(scope)
            if native is not None:
                name = _native_name(native, scope, request)
                service.access.authorize_native(_header(scope, b"authorization"), name)
                if native.unloads:
                    return await self._unload_native(service, name, scope,
                                                     _replay(body, receive), send)
                if native.path_field is not None:  # a load: a push's verdict first
                    await service.check_native_load(
                        request.get(native.path_field) if isinstance(request, dict) else None)
                else:
                    await service.refuse_if_unsupported()
                return await self.app(scope, _replay(body, receive), send)
            admitted, engine_named, scope, body = self._admit(service, scope, request, body)
        except LoRASyncError as e:
            return await _json_reply(send, e.status, e.to_json())
        if not admitted and not engine_named:
            return await self.app(scope, _replay(body, receive), send)
        versions = sorted({a.served_name: a for a in admitted}.values(), key=lambda a: a.version)
        # Every engine request this route makes must carry exactly these (applied.py).
        expected = applied.Expected(_route_path(scope), frozenset(
            [a.served_name for a in admitted] + engine_named))
        started = None  # whose reply started: "ours" (the refusal, in the engine's place)

        async def send_with_version(message):
            nonlocal started
            if started == "ours":
                return  # the engine's reply to a refused request: ours went instead
            if message["type"] == "http.response.start":
                refusal = expected.refusal(message)
                started = "engine" if refusal is None else "ours"
                if refusal is not None:
                    return await _json_reply(send, refusal.status, refusal.to_json())
                if versions:
                    message = {**message, "headers": list(message.get("headers", [])) + [
                        (b"x-lora-version", ",".join(str(a.version) for a in versions).encode()),
                        (b"x-lora-name", ",".join(a.served_name for a in versions).encode())]}
            await send(message)
        token = applied.expect(expected)
        try:
            await self.app(scope, _replay(body, receive), send_with_version)
        except LoRASyncError as e:
            if e is not expected.refused or started is not None:
                raise
            await _json_reply(send, e.status, e.to_json())
        finally:
            applied.done(token)
            for a in admitted:
                service.registry.release(a.served_name)

    async def _unload_native(self, service, name, scope, receive, send) -> None:
        """Runs the engine's unload; once it succeeded, the engine's cached copy is evicted
        (registry.evict_when_idle): vLLM's own unload only forgets the name."""
        adapter_id = service.bridge.engine_adapter_id(name) if isinstance(name, str) else None
        status = []

        async def watch(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
        await self.app(scope, receive, watch)
        if adapter_id is not None and status and 200 <= status[0] < 300:
            service.registry.evict_when_idle(adapter_id)

    def _native_route(self, scope) -> NativeRoute | None:
        method, path = scope["method"], scope["path"]
        route = self.native.get((method, path))
        if route is None:
            route = next((r for r in self.native_prefixes
                          if r.method == method and path.startswith(r.path)), None)
        return route

    def _admit(self, service, scope, request, body):
        """Admits every adapter the request names; returns (admitted, the engine's own
        adapters it names, scope, body) with the request rewritten to name the admitted
        versions."""
        if not isinstance(request, dict):
            request = {}  # no JSON names, but the SageMaker header may still name one
        places = [request] + [request[k] for k in NESTED if isinstance(request.get(k), dict)]
        for place in places:
            for f in INTERNAL_FIELDS:
                if place.get(f) is not None:
                    raise BadRequest(f"field {f!r} is internal to the engine; name the "
                                     "adapter in 'model' or 'lora_path'", code="bad_request")
            for f, marker in self.cache_key_fields.items():
                values = place.get(f) if isinstance(place.get(f), list) else [place.get(f)]
                if any(isinstance(v, str) and marker in v for v in values):
                    raise BadRequest(f"field {f!r} must not contain {marker!r}: the engine "
                                     "keys lora-sync's adapters by it", code="bad_request")
        admitted, ok, model_served = _Named(), False, None
        # Who asks (tenants.py): every name below is admitted for this caller, or answered
        # as a name that is not served.
        caller = service.access.caller(_header(scope, b"authorization"))
        try:
            header = _header(scope, SAGEMAKER_ADAPTER_HEADER)
            if header is not None and not self.reads_adapter_header:
                raise BadRequest("this engine does not read the X-Amzn-SageMaker-Adapter-"
                                 "Identifier header (it would serve the base model); name "
                                 "the adapter in 'model' or 'lora_path'", code="bad_request")
            if header is not None:
                served = self._admit_name(service, header, admitted, caller)
                if served is not None:
                    scope = _with_header(scope, SAGEMAKER_ADAPTER_HEADER, served)
            for place in places:
                for f in NAME_FIELDS:
                    value = place.get(f)
                    if isinstance(value, list):
                        place[f] = [self._admit_name(service, v, admitted, caller) or v
                                    for v in value]
                        continue
                    if not isinstance(value, str):
                        continue
                    served = self._admit_model(service, value, admitted, caller) \
                        if f == "model" else self._admit_name(service, value, admitted, caller)
                    if served is not None:
                        place[f] = served
                        model_served = model_served or (served if f == "model" else None)
            if model_served is not None:
                for f in self.also_set:  # SGLang serves the adapter named in lora_path
                    if request.get(f) not in (None, model_served):
                        raise BadRequest(f"'model' names {model_served} but {f!r} names "
                                         f"another adapter; name it once", code="bad_request")
                    request[f] = model_served
            if admitted and self.engine_guards is not None \
                    and not self.engine_guards(scope["path"]):
                service.access.authorize_generation(_header(scope, b"authorization"), caller)
            ok = True
        finally:
            if not ok:
                for a in admitted:
                    service.registry.release(a.served_name)
        if (admitted or model_served) and request:  # rewritten: the engine reads the new one
            body = json.dumps(request).encode()
            scope = _with_header(scope, b"content-length", str(len(body)))
        return admitted, admitted.engine, scope, body

    def _admit_model(self, service, model: str, admitted: list, caller) -> str | None:
        """`model` read as the engine reads it: the versioned name it resolves to if it is
        ours; with strict_models, a name neither we nor the engine serve is a 404."""
        name = self.model_adapter(model)
        served = self._admit_name(service, name, admitted, caller)
        if served is None and self.strict_models and not service.registry.serves(name):
            raise NotFound(f"model {name[:140]!r} is not served here (neither a model nor an "
                           "adapter of this server)", code="model_not_found")
        if served is None and self.also_set and name == model \
                and name not in self.model_names and service.registry.serves(name):
            # An engine adapter named bare: SGLang would read it as a model name and serve
            # the base model. It is named where the engine serves it (`also_set`), as ours.
            return name
        return served

    def _admit_name(self, service, value, admitted: list, caller) -> str | None:
        """The versioned name `value` resolves to, if it is one of ours (counted in flight).
        An adapter the engine loaded itself is refused to a key that may not generate on it
        (a tenant's generate = "base"), as a name that is not served."""
        if not isinstance(value, str):
            return None
        record = service.admit(value, caller)
        if record is None:
            if self.engine_adapter(service, value):
                if not service.access.tenancy.may_generate(caller, value):
                    raise hide(value, "model")
                admitted.engine.append(value)
            return None
        admitted.append(record)
        return record.served_name

    def engine_adapter(self, service, name: str) -> bool:
        """Whether `name` is an adapter the engine serves itself, not one of its models:
        where admission knows the model names (SGLang), any other engine name; else the
        engine's own adapter table (vLLM's bridge)."""
        if not service.registry.serves(name) or name in self.model_names:
            return False
        return bool(self.model_names) or service.bridge.engine_adapter_id(name) is not None

    def listed_for(self, service, caller, model_id: str) -> bool:
        """Whether `caller` sees `model_id` in the engine's model listing: the models, and
        the adapters (ours, the engine's) it may generate on."""
        base = naming.split_versioned(model_id)[0]
        adapter = service.registry.owns(model_id) or service.access.tenancy.owner_of(base) is not None \
            or self.engine_adapter(service, model_id)
        return not adapter or service.access.tenancy.may_generate(caller, base)


async def _list_models_for(service, app, scope, receive, send, listed_for) -> None:
    """The engine's model listing, less the adapters the caller may not generate on (other
    tenants' names would otherwise be probed here)."""
    caller = service.access.caller(_header(scope, b"authorization"))
    start, chunks = None, []

    async def keep(message):
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
    await app(scope, receive, keep)
    if start is None:
        return
    body = b"".join(chunks)
    try:
        listing = json.loads(body) if start["status"] == 200 else None
    except ValueError:
        listing = None
    if isinstance(listing, dict) and isinstance(listing.get("data"), list):
        listing["data"] = [m for m in listing["data"] if not isinstance(m, dict)
                           or not isinstance(m.get("id"), str)
                           or listed_for(service, caller, m["id"])]
        body = json.dumps(listing).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _native_name(route: NativeRoute, scope, request) -> str | None:
    if route.field is None:
        return scope["path"][len(route.path):] or None
    return request.get(route.field) if isinstance(request, dict) else None


# Bodies the engines read as forms, not JSON (vLLM's audio routes).
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
# Encodings an engine may undo behind admission (SGLang's x-body-compressed middleware):
# admission cannot read such a body, so it is refused rather than passed on unread.
ENCODING_HEADERS = (b"content-encoding", b"x-body-compressed")


def _parse(body: bytes, scope):
    """The JSON body, or None when there is none or it is a form. The content type does not
    decide: some engine routes read JSON whatever the header says (vLLM's /invocations), so
    a body that parses is admitted. A body that claims to be JSON must parse: the engine
    would otherwise read an adapter name that admission never saw (a parser differential)."""
    for name in ENCODING_HEADERS:
        if (_header(scope, name) or "identity").strip().lower() != "identity":
            raise BadRequest(f"{name.decode()} bodies cannot be checked by lora-sync's "
                             "admission; send the request uncompressed", code="bad_request")
    ctype = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
    if not body.strip() or ctype in FORM_TYPES:
        return None
    try:
        return loads(body)
    except RecursionError:
        raise BadRequest("request body is nested too deeply", code="bad_request") from None
    except ValueError as e:
        if ctype not in ("", "application/json") and not ctype.endswith("+json"):
            return None  # not JSON, and not claimed to be: no engine reads a name from it
        raise BadRequest(f"request body is not valid JSON: {str(e)[:200]}",
                         code="bad_request") from None


def _route_path(scope) -> str:
    """The path the app's routes match (less a --root-path, as Starlette's Mount reads it)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _header(scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _with_header(scope, name: bytes, value: str) -> dict:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != name]
    return {**scope, "headers": headers + [(name, value.encode())]}


async def _read_body(receive, limit: int) -> bytes:
    chunks, more, n = [], True, 0
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        n += len(chunk)
        if n > limit:
            raise PayloadTooLarge(f"request body above {limit} bytes "
                                  "(LORA_SYNC_MAX_REQUEST_MB)")
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """Hands the already-read body to the app, then the real channel (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _json_reply(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
