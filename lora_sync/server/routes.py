"""The added HTTP routes, thin: parse, call the service, map errors to status codes.
Mounted under /v1 on vLLM and at the root on SGLang."""
from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from ..errors import BadAdapter, LoRASyncError, PayloadTooLarge
from .service import AdapterService

logger = logging.getLogger("lora_sync")
# POST routes whose JSON body goes straight to the service method of the same job.
JSON_ROUTES = {"/init_lora_update_group": "init_group",
               "/load_lora_adapter_from_distributed": "load_from_distributed",
               "/destroy_lora_update_group": "destroy_group",
               "/retire_lora_adapter": "retire_name",
               "/lora_sync_lease": "grant_lease",
               "/lora_sync_lease_cancel": "cancel_lease",
               "/load_lora_adapter_from_lease": "load_from_lease"}
GET_ROUTES = ("/lora_sync_info", "/lora_adapters")
PICKLE_HINT = ("send the adapter as a safetensors body with Content-Type: "
               "application/octet-stream (see docs/protocol.md); pickled tensors are refused")


def _service(request: Request) -> AdapterService:
    return request.app.state.lora_sync


def own_paths(prefix: str) -> frozenset:
    """Every path of ours (admission leaves them to the routes' own checks)."""
    return frozenset(prefix + p for p in (*JSON_ROUTES, *GET_ROUTES,
                                          "/load_lora_adapter_from_tensors"))


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

    async def handle(request: Request, action):
        try:
            service = _service(request)
            service.authorize(request.headers.get("authorization"))
            return JSONResponse(await action(service))
        except LoRASyncError as e:
            return JSONResponse(e.to_json(), status_code=e.status)
        except ClientDisconnect:
            err = BadAdapter("the client disconnected before the body was complete",
                             code="client_disconnected")
            return JSONResponse(err.to_json(), status_code=err.status)
        except Exception as e:  # a bug of ours or the engine's: say so, keep serving
            logger.exception("lora-sync route %s failed", request.url.path)
            err = LoRASyncError(f"{type(e).__name__}: {e}")
            return JSONResponse(err.to_json(), status_code=err.status)

    @router.post("/load_lora_adapter_from_tensors")
    async def load_from_tensors(request: Request):
        async def act(service: AdapterService):
            ctype = request.headers.get("content-type", "").split(";")[0].strip()
            if ctype != "application/octet-stream":
                raise BadAdapter(f"Content-Type {ctype or 'none'!r} refused: {PICKLE_HINT}",
                                 code="bad_content_type", status=415)
            length = request.headers.get("content-length")
            if length is not None and not (length.isascii() and length.isdigit()):
                raise BadAdapter("Content-Length must be a decimal integer", code="bad_request")
            return await service.load_from_body(request.stream(),
                                                int(length) if length else None)
        return await handle(request, act)

    def add_json_route(path: str, method: str):
        async def route(request: Request):
            async def act(service: AdapterService):
                body = await _json(request, service.settings.max_request_bytes)
                return await getattr(service, method)(body)
            return await handle(request, act)
        router.post(path)(route)

    for path, method in JSON_ROUTES.items():
        add_json_route(path, method)

    @router.get("/lora_sync_info")
    async def info(request: Request):
        return await handle(request, lambda s: s.info())

    @router.get("/lora_adapters")
    async def list_adapters(request: Request):
        async def act(service):
            return service.list_adapters()
        return await handle(request, act)

    return router
