"""GPU trainers: how fast does a rank-64 adapter get from GPU tensors into an shm lease?

Needs only torch with CUDA (no vLLM, SGLang or lora-sync server; lora_sync is imported from
this checkout). A lease is a memfd the trainer maps and writes (lora_sync/transports/shm/trainer.py);
from a CUDA tensor that write is a device-to-host copy. Into pageable memory the driver
stages it through its own pinned buffer; registering the mapping with CUDA
(cudaHostRegister) makes it pinned, at a price per lease (every push gets a new memfd).
Each arm copies the whole adapter, on a new lease per repetition, as a push does. A ready
lease is readied as the client readies one (ready_lease.py: in huge pages, page tables
filled). `copy` is the time until lora_sync's write returns (the push's wait: its commit is
already out), `unmap` the release of the registration and the unmap after it, which run on
the client's unmap thread while the commit travels (the server's seal waits for them):

  per_tensor          one synchronous torch copy per tensor into the mapping (lora_sync
                      before device_copy.py), 4 KiB pages, unmap included
  lora_sync_ready     lora_sync's write (shm.write_then_unmap) into a ready lease: a push
                      that finds its ready lease after a change of device
  lora_sync_pinned    the same into a ready lease registered with CUDA where it was readied
                      (off the push's path): every later push of a GPU trainer
  lora_sync_pinned_4k the same in 4 KiB pages (a host whose kernel gives no huge pages)
  lora_sync_fresh     lora_sync's write (shm.write_lease) into a lease just granted: mapping
                      and page tables included
  register            what registering (and unregistering) a lease's mapping costs
  pinned              the same packed copies into torch's pinned memory: the bus's floor
  shared_copy         lora_sync's write of the `shared` transport (shared_copy.write_sealed:
                      a new memfd, GPU tensors through a mapping, unmapped, all four seals),
                      checked byte for byte against the same file encoded on the host

    python scripts/gpu_check.py [--rank 64] [--reps 20] [--out gpu_check.json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lora_sync import pages, wire  # noqa: E402
from lora_sync.transports import shm  # noqa: E402
from lora_sync.transports.device_copy import HostPin, copy_to_host  # noqa: E402
from lora_sync.transports.shared_copy import write_sealed  # noqa: E402

# Qwen2.5-0.5B's linear layers (in, out) and depth: the benchmark's shapes (docs/benchmarks.md).
LAYERS = 24
MODULES = {"q_proj": (896, 896), "k_proj": (896, 128), "v_proj": (896, 128),
           "o_proj": (896, 896), "gate_proj": (896, 4864), "up_proj": (896, 4864),
           "down_proj": (4864, 896)}


def adapter(rank: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in MODULES.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, device="cuda").to(dtype)
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, device="cuda").to(dtype)
    return out


def mapped_lease(nbytes: int, huge_pages: bool = True) -> tuple[int, mmap.mmap]:
    """A lease as the server grants one (shm.new_lease: a lease memfd, its probe written),
    held by this process, mapped by lora_sync's trainer side through /proc like any
    other (`huge_pages`: as the client readies one); returns its descriptor (to close) and
    the mapping."""
    fd, lease = shm.new_lease(nbytes, 60.0)
    mapping, read_fd = shm.map_lease(lease, huge_pages=huge_pages)
    os.close(read_fd)
    return fd, mapping


def huge_pages_given(nbytes: int) -> bool:
    """Whether this kernel backs a lease with huge pages (else every arm is in 4 KiB pages)."""
    fd, _ = shm.new_lease(nbytes, 60.0)
    try:
        return pages.give_huge_pages(fd, nbytes)
    finally:
        os.close(fd)


def clock(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def summary(xs: list[float]) -> dict:
    return {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs)}


def repeat(one_rep, reps: int) -> dict:
    """`one_rep()` returns {part: ms}; a warm-up, then the summary of each part."""
    one_rep()  # first-touch faults, lazy CUDA init
    runs = [one_rep() for _ in range(reps)]
    return {k: summary([r[k] for r in runs]) for k in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="gpu_check.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA device")
    parts = wire.layout(adapter(a.rank), {"format": "pt"})
    nbytes = shm.total_bytes(parts)
    placed, offset = [], len(parts[0])
    for t in parts[1:]:
        placed.append((offset, t))
        offset += t.numel() * t.element_size()

    def per_tensor() -> dict:
        fd, mapping = mapped_lease(nbytes, huge_pages=False)

        def write():
            flat = torch.frombuffer(mapping, dtype=torch.uint8)
            for off, t in placed:
                n = t.numel() * t.element_size()
                flat[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            del flat
            mapping.close()
        ms = clock(write)
        os.close(fd)
        return {"copy": ms}

    def ready_rep(pin: bool, huge_pages: bool = True) -> dict:
        fd, mapping = mapped_lease(nbytes, huge_pages)
        hold = HostPin.of(mapping) if pin else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        unmapped = shm.write_then_unmap(mapping, parts, hold)  # returns once every byte is in
        t1 = time.perf_counter()
        unmapped.result()
        t2 = time.perf_counter()
        os.close(fd)
        return {"copy": (t1 - t0) * 1e3, "unmap": (t2 - t1) * 1e3}

    def fresh_rep():
        fd, lease = shm.new_lease(nbytes, 60.0)
        box = {}
        ms = clock(lambda: box.setdefault("fd", shm.write_lease(lease, parts)))
        os.close(box["fd"])
        os.close(fd)
        return {"copy": ms}

    def register_rep():
        fd, mapping = mapped_lease(nbytes)
        t0 = time.perf_counter()
        hold = HostPin.of(mapping)
        t1 = time.perf_counter()
        hold.release()
        t2 = time.perf_counter()
        mapping.close()
        os.close(fd)
        return {"register": (t1 - t0) * 1e3, "unregister": (t2 - t1) * 1e3}

    expected = torch.cat([c.contiguous().reshape(-1).view(torch.uint8).cpu()
                          if isinstance(c, torch.Tensor) else
                          torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in parts])

    def shared_rep():
        box = {}
        ms = clock(lambda: box.setdefault("file", write_sealed(parts)))
        shared = box["file"]
        got = torch.frombuffer(bytearray(os.pread(shared.fd, nbytes, 0)), dtype=torch.uint8)
        assert torch.equal(got, expected), "the sealed copy differs from the tensors"
        shared.close()
        return {"copy": ms}

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    arms = {"per_tensor": per_tensor,
            "lora_sync_ready": lambda: ready_rep(pin=False),
            "lora_sync_pinned": lambda: ready_rep(pin=True),
            "lora_sync_pinned_4k": lambda: ready_rep(pin=True, huge_pages=False),
            "lora_sync_fresh": fresh_rep,
            "register": register_rep,
            "shared_copy": shared_rep,
            "pinned": lambda: {"copy": clock(lambda: copy_to_host(pinned, placed))}}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cpus": os.cpu_count(), "rank": a.rank, "bytes": nbytes, "reps": a.reps,
              "huge_pages": huge_pages_given(nbytes)}
    for name, rep in arms.items():
        result[name] = repeat(rep, a.reps)
        if "copy" in result[name]:
            result[name]["gb_per_s"] = nbytes / result[name]["copy"]["median_ms"] / 1e6
        print(name, json.dumps(result[name]), flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
