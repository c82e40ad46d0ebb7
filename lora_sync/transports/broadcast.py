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
the push with a 400, and the previous versions keep serving."""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .. import collective, http, naming
from ..adapter import LoRAAdapter, ModelSpec, check_adapter, parse_config
from ..errors import (BadAdapter, Forbidden, LoRASyncError, PayloadTooLarge, TooBusy,
                      TransferFailed)
from ..fields import field as json_field
from ..wire import MAX_TENSORS, TensorSpec
from .base import PushResult, Received, Route

INIT_ROUTE = "init_lora_update_group"
LOAD_ROUTE = "load_lora_adapter_from_distributed"
DESTROY_ROUTE = "destroy_lora_update_group"
MAX_WORLD_SIZE = 4096
MAX_GROUP_TIMEOUT_S = 3600.0
MAX_TRANSFER_ID = 2 ** 63 - 1
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
    tokens: list = field(default_factory=list)  # per server: the group's ownership token
    broken: bool = False
    send_buffers: dict = field(default_factory=dict)  # the frames, kept between pushes


def init_group(client, master_address: str, master_port: int, backend: str = "gloo",
               group_name: str = "default", timeout_s: float = 120.0,
               bucket_bytes: int = collective.DEFAULT_BUCKET_BYTES) -> TrainerGroup:
    """Forms one group with every worker of every server: server i's workers take ranks
    offset_i .. offset_i + workers_i - 1, offsets following the server order."""
    infos = client.info()
    offsets, world = [], 1
    for info in infos:
        offsets.append(world)
        world += int(info["workers"])
    bodies = [{"master_address": master_address, "master_port": master_port,
               "rank_offset": off, "world_size": world, "backend": backend,
               "group_name": group_name, "timeout_s": timeout_s} for off in offsets]
    with ThreadPoolExecutor(len(client.servers)) as pool:
        joins = [pool.submit(http.call, "POST", s.route(INIT_ROUTE),
                             json_body=b, headers=client.headers, timeout=timeout_s + 30)
                 for s, b in zip(client.servers, bodies)]
        pg = collective.create_group(master_address, master_port, 0, world, backend,
                                     timeout_s)
        replies = [j.result()[0] for j in joins]
    device = "cuda" if backend == "nccl" else "cpu"
    group = TrainerGroup(group_name, pg, world, backend, device, bucket_bytes, timeout_s,
                         [r.get("group_token") for r in replies])
    group.specs = [ModelSpec({k: tuple(v) for k, v in i["linear_modules"].items()},
                             int(i["max_lora_rank"])) for i in infos]
    return group


def broadcast(client, group: TrainerGroup, adapter: LoRAAdapter, name: str,
              version: int | None = None, checksum: bool = False) -> list:
    """Posts the metadata to every server and broadcasts the tensors concurrently; returns
    when every server has the version servable."""
    if group.broken:
        raise TransferFailed(f"group {group.name!r} failed earlier; destroy it and call "
                             "init_group again")
    specs = adapter.specs()
    for spec in group.specs:  # refuse before any collective call
        check_adapter(specs, adapter.config, spec)
    transfer = collective.Transfer.plan(specs, secrets.randbelow(MAX_TRANSFER_ID) + 1,
                                        group.bucket_bytes)
    body = {"lora_name": name, "version": version, "adapter_config": adapter.config,
            "tensors": [s.to_json() for s in specs], "group_name": group.name,
            "bucket_bytes": group.bucket_bytes, "transfer_id": transfer.transfer_id,
            "checksum": adapter.checksum() if checksum else None}
    t0 = time.perf_counter()
    posts = [client._pool.submit(http.call, "POST", s.route(LOAD_ROUTE),
                                 json_body={**body, "group_token": token},
                                 headers=client.headers, timeout=group.timeout_s + 60)
             for s, token in zip(client.servers, group.tokens)]
    sent = threading.Event()
    errors: list[BaseException] = []

    def send():
        try:
            collective.send_transfer(group.pg, transfer, adapter.tensors, group.send_buffers,
                                     group.device)
        except BaseException as e:
            errors.append(e)
        finally:
            sent.set()

    threading.Thread(target=send, daemon=True, name="lora-sync-broadcast").start()
    results = []
    try:
        for s, p in zip(client.servers, posts):
            reply, _ = p.result()
            results.append(PushResult.from_reply(s.url, reply, time.perf_counter() - t0,
                                                 name, version))
    except LoRASyncError:
        # A server refused after the broadcast started: its peers' receive may now be
        # out of step, so the group cannot be trusted any more.
        group.broken = True
        raise
    if not sent.wait(group.timeout_s) or errors:
        group.broken = True
        raise TransferFailed(f"broadcast did not complete: {errors[0] if errors else 'timeout'}")
    return results


def destroy_group(client, group: TrainerGroup) -> None:
    tokens = dict(zip((s.url for s in client.servers), group.tokens))
    client._each(lambda s: http.call("POST", s.route(DESTROY_ROUTE),
                                     json_body={"group_name": group.name,
                                                "group_token": tokens.get(s.url)},
                                     headers=client.headers, timeout=client.timeout))
    group.pg.shutdown()


# -- typed messages ---------------------------------------------------------------------
def group_name_of(body: dict) -> str:
    return naming.check_name(json_field(body, "group_name", str, "default", max_len=128),
                             "group_name")


def group_token_of(body: dict, where: str) -> str:
    return json_field(body, "group_token", str, max_len=64, where=where)


@dataclass(frozen=True)
class InitGroupRequest:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    group_name: str
    timeout_s: float

    @classmethod
    def from_json(cls, body: dict) -> "InitGroupRequest":
        where = INIT_ROUTE
        backend = json_field(body, "backend", str, "gloo", max_len=8, where=where)
        if backend not in ("gloo", "nccl"):
            raise BadAdapter(f"backend must be 'gloo' or 'nccl', got {backend!r}",
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
                                 hi=MAX_GROUP_TIMEOUT_S, where=where))


@dataclass(frozen=True)
class DistributedLoadRequest:
    lora_name: str
    version: int | None
    config: dict
    specs: list[TensorSpec]
    group_name: str
    group_token: str
    bucket_bytes: int
    transfer_id: int
    checksum: str | None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def frames_nbytes(self) -> int:
        """What the workers allocate to receive it (payload, padding, trailers)."""
        return sum(b.frame_bytes for b in collective.plan_buckets(self.specs,
                                                                  self.bucket_bytes))

    @classmethod
    def from_json(cls, body: dict) -> "DistributedLoadRequest":
        where = LOAD_ROUTE
        raw_specs = json_field(body, "tensors", list, max_len=MAX_TENSORS, where=where)
        specs = [TensorSpec.from_json(s) for s in raw_specs]
        if len({s.name for s in specs}) != len(specs):
            raise BadAdapter("'tensors' lists a name twice", code="bad_metadata")
        config = body.get("adapter_config")
        if isinstance(config, str):
            config = parse_config(config)
        elif config is not None and not isinstance(config, dict):
            raise BadAdapter("adapter_config must be a JSON object or its JSON text",
                             code="bad_config")
        checksum = json_field(body, "checksum", str, None, max_len=80, where=where)
        if checksum is not None and not _CHECKSUM.fullmatch(checksum):
            raise BadAdapter("checksum must be 'sha256:' and 64 lowercase hex digits",
                             code="bad_request")
        return cls(
            lora_name=naming.check_name(body.get("lora_name")),
            version=naming.parse_version(body.get("version")),
            config=config if config is not None else {}, specs=specs,
            group_name=group_name_of(body), group_token=group_token_of(body, where),
            bucket_bytes=json_field(body, "bucket_bytes", int, collective.DEFAULT_BUCKET_BYTES,
                                    lo=1 << 12, hi=1 << 30, where=where),
            transfer_id=json_field(body, "transfer_id", int, lo=1, hi=MAX_TRANSFER_ID,
                                   where=where),
            checksum=checksum)


# -- server routes (API process) --------------------------------------------------------
@dataclass
class Groups:
    """The server's view of its update groups: each one's timeout and ownership token."""
    timeouts: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)

    def forget(self, group_name: str) -> None:
        self.timeouts.pop(group_name, None)
        self.tokens.pop(group_name, None)

    def check_owner(self, group_name: str, token: str | None) -> None:
        """Only the client that created a group may load on it or destroy it."""
        owner = self.tokens.get(group_name)
        if owner is None:
            raise BadAdapter(f"no LoRA update group {group_name!r} on this server; call "
                             "init_lora_update_group first", code="no_group")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(),
                                                                 owner.encode()):
            raise Forbidden(f"group {group_name!r} belongs to the client that created it: "
                            "'group_token' must be the token its init returned",
                            code="bad_token")


def server_state(settings) -> Groups:
    return Groups()


async def init(service, body: dict) -> dict:
    req = InitGroupRequest.from_json(body)
    address = await allowed_trainer(req.master_address, service.settings.allowed_trainers)
    status = await service.bridge.worker_status()
    workers = len(status)
    if req.rank_offset + workers > req.world_size:
        raise BadAdapter(f"ranks {req.rank_offset}..{req.rank_offset + workers - 1} of this "
                         f"server's {workers} worker(s) do not fit world_size "
                         f"{req.world_size} (rank 0 is the trainer)", code="bad_request")
    if len(status[0].get("groups", [])) >= service.settings.max_groups:
        raise TooBusy(f"this server already has {service.settings.max_groups} update groups "
                      "(or group set-ups still timing out); destroy one first",
                      code="too_many_groups")
    t0 = time.perf_counter()
    try:
        await service.bridge.call_workers_in_background(
            "init_group", req.timeout_s + 2, group_name=req.group_name, host=address,
            port=req.master_port, rank_offset=req.rank_offset, world_size=req.world_size,
            backend=req.backend, timeout_s=req.timeout_s)
    except LoRASyncError as e:
        if e.code != "group_exists":  # a half-made group (some workers joined) goes
            await asyncio.shield(_destroy_on_workers(service, req.group_name))
        raise
    groups = service.transport_state["broadcast"]
    groups.timeouts[req.group_name] = req.timeout_s
    groups.tokens[req.group_name] = token = secrets.token_urlsafe(24)
    return {"group_name": req.group_name, "workers": workers, "group_token": token,
            "ms": (time.perf_counter() - t0) * 1e3}


async def load(service, body: dict) -> dict:
    t0 = time.perf_counter()
    req = DistributedLoadRequest.from_json(body)
    groups = service.transport_state["broadcast"]
    groups.check_owner(req.group_name, req.group_token)
    cfg = check_adapter(req.specs, req.config, await service.model_spec())
    if req.frames_nbytes > service.settings.max_body_bytes:  # what the workers allocate
        raise PayloadTooLarge(f"the adapter is {req.frames_nbytes} bytes framed, above the "
                              f"limit of {service.settings.max_body_bytes} "
                              "(LORA_SYNC_MAX_BODY_MB)")
    settle_ms = await service.settle()
    wait_s = groups.timeouts.get(req.group_name, 120.0) + 30

    async def receive(adapter_id):
        return await service.bridge.call_workers_in_background(
            "intake", wait_s, transport="broadcast", adapter_id=adapter_id, config=cfg,
            checksum=req.checksum, group_name=req.group_name,
            specs=[s.to_json() for s in req.specs], bucket_bytes=req.bucket_bytes,
            transfer_id=req.transfer_id)
    try:
        reply = await service.install(req.lora_name, req.version, cfg, req.nbytes,
                                      "broadcast", receive, t0)
    except LoRASyncError as e:
        if e.code in ("transfer_mismatch", "transfer_failed"):  # the workers dropped it
            groups.forget(req.group_name)
        raise
    reply["timings_ms"]["settle"] = settle_ms
    return reply


async def destroy(service, body: dict) -> dict:
    group = group_name_of(body)
    groups = service.transport_state["broadcast"]
    groups.check_owner(group, group_token_of(body, DESTROY_ROUTE))
    await _destroy_on_workers(service, group)
    groups.forget(group)
    return {"group_name": group, "destroyed": True}


async def _destroy_on_workers(service, group: str) -> None:
    await service.bridge.call_workers("destroy_group", group_name=group)


async def allowed_trainer(host: str, allowed: tuple) -> str:
    """The address workers will dial for `host`, if LORA_SYNC_ALLOWED_TRAINERS lets them:
    every address the name resolves to must be allowed (no DNS games)."""
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM), 5)
    except (OSError, asyncio.TimeoutError, UnicodeError) as e:
        raise BadAdapter(f"master_address {host!r} does not resolve ({e})",
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

ROUTES = {f"/{INIT_ROUTE}": Route(init), f"/{LOAD_ROUTE}": Route(load),
          f"/{DESTROY_ROUTE}": Route(destroy)}


# -- worker side ------------------------------------------------------------------------
def worker_intake(worker, group_name: str, specs: list, bucket_bytes: int,
                  transfer_id: int) -> Received:
    """Receives the framed buckets into reused buffers (filling memory that is already
    mapped is several times cheaper than fresh pages; docs/protocol.md), checking the frames
    against the declaration before the tensors are used."""
    pg, device = worker.group(group_name)
    transfer = collective.Transfer.plan([TensorSpec.from_json(s) for s in specs],
                                        transfer_id, bucket_bytes)
    buffers = [worker.take_buffer(torch.uint8, b.frame_bytes, device)
               for b in transfer.buckets]
    try:
        tensors = collective.receive_transfer(pg, transfer, buffers)
    except collective.FrameMismatch as e:  # the trainer is out of step: the group is too
        worker.destroy_group(group_name)
        raise BadAdapter(f"{e}; the group was dropped, create a new one",
                         code="transfer_mismatch") from e
    except Exception as e:  # a dead or slow trainer: the group is no longer usable
        worker.destroy_group(group_name)
        raise TransferFailed(f"broadcast in group {group_name!r} failed ({e}); the group "
                             "was dropped, create a new one") from e
    if device != "cpu":  # copied out: the device buckets are free for the next receive
        tensors = {k: v.cpu() for k, v in tensors.items()}
        worker.keep_spares(buffers)
        buffers = []
    return Received(tensors, transfer.nbytes, buffers)
