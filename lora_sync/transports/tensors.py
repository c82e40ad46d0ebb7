"""Tensors over HTTP: the adapter as one safetensors body, streamed from tensor memory."""
from __future__ import annotations

import time

from .. import http
from .base import PushResult, Server

ROUTE = "load_lora_adapter_from_tensors"


def push_one(client, server: Server, adapter, name: str, version: int | None,
             checksum: bool) -> PushResult:
    chunks = adapter.encode(name, version, with_checksum=checksum)
    t0 = time.perf_counter()
    body, _ = http.call("POST", server.route(ROUTE), chunks=chunks, timeout=client.timeout,
                        headers={**client.headers, "Content-Type": "application/octet-stream"})
    return PushResult.from_reply(server.url, body, time.perf_counter() - t0)
