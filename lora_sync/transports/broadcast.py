"""The broadcast transport: the trainer is rank 0 of a torch.distributed group whose other
ranks are the workers of one or more servers (NCCL on GPU, gloo on CPU), and broadcasts the
tensors in buckets; only the metadata crosses HTTP.

  trainer side   init_group / broadcast / destroy_group
  typed messages InitGroupRequest, DistributedLoadRequest
  server routes  /init_lora_update_group, /load_lora_adapter_from_distributed,
                 /destroy_lora_update_group
  worker intake  receive the framed buckets into reused buffers, checked before use

Rules: a group belongs to the client that created it (init returns a token that loading on
it and destroying it take); what the workers receive is framed and checked against the
declaration before it is used (collective.Transfer): a mismatch drops the group and fails
the push with a 400, and the previous versions keep serving. A declaration (the tensors'
names, dtypes and shapes) is sent once per group and layout: the server and its workers keep
the group's last one, and a push of the same layout names it by its digest (`layout`)
instead of listing 336 tensors again (Groups.layout_of)."""
from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import json
import re
import secrets
import socket
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from .. import collective, http, naming
from ..adapter import LoRAAdapter, ModelSpec, check_adapter, parse_config
from ..errors import (BadAdapter, BadRequest, Forbidden, LoRASyncError, PayloadTooLarge, TooBusy,
                      TransferFailed)
from ..fields import field as json_field
from ..wire import MAX_TENSORS, TensorSpec
from .base import PackedCopy, PushResult, Received, Route, SendContext, Server, \
    ServerContext, Staged, Transport, with_protocol

INIT_ROUTE = "init_lora_update_group"
LOAD_ROUTE = "load_lora_adapter_from_distributed"
DESTROY_ROUTE = "destroy_lora_update_group"
MAX_WORLD_SIZE = 4096
MAX_GROUP_TIMEOUT_S = 3600.0
MAX_TRANSFER_ID = 2 ** 63 - 1
# A push's reply may come this long after the group's own timeout: the server's work after
# the transfer (checks, build, register) takes a small fraction of it; a server that has not
# answered by then (a cut link) fails that push, and the client resyncs it later.
REPLY_GRACE_S = 20.0
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass
class TrainerGroup:
    name: str
    pg: object
    world_size: int
    backend: str
    device: str
    bucket_bytes: int
    timeout_s: float
    tokens: dict = field(default_factory=dict)  # server url -> the group's ownership token
    broken: bool = False
    send_buffers: dict = field(default_factory=dict)  # the frames, kept between pushes
    # server url -> the layout that server holds for this group (a push of it names it)
    declared: dict = field(default_factory=dict)
    # The last adapter layout checked against every server: (its names, dtypes and shapes,
    # config as JSON text, specs, their JSON, its Transfer). A trainer pushes one layout every
    # step; checking, planning and listing it again was a noticeable part of each push.
    checked: tuple | None = None

    def plan(self, adapter: LoRAAdapter) -> tuple[list[dict], collective.Transfer]:
        """The adapter's specs as JSON and its transfer under a new id, once its layout and
        config are checked against every server's model (before any collective call)."""
        shapes = [(k, t.dtype, t.shape) for k, t in adapter.tensors.items()]
        config = json.dumps(adapter.config, sort_keys=True)
        if self.checked is None or self.checked[:2] != (shapes, config):
            self.checked = None
            specs = adapter.specs()
            for spec in self.specs:
                check_adapter(specs, adapter.config, spec)
            self.checked = (shapes, config, [s.to_json() for s in specs],
                            collective.Transfer.plan(specs, 0, self.bucket_bytes))
        _, _, listed, transfer = self.checked
        return listed, replace(transfer, transfer_id=secrets.randbelow(MAX_TRANSFER_ID) + 1)


