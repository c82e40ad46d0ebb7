"""Trainer-side helpers for sharded (FSDP2 / DTensor) trainers.

Under `fully_shard` every LoRA weight is a DTensor holding one shard per rank. `gather_adapter`
turns them into one full LoRAAdapter on rank 0 (the rank that pushes); `share_result` hands
rank 0's push result (or error) back to every rank so all ranks take the same branch next.
Both are collectives: every rank of the group must call them, in the same order."""
from __future__ import annotations

import hashlib
import json
import math

import torch
import torch.distributed as dist

from ..adapter import LoRAAdapter, peft_state
from ..errors import LoRASyncError, error_from_json

# The dtypes the wire format carries (wire.DTYPES); strings are what configs/CLIs pass.
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Collectives on these backends need tensors on the accelerator; anything else (gloo,
# "cpu:gloo,cuda:nccl") takes CPU tensors.
_BACKEND_DEVICE = {"nccl": "cuda", "xccl": "xpu"}


def gather_adapter(model_or_adapter, group=None, dtype=None,
                   adapter_name: str = "default") -> LoRAAdapter | None:
    """The full adapter on rank 0 of `group`, None on the other ranks.

    Accepts a PEFT model (sharded or not) or a LoRAAdapter whose tensors may be DTensors.
    `dtype` (torch.bfloat16/float16/float32 or its name) casts every tensor. Tensors come back
    detached, contiguous, on CPU, never sharing memory with the model's parameters. Every rank
    that holds shards must call this: gathering a DTensor is a collective over its mesh."""
    dtype = _check_dtype(dtype)  # before any collective: a bad value fails on every rank alike
    if isinstance(model_or_adapter, LoRAAdapter):
        tensors, config = model_or_adapter.tensors, model_or_adapter.config
    else:
        tensors = peft_state(model_or_adapter, adapter_name)
        config = model_or_adapter.peft_config[adapter_name].to_dict()
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    keep = not distributed or dist.get_rank(group) == 0
    full = {}
    with torch.no_grad():
        if dtype is not None:  # before the gather: elementwise, so same result, fewer bytes
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        # Sorted: the gathers are collectives, so every rank must run them in one order.
        names = sorted(tensors)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if world > 1 else []
        flat = [k for k in names if world > 1 and _fits_flat(tensors[k], ranks)]
        if world > 1 and not _check_same_tensors(tensors, flat, group):
            flat = []
        if flat:
            full = _gather_flat([tensors[k] for k in flat], flat, group, world, keep)
        flat = set(flat)
        for name in names:
            if name not in flat:  # not sharded, or sharded some other way: DTensor does it
                t = _full(tensors[name])
                if keep:
                    full[name] = t
    return LoRAAdapter({k: full[k] for k in tensors}, config) if keep else None  # PEFT order


def share_result(obj_json, group=None, src: int = 0):
    """Rank `src` of `group` passes a JSON-serialisable value; every rank returns it (decoded
    from JSON on every rank, src included, so all ranks hold equal values). No pickle."""
    if not (dist.is_available() and dist.is_initialized()):
        return json.loads(json.dumps(obj_json))
    device = _device(group)
    me = dist.get_rank(group) == src
    data, error = b"", None
    if me:
        try:
            data = json.dumps(obj_json, ensure_ascii=False).encode()
        except (TypeError, ValueError) as e:
            error = e  # still broadcast (length -1), or the other ranks would wait forever
    length = torch.tensor([-1 if error else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, group=group, group_src=src)
    if error is not None:
        raise TypeError(f"share_result: rank {src}'s value is not JSON: {error}") from error
    n = int(length.item())
    if n < 0:
        raise RuntimeError(f"share_result: rank {src}'s value could not be encoded as JSON")
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if me else
           torch.empty(n, dtype=torch.uint8, device=device))
    if n:
        dist.broadcast(buf, group=group, group_src=src)
    return json.loads(bytes(buf.cpu().numpy()).decode())


def _check_dtype(dtype):
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (or the torch dtype), "
                     f"got {dtype!r}")


def _device(group) -> torch.device:
    kind = _BACKEND_DEVICE.get(dist.get_backend(group), "cpu")
    return torch.device(kind, getattr(torch, kind).current_device()) if kind != "cpu" \
        else torch.device("cpu")


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return t.full_tensor().detach().to("cpu").contiguous()
    # A plain tensor may be the live parameter itself: copy, so later steps don't change it.
    return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)


