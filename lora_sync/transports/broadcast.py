"""Trainer side of the broadcast transport: rank 0 of a group whose other ranks are the
workers of one or more servers."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import collective, http
from ..adapter import LoRAAdapter, ModelSpec, check_adapter
from ..errors import LoRASyncError, TransferFailed
from .base import PushResult


@dataclass
class TrainerGroup:
    name: str
    pg: object
    world_size: int
    backend: str
    device: str
    bucket_bytes: int
    timeout_s: float
    broken: bool = False
    send_buffers: dict = field(default_factory=dict)  # dtype -> flat buffer, kept between pushes


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
        joins = [pool.submit(http.call, "POST", s.route("init_lora_update_group"),
                             json_body=b, headers=client.headers, timeout=timeout_s + 30)
                 for s, b in zip(client.servers, bodies)]
        pg = collective.create_group(master_address, master_port, 0, world, backend,
                                     timeout_s)
        for j in joins:
            j.result()
    device = "cuda" if backend == "nccl" else "cpu"
    group = TrainerGroup(group_name, pg, world, backend, device, bucket_bytes, timeout_s)
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
    body = {"lora_name": name, "version": version, "adapter_config": adapter.config,
            "tensors": [s.to_json() for s in specs], "group_name": group.name,
            "bucket_bytes": group.bucket_bytes,
            "checksum": adapter.checksum() if checksum else None}
    plan = collective.plan_buckets(specs, group.bucket_bytes)
    t0 = time.perf_counter()
    posts = [client._pool.submit(http.call, "POST", s.route("load_lora_adapter_from_distributed"),
                                 json_body=body, headers=client.headers,
                                 timeout=group.timeout_s + 60) for s in client.servers]
    sent = threading.Event()
    errors: list[BaseException] = []

    def send():
        try:
            collective.send_buckets(group.pg, plan, adapter.tensors, group.send_buffers,
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
            results.append(PushResult.from_reply(s.url, reply, time.perf_counter() - t0))
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
    client._each(lambda s: http.call("POST", s.route("destroy_lora_update_group"),
                                     json_body={"group_name": group.name},
                                     headers=client.headers, timeout=client.timeout))
    group.pg.shutdown()
