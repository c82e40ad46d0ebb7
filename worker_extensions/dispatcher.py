"""The one worker-side dispatcher both engines share: `LoRASyncWorker.call(op, args)`.

Each engine supplies a `WorkerEngine` (its rank, how it builds/registers an adapter, how it
unloads one); everything else — which transport takes the bytes in, the checks, the groups,
the replies — is here, once. Ops take keyword arguments only, the same on both engines."""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

from lora_sync import full_gc
from lora_sync.adapter import lora_weights
from lora_sync.errors import BadRequest
from lora_sync.messages import IntakeRequest, WorkerReply
from lora_sync.notices import write_notice
from lora_sync.transports import TRANSPORTS
from lora_sync.pages import fill_page_tables

from .receiver import StoredAdapter, WorkerState, check_intake, engine_refusal


class WorkerEngine(ABC):
    """What one engine's worker process supplies."""

    # True when the engine never writes the tensors `build` gets (its in-place steps are
    # done into buffers of its own): then they may view read-only memory, and a sealed shm
    # lease or a staged HTTP body is mapped read-only, shared by every worker. A write there
    # would kill the worker, so only an engine whose every step on them is known says so.
    maps_read_only: bool = False
    # True when the engine first reads an adapter's tensors when a request first uses it
    # (SGLang copies them into its memory pool then): the page tables of a mapped body are
    # filled on a thread from intake on, not by that request's faults.
    reads_at_first_use: bool = False
    # True in an engine's worker process: its heap is frozen at the first push unless the
    # engine froze it (full_gc), as EngineBridge.freezes_heap.
    freezes_heap: bool = False

    @abstractmethod
    def rank(self) -> tuple[int, int]:
        """(rank, world_size) of this worker among the server's workers."""

    @abstractmethod
    def build(self, adapter_id: int, stored: StoredAdapter, take_buffer):
        """Runs when an adapter arrives, so a bad one fails before it is published; returns
        what to keep as `stored.built` (ValueError: the engine refuses the adapter).
        `take_buffer(dtype, numel)`: a reused buffer, for what it must not do in place
        (`stored.read_only`); add what it takes to `stored.buffers`."""

    def register(self, adapter_id: int, stored: StoredAdapter, lora_id: str) -> None:
        """Hands the adapter to the engine, for engines that register inside the worker,
        under `lora_id`: the registration's identity (EngineBridge.identity)."""

    def facts(self) -> dict:
        """Which of its own paths this engine's worker takes (shown in `info`)."""
        return {}

    def model_unsupported(self) -> str | None:
        """Why no forward pass of the served model with LoRA enabled can run on this worker
        (a short reason: what cannot run, and that requests fail), or None when it can.
        While a worker says so, the server refuses every push (`AdapterService.
        refuse_if_unsupported`): an adapter whose first request kills the engine is never
        taken. Cheap, never raises (a failed probe is itself a reason), asked once."""
        return None

    @abstractmethod
    def unload(self, adapter_id: int) -> None:
        """Drops the engine's own copy (its LoRA cache entry)."""

    @abstractmethod
    def cached_ids(self) -> list[int]:
        """Adapter ids the engine holds in its LoRA cache."""


