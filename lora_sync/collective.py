"""The process group between a trainer (rank 0) and inference workers, and bucket packing.

Both sides call `create_group` (same code, the backend is a parameter: gloo on CPU, nccl on
GPU) and `pack_buckets` / `unpack_bucket` agree on how tensors are laid out in a broadcast."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .wire import DTYPES, TensorSpec

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


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


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], device="cpu") -> torch.Tensor:
    flat = torch.empty(bucket.numel, dtype=DTYPES[bucket.dtype], device=device)
    torch.cat([tensors[s.name].reshape(-1) for s in bucket.specs], out=flat)
    return flat


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into `flat` (no copy), one per tensor of the bucket."""
    out, pos = {}, 0
    for s in bucket.specs:
        n = s.nbytes // DTYPES[s.dtype].itemsize
        out[s.name] = flat[pos:pos + n].view(s.shape)
        pos += n
    return out


def broadcast_buckets(group: Group, buckets: list[Bucket], tensors: dict | None, device="cpu",
                      src: int = 0) -> dict[str, torch.Tensor]:
    """Rank `src` sends `tensors`; every other rank receives them (tensors=None)."""
    received = {}
    for b in buckets:
        flat = (pack_bucket(b, tensors, device) if tensors is not None else
                torch.empty(b.numel, dtype=DTYPES[b.dtype], device=device))
        group.broadcast(flat, src)
        received.update(unpack_bucket(b, flat))
    return received
