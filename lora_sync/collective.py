"""The process group between a trainer (rank 0) and inference workers, and bucket packing.

Both sides call `create_group` (same code, the backend is a parameter: gloo on CPU, nccl on
GPU) and plan the same `Transfer` (buckets, framing) from the tensor specs."""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .host_copy import pack_into
from .wire import DTYPES, TensorSpec, plan_views

# Small buckets, all in flight at once, let the sender pack bucket k+1 while bucket k is on
# the wire: faster than one flat buffer or pack-then-send (measured in docs/benchmarks.md,
# "What each piece bought").
DEFAULT_BUCKET_BYTES = 8 * 1024 * 1024
# gloo: connections per pair of ranks, each carrying one bucket at a time. One TCP stream
# leaves the wire idle between its segments; several in parallel fill it (docs/protocol.md,
# "Parallel streams"; measured in docs/benchmarks.md, "What each piece bought"). Every member
# of a group must use the same number.
DEFAULT_STREAMS = 4
MAX_STREAMS = 16
# Every member wraps the trainer's TCP store in this prefix (docs/wire_format.md).
STORE_PREFIX = "lora-sync"


def create_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 120.0, streams: int = DEFAULT_STREAMS) -> "Group":
    """A process group that leaves torch.distributed's default group untouched (the engine
    already uses it). Rank 0 hosts the TCP store."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=False)
    # The same prefix on every member, whatever name each dialled the trainer by (the server's
    # workers dial the address it resolved `master_address` to).
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "gloo":
        # gloo runs collective k on connection k mod streams, one thread per connection.
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = _gloo_devices(streams)
        opts._threads = max(2, streams)
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    pg._set_sequence_number_for_group()
    return Group(pg, store)


def _gloo_devices(count: int) -> list:
    """`count` gloo devices on the interfaces GLOO_SOCKET_IFNAME lists, in turn, as torch's
    own constructor picks them; without it, on the address the hostname resolves to."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if not interfaces:
        return [dist.ProcessGroupGloo.create_default_device() for _ in range(count)]
    return [dist.ProcessGroupGloo.create_device(interface=interfaces[i % len(interfaces)])
            for i in range(count)]