# FSDP2 shards every parameter on dim 0 over a 1-D mesh, like torch.chunk. One DTensor
# full_tensor() per LoRA weight costs a collective each (28 of them, rank 64, tiny model),
# and their latencies add up; packing all such shards into one buffer and gathering once
# pays one latency, over an order of magnitude cheaper on gloo.
def _chunk_rows(n: int, world: int, i: int) -> int:
    c = -(-n // world)
    return max(0, min(n, (i + 1) * c) - i * c)


def _fits_flat(t: torch.Tensor, ranks: list) -> bool:
    from torch.distributed.tensor import DTensor, Shard
    if not (isinstance(t, DTensor) and t.ndim >= 1 and tuple(t.placements) == (Shard(0),)):
        return False
    return t.device_mesh.mesh.tolist() == ranks  # mesh coordinate i is group rank i


def _gather_flat(ts: list, names: list, group, world: int, keep: bool) -> dict:
    """Rank 0's full tensors from one gather of every rank's padded shards, as bytes."""
    layout, total = [], 0  # (offset, bytes per row); each region fits rank 0's chunk
    for t in ts:
        row = t.dtype.itemsize * math.prod(t.shape[1:])  # (not t[0]: that is a collective)
        layout.append((total, row))
        total += row * _chunk_rows(t.shape[0], world, 0)
    device = _device(group)
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    for t, (off, _) in zip(ts, layout):
        local = t.to_local().detach().contiguous().view(-1).view(torch.uint8)
        buf[off:off + local.numel()].copy_(local)
    parts = [torch.empty_like(buf) for _ in range(world)] if keep else None
    dist.gather(buf, parts, group=group, group_dst=0)
    if not keep:
        return {}
    parts = [p.cpu() for p in parts]
    out = {}
    for name, t, (off, row) in zip(names, ts, layout):
        pieces = [p[off:off + row * _chunk_rows(t.shape[0], world, i)]
                  for i, p in enumerate(parts)]
        out[name] = torch.cat(pieces).view(t.dtype).view(t.shape)
    return out


def _check_same_tensors(tensors: dict, flat: list, group) -> bool:
    """Raises unless every rank holds the same names, global shapes, dtypes and sharding;
    returns whether every rank's shards of `flat` are laid out as _gather_flat expects."""
    flat_set = set(flat)
    sig = json.dumps([(k, list(v.shape), str(v.dtype), str(getattr(v, "placements", None)),
                       k in flat_set) for k, v in sorted(tensors.items())])
    me = dist.get_rank(group)
    fits = all(tuple(tensors[k].to_local().shape) ==
               (_chunk_rows(tensors[k].shape[0], dist.get_world_size(group), me),
                *tensors[k].shape[1:]) for k in flat)
    mine = torch.frombuffer(bytearray(hashlib.sha256(sig.encode()).digest() + bytes([fits])),
                            dtype=torch.uint8).to(_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    differ = [i for i, d in enumerate(everyone) if not torch.equal(d[:32], mine[:32])]
    if differ:  # a mismatch would otherwise hang or mix up tensors in the gathers
        raise RuntimeError(f"gather_adapter: ranks {differ} hold other LoRA tensors (names, "
                           f"shapes, dtypes or sharding) than rank {me} of the group")
    return bool(flat) and all(int(d[32]) for d in everyone)


def multi_rank(group=None) -> bool:
    """Whether this process is one of several ranks of a trainer's process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def on_rank0(fn, model_or_adapter, group=None, dtype=None):
    """Call on every rank: the full adapter is gathered to rank 0, which runs `fn(adapter)`
    (its JSON-able result); every rank returns that result, or raises what rank 0 raised,
    so all ranks take the same branch next."""
    adapter = gather_adapter(model_or_adapter, group, dtype)
    outcome = None
    if adapter is not None:
        try:
            outcome = {"result": fn(adapter)}
        except LoRASyncError as e:  # shared before raising, or the other ranks would wait
            outcome = {"error": e.to_json()["error"]}
        except Exception as e:
            outcome = {"error": {"type": type(e).__name__, "message": str(e)[:4000]}}
    outcome = share_result(outcome, group)
    if "error" not in outcome:
        return outcome["result"]
    err = outcome["error"]
    if "code" in err:
        raise error_from_json(err["status"], {"error": err})
    raise RuntimeError(f"rank 0 failed: {err['type']}: {err['message']}")
