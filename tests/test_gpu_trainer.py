"""A GPU trainer's side: its copy into an shm lease (lora_sync/transports/device_copy.py)
and its NCCL broadcast sender (lora_sync/collective.py).

The packing runs on any device, so its rules are checked here on CPU tensors; the tests
marked `cuda` need a GPU (they skip without one: CI has none) and ran on an H100 and an H200 with
`python3 -m pytest tests/test_gpu_trainer.py` (see docs/protocol.md)."""
from __future__ import annotations

import mmap
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lora_sync import collective, wire
from lora_sync.transports import shm
from lora_sync.transports.device_copy import HostPin, _buckets, copy_to_host

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 64), min_size=1, max_size=30),
       gaps=st.lists(st.booleans(), min_size=30, max_size=30),
       limit=st.integers(1, 100))
def test_buckets_pack_only_neighbours_and_stay_bounded(sizes, gaps, limit):
    """Every tensor lands in exactly one run, in order; a run is bytes that follow each
    other in the file, at most `limit` of them unless it is a single tensor."""
    placed, offset = [], 0
    for i, n in enumerate(sizes):
        offset += 3 if gaps[i] else 0
        placed.append((offset, torch.arange(n, dtype=torch.uint8)))
        offset += n
    runs = list(_buckets(placed, limit))
    flat = [t for _, run in runs for t in run]
    assert [t.tolist() for t in flat] == [t.tolist() for _, t in placed]
    starts = {o for o, _ in placed}
    for start, run in runs:
        assert start in starts
        size = sum(t.numel() for t in run)
        assert size <= limit or len(run) == 1
    dst = torch.zeros(offset + 1, dtype=torch.uint8)
    copy_to_host(dst, placed, bucket_bytes=limit)
    expected = torch.zeros(offset + 1, dtype=torch.uint8)
    for o, t in placed:
        expected[o:o + t.numel()] = t
    assert torch.equal(dst, expected)


def _lease_bytes(chunks, pin: bool = False) -> bytes:
    nbytes = shm.total_bytes(chunks)
    fd = os.memfd_create("lora-sync-test")
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        hold = HostPin.of(mapping) if pin else None
        assert (hold is not None) == pin
        shm.write_mapped(mapping, chunks, hold)
        assert mapping.closed and (hold is None or not hold.address)
        return os.pread(fd, nbytes, 0)
    finally:
        os.close(fd)


def _adapter(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.{m}.lora_{ab}.weight": torch.randn(shape, generator=g)
            .to(torch.bfloat16).to(device)
            for i in range(3) for m, shape in (("q", (8, 48)), ("mlp", (48 * 1000, 8)))
            for ab in "AB"}


@cuda
@pytest.mark.parametrize("pin", [False, True])
def test_gpu_tensors_land_in_a_lease_byte_for_byte(pin):
    """Into plain or CUDA-registered memory, the lease holds the file the CPU would write."""
    tensors = _adapter("cuda")
    chunks = wire.layout(tensors, {"k": "v"})
    assert sum(c.numel() * c.element_size() for c in chunks[1:]) > (1 << 20)
    cpu = {k: v.cpu() for k, v in tensors.items()}
    assert _lease_bytes(chunks, pin) == wire.encode_bytes(cpu, {"k": "v"})


@cuda
def test_a_file_of_cpu_and_gpu_tensors_lands_in_order():
    tensors = _adapter("cpu")
    mixed = {k: (v.cuda() if i % 2 else v) for i, (k, v) in enumerate(tensors.items())}
    assert _lease_bytes(wire.layout(mixed, {})) == wire.encode_bytes(tensors, {})


@cuda
def test_a_failed_write_still_unregisters_and_unmaps():
    """Chunks larger than the lease: an error, and CUDA lets go of the mapping first."""
    chunks = wire.layout(_adapter("cuda"), {})
    fd = os.memfd_create("lora-sync-test")
    try:
        os.ftruncate(fd, 4096)
        mapping = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
        hold = HostPin.of(mapping)
        with pytest.raises(ValueError, match="do not fit"):
            shm.write_mapped(mapping, chunks, hold)
        assert mapping.closed and not hold.address
    finally:
        os.close(fd)


