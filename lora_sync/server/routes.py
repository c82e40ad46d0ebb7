"""The added HTTP routes, thin: parse, call the service, map errors to status codes.
Mounted under /v1 on vLLM and at the root on SGLang."""
from __future__ import annotations

import hmac
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import BadAdapter, LoRASyncError, Unauthorized
from .service import AdapterService

logger = logging.getLogger("lora_sync")
# POST routes whose JSON body goes straight to the service method of the same job.
JSON_ROUTES = {"/init_lora_update_group": "init_group",
               "/load_lora_adapter_from_distributed": "load_from_distributed",
               "/destroy_lora_update_group": "destroy_group"}
PICKLE_HINT = ("send the adapter as a safetensors body with Content-Type: "
               "application/octet-stream (see docs/protocol.md); pickled tensors are refused")


def _service(request: Request) -> AdapterService:
    return request.app.state.lora_sync


def _authorize(request: Request, service: AdapterService) -> None:
    key = service.settings.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise Unauthorized("missing or wrong API key for lora-sync admin routes")


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except Exception as e:
        raise BadAdapter("body must be JSON", code="bad_request") from e
    if not isinstance(body, dict):
        raise BadAdapter("body must be a JSON object", code="bad_request")
    return body


def build_router(prefix: str = "") -> APIRouter:
    router = APIRouter(prefix=prefix)

    async def handle(request: Request, action):
        try:
            service = _service(request)
            _authorize(request, service)
            return JSONResponse(await action(service))
        except LoRASyncError as e:
            return JSONResponse(e.to_json(), status_code=e.status)
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
            return await service.load_from_body(request.stream(),
                                                int(length) if length else None)
        return await handle(request, act)

    def add_json_route(path: str, method: str):
        async def route(request: Request):
            async def act(service: AdapterService):
                return await getattr(service, method)(await _json(request))
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
