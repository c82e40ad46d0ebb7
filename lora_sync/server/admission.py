"""Admission of generation requests that name a lora-sync adapter (ASGI middleware).

At admission the alias is resolved to the newest servable version and the request is
rewritten to name that version, so the engine serves exactly it even if a push moves the
alias meanwhile. The version is counted as in flight until the response ends; a retired
version is dropped from the engine only when its last request finishes. Every reply carries
`X-LoRA-Version` / `X-LoRA-Name` headers naming the version that served it.
"""
from __future__ import annotations

import json

# Routes whose JSON body names the adapter, and the field that does (OpenAI routes on both
# engines; SGLang's native /generate uses lora_path).
ADAPTER_FIELDS = {"/v1/completions": "model", "/v1/chat/completions": "model",
                  "/generate": "lora_path"}


class AdmissionMiddleware:
    def __init__(self, app, also_set: tuple[str, ...] = ()):
        self.app = app
        self.also_set = also_set  # more fields to set to the version (engine-specific)

    async def __call__(self, scope, receive, send):
        field = ADAPTER_FIELDS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if field is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        service = getattr(scope["app"].state, "lora_sync", None)
        body = await _read_body(receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        name = request.get(field) if isinstance(request, dict) else None
        admitted = None
        if service is not None and isinstance(name, str):
            # SGLang style "base:adapter" names the adapter after the colon.
            admitted = service.admit(name.rsplit(":", 1)[-1])
        if admitted is None:  # not ours: pass through untouched
            return await self.app(scope, _replay(body, receive), send)
        if isinstance(admitted, dict):  # a retired or unknown version of one of our names
            return await _json_reply(send, 404, admitted)
        for f in (field, *self.also_set):
            request[f] = admitted.served_name
        body = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}

        async def send_with_version(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + [
                    (b"x-lora-version", str(admitted.version).encode()),
                    (b"x-lora-name", admitted.served_name.encode())]}
            await send(message)
        try:
            await self.app(scope, _replay(body, receive), send_with_version)
        finally:
            service.release(admitted.served_name)


async def _read_body(receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
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
