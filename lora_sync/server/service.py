"""What the added routes do, the same on both engines: check, stage, load, publish."""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field

from .. import naming
from ..adapter import META_CHECKSUM, META_CONFIG, META_NAME, META_VERSION, check_adapter
from ..adapter import ModelSpec
from ..collective import DEFAULT_BUCKET_BYTES
from ..errors import BadAdapter, LoRASyncError, NotFound
from ..staging import StagingArea, discard
from ..wire import TensorSpec
from .bridge import EngineBridge


@dataclass
class Settings:
    max_body_bytes: int = 2 * 1024 ** 3
    # Newest versions kept servable per name. Two lets rollouts that started on the previous
    # version finish on it while the new one takes the alias (one-step off-policy).
    keep_versions: int = 2
    api_key: str | None = None

    @classmethod
    def from_env(cls) -> "Settings":
        keep = os.environ.get("LORA_SYNC_KEEP_VERSIONS")
        return cls(
            max_body_bytes=int(float(os.environ.get("LORA_SYNC_MAX_BODY_MB", 2048)) * 2 ** 20),
            keep_versions=max(1, int(keep)) if keep else cls.keep_versions,
            api_key=os.environ.get("LORA_SYNC_API_KEY") or None)


@dataclass
class AdapterRecord:
    name: str
    version: int
    served_name: str
    adapter_id: int
    bytes: int
    rank: int
    transport: str
    load_ms: float
    loaded_at: float = field(default_factory=time.time)
    inflight: int = 0          # admitted requests not yet finished
    retired: bool = False      # out of the window: no new requests, dropped when idle
    staged_path: str | None = field(default=None, repr=False)  # the body workers map


def _parse_config(raw: str | None) -> dict:
    """PEFT's adapter_config.json text, as sent in the metadata or the broadcast request."""
    if raw is None:
        raise BadAdapter(f"safetensors __metadata__ has no {META_CONFIG!r} (the JSON text of "
                         "PEFT's adapter_config.json)", code="missing_metadata")
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadAdapter(f"{META_CONFIG} is not valid JSON: {e}", code="bad_config") from e
    if not isinstance(cfg, dict):
        raise BadAdapter(f"{META_CONFIG} must be a JSON object", code="bad_config")
    return cfg