def init_group(servers: list, headers: dict, infos: list, master_address: str,
               master_port: int, backend: str = "gloo", group_name: str = "default",
               timeout_s: float = 120.0,
               bucket_bytes: int = collective.DEFAULT_BUCKET_BYTES,
               streams: int = collective.DEFAULT_STREAMS) -> TrainerGroup:
    """Forms one group with every worker of every server (`infos`: their lora_sync_info):
    server i's workers take ranks offset_i .. offset_i + workers_i - 1, offsets following
    the server order. A server that refuses to join fails the call at once. `streams`:
    gloo connections per pair of ranks (collective.DEFAULT_STREAMS)."""
    headers = with_protocol(headers)
    # Each server's model and what its engine covers, read before any group exists: every
    # push is checked against them as that server will check it (TrainerGroup.plan).
    specs = [ModelSpec.from_info(i) for i in infos]
    offsets, world = [], 1
    for info in infos:
        offsets.append(world)
        world += int(info["workers"])
    bodies = [{"master_address": master_address, "master_port": master_port,
               "rank_offset": off, "world_size": world, "backend": backend,
               "group_name": group_name, "timeout_s": timeout_s, "streams": streams}
              for off in offsets]
    forming: Future = Future()

    def rendezvous():  # a daemon thread: a refused group must not hold the trainer's exit
        try:
            forming.set_result(collective.create_group(master_address, master_port, 0, world,
                                                       backend, timeout_s, streams))
        except BaseException as e:
            forming.set_exception(e)
    pool = ThreadPoolExecutor(len(servers))
    try:
        joins = [pool.submit(http.call, "POST", s.route(INIT_ROUTE), json_body=b,
                             headers=headers, timeout=timeout_s + 30)
                 for s, b in zip(servers, bodies)]
        threading.Thread(target=rendezvous, daemon=True, name="lora-sync-rendezvous").start()
        # A refusal is final: waiting out the rendezvous for its workers would only delay
        # the error (the rendezvous, and the other servers' joins, then time out alone).
        done, _ = wait([forming, *joins], return_when=FIRST_EXCEPTION)
        for f in joins:
            if f in done and f.exception() is not None:
                raise f.exception()
        pg = forming.result()
        replies = [j.result()[0] for j in joins]
    finally:
        pool.shutdown(wait=False)
    device = "cuda" if backend == "nccl" else "cpu"
    group = TrainerGroup(group_name, pg, world, backend, device, bucket_bytes, timeout_s,
                         {s.url: r.get("group_token") for s, r in zip(servers, replies)})
    group.specs = specs
    return group


def destroy_group(servers: list, headers: dict, group: TrainerGroup, timeout: float) -> None:
    headers = with_protocol(headers)
    with ThreadPoolExecutor(len(servers)) as pool:
        for s in servers:
            pool.submit(http.call, "POST", s.route(DESTROY_ROUTE), headers=headers,
                        timeout=timeout, json_body={"group_name": group.name,
                                                    "group_token": group.tokens.get(s.url)})
    group.pg.shutdown()


@dataclass
class Outgoing:
    """One broadcast under way: the metadata every server gets, and the collective send."""
    group: TrainerGroup
    body: dict
    sent: threading.Event = field(default_factory=threading.Event)
    packed: threading.Event = field(default_factory=threading.Event)
    errors: list = field(default_factory=list)
    copy: PackedCopy | None = None  # with SendContext.keep: the frames, once all are packed
    sender: threading.Thread | None = None  # packs and sends; started by `start`
    started: bool = False
    pack_ms: float | None = None  # the sender's packing of every bucket (beside the wire)
    _start_lock: threading.Lock = field(default_factory=threading.Lock)

    def mark_packed(self, copy: PackedCopy | None) -> None:
        self.copy = copy
        self.packed.set()

    def start(self) -> None:
        """Starts packing and sending, once: when the first server's request has left (its
        packing then no longer competes with the request for a core), or at `finish`."""
        with self._start_lock:
            if not self.started:
                self.started = True
                self.sender.start()


# -- typed messages ---------------------------------------------------------------------
def group_name_of(body: dict) -> str:
    return naming.check_name(json_field(body, "group_name", str, "default", max_len=128),
                             "group_name")


def group_token_of(body: dict, where: str) -> str:
    return json_field(body, "group_token", str, max_len=64, where=where)


@dataclass(frozen=True)
class GroupRef:
    """A group named by the client that owns it (destroy)."""
    group_name: str
    group_token: str

    @classmethod
    def from_json(cls, body: dict) -> "GroupRef":
        return cls(group_name_of(body), group_token_of(body, DESTROY_ROUTE))


