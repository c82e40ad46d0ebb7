"""The process group between a trainer (rank 0) and inference workers, and bucket packing.

Both sides call `create_group` (same code, the backend is a parameter: gloo on CPU, nccl on
GPU) and `pack_bucket` / `unpack_bucket` agree on how tensors are laid out in a broadcast."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .wire import DTYPES, TensorSpec

# Small buckets, all in flight at once, let the sender pack bucket k+1 while bucket k is on
# the wire. On this 2-core CPU box (70 MB, gloo) 8 MiB buckets took 28-38 ms against 57 ms for
# one flat buffer and 82 ms for pack-then-send (docs/protocol.md).
DEFAULT_BUCKET_BYTES = 8 * 1024 * 1024


def create_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 120.0) -> "Group":
    """A process group that leaves torch.distributed's default group untouched (the engine
    already uses it). Rank 0 hosts the TCP store."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(f"lora-sync/{host}:{port}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout=timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    pg._set_sequence_number_for_group()
    return Group(pg, store)


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

    @property
    def numel(self) -> int:
        return sum(s.nbytes for s in self.specs) // DTYPES[self.dtype].itemsize


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


def send_buffers(buckets: list[Bucket], kept: dict, device="cpu") -> list[torch.Tensor]:
    """One flat view per bucket into a buffer per dtype that the sender keeps in `kept`
    between broadcasts: packing into memory that is already mapped is several times faster
    than into fresh pages."""
    need: dict[str, int] = {}
    for b in buckets:
        need[b.dtype] = need.get(b.dtype, 0) + b.numel
    for dtype, n in need.items():
        buf = kept.get(dtype)
        if buf is None or buf.numel() < n or buf.device.type != torch.device(device).type:
            kept[dtype] = torch.empty(n, dtype=DTYPES[dtype], device=device)
    views, pos = [], dict.fromkeys(need, 0)
    for b in buckets:
        views.append(kept[b.dtype][pos[b.dtype]:pos[b.dtype] + b.numel])
        pos[b.dtype] += b.numel
    return views


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor],
                out: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensors[s.name].reshape(-1) for s in bucket.specs], out=out)


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into `flat` (no copy), one per tensor of the bucket."""
    out, pos = {}, 0
    for s in bucket.specs:
        n = s.nbytes // DTYPES[s.dtype].itemsize
        out[s.name] = flat[pos:pos + n].view(s.shape)
        pos += n
    return out


def send_buckets(group: Group, buckets: list[Bucket], tensors: dict, kept: dict,
                 device="cpu", src: int = 0) -> None:
    """The sender's side: packs each bucket into its kept buffer and queues it at once, so
    packing the next bucket overlaps sending this one."""
    works = []
    for b, flat in zip(buckets, send_buffers(buckets, kept, device)):
        pack_bucket(b, tensors, flat)
        works.append(group.start_broadcast(flat, src))
    for w in works:
        w.wait()


def receive_buckets(group: Group, buckets: list[Bucket], flats: list[torch.Tensor],
                    src: int = 0) -> dict[str, torch.Tensor]:
    """A receiver's side: bucket i lands in `flats[i]` (which become the adapter's storage),
    all queued at once; returns views named like the sender's tensors."""
    works, received = [], {}
    for b, flat in zip(buckets, flats):
        works.append(group.start_broadcast(flat, src))
        received.update(unpack_bucket(b, flat))
    for w in works:
        w.wait()
    return received


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (for the trainer's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