class AdapterService:
    def __init__(self, bridge: EngineBridge, settings: Settings | None = None):
        self.bridge = bridge
        self.settings = settings or Settings.from_env()
        self.book = naming.VersionBook()
        self.records: dict[str, AdapterRecord] = {}     # served name -> record
        self._locks: dict[str, asyncio.Lock] = {}
        self._spec: ModelSpec | None = None
        self.group_timeouts: dict[str, float] = {}
        self.staging = StagingArea()
        self._freeing: set[asyncio.Task] = set()

    async def model_spec(self) -> ModelSpec:
        if self._spec is None:
            self._spec = await self.bridge.model_spec()
        return self._spec

    # -- transports ----------------------------------------------------------------
    async def load_from_body(self, chunks, content_length: int | None) -> dict:
        t0 = time.perf_counter()
        settle_ms = await self._settle()
        t_recv = time.perf_counter()
        staged = await self.staging.stage(chunks, self.settings.max_body_bytes, content_length)
        kept = False
        try:
            meta = staged.header.metadata
            name = naming.check_name(meta.get(META_NAME))
            version = naming.parse_version(meta.get(META_VERSION))
            cfg = check_adapter(staged.header.specs, _parse_config(meta.get(META_CONFIG)),
                                await self.model_spec())
            received_ms = (time.perf_counter() - t_recv) * 1e3

            async def stage(adapter_id):
                return await self.bridge.stage_from_shm(adapter_id, staged.path, cfg,
                                                        meta.get(META_CHECKSUM))
            nbytes = staged.nbytes - staged.header.data_start
            reply = await self._install(name, version, cfg, nbytes, "tensors", stage, t0,
                                        staged.path)
            kept = True  # the workers now map the file: it goes back when the version does
            reply["timings_ms"].update(settle=settle_ms, receive=received_ms)
            return reply
        finally:
            if not kept:
                self.staging.release(staged.path)

    async def load_from_distributed(self, body: dict) -> dict:
        t0 = time.perf_counter()
        if not isinstance(body, dict):
            raise BadAdapter("body must be a JSON object", code="bad_request")
        name = naming.check_name(body.get("lora_name"))
        version = naming.parse_version(body.get("version"))
        cfg = body.get("adapter_config")
        if isinstance(cfg, str):
            cfg = _parse_config(cfg)
        raw_specs = body.get("tensors")
        if not isinstance(raw_specs, list):
            raise BadAdapter("'tensors' must be a list of {name, dtype, shape}",
                             code="bad_metadata")
        specs = [TensorSpec.from_json(s) for s in raw_specs]
        if len({s.name for s in specs}) != len(specs):
            raise BadAdapter("'tensors' lists a name twice", code="bad_metadata")
        cfg = check_adapter(specs, cfg if cfg is not None else {}, await self.model_spec())
        group = body.get("group_name") or "default"
        bucket = int(body.get("bucket_bytes") or DEFAULT_BUCKET_BYTES)
        nbytes = sum(s.nbytes for s in specs)
        settle_ms = await self._settle()

        async def receive(adapter_id):
            return await self.bridge.receive(adapter_id, group, [s.to_json() for s in specs], cfg,
                                             bucket, body.get("checksum"),
                                             self.group_timeouts.get(group, 120.0) + 30)
        reply = await self._install(name, version, cfg, nbytes, "broadcast", receive, t0)
        reply["timings_ms"]["settle"] = settle_ms
        return reply

    async def _install(self, name, version_req, cfg, nbytes, transport, stage, t0,
                       staged_path: str | None = None) -> dict:
        t_in = time.perf_counter()
        async with self._locks.setdefault(name, asyncio.Lock()):
            version = self.book.reserve(name, version_req)
            served = naming.versioned(name, version)
            adapter_id = self.bridge.new_adapter_id()
            t1 = time.perf_counter()
            try:
                worker_ms = max(r.get("ms", 0.0) for r in await stage(adapter_id))
                t2 = time.perf_counter()
                handle = await self.bridge.activate(served, adapter_id)
            except BaseException:
                self.book.release(name, version)
                await asyncio.shield(self._forget([adapter_id]))
                raise
            t3 = time.perf_counter()
            # Publish the version and move the alias in one step: a request sees the old
            # or the new version, never a gap.
            self.bridge.publish([served, name], handle)
            retired = self.book.commit(name, version, self.settings.keep_versions)
            rec = AdapterRecord(name, version, served, adapter_id, nbytes, int(cfg["r"]),
                                transport, (t3 - t0) * 1e3, staged_path=staged_path)
            self.records[served] = rec
            self._retire(name, retired)
        return {"name": served, "lora_name": name, "version": version, "bytes": nbytes,
                "load_ms": rec.load_ms, "transport": transport,
                "timings_ms": {"wait": (t1 - t_in) * 1e3, "worker": worker_ms,
                               "handoff": (t2 - t1) * 1e3 - worker_ms,
                               "register": (t3 - t2) * 1e3}}

    # -- admission (see admission.py) -------------------------------------------------
    def admit(self, requested: str):
        """The record a generation request naming `requested` will use (counted in flight),
        an error reply for a retired/unknown version of one of our names, or None when the
        name is not ours."""
        name, version = naming.split_versioned(requested)
        if version is None:
            latest = self.book.latest(requested)
            if latest is None:
                return None
            rec = self.records[naming.versioned(requested, latest)]
        else:
            if name not in self.book.versions:
                return None
            rec = self.records.get(requested)
            if rec is None or rec.retired:
                available = [naming.versioned(name, v) for v in self.book.versions[name]]
                return NotFound(f"{requested} is not servable (retired or never loaded); "
                                f"versions available: {available}",
                                code="version_retired").to_json()
        rec.inflight += 1
        return rec

    def release(self, served_name: str) -> None:
        rec = self.records.get(served_name)
        if rec is None:
            return
        rec.inflight -= 1
        if rec.retired and rec.inflight == 0:
            self._drop(rec)

    def _drop(self, rec: AdapterRecord) -> None:
        """Unlists a version now; frees its engine copies in the background (the next push
        waits for that in `_settle`, so it can reuse the memory)."""
        if self.records.pop(rec.served_name, None) is None:
            return  # already dropped
        task = asyncio.get_running_loop().create_task(self._free(rec))
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)

    async def _free(self, rec: AdapterRecord) -> None:
        await self.bridge.unpublish([rec.served_name])
        dropped = await self._forget([rec.adapter_id])
        if rec.staged_path is not None:
            # Reuse the file only once no worker serves from it; else just unlink it.
            (self.staging.release if dropped else discard)(rec.staged_path)

    async def _settle(self) -> float:
        """Waits until dropped versions are freed (overlaps the trainer's step in practice);
        returns the milliseconds waited."""
        t0 = time.perf_counter()
        if self._freeing:
            await asyncio.gather(*self._freeing, return_exceptions=True)
        return (time.perf_counter() - t0) * 1e3

    async def _forget(self, adapter_ids: list[int]) -> bool:
        try:
            await self.bridge.drop(adapter_ids)
            return True
        except Exception:  # best effort: nothing was published for these ids
            return False

    def _retire(self, name: str, versions: list[int]) -> None:
        """Never waits for generation: idle versions go now, busy ones when their last
        request finishes (see `release`)."""
        for v in versions:
            rec = self.records.get(naming.versioned(name, v))
            if rec is not None:
                rec.retired = True
                if rec.inflight == 0:
                    self._drop(rec)

    # -- groups ----------------------------------------------------------------------
    async def init_group(self, body: dict) -> dict:
        try:
            host, port = str(body["master_address"]), int(body["master_port"])
            rank_offset, world_size = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise BadAdapter("init_lora_update_group needs master_address, master_port, "
                             "rank_offset and world_size", code="bad_request") from e
        backend = body.get("backend", "gloo")
        if backend not in ("gloo", "nccl"):
            raise BadAdapter(f"backend must be 'gloo' or 'nccl', got {backend!r}",
                             code="bad_request")
        workers = len(await self.bridge.worker_status())
        if rank_offset < 1 or rank_offset + workers > world_size:
            raise BadAdapter(f"ranks {rank_offset}..{rank_offset + workers - 1} of this "
                             f"server's {workers} worker(s) do not fit world_size {world_size} "
                             "(rank 0 is the trainer)", code="bad_request")
        group = body.get("group_name") or "default"
        t0 = time.perf_counter()
        timeout_s = float(body.get("timeout_s") or 120)
        await self.bridge.init_group(group, host, port, rank_offset, world_size, backend,
                                     timeout_s)
        self.group_timeouts[group] = timeout_s
        return {"group_name": group, "workers": workers, "ms": (time.perf_counter() - t0) * 1e3}

    async def destroy_group(self, body: dict) -> dict:
        group = (body or {}).get("group_name") or "default"
        await self.bridge.destroy_group(group)
        return {"group_name": group, "destroyed": True}

    async def info(self) -> dict:
        """What a trainer needs before it broadcasts: worker count and the model's limits,
        so it can refuse a bad adapter before any collective call."""
        spec = await self.model_spec()
        status = await self.bridge.worker_status()
        return {"workers": len(status), "worker_status": status, "max_lora_rank": spec.max_rank,
                "linear_modules": {k: list(v) for k, v in spec.linear.items()},
                "keep_versions": self.settings.keep_versions,
                "max_body_bytes": self.settings.max_body_bytes}

    def list_adapters(self) -> dict:
        out = {}
        for rec in self.records.values():
            entry = out.setdefault(rec.name, {"name": rec.name, "alias_target": None,
                                              "versions": []})
            entry["versions"].append(asdict(rec))
            entry["alias_target"] = naming.versioned(rec.name, self.book.latest(rec.name))
            entry["inflight"] = entry.get("inflight", 0) + rec.inflight
        return {"adapters": list(out.values()), "keep_versions": self.settings.keep_versions}


def check_worker_replies(replies: list[dict]) -> list[dict]:
    """Raises the first worker refusal as the matching LoRASyncError."""
    for r in replies:
        if not r.get("ok"):
            raise LoRASyncError(r.get("message", "worker failed"), code=r.get("code"),
                                status=r.get("status", 500))
    return replies