@dataclass(frozen=True)
class InitGroupRequest:
    opens: ClassVar[str] = "group"  # as LeaseRequest.opens
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    group_name: str
    timeout_s: float
    streams: int

    @classmethod
    def from_json(cls, body: dict) -> "InitGroupRequest":
        where = INIT_ROUTE
        backend = json_field(body, "backend", str, "gloo", max_len=8, where=where)
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"backend must be 'gloo' or 'nccl', got {backend!r}",
                             code="bad_request")
        return cls(
            master_address=json_field(body, "master_address", str, max_len=253, where=where),
            master_port=json_field(body, "master_port", int, lo=1, hi=65535, where=where),
            rank_offset=json_field(body, "rank_offset", int, lo=1, hi=MAX_WORLD_SIZE,
                                   where=where),
            world_size=json_field(body, "world_size", int, lo=2, hi=MAX_WORLD_SIZE,
                                  where=where),
            backend=backend, group_name=group_name_of(body),
            timeout_s=json_field(body, "timeout_s", float, 120.0, lo=0.1,
                                 hi=MAX_GROUP_TIMEOUT_S, where=where),
            streams=json_field(body, "streams", int, collective.DEFAULT_STREAMS, lo=1,
                               hi=collective.MAX_STREAMS, where=where))


@dataclass(frozen=True)
class DistributedLoadRequest:
    lora_name: str
    version: int | None
    config: dict
    specs: list[TensorSpec] | None  # None: the request names a layout (`layout`) instead
    layout: int | None
    group_name: str
    group_token: str
    bucket_bytes: int
    transfer_id: int
    checksum: str | None

    @classmethod
    def from_json(cls, body: dict) -> "DistributedLoadRequest":
        where = LOAD_ROUTE
        raw_specs = json_field(body, "tensors", list, None, max_len=MAX_TENSORS, where=where)
        layout = json_field(body, "layout", int, None, lo=0, hi=2 ** 64 - 1, where=where)
        if raw_specs is None and layout is None:
            raise BadRequest("'tensors' is required (or 'layout': the digest of tensors this "
                             "group declared before)", code="bad_request")
        specs = None if raw_specs is None else [TensorSpec.from_json(s) for s in raw_specs]
        if specs is not None and len({s.name for s in specs}) != len(specs):
            raise BadAdapter("'tensors' lists a name twice", code="bad_metadata")
        config = body.get("adapter_config")
        if isinstance(config, str):
            config = parse_config(config)
        elif config is not None and not isinstance(config, dict):
            raise BadAdapter("adapter_config must be a JSON object or its JSON text",
                             code="bad_config")
        checksum = json_field(body, "checksum", str, None, max_len=80, where=where)
        if checksum is not None and not _CHECKSUM.fullmatch(checksum):
            raise BadRequest("checksum must be 'sha256:' and 64 lowercase hex digits",
                             code="bad_request")
        return cls(
            lora_name=naming.check_name(body.get("lora_name")),
            version=naming.parse_version(body.get("version")),
            config=config if config is not None else {}, specs=specs, layout=layout,
            group_name=group_name_of(body), group_token=group_token_of(body, where),
            bucket_bytes=json_field(body, "bucket_bytes", int, collective.DEFAULT_BUCKET_BYTES,
                                    lo=1 << 12, hi=1 << 30, where=where),
            transfer_id=json_field(body, "transfer_id", int, lo=1, hi=MAX_TRANSFER_ID,
                                   where=where),
            checksum=checksum)


# -- server routes (API process) --------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """A group's declared tensors and their layout_digest: kept by the API process (one per
    group) and by each worker (WorkerState.layouts), named by later pushes."""
    digest: int
    specs: list[TensorSpec]

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def buckets(self, bucket_bytes: int) -> tuple:
        """Its buckets at that size, kept for the last size asked: every push of a trainer
        asks the same, and planning walks every tensor."""
        kept = self.__dict__.get("_buckets")
        if kept is None or kept[0] != bucket_bytes:
            kept = self.__dict__["_buckets"] = (
                bucket_bytes, tuple(collective.plan_buckets(self.specs, bucket_bytes)))
        return kept[1]

    def transfer(self, transfer_id: int, bucket_bytes: int) -> collective.Transfer:
        return collective.Transfer(transfer_id, self.buckets(bucket_bytes), bucket_bytes,
                                   self.digest)

    def frames_nbytes(self, bucket_bytes: int) -> int:
        """What the workers allocate to receive it (payload, padding, trailers)."""
        return sum(b.frame_bytes for b in self.buckets(bucket_bytes))


@dataclass
class Groups:
    """The server's view of its update groups: each one's timeout, ownership token, the
    layout its last successful push declared (what a push may name) and whether its workers
    are known to hold that layout."""
    timeouts: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    # Groups whose workers hold the group's layout: the last push that reached them had it.
    workers_hold: set[str] = field(default_factory=set)

    def forget(self, group_name: str) -> None:
        for held in (self.timeouts, self.tokens, self.layouts):
            held.pop(group_name, None)
        self.workers_hold.discard(group_name)

    def layout_of(self, req: DistributedLoadRequest) -> Layout:
        """The tensors a push declares: its own list, or the layout it names, which must be
        the one the group's last successful push declared (a refused push changes nothing)."""
        if req.specs is not None:
            layout = Layout(collective.layout_digest(req.specs), req.specs)
            if req.layout not in (None, layout.digest):
                raise BadRequest("'layout' is not the digest of 'tensors'", code="bad_request")
            return layout
        held = self.layouts.get(req.group_name)
        if held is None or held.digest != req.layout:
            raise BadRequest(f"group {req.group_name!r} holds no layout {req.layout}: send "
                             "'tensors'", code="layout_unknown")
        return held

    def check_owner(self, group_name: str, token: str | None) -> None:
        """Only the client that created a group may load on it or destroy it."""
        owner = self.tokens.get(group_name)
        if owner is None:
            raise BadRequest(f"no LoRA update group {group_name!r} on this server; call "
                             "init_lora_update_group first", code="no_group")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(),
                                                                 owner.encode()):
            raise Forbidden(f"group {group_name!r} belongs to the client that created it: "
                            "'group_token' must be the token its init returned",
                            code="bad_token")


