"""Tensors over HTTP: the adapter as one safetensors body, streamed from tensor memory into
a staged file the workers map."""
from __future__ import annotations

import time

from .. import http
from ..staging import StagedFile, open_staged
from .base import PushResult, RawBody, Received, Route, Server

ROUTE = "load_lora_adapter_from_tensors"


# -- trainer side -----------------------------------------------------------------------
def push_one(client, server: Server, adapter, name: str, version: int | None,
             checksum: bool) -> PushResult:
    chunks = adapter.encode(name, version, with_checksum=checksum)
    t0 = time.perf_counter()
    body, _ = http.call("POST", server.route(ROUTE), chunks=chunks, timeout=client.timeout,
                        headers={**client.headers, "Content-Type": "application/octet-stream"})
    return PushResult.from_reply(server.url, body, time.perf_counter() - t0, name, version)


# -- server side (API process) ----------------------------------------------------------
async def load(service, raw: RawBody) -> dict:
    t0 = time.perf_counter()
    settle_ms = await service.settle()
    t_recv = time.perf_counter()
    staged = await service.receive_body(raw.chunks, raw.content_length)
    return await service.install_file(staged, StagedFile(service.staging, staged.path),
                                      "tensors", t0, settle=settle_ms,
                                      receive=(time.perf_counter() - t_recv) * 1e3)

ROUTES = {f"/{ROUTE}": Route(load, body="stream")}


# -- worker side ------------------------------------------------------------------------
def worker_intake(worker, path: str) -> Received:
    """Views the staged body in place: the tensors share its mapping (see `open_staged`)."""
    header, tensors = open_staged(path, only_reader=worker.world_size == 1)
    return Received(tensors, header.total_bytes - header.data_start)
