"""A GPU trainer's tensors into host memory (an shm lease's mapping), device to host.

What costs is not the bytes but the number of copies and where they land. Ways to write
a rank-64 adapter (70 MB, 336 tensors) into a ready lease, unmap included, slowest first
(scripts/gpu_check.py measures them; docs/benchmarks.md, "A GPU trainer's copy", has the
table):

- one synchronous copy per tensor (torch's `copy_`): a transfer and a wait per tensor;
- the tensors packed on the GPU into buckets of at most BUCKET_BYTES, one queued copy per
  bucket, into plain (pageable) memory, which the driver stages through a buffer of its
  own;
- the same into a mapping registered with CUDA (cudaHostRegister): about half the time of
  the first, and the copies are the smaller part of it, behind the unmap and releasing the
  registration.

Registering 70 MB costs about what it then saves, and every push gets a new memfd:
registered on the push's path it would gain nothing. So only a lease readied ahead
(ready_lease.py) is registered, there, off the path.

The copies run on each device's current stream, after the work the trainer queued there."""
from __future__ import annotations

import ctypes
import logging
import mmap

import torch

log = logging.getLogger(__name__)
# A bucket is a transient GPU buffer: bounded, so that a large adapter needs no second copy
# of itself on the GPU. Into pageable memory, 70 MB in 32 MB buckets copies nearly as fast
# as in one (in 8 MB ones, measurably slower); into registered memory the size is moot.
BUCKET_BYTES = 32 << 20
# cudaHostRegisterPortable: pinned for every device, not only the registering thread's
# current one (a trainer rank's tensors may be on cuda:3; the registering thread's is 0).
_PORTABLE = 1


def on_device(chunk) -> bool:
    # is_cpu, not device.type: that builds a device object per call, thousands per push
    return isinstance(chunk, torch.Tensor) and not chunk.is_cpu


def copy_to_host(dst: torch.Tensor, placed: list[tuple[int, torch.Tensor]],
                 bucket_bytes: int = BUCKET_BYTES) -> None:
    """Copies each (offset, tensor) into `dst` (a flat uint8 host tensor) at its byte
    offset, and waits for the copies. Neighbours (each one's bytes ending where the next's
    start) on one device are packed into one copy of at most `bucket_bytes`."""
    devices = set()
    for offset, group in _buckets(placed, bucket_bytes):
        packed = torch.cat(group) if len(group) > 1 else group[0]
        # queued on CUDA and waited for below; other devices copy synchronously
        dst[offset:offset + packed.numel()].copy_(packed, non_blocking=packed.is_cuda)
        if packed.is_cuda:
            devices.add(packed.device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _buckets(placed, limit: int):
    """(offset, [byte views]) runs: adjacent in `dst`, one device, at most `limit` bytes
    (a tensor larger than that is a run by itself)."""
    start, run, size, end, device = 0, [], 0, None, None
    for offset, tensor in placed:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if run and (offset != end or flat.device != device or size + flat.numel() > limit):
            yield start, run
            run, size = [], 0
        if not run:
            start, device = offset, flat.device
        run.append(flat)
        size += flat.numel()
        end = offset + flat.numel()
    if run:
        yield start, run


class HostPin:
    """A mapping registered with CUDA (page-locked), so that copies into it run at the
    bus's speed. `release()` before the mapping is closed: CUDA must let go of the pages
    before they are unmapped."""

    def __init__(self, address: int):
        self.address = address

    @classmethod
    def of(cls, mapping: mmap.mmap) -> "HostPin | None":
        """None where CUDA is not there or refuses (the copies then stage through the
        driver's own pinned buffer, as into any host memory)."""
        if not torch.cuda.is_available() or not len(mapping):
            return None
        anchor = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the mapping is open
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(address, len(mapping), _PORTABLE))
        except RuntimeError as e:  # CUDA itself failed: the lease is still usable unpinned
            err = str(e)
        if err:
            log.debug("cudaHostRegister refused a lease mapping: %s", err)
            return None
        return cls(address)

    def release(self) -> None:
        if self.address:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.address = 0
