"""Engine-agnostic worker state: adapters kept in memory, the buffers they arrived in, and
the trainer process groups; plus the checks every intake runs.

The transports' worker sides (lora_sync/transports) use it as their pool: `take_buffer`,
`group`, `keep_spares`; the dispatcher (dispatcher.py) owns one per worker."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from lora_sync import collective
from lora_sync.adapter import check_finite, tensors_checksum
from lora_sync.errors import BadAdapter, BadRequest, Conflict, TransferFailed
from lora_sync.messages import WorkerReply
from lora_sync.notices import write_notice


@dataclass
class StoredAdapter:
    tensors: dict[str, torch.Tensor]
    config: dict
    nbytes: int
    built: object = None  # the engine's LoRA model object, built once at intake
    buffers: list = field(default_factory=list)  # reused buffers the tensors view
    read_only: bool = False  # the tensors view a read-only mapping: build must not write them
    # ms of `built` that the engine's own code took (vLLM's LoRAModel from the tensors, as
    # its disk loader makes it): the push's `engine_build`, inside its `build`
    engine_build_ms: float = 0.0


@dataclass
class WorkerState:
    adapters: dict[int, StoredAdapter] = field(default_factory=dict)
    groups: dict[str, object] = field(default_factory=dict)
    # Groups being set up on a background thread: name -> the set-up that may finish it.
    pending: dict[str, object] = field(default_factory=dict)
    groups_lock: threading.Lock = field(default_factory=threading.Lock)
    # Per group, the tensors it last declared (transports/broadcast.py Layout): a later push
    # of the same layout names it instead of listing them again.
    layouts: dict[str, object] = field(default_factory=dict)
    # Buckets of the last freed adapter, for the next broadcast to receive into: filling
    # memory that is already mapped is several times cheaper than fresh pages (docs/protocol.md,
    # "Why memory is reused"; measured in docs/benchmarks.md, "What each piece bought").
    spare: list[torch.Tensor] = field(default_factory=list)
    # A busy version is freed when its last request ends, maybe while a receive runs.
    spare_lock: threading.Lock = field(default_factory=threading.Lock)
    # The engine never writes the tensors it is given (WorkerEngine.maps_read_only): a
    # sealed lease or a staged body is then mapped read-only instead of copied.
    maps_read_only: bool = False

    def take_buffer(self, dtype: torch.dtype, numel: int, device: str) -> torch.Tensor:
        """A buffer to receive into: the spare of that shape if there is one."""
        with self.spare_lock:
            for i, buf in enumerate(self.spare):
                if (buf.dtype, buf.numel(), buf.device.type) == (dtype, numel, device):
                    return self.spare.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def group(self, group_name: str):
        """(process group, device) of a group this worker joined."""
        pg, device = self.groups.get(group_name, (None, None))
        if pg is None:
            raise BadRequest(f"no LoRA update group {group_name!r} on this worker; call "
                             "init_lora_update_group first", code="no_group")
        return pg, device

    def free(self, adapter_id: int) -> None:
        """Forgets an adapter the engine no longer serves; its buckets become the spares."""
        stored = self.adapters.pop(adapter_id, None)
        if stored is not None and stored.buffers:
            self.keep_spares(stored.buffers)

    def keep_spares(self, buffers: list) -> None:
        with self.spare_lock:
            self.spare = buffers

    # -- groups ---------------------------------------------------------------------
    def init_group_in_background(self, group_name: str, notice_path: str, host: str,
                                 port: int, rank: int, world_size: int, backend: str,
                                 timeout_s: float, streams: int) -> None:
        """Joins the trainer's group on a thread: the rendezvous may wait for a slow or
        hostile peer, and the engine must keep generating meanwhile. The outcome goes to
        `notice_path`; a group that comes up after the API gave up is shut down."""
        with self.groups_lock:
            if group_name in self.groups or group_name in self.pending:
                raise Conflict(f"group {group_name!r} already exists", code="group_exists")
            setup = self.pending[group_name] = object()
        deadline = time.monotonic() + timeout_s

        def create() -> None:
            try:
                pg = collective.create_group(host, port, rank, world_size, backend, timeout_s,
                                             streams)
            except Exception as e:
                raise TransferFailed(f"could not join group {group_name!r} at {host}:{port} "
                                     f"within {timeout_s:g} s: {str(e)[:300]}") from e
            with self.groups_lock:
                wanted = self.pending.get(group_name) is setup and time.monotonic() < deadline
                if wanted:
                    del self.pending[group_name]
                    self.groups[group_name] = (pg, "cuda" if backend == "nccl" else "cpu")
            if not wanted:
                pg.shutdown()
                raise TransferFailed(f"group {group_name!r} came up after {timeout_s:g} s; "
                                     "discarded")

        def work():
            try:
                write_notice(notice_path, WorkerReply.run(create))
            finally:
                with self.groups_lock:
                    if self.pending.get(group_name) is setup:
                        del self.pending[group_name]
        threading.Thread(target=work, name=f"lora-sync-join-{group_name}", daemon=True).start()

    def group_names(self) -> list[str]:
        """Groups up or being set up (each holds a connection to a trainer)."""
        with self.groups_lock:
            return sorted({*self.groups, *self.pending})

    def destroy_group(self, group_name: str) -> bool:
        with self.groups_lock:
            self.pending.pop(group_name, None)  # a late set-up is then discarded
            self.layouts.pop(group_name, None)
            pg, _ = self.groups.pop(group_name, (None, None))
        if pg is not None:
            pg.shutdown()
        return pg is not None


def check_intake(tensors: dict[str, torch.Tensor], checksum: str | None,
                 finite: bool) -> None:
    """What every transport checks once the tensors are in the worker. `finite`: the
    operator's LORA_SYNC_CHECK_FINITE, off by default (a full pass over the weights would
    be the largest part of a sync on CPU)."""
    check_finite(tensors, finite)
    if checksum:
        actual = tensors_checksum(tensors)
        if actual != checksum:
            raise BadAdapter(f"checksum mismatch: the tensors hash to {actual}, the request "
                             f"says {checksum}", code="checksum_mismatch")


def engine_refusal(fn, *args):
    """Runs the engine's own build/register step: its ValueError is its verdict on the
    adapter (a 400 naming it), anything else stays a worker failure."""
    try:
        return fn(*args)
    except ValueError as e:
        raise BadAdapter(f"the engine refused the adapter: {e}", code="engine_refused") from e
