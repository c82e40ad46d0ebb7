"""The added HTTP routes, thin: parse, call the service, map errors to status codes.
Mounted under /v1 on vLLM and at the root on SGLang."""
from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from ..errors import BadRequest, ClientDisconnected, LoRASyncError, PayloadTooLarge
from ..api import ADAPTERS_ROUTE, ALIAS_ROUTE, GET_ROUTES, INFO_ROUTE, RETIRE_ROUTE
from ..fields import loads
from ..transports import TRANSPORTS
from ..transports.base import PROTOCOL_HEADER, PROTOCOL_VERSION, RawBody, Transport, \
    check_protocol
from . import metrics
from .service import AdapterService
from .socket_body import RAW_RECEIVE, BodyChunks

logger = logging.getLogger("lora_sync")
# Every POST route: path -> (transport, its Route); and retiring a name, the service's own.
TRANSPORT_ROUTES = {path: (t, route) for t in TRANSPORTS.values()
                    for path, route in t.routes().items()}
# The routes whose reply is a push's outcome, by transport (metrics and the push log line),
# and a push's first step (shm's lease): a refused first step is a failed push.
PUSH_ROUTES = {t.push_path: t.name for t in TRANSPORTS.values()}
PUSH_START_ROUTES = {t.start_path: t.name for t in TRANSPORTS.values() if t.start_path}
# Every lora-sync reply names the server instance that gave it (new at each start).
INSTANCE_HEADER = "X-LoRA-Sync-Instance"
PICKLE_HINT = ("send the adapter as a safetensors body with Content-Type: "
               "application/octet-stream (see docs/protocol.md); pickled tensors are refused")


def _service(request: Request) -> AdapterService:
    return request.app.state.lora_sync


def own_paths(prefix: str) -> frozenset:
    """Every path of ours (admission leaves them to the routes' own checks)."""
    return frozenset(prefix + p for p in (*TRANSPORT_ROUTES, RETIRE_ROUTE, ALIAS_ROUTE,
                                          *GET_ROUTES))


def put_first(routes: list, before: int) -> None:
    """Moves the routes added since `routes` had `before` entries to its front: Starlette,
    and SGLang's request metrics after it, match each request against the routes in order,
    and an engine's hundred routes ahead of ours took a visible part of every push's round
    trip. Our paths are ours alone (SGLang's same-path routes are removed first), so a route
    of ours now also wins over any upstream pattern that would have matched it too."""
    routes[:] = routes[before:] + routes[:before]


async def _json(request: Request, limit: int) -> dict:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise PayloadTooLarge(f"JSON body above {limit} bytes (LORA_SYNC_MAX_REQUEST_MB)")
    try:
        body = loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"body must be JSON ({type(e).__name__})", code="bad_request") from e
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object", code="bad_request")
    return body


def build_router(prefix: str = "") -> APIRouter:
    router = APIRouter(prefix=prefix)

    async def handle(request: Request, action, route: str):
        service = _service(request)
        t0 = time.perf_counter()
        caller = None
        try:
            # who: the operator, or a tenant (tenants.py); the action gets it
            caller = service.access.authorize(request.headers.get("authorization"))
            if request.method == "POST":  # another protocol: refused before anything else
                check_protocol(request.headers.get(PROTOCOL_HEADER))
            body, status = await action(service, caller), 200
        except LoRASyncError as e:
            body, status = e.to_json(), e.status
        except ClientDisconnect:
            err = ClientDisconnected("the client disconnected before the body was complete")
            body, status = err.to_json(), err.status
        except Exception as e:  # a bug of ours or the engine's: say so, keep serving
            logger.exception("lora-sync route %s failed", request.url.path)
            err = LoRASyncError(f"{type(e).__name__}: {e}")
            body, status = err.to_json(), err.status
        seconds = time.perf_counter() - t0
        tenant = caller.label if caller and service.access.tenancy.enabled else None

        async def record() -> None:
            # Right after the reply is written, in the same task: no other request is read
            # in between unless that write has to wait, so a /metrics read after the reply
            # sees it. Before the reply, the push's log line and counters took a visible
            # part of the API process's time per push.
            metrics.observe(route, status, body, seconds,
                            PUSH_ROUTES.get(route) or PUSH_START_ROUTES.get(route), tenant=tenant)
        body["instance_id"] = service.instance_id
        return JSONResponse(body, status_code=status,
                            headers={INSTANCE_HEADER: service.instance_id,
                                     PROTOCOL_HEADER: str(PROTOCOL_VERSION)},
                            background=BackgroundTask(record))

    async def read_stream(request: Request, service: AdapterService) -> RawBody:
        ctype = request.headers.get("content-type", "").split(";")[0].strip()
        if ctype != "application/octet-stream":
            raise BadRequest(f"Content-Type {ctype or 'none'!r} refused: {PICKLE_HINT}",
                             code="bad_content_type", status=415)
        length = request.headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit()):
            raise BadRequest("Content-Length must be a decimal integer", code="bad_request")
        length = int(length) if length else None
        chunks = request.stream()
        if service.settings.socket_body:  # from the socket where it can (socket_body.py)
            chunks = BodyChunks(request.scope.get(RAW_RECEIVE), length, chunks)
        return RawBody(chunks, length)

    async def read_json(request: Request, service: AdapterService) -> dict:
        return await _json(request, service.settings.max_request_bytes)

    def add_transport_route(path: str, transport: Transport, route):
        async def act(service: AdapterService, request: Request, caller):
            if route.stream:
                parsed = await read_stream(request, service)
            else:
                parsed = route.parse(await read_json(request, service), service.settings)
            return await service.transport_call(transport, route, parsed, caller)

        async def endpoint(request: Request):
            return await handle(request, lambda service, caller: act(service, request, caller),
                                path)
        router.post(path)(endpoint)

    for path, (transport, route) in TRANSPORT_ROUTES.items():
        add_transport_route(path, transport, route)

    @router.post(RETIRE_ROUTE)
    async def retire(request: Request):
        async def act(service: AdapterService, caller):
            return await service.retire_name(await read_json(request, service), caller)
        return await handle(request, act, RETIRE_ROUTE)

    @router.post(ALIAS_ROUTE)
    async def alias(request: Request):
        async def act(service: AdapterService, caller):
            return await service.point_alias(await read_json(request, service), caller)
        return await handle(request, act, ALIAS_ROUTE)

    @router.get(INFO_ROUTE)
    async def info(request: Request):
        return await handle(request, lambda s, caller: s.info(caller), INFO_ROUTE)

    @router.get(ADAPTERS_ROUTE)
    async def list_adapters(request: Request):
        async def act(service, caller):
            return service.list_adapters(caller)
        return await handle(request, act, ADAPTERS_ROUTE)

    return router