async def allowed_trainer(host: str, allowed: tuple) -> str:
    """The address workers will dial for `host`, if LORA_SYNC_ALLOWED_TRAINERS lets them:
    every address the name resolves to must be allowed (no DNS games)."""
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM), 5)
    except (OSError, asyncio.TimeoutError, UnicodeError) as e:
        raise BadRequest(f"master_address {host!r} does not resolve ({e})",
                         code="bad_request") from None
    addresses = {info[4][0] for info in infos}
    nets = [ipaddress.ip_network(n, strict=False) for n in allowed]
    refused = sorted(a for a in addresses if not any(ipaddress.ip_address(a) in n for n in nets))
    if refused or not addresses:
        raise Forbidden(f"master_address {host!r} ({', '.join(refused)}) is not an allowed "
                        "trainer address; the operator lists them in "
                        f"LORA_SYNC_ALLOWED_TRAINERS (now {list(allowed)})",
                        code="trainer_not_allowed")
    return sorted(addresses)[0]


@dataclass
class BroadcastClientState:
    """A client's update group, once it made one (`open_group`)."""
    group: TrainerGroup | None = None


class BroadcastTransport(Transport):
    name = "broadcast"
    push_path = f"/{LOAD_ROUTE}"
    per_server = False

    def routes(self):
        return {f"/{INIT_ROUTE}": Route(lambda body, limits: InitGroupRequest.from_json(body),
                                        self.init),
                self.push_path: Route(lambda body, limits:
                                      DistributedLoadRequest.from_json(body)),
                f"/{DESTROY_ROUTE}": Route(lambda body, limits: GroupRef.from_json(body),
                                           self.destroy)}

    # trainer side
    def new_client_state(self, config) -> BroadcastClientState:
        return BroadcastClientState()

    def open_group(self, state: BroadcastClientState, servers: list, headers: dict,
                   infos: list, *args, **kw) -> TrainerGroup:
        """The client's group with every worker of `servers` (`init_group`)."""
        state.group = init_group(servers, headers, infos, *args, **kw)
        return state.group

    def close_group(self, state: BroadcastClientState, servers: list, headers: dict,
                    timeout: float) -> None:
        group, state.group = state.group, None
        if group is not None:
            destroy_group(servers, headers, group, timeout)

    def prepare(self, adapter: LoRAAdapter, ctx: SendContext) -> Outgoing:
        """Checks the adapter against every server (before any collective call), then
        starts the collective send: it completes once every server's workers receive."""
        group = ctx.state.group if ctx.state is not None else None
        if group is None:
            raise RuntimeError("call init_group() before pushing with transport='broadcast'")
        if group.broken:
            raise TransferFailed(f"group {group.name!r} failed earlier; destroy it and call "
                                 "init_group again")
        listed, transfer = group.plan(adapter)
        out = Outgoing(group, {
            "lora_name": ctx.name, "version": ctx.version, "adapter_config": adapter.config,
            "tensors": listed, "layout": transfer.layout,
            "group_name": group.name, "bucket_bytes": group.bucket_bytes,
            "transfer_id": transfer.transfer_id,
            "checksum": adapter.checksum() if ctx.checksum else None})

        # Packing copies the tensors anyway: where the client keeps what it pushed, it packs
        # into the client's buffer and the frames are that copy (one copy, not two).
        kept = ctx.keep and self.keeps_copy(ctx.state)
        frames = group.send_buffers
        if kept:  # the client's spare, or a new buffer
            frames = {"frames": ctx.spare} if ctx.spare is not None else {}

        def packed(began: float):  # views of the copy, made while the frames are on the wire
            out.pack_ms = (time.perf_counter() - began) * 1e3
            copy = None
            if kept:
                views = collective.unpack_frames(transfer,
                                                 collective.frame_buffers(transfer, frames))
                copy = PackedCopy({k: views[k] for k in adapter.tensors}, frames["frames"])
            out.mark_packed(copy)

        def send():
            try:
                collective.send_transfer(group.pg, transfer, adapter.tensors, frames,
                                         group.device,
                                         packed=functools.partial(packed, time.perf_counter()))
            except BaseException as e:
                out.errors.append(e)
            finally:
                out.packed.set()
                out.sent.set()
        out.sender = threading.Thread(target=send, daemon=True, name="lora-sync-broadcast")
        return out

    def keeps_copy(self, state: BroadcastClientState) -> bool:
        group = state.group if state is not None else None
        return group is not None and group.device == "cpu"  # the client keeps host memory

    def send(self, out: Outgoing, server: Server, ctx: SendContext) -> PushResult:
        t0 = time.perf_counter()
        body = {**out.body, "group_token": out.group.tokens[server.url]}
        if out.group.declared.get(server.url) == body["layout"]:
            del body["tensors"]  # the server holds this layout for the group: named only
        reply, _ = http.call("POST", server.route(LOAD_ROUTE),
                             headers=with_protocol(ctx.headers), json_body=body,
                             timeout=out.group.timeout_s + REPLY_GRACE_S, on_sent=out.start)
        result = PushResult.from_reply(server.url, reply, time.perf_counter() - t0, ctx.name,
                                       ctx.version)
        if out.pack_ms is not None:  # trainer side, beside the workers' `transfer`
            reply.setdefault("timings_ms", {})["pack"] = out.pack_ms
        return result

    def finish(self, out: Outgoing, results: list) -> PackedCopy | None:
        out.start()  # no request left (every server failed first): the copy is still packed
        for r in results:  # a server that took the push holds its layout
            if r.ok:
                out.group.declared[r.server] = out.body["layout"]
            else:
                out.group.declared.pop(r.server, None)
        if any(not r.ok for r in results):
            # A server refused or failed after the broadcast started: its peers' receive may
            # now be out of step, so the group cannot be trusted any more.
            out.group.broken = True
            # Packing never waits on the wire: the copy is whole within moments, or absent.
            return out.copy if out.packed.wait(out.group.timeout_s) else None
        if not out.sent.wait(out.group.timeout_s) or out.errors:
            out.group.broken = True
            raise TransferFailed("broadcast did not complete: "
                                 f"{out.errors[0] if out.errors else 'timeout'}")
        return out.copy

    def send_timeout(self, ctx: SendContext) -> float | None:
        group = ctx.state.group if ctx.state is not None else None
        return group.timeout_s + REPLY_GRACE_S if group is not None else None

    # server side
    def new_state(self, limits) -> Groups:
        return Groups()

    def groups(self, state: Groups) -> list[str]:
        return list(state.tokens)

    async def init(self, req: InitGroupRequest, ctx: ServerContext) -> dict:
        address = await allowed_trainer(req.master_address, ctx.limits.allowed_trainers)
        status = await ctx.workers.status()
        workers = len(status)
        if req.rank_offset + workers > req.world_size:
            raise BadRequest(f"ranks {req.rank_offset}..{req.rank_offset + workers - 1} of "
                             f"this server's {workers} worker(s) do not fit world_size "
                             f"{req.world_size} (rank 0 is the trainer)", code="bad_request")
        if len(status[0].get("groups", [])) >= ctx.limits.max_groups:
            raise TooBusy(f"this server already has {ctx.limits.max_groups} update groups "
                          "(or group set-ups still timing out); destroy one first",
                          code="too_many_groups")
        t0 = time.perf_counter()
        try:
            await ctx.workers.call_in_background(
                "init_group", req.timeout_s + 2, group_name=req.group_name, host=address,
                port=req.master_port, rank_offset=req.rank_offset, world_size=req.world_size,
                backend=req.backend, timeout_s=req.timeout_s, streams=req.streams)
        except LoRASyncError as e:
            if e.code != "group_exists":  # a half-made group (some workers joined) goes
                await asyncio.shield(ctx.workers.call("destroy_group",
                                                      group_name=req.group_name))
            raise
        ctx.state.timeouts[req.group_name] = req.timeout_s
        ctx.state.tokens[req.group_name] = token = secrets.token_urlsafe(24)
        return {"group_name": req.group_name, "workers": workers, "group_token": token,
                "ms": (time.perf_counter() - t0) * 1e3}

    async def stage(self, req: DistributedLoadRequest, ctx: ServerContext) -> Staged:
        groups = ctx.state
        groups.check_owner(req.group_name, req.group_token)
        layout = groups.layout_of(req)
        framed = layout.frames_nbytes(req.bucket_bytes)
        if framed > ctx.limits.max_body_bytes:  # what the workers allocate
            raise PayloadTooLarge(f"the adapter is {framed} bytes framed, above "
                                  f"the limit of {ctx.limits.max_body_bytes} "
                                  "(LORA_SYNC_MAX_BODY_MB)")
        # Each worker keeps the last list it was sent: a named layout is the group's, which
        # the workers hold unless a list went out since the last successful push.
        listed = req.specs is not None or req.group_name not in groups.workers_hold
        if listed:
            groups.workers_hold.discard(req.group_name)

        def forget_dropped(error: LoRASyncError) -> None:
            if error.code in ("transfer_mismatch", "transfer_failed"):  # workers dropped it
                groups.forget(req.group_name)

        def declared() -> None:  # from now on a push may name it
            groups.layouts[req.group_name] = layout
            groups.workers_hold.add(req.group_name)
        return Staged(req.lora_name, req.version, req.config, layout.specs,
                      layout.nbytes, req.checksum,
                      {"group_name": req.group_name, "layout": layout.digest,
                       "specs": [s.to_json() for s in layout.specs] if listed else None,
                       "bucket_bytes": req.bucket_bytes, "transfer_id": req.transfer_id},
                      background_s=groups.timeouts.get(req.group_name, 120.0) + 30,
                      on_failure=forget_dropped, on_success=declared)

    async def destroy(self, req: GroupRef, ctx: ServerContext) -> dict:
        ctx.state.check_owner(req.group_name, req.group_token)
        await ctx.workers.call("destroy_group", group_name=req.group_name)
        ctx.state.forget(req.group_name)
        return {"group_name": req.group_name, "destroyed": True}

    # worker side
    def receive(self, intake, pool) -> Received:
        """Receives the framed buckets into reused buffers (filling memory that is already
        mapped is several times cheaper than fresh pages: docs/benchmarks.md, "What each piece
        bought"), checking the frames against the declaration before the tensors are used."""
        group_name, args = intake.args["group_name"], intake.args
        pg, device = pool.group(group_name)
        layout = pool.layouts.get(group_name)
        if args["specs"] is not None:
            layout = Layout(args["layout"], [TensorSpec.from_json(s) for s in args["specs"]])
            pool.layouts[group_name] = layout
        try:
            if layout is None or layout.digest != args["layout"]:  # (the API keeps in step)
                raise collective.FrameMismatch(f"this worker holds no layout {args['layout']} "
                                               f"for group {group_name!r}")
            transfer = layout.transfer(args["transfer_id"], args["bucket_bytes"])
            buffers = [pool.take_buffer(torch.uint8, b.frame_bytes, device)
                       for b in transfer.buckets]
            timings = {}
            tensors = collective.receive_transfer(pg, transfer, buffers, timings_ms=timings)
            if len(transfer.buckets) > 1 and any(b.dtype != transfer.buckets[0].dtype
                                                 for b in transfer.buckets):
                # buckets group the tensors by dtype: back to the declared order, the order
                # the checksum is over (docs/wire_format.md)
                tensors = {s.name: tensors[s.name] for s in layout.specs}
        except collective.FrameMismatch as e:  # the trainer is out of step: the group is too
            pool.destroy_group(group_name)
            raise BadRequest(f"{e}; the group was dropped, create a new one",
                             code="transfer_mismatch") from e
        except Exception as e:  # a dead or slow trainer: the group is no longer usable
            pool.destroy_group(group_name)
            raise TransferFailed(f"broadcast in group {group_name!r} failed ({e}); the group "
                                 "was dropped, create a new one") from e
        if device != "cpu":  # copied out: the device buckets are free for the next receive
            tensors = {k: v.cpu() for k, v in tensors.items()}
            pool.keep_spares(buffers)
            buffers = []
        return Received(tensors, transfer.nbytes, buffers, timings_ms=timings)
