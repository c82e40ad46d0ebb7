"""The shm Transport: the trainer's push, the server's routes, the worker's intake."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


from ... import wire
from ...errors import BadRequest, LoRASyncError, NotFound, TooBusy
from ...staging import StagedBody
from ..base import ClientConfig, PushResult, Received, Route, SealedCopy, SendContext, Server, \
    ServerContext, Staged, Transport, staged_file
from ..device_copy import on_device
from .lease_table import LeaseTable
from .messages import (CANCEL_ROUTE, COMMIT_ROUTE, LEASE_ROUTE, RENEW_ROUTE, CommitRequest, Lease,
                       LeaseRequest)
from .ready_lease import ReadyLeases
from .trainer import LeaseRefused, _CopyOnSent, _post, total_bytes, write_lease
from .worker import map_read_only, receive_sealed


@dataclass
class ShmClientState:
    """A client's shm state: its leases readied ahead (None: it readies none), and which
    servers' leases it found out of reach (another host or PID namespace)."""
    ready: ReadyLeases | None
    reach: dict = field(default_factory=dict)  # server url -> its leases reach us


class ShmTransport(Transport):
    name = "shm"
    push_path = f"/{COMMIT_ROUTE}"
    start_path = f"/{LEASE_ROUTE}"

    def routes(self):
        def ticket(body, limits):
            return CommitRequest.from_json(body)
        return {self.start_path: Route(lambda body, limits: LeaseRequest.from_json(
                    body, limits.max_body_bytes), self.grant),
                f"/{CANCEL_ROUTE}": Route(ticket, self.cancel),
                f"/{RENEW_ROUTE}": Route(ticket, self.renew),
                self.push_path: Route(ticket)}

    # trainer side
    auto_order = 0  # first: on the trainer's host nothing is cheaper

    def new_client_state(self, config: ClientConfig) -> "ShmClientState":
        return ShmClientState(ReadyLeases(config.headers, config.client_id,
                                          config.probe_timeout) if config.lease_ahead else None)

    def close_client_state(self, state: "ShmClientState") -> None:
        if state.ready is not None:
            state.ready.close()

    def after_push(self, state: "ShmClientState") -> None:
        if state.ready is not None:
            state.ready.start()  # the next leases, readied after this push

    def reaches(self, server: Server, state: "ShmClientState") -> bool:
        return state.reach.get(server.url, True)

    def keeps_copy(self, state) -> bool:
        return True  # the sealed lease, where the server is reachable (else HTTP, no copy)

    def prepare(self, adapter, ctx: SendContext) -> list:
        return wire.layout(adapter.tensors, adapter.metadata(ctx.name, ctx.version,
                                                              ctx.checksum))

    def send(self, parts: list, server: Server, ctx: SendContext) -> PushResult | None:
        """Into the lease the client readied for this name (ready_lease.py) if it has one,
        else lease, write, commit. None (after cancelling the lease) when the server's
        memory is not reachable from this process, which the state remembers (`reaches`):
        `auto` then takes HTTP. After a push, it asks for the next lease of this size to be
        readied (`ctx.ahead`)."""
        state: ShmClientState | None = ctx.state
        ready = state.ready if state is not None and ctx.ahead else None
        nbytes = total_bytes(parts)
        result = None
        if ready is not None:
            result = self._send_ready(ready, parts, server, ctx, nbytes)
        if result is None:
            result = self._send_fresh(parts, server, ctx, nbytes)
        if state is not None:
            state.reach[server.url] = result is not None
        if result is not None and ready is not None:
            ready.want(server, ctx.name, nbytes, pin=any(on_device(p) for p in parts))
        return result

    def _send_ready(self, leases, parts, server, ctx, nbytes) -> PushResult | None:
        t0 = time.perf_counter()
        ready = leases.take(server, ctx.name, nbytes)
        if ready is None:
            return None
        copy = _CopyOnSent(ready.mapping, parts, ready.pin)
        try:
            return self._commit(ready.lease, ready.read_fd, server, ctx, t0,
                                time.perf_counter(), copy)
        except NotFound:  # it expired (the trainer slept through its renewals) or restarted
            return None
        finally:
            os.close(ready.read_fd)
            copy.finish()  # its error, not the server's refusal of the incomplete lease

    def _send_fresh(self, parts, server, ctx, nbytes) -> PushResult | None:
        t0 = time.perf_counter()
        try:
            granted, _ = _post(server, LEASE_ROUTE, ctx, {"nbytes": nbytes,
                                                          "client": ctx.client_id})
        except TooBusy as e:
            refused = LeaseRefused(e.message, code=e.code, status=e.status)
            refused.server = e.server
            raise refused from e
        lease = Lease.from_json(granted, server.url, nbytes)
        t1 = time.perf_counter()
        read_fd = write_lease(lease, parts)
        if read_fd is None:  # not a memfd this process can reach: never written
            try:
                _post(server, CANCEL_ROUTE, ctx, lease.ticket())
            except LoRASyncError:
                pass  # it expires on the server anyway; why the lease went unused stands
            return None
        try:
            return self._commit(lease, read_fd, server, ctx, t0, t1)
        finally:
            os.close(read_fd)

    @staticmethod
    def _commit(lease: Lease, read_fd: int, server, ctx, t0: float, t1: float,
                copy: "_CopyOnSent | None" = None) -> PushResult:
        """The commit call (`t0`-`t1` was getting the lease). Without `copy` the lease is
        written already; with it, the copy into the mapped lease runs once the request has
        left, while the server takes it up to the seal, which waits for the unmap (see
        `write_then_unmap` for why a commit ahead of its bytes is safe). With `ctx.keep`,
        the result keeps the file as the server holds it (`kept`): the sealed lease mapped
        read-only, no copy (its tensors: `view_mapped`)."""
        t2 = time.perf_counter()
        reply, _ = _post(server, COMMIT_ROUTE, ctx, lease.ticket(),
                         on_sent=copy.run if copy is not None else None)
        result = PushResult.from_reply(server.url, reply, time.perf_counter() - t0, ctx.name,
                                       ctx.version)
        timings = reply.setdefault("timings_ms", {})  # a dict: checked by from_reply
        # trainer side: `write`, before the commit went out; `copy`, after (the server's
        # `receive` waited for it)
        timings.update(lease=(t1 - t0) * 1e3, write=(t2 - t1) * 1e3)
        if copy is not None:
            timings["copy"] = copy.seconds * 1e3
        if ctx.keep:
            result.kept = SealedCopy(map_read_only(read_fd))
        return result

    # server side
    def new_state(self, limits) -> LeaseTable:
        return LeaseTable(limits.lease_ttl_s, limits.max_leases)

    def held_bytes(self, state: LeaseTable) -> int:
        return state.held_bytes

    def leases(self, state: LeaseTable) -> dict:
        return state.pending

    def info(self, state: LeaseTable) -> dict:
        return {"open_leases": len(state.pending)}

    async def grant(self, req: LeaseRequest, ctx: ServerContext) -> dict:
        """A lease's pages come from the retired versions' memory where they can: a push's
        own lease frees them now, as the push would at its commit; a lease readied ahead
        waits for them to go as they would, at the next pause in serving. Fresh pages cost
        a VM's host many times the work of recycled ones, and that work ran beside the first
        requests on the version just pushed (SGLang's first completion measurably slower)."""
        await ctx.retired_freed(hasten=not req.ahead)
        budget = ctx.limits.max_staging_bytes - ctx.staging.inflight
        return ctx.state.grant(req.nbytes, budget, req.client).to_json()

    async def cancel(self, req: CommitRequest, ctx: ServerContext) -> dict:
        ctx.state.cancel(req)
        return {"cancelled": True}

    async def renew(self, req: CommitRequest, ctx: ServerContext) -> dict:
        return {"expires_s": ctx.state.renew(req)}

    async def stage(self, req: CommitRequest, ctx: ServerContext) -> Staged:
        t0 = time.perf_counter()
        sealed, header = await ctx.state.take(req)
        # receive: the seal (with its wait for the trainer's unmap) and the header
        return staged_file(StagedBody(sealed.path, sealed.nbytes, header), sealed,
                           receive=(time.perf_counter() - t0) * 1e3)

    # worker side
    def receive(self, intake, pool) -> Received:
        """The sealed lease, mapped or read (`receive_sealed`)."""
        received = receive_sealed(intake.args["path"], pool)
        if received is None:
            raise BadRequest("the committed lease is not sealed", code="bad_lease")
        return received