@cuda
def test_the_nccl_sender_packs_cuda_tensors_into_frames_that_unpack_to_them():
    """The broadcast sender's own path on NCCL (a group of the trainer alone: one GPU cannot
    hold two NCCL ranks): the header and every bucket go out of device memory, and the
    frames it keeps unpack to exactly the tensors sent, trailers in place."""
    import socket
    tensors = _adapter("cuda")
    specs = [wire.TensorSpec.of(k, v) for k, v in tensors.items()]
    transfer = collective.Transfer.plan(specs, 7, bucket_bytes=1 << 20)
    assert len(transfer.buckets) > 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = collective.create_group("127.0.0.1", port, 0, 1, backend="nccl", timeout_s=30)
    try:
        kept, packed = {}, []
        collective.send_transfer(group, transfer, tensors, kept, device="cuda",
                                 packed=lambda: packed.append(True))
        assert packed == [True] and kept["frames"].device.type == "cuda"
        frames = collective.frame_buffers(transfer, kept, "cuda")
        got = collective.unpack_frames(transfer, frames)
        assert got.keys() == tensors.keys()
        assert all(torch.equal(got[k], tensors[k]) for k in tensors)
        for i, (b, frame) in enumerate(zip(transfer.buckets, frames)):
            transfer.check_trailer(i, bytes(frame[b.trailer_at:].cpu().numpy()))
    finally:
        group.shutdown()


@cuda
def test_a_lease_readied_after_a_gpu_push_is_registered_and_let_go(monkeypatch):
    """After a push from GPU tensors, the next lease is readied registered with CUDA; the
    push that takes it writes the file and releases the registration, and a lease readied
    for another name is released when discarded. STAND-IN: no server runs on the GPU
    machine, so the grant, renew and cancel calls are answered here with leases of this
    process (the client opens them through /proc like any server's)."""
    from lora_sync.transports.shm import ready_lease
    from lora_sync.transports.base import Server
    from lora_sync.transports.shm.ready_lease import ReadyLeases
    fds, pins = [], []

    def post(self, server, route, body):
        if route == shm.LEASE_ROUTE:
            fd, lease = shm.new_lease(body["nbytes"], 60.0)
            fds.append(fd)
            return lease.to_json()
        return {"expires_s": 60.0}

    monkeypatch.setattr(ReadyLeases, "_post", post)
    register = HostPin.of.__func__

    def registering(cls, mapping):  # the real registration, remembered
        pins.append(register(cls, mapping))
        return pins[-1]

    monkeypatch.setattr(ready_lease.HostPin, "of", classmethod(registering))
    tensors = _adapter("cuda")
    chunks = wire.layout(tensors, {})
    nbytes = shm.total_bytes(chunks)
    server = Server("http://127.0.0.1:9")
    leases = ReadyLeases({}, "test-client")
    try:
        leases.want(server, "policy", nbytes, pin=True)
        leases.start()
        ready = leases.take(server, "policy", nbytes)
        assert ready.pin is not None and ready.pin.address
        pin = ready.pin
        shm.write_mapped(ready.mapping, chunks, ready.pin)
        assert not pin.address and ready.mapping.closed
        assert os.pread(ready.read_fd, nbytes, 0) == \
            wire.encode_bytes({k: v.cpu() for k, v in tensors.items()}, {})
        os.close(ready.read_fd)

        leases.want(server, "policy", nbytes, pin=True)
        leases.start()
        assert leases.take(server, "other", nbytes) is None  # discarded
        assert len(fds) == len(pins) == 2 and all(not p.address for p in pins)
    finally:
        leases.close()
        for fd in fds:
            os.close(fd)
