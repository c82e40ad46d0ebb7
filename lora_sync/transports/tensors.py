"""Tensors over HTTP: the adapter as one safetensors body, streamed from tensor memory into
a staged file the workers map. Works from any host."""
from __future__ import annotations

import time

from .. import http
from ..staging import StagedFile, open_staged
from .base import PushResult, RawBody, Received, Route, SendContext, Server, ServerContext, \
    Staged, Transport, staged_file, with_protocol

ROUTE = "load_lora_adapter_from_tensors"


class TensorsTransport(Transport):
    name = "tensors"
    push_path = f"/{ROUTE}"

    def routes(self):
        return {self.push_path: Route(stream=True)}

    # trainer side
    auto_order = 1  # reaches any server the client can call
    def send(self, adapter, server: Server, ctx: SendContext) -> PushResult:
        chunks = adapter.encode(ctx.name, ctx.version, with_checksum=ctx.checksum)
        t0 = time.perf_counter()
        body, _ = http.call("POST", server.route(ROUTE), chunks=chunks, timeout=ctx.timeout,
                            headers={**with_protocol(ctx.headers),
                                     "Content-Type": "application/octet-stream"},
                            on_sent=ctx.body_sent)
        return PushResult.from_reply(server.url, body, time.perf_counter() - t0, ctx.name,
                                     ctx.version)

    # server side
    async def stage(self, raw: RawBody, ctx: ServerContext) -> Staged:
        t0 = time.perf_counter()
        body = await ctx.receive_body(raw)
        return staged_file(body, StagedFile(ctx.staging, body.path),
                           receive=(time.perf_counter() - t0) * 1e3)

    # worker side
    def receive(self, intake, pool) -> Received:
        """Views the staged body in place: the tensors share its mapping (`open_staged`),
        read-only where the engine only reads them."""
        header, tensors = open_staged(intake.args["path"], read_only=pool.maps_read_only)
        return Received(tensors, header.total_bytes - header.data_start,
                        read_only=pool.maps_read_only)
