"""GPU trainers: how fast does a rank-64 adapter get from GPU tensors into an shm lease?

Needs only torch with CUDA (no vLLM, SGLang or lora-sync server). A lease is a memfd the
trainer maps and writes (lora_sync/transports/shm.py); from a CUDA tensor that write is a
device-to-host copy. Into pageable memory the driver stages it through its own pinned buffer
(about half the PCIe bandwidth); registering the mapping with CUDA (cudaHostRegister) makes it
pinned. This times, per copy of the whole adapter:

  pageable     GPU tensors -> the lease mapping, as mapped
  registered   GPU tensors -> the same mapping after cudaHostRegister (and what registering
               costs, once per lease)
  pinned       GPU tensors -> torch pinned memory (cudaMemcpy's best case, the reference)

    python scripts/gpu_check.py [--rank 64] [--reps 20] [--out gpu_check.json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time

import torch

# Qwen2.5-0.5B's linear layers (in, out) and depth: the README benchmark's shapes.
LAYERS = 24
MODULES = {"q_proj": (896, 896), "k_proj": (896, 128), "v_proj": (896, 128),
           "o_proj": (896, 896), "gate_proj": (896, 4864), "up_proj": (896, 4864),
           "down_proj": (4864, 896)}


def adapter(rank: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    out = []
    for _ in range(LAYERS):
        for fan_in, fan_out in MODULES.values():
            out.append(torch.randn(rank, fan_in, device="cuda").to(dtype))
            out.append(torch.randn(fan_out, rank, device="cuda").to(dtype))
    return out


def copy_into(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for dst, src in zip(views, tensors):
        dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def views_of(buf, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.frombuffer(buf, dtype=torch.uint8) if not isinstance(buf, torch.Tensor) else buf
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(flat[off:off + n])
        off += n
    return views


def timed(fn, reps: int) -> dict:
    fn()  # warm-up: first-touch faults, lazy CUDA init
    xs = [fn() for _ in range(reps)]
    return {"median_ms": statistics.median(xs) * 1e3, "min_ms": min(xs) * 1e3,
            "max_ms": max(xs) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="gpu_check.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA device")
    tensors = adapter(a.rank)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    fd = os.memfd_create("lora-sync-lease", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    lease = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    lease_views = views_of(lease, tensors)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rank": a.rank, "bytes": nbytes, "reps": a.reps}
    result["pageable"] = timed(lambda: copy_into(lease_views, tensors), a.reps)

    cudart = torch.cuda.cudart()
    ptr = lease_views[0].data_ptr()
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    result["register_ms"] = (time.perf_counter() - t0) * 1e3
    if int(err) != 0:
        result["registered"] = {"error": f"cudaHostRegister returned {err}"}
    else:
        result["registered"] = timed(lambda: copy_into(lease_views, tensors), a.reps)
        t0 = time.perf_counter()
        cudart.cudaHostUnregister(ptr)
        result["unregister_ms"] = (time.perf_counter() - t0) * 1e3

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned_views = views_of(pinned, tensors)
    result["pinned"] = timed(lambda: copy_into(pinned_views, tensors), a.reps)
    for k in ("pageable", "registered", "pinned"):
        if "median_ms" in result[k]:
            result[k]["gb_per_s"] = nbytes / result[k]["median_ms"] / 1e6
    lease_views.clear()  # the mapping closes only once nothing views it
    lease.close()
    os.close(fd)
    print(json.dumps(result, indent=1))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