@dataclass
class Group:
    pg: object
    store: object  # the TCP store must outlive the process group

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.pg.broadcast(tensor, src).wait()

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Queues a broadcast and returns its work handle (ops run in the order queued)."""
        return self.pg.broadcast(tensor, src)

    def shutdown(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # older torch or already broken: nothing to release
            pass


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of one dtype, sent as one flat buffer."""
    dtype: str
    specs: tuple[TensorSpec, ...]

    @functools.cached_property  # asked for per frame, and a bucket may hold thousands
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def trailer_at(self) -> int:
        """Where the trailer starts in the bucket's frame: past the payload, padded so
        every frame (and so every payload) starts aligned for any dtype."""
        return -(-self.nbytes // FRAME_BYTES) * FRAME_BYTES

    @property
    def frame_bytes(self) -> int:
        return self.trailer_at + FRAME_BYTES


def plan_buckets(specs: list[TensorSpec], max_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Groups tensors by dtype (in order of first appearance), cutting a bucket before it
    would exceed `max_bytes`. Sender and receivers compute the same plan from the specs."""
    by_dtype: dict[str, list[TensorSpec]] = {}
    for s in specs:
        by_dtype.setdefault(s.dtype, []).append(s)
    buckets = []
    for dtype, group in by_dtype.items():
        cur, size = [], 0
        for s in group:
            if cur and size + s.nbytes > max_bytes:
                buckets.append(Bucket(dtype, tuple(cur)))
                cur, size = [], 0
            cur.append(s)
            size += s.nbytes
        if cur:
            buckets.append(Bucket(dtype, tuple(cur)))
    return buckets


# -- framing: what a receiver checks before anything it received is used ----------------
# A transfer is one fixed-size header, then each bucket as [payload | trailer]. Receivers
# check the header against what the trainer declared over HTTP before posting any bucket
# receive (so declared and sent sizes agree, whatever was declared), and every trailer after
# (a short message leaves a zeroed trailer: nothing partial, nothing left over from an
# earlier transfer in a reused buffer, is ever taken). The transfer id, new at every push,
# ties every frame to the declaration.
MAGIC = b"LSYNC\x01\x00\x00"
FRAME_BYTES = 64
_HEADER = struct.Struct("<8sQQQQQ")   # magic, transfer id, payload bytes, buckets,
                                       # bucket_bytes, layout digest
_TRAILER = struct.Struct("<8sQQQQ")   # magic, transfer id, bucket index, bytes, layout


class FrameMismatch(ValueError):
    """What arrived is not what was declared."""


def layout_digest(specs: list[TensorSpec]) -> int:
    """64 bits of SHA-256 over the tensors' names, dtypes and shapes, in order."""
    text = json.dumps([[s.name, s.dtype, list(s.shape)] for s in specs]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


@dataclass(frozen=True)
class Transfer:
    """One broadcast as both sides compute it from the tensor specs."""
    transfer_id: int
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    layout: int

    @classmethod
    def plan(cls, specs: list[TensorSpec], transfer_id: int,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, layout: int | None = None) -> "Transfer":
        """`layout`: the specs' layout_digest, where the caller already has it."""
        return cls(transfer_id, tuple(plan_buckets(specs, bucket_bytes)), bucket_bytes,
                   layout_digest(specs) if layout is None else layout)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def header(self) -> bytes:
        return _HEADER.pack(MAGIC, self.transfer_id, self.nbytes, len(self.buckets),
                            self.bucket_bytes, self.layout).ljust(FRAME_BYTES, b"\0")

    def trailer(self, index: int) -> bytes:
        return _TRAILER.pack(MAGIC, self.transfer_id, index, self.buckets[index].nbytes,
                             self.layout).ljust(FRAME_BYTES, b"\0")

    def check_header(self, got: bytes) -> None:
        if got != self.header():
            raise FrameMismatch(f"the broadcast header {_describe(_HEADER, got)} does not "
                                f"match the declaration {_describe(_HEADER, self.header())}")

    def check_trailer(self, index: int, got: bytes) -> None:
        if got != self.trailer(index):
            raise FrameMismatch(f"bucket {index} of {len(self.buckets)} arrived incomplete or "
                                f"from another transfer (trailer {_describe(_TRAILER, got)})")


def _describe(fmt: struct.Struct, raw: bytes) -> str:
    magic, tid, *rest = fmt.unpack(raw[:fmt.size])
    return f"(magic={magic!r}, transfer={tid}, fields={rest})"


def frame_buffers(transfer: Transfer, kept: dict, device="cpu") -> list[torch.Tensor]:
    """One byte view [payload | trailer] per bucket into one buffer the sender keeps in
    `kept` between broadcasts: packing into memory that is already mapped is several times
    faster than into fresh pages."""
    sizes = [b.frame_bytes for b in transfer.buckets]
    buf = kept.get("frames")
    if buf is None or buf.numel() < sum(sizes) or buf.device.type != torch.device(device).type:
        buf = kept["frames"] = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    views, pos = [], 0
    for n in sizes:
        views.append(buf[pos:pos + n])
        pos += n
    return views


def payload(bucket: Bucket, frame: torch.Tensor) -> torch.Tensor:
    """The bucket's tensors' flat storage inside its frame, in the bucket's dtype."""
    return frame[:bucket.nbytes].view(DTYPES[bucket.dtype])


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor],
                out: torch.Tensor) -> torch.Tensor:
    """Host tensors go in by memcpy (host_copy: torch's copy would spin against gloo's
    threads), device ones by torch."""
    parts = [tensors[s.name].detach() for s in bucket.specs]
    if not pack_into(out, parts):
        torch.cat([t.reshape(-1) for t in parts], out=out)
    return out


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into `flat` (no copy), one per tensor of the bucket."""
    out, pos = {}, 0
    for s in bucket.specs:
        n = s.nbytes // DTYPES[s.dtype].itemsize
        out[s.name] = flat[pos:pos + n].view(s.shape)
        pos += n
    return out


def _bytes_tensor(raw: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def unpack_frames(transfer: Transfer, frames: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of a transfer, as views into its frames (bucket i in `frames[i]`)."""
    out = {}
    for b, frame, plan in zip(transfer.buckets, frames, _view_plans(transfer)):
        out.update(plan.views(frame, 0) if plan is not None
                   else unpack_bucket(b, payload(b, frame)))
    return out


_PLANS: dict[tuple, tuple] = {}  # (layout, bucket_bytes) -> (buckets, their plans)
_PLANS_MAX = 4
_PLANS_LOCK = threading.Lock()  # each group's receive runs on a thread of its own


def _view_plans(transfer: Transfer) -> list:
    """Each bucket's wire.ViewPlan (None: cut tensor by tensor), kept per layout and bucket
    size: a trainer sends the same layout every step. Kept with the buckets it was made for
    and used for equal buckets only (a worker plans each push from the same specs, so the
    comparison is by identity, element by element)."""
    key = (transfer.layout, transfer.bucket_bytes)
    with _PLANS_LOCK:
        kept = _PLANS.get(key)
    if kept is not None and kept[0] == transfer.buckets:
        return kept[1]
    plans = []
    for b in transfer.buckets:
        ends = list(itertools.accumulate(s.nbytes for s in b.specs))
        plans.append(plan_views(list(b.specs), list(zip([0] + ends[:-1], ends))))
    with _PLANS_LOCK:
        if len(_PLANS) >= _PLANS_MAX:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = (transfer.buckets, plans)
    return plans


def send_transfer(group: Group, transfer: Transfer, tensors: dict, kept: dict,
                  device="cpu", src: int = 0, packed=None) -> None:
    """The sender's side: the header, then each bucket packed into its kept frame and
    queued at once, so packing the next bucket overlaps sending this one. `packed()`, if
    given, runs once every bucket is packed, while they may still be on the wire."""
    works = [group.start_broadcast(_bytes_tensor(transfer.header(), device), src)]
    for i, (b, frame) in enumerate(zip(transfer.buckets,
                                       frame_buffers(transfer, kept, device))):
        pack_bucket(b, tensors, payload(b, frame))
        frame[b.trailer_at:].copy_(_bytes_tensor(transfer.trailer(i), device))
        works.append(group.start_broadcast(frame, src))
    if packed is not None:
        packed()
    for w in works:
        w.wait()


def receive_transfer(group: Group, transfer: Transfer, frames: list[torch.Tensor],
                     src: int = 0, timings_ms: dict | None = None) -> dict[str, torch.Tensor]:
    """A receiver's side: checks the header before posting any bucket receive; bucket i
    lands in `frames[i]` (`frame_bytes` long, which become the adapter's storage), its
    trailer zeroed first and checked after; returns views named like the sender's tensors.
    FrameMismatch: the caller must drop the group (the sender is out of step).
    `timings_ms` gets `header_wait` (until the sender's header was in: time spent waiting
    on the trainer) and `transfer` (from then to the last bucket in)."""
    t0 = time.perf_counter()
    header = torch.zeros(FRAME_BYTES, dtype=torch.uint8, device=frames[0].device
                         if frames else "cpu")
    group.broadcast(header, src)
    transfer.check_header(bytes(header.cpu().numpy()))
    t1 = time.perf_counter()
    works = []
    for b, frame in zip(transfer.buckets, frames):
        frame[b.trailer_at:].zero_()
        works.append(group.start_broadcast(frame, src))
    received = unpack_frames(transfer, frames)
    for w in works:
        w.wait()
    if timings_ms is not None:
        timings_ms.update(header_wait=(t1 - t0) * 1e3, transfer=(time.perf_counter() - t1) * 1e3)
    for i, (b, frame) in enumerate(zip(transfer.buckets, frames)):
        transfer.check_trailer(i, bytes(frame[b.trailer_at:].cpu().numpy()))
    return received


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody holds now (for the trainer's rendezvous, a server), below the kernel's
    ephemeral range where it is known: a connection opened meanwhile (the trainer's calls
    to its servers while the group forms) takes its local port from that range, and once
    took the port picked here before the store listened on it (EADDRINUSE)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64 if low > 2048 else 0):
        try:
            with socket.socket() as s:
                s.bind((host, rng.randrange(max(1024, low // 2), low)))
                return s.getsockname()[1]
        except OSError:  # held by someone: another
            continue
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