class LoRASyncWorker:
    def __init__(self, engine: WorkerEngine):
        self.engine = engine
        self.state = WorkerState(maps_read_only=engine.maps_read_only)
        self._background_locks: dict[str, threading.Lock] = {}
        self.ops = {"info": self.info, "intake": self.intake, "register": self.register,
                    "free": self.free, "init_group": self.init_group,
                    "destroy_group": self.destroy_group}

    def call(self, op: str, args: dict) -> dict:
        """Runs one op; its WorkerReply as a plain dict (what the engine's RPC carries)."""
        fn = self.ops.get(op)
        if fn is None or not isinstance(args, dict):
            return WorkerReply.failed(BadRequest(f"unknown lora-sync worker operation {op!r}",
                                                 code="bad_request")).to_json()
        return WorkerReply.run(fn, **args).to_json()

    # -- ops ------------------------------------------------------------------------------
    def info(self) -> dict:
        rank, world = self.engine.rank()
        return {"rank": rank, "world_size": world, "cached_ids": sorted(self.engine.cached_ids()),
                "held_ids": sorted(self.state.adapters), "groups": self.state.group_names(),
                "engine": self.engine.facts(),
                "model_unsupported": self.engine.model_unsupported()}

    def intake(self, request: dict, notice_paths: list | None = None) -> dict:
        """Takes an adapter in through its transport's worker side, checks and builds it.
        With `notice_paths` it runs on a thread (one at a time per transport and group) and
        the outcome goes to this rank's notice: the engine keeps stepping meanwhile."""
        intake = IntakeRequest.from_json(request)
        transport = TRANSPORTS.get(intake.transport)
        if transport is None:
            raise BadRequest(f"unknown transport {intake.transport!r}", code="bad_request")
        rank, _ = self.engine.rank()

        def work() -> dict:
            with full_gc.during_push(freeze=self.engine.freezes_heap) as collections:
                reply = take()
            reply["timings_ms"]["worker_gc"] = collections.ms
            return reply

        def take() -> dict:
            t0 = time.perf_counter()
            received = transport.receive(intake, self.state)
            if received.read_only and self.engine.reads_at_first_use:
                threading.Thread(target=fill_page_tables, args=(received.tensors,),
                                 name="lora-sync-fill-pages", daemon=True).start()
            t1 = time.perf_counter()
            check_intake(received.tensors, intake.checksum, intake.check_finite)
            # What check_adapter left out of the verdict never reaches the engine either.
            stored = StoredAdapter(lora_weights(received.tensors), intake.config,
                                   received.nbytes,
                                   buffers=received.buffers, read_only=received.read_only)
            t2 = time.perf_counter()
            stored.built = engine_refusal(self.engine.build, intake.adapter_id, stored,
                                          lambda dtype, n: self.state.take_buffer(dtype, n,
                                                                                  "cpu"))
            self.state.adapters[intake.adapter_id] = stored
            return {"bytes": stored.nbytes,
                    "timings_ms": {**received.timings_ms,
                                   "intake": (t1 - t0) * 1e3, "checks": (t2 - t1) * 1e3,
                                   "engine_build": stored.engine_build_ms,
                                   "build": (time.perf_counter() - t2) * 1e3}}
        if notice_paths is None:
            return work()
        self._in_background(intake.args.get("group_name", intake.transport),
                            notice_paths[rank], work)
        return {}

    def register(self, adapter_id: int, lora_id: str) -> None:
        with full_gc.during_push(freeze=self.engine.freezes_heap):
            engine_refusal(self.engine.register, adapter_id, self.state.adapters[adapter_id],
                           lora_id)

    def free(self, adapter_ids: list) -> dict:
        """Forgets adapters: the engine's cache entry and our in-memory copy."""
        for i in adapter_ids:
            self.engine.unload(i)
            self.state.free(i)
        return {"held": len(self.state.adapters)}

    def init_group(self, group_name: str, host: str, port: int, rank_offset: int,
                   world_size: int, backend: str, timeout_s: float, streams: int,
                   notice_paths: list) -> None:
        """Starts joining the trainer's group and returns at once (see WorkerState)."""
        rank, _ = self.engine.rank()
        self.state.init_group_in_background(group_name, notice_paths[rank], host, port,
                                            rank_offset + rank, world_size, backend, timeout_s,
                                            streams)

    def destroy_group(self, group_name: str) -> dict:
        return {"existed": self.state.destroy_group(group_name)}

    def _in_background(self, key: str, notice_path: str, work) -> None:
        lock = self._background_locks.setdefault(key, threading.Lock())

        def run():
            with lock:  # one transfer at a time per group, in request order
                write_notice(notice_path, WorkerReply.run(work))
        threading.Thread(target=run, name=f"lora-sync-intake-{key}", daemon=True).start()
