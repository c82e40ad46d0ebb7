"""The added HTTP routes, thin: parse, call the service, map errors to status codes.
Mounted under /v1 on vLLM and at the root on SGLang."""
from __future__ import annotations

import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from ..errors import BadAdapter, LoRASyncError, PayloadTooLarge
from ..transports import TRANSPORTS, broadcast, shm, tensors
from ..transports.base import RawBody, Route
from . import metrics
from .service import AdapterService

logger = logging.getLogger("lora_sync")
# Every POST route: the transports' own, and retiring a name.
POST_ROUTES = {path: route for module in TRANSPORTS.values()
               for path, route in module.ROUTES.items()}
POST_ROUTES["/retire_lora_adapter"] = Route(AdapterService.retire_name)
GET_ROUTES = ("/lora_sync_info", "/lora_adapters")
# The routes whose reply is a push's outcome, by transport (metrics and the push log line),
# and the shm lease, the first step of an shm push: a refused lease is a failed push.
PUSH_ROUTES = {f"/{tensors.ROUTE}": "tensors", f"/{shm.COMMIT_ROUTE}": "shm",
               f"/{broadcast.LOAD_ROUTE}": "broadcast"}
PUSH_START_ROUTES = {f"/{shm.LEASE_ROUTE}": "shm"}
# Every lora-sync reply names the server instance that gave it (new at each start).
INSTANCE_HEADER = "X-LoRA-Sync-Instance"
PICKLE_HINT = ("send the adapter as a safetensors body with Content-Type: "
               "application/octet-stream (see docs/protocol.md); pickled tensors are refused")


def _service(request: Request) -> AdapterService:
    return request.app.state.lora_sync


def own_paths(prefix: str) -> frozenset:
    """Every path of ours (admission leaves them to the routes' own checks)."""
    return frozenset(prefix + p for p in (*POST_ROUTES, *GET_ROUTES))


async def _json(request: Request, limit: int) -> dict:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise PayloadTooLarge(f"JSON body above {limit} bytes (LORA_SYNC_MAX_REQUEST_MB)")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadAdapter(f"body must be JSON ({type(e).__name__})", code="bad_request") from e
    if not isinstance(body, dict):
        raise BadAdapter("body must be a JSON object", code="bad_request")
    return body


def build_router(prefix: str = "") -> APIRouter:
    router = APIRouter(prefix=prefix)

    async def handle(request: Request, action, route: str):
        service = _service(request)
        t0 = time.perf_counter()
        try:
            service.authorize(request.headers.get("authorization"))
            body, status = await action(service), 200
        except LoRASyncError as e:
            body, status = e.to_json(), e.status
        except ClientDisconnect:
            err = BadAdapter("the client disconnected before the body was complete",
                             code="client_disconnected")
            body, status = err.to_json(), err.status
        except Exception as e:  # a bug of ours or the engine's: say so, keep serving
            logger.exception("lora-sync route %s failed", request.url.path)
            err = LoRASyncError(f"{type(e).__name__}: {e}")
            body, status = err.to_json(), err.status
        metrics.observe(route, status, body, time.perf_counter() - t0,
                        PUSH_ROUTES.get(route) or PUSH_START_ROUTES.get(route))
        body["instance_id"] = service.instance_id
        return JSONResponse(body, status_code=status,
                            headers={INSTANCE_HEADER: service.instance_id})

    async def read_stream(request: Request, service: AdapterService) -> RawBody:
        ctype = request.headers.get("content-type", "").split(";")[0].strip()
        if ctype != "application/octet-stream":
            raise BadAdapter(f"Content-Type {ctype or 'none'!r} refused: {PICKLE_HINT}",
                             code="bad_content_type", status=415)
        length = request.headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit()):
            raise BadAdapter("Content-Length must be a decimal integer", code="bad_request")
        return RawBody(request.stream(), int(length) if length else None)

    async def read_json(request: Request, service: AdapterService) -> dict:
        return await _json(request, service.settings.max_request_bytes)

    readers = {"json": read_json, "stream": read_stream}

    def add_post_route(path: str, route: Route):
        async def endpoint(request: Request):
            async def act(service: AdapterService):
                return await route.handler(service, await readers[route.body](request, service))
            return await handle(request, act, path)
        router.post(path)(endpoint)

    for path, route in POST_ROUTES.items():
        add_post_route(path, route)

    @router.get("/lora_sync_info")
    async def info(request: Request):
        return await handle(request, lambda s: s.info(), "/lora_sync_info")

    @router.get("/lora_adapters")
    async def list_adapters(request: Request):
        async def act(service):
            return service.list_adapters()
        return await handle(request, act, "/lora_adapters")

    return router
