"""Host-to-host copies by plain memcpy (ctypes.memmove, which lets go of the GIL), not
torch's copy.

A torch copy on a thread other than the trainer's starts a second OpenMP team whose threads
spin against the trainer's own and against whatever else runs meanwhile, such as gloo's
socket threads during a broadcast: on a host with few cores that costs more than the copy
itself (docs/benchmarks.md, "What each piece bought")."""
from __future__ import annotations

import ctypes

import numpy as np
import torch


def memmove_each(copies) -> None:
    """Every (destination address, source address, bytes) copy, in order, on this thread."""
    for dst, src, n in coalesced(copies):
        ctypes.memmove(dst, src, n)


def host_runs(tensors: list[torch.Tensor]) -> list[tuple[int, int]] | None:
    """(address, bytes) of each run of tensors that lie back to back in host memory, in
    order (tensors with no bytes left out); None unless every tensor is a contiguous host
    tensor. A few attribute reads per tensor, the runs found by numpy: a packed adapter
    (`trainer.pack_parameters`) of tens of thousands of tensors is one run, found at a
    fraction of a microsecond a tensor."""
    if not all(t.is_cpu and t.is_contiguous() for t in tensors):
        return None
    start = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    size = np.array([t.nbytes for t in tensors], dtype=np.int64)
    if not size.all():
        start, size = start[size > 0], size[size > 0]
    if not len(start):
        return []
    end = start + size
    breaks = np.flatnonzero(start[1:] != end[:-1]) + 1
    firsts, lasts = np.r_[0, breaks], np.r_[breaks, len(start)] - 1
    return list(zip(start[firsts].tolist(), (end[lasts] - start[firsts]).tolist()))


def coalesced(copies) -> list[tuple[int, int, int]]:
    """The copies, each run of neighbours (one starting where the last ended, on both
    sides) made one: tensors packed back to back in one buffer (`trainer.pack_parameters`)
    then cost one call for all, not one each."""
    out, dst0, src0, run = [], 0, 0, 0
    for dst, src, n in copies:
        if run and dst == dst0 + run and src == src0 + run:
            run += n
            continue
        if run:
            out.append((dst0, src0, run))
        dst0, src0, run = dst, src, n
    if run:
        out.append((dst0, src0, run))
    return out


def halves(copies: list[tuple[int, int, int]]) -> tuple[list, list]:
    """The copies cut in two of about equal bytes (one copy split where it spans the
    middle), for two threads."""
    total = sum(n for _, _, n in copies)
    first, done = [], 0
    for i, (dst, src, n) in enumerate(copies):
        if done + n >= total // 2:
            cut = total // 2 - done
            head = [(dst, src, cut)] if cut else []
            return first + head, [(dst + cut, src + cut, n - cut)] + list(copies[i + 1:])
        first.append((dst, src, n))
        done += n
    return first, []


def copy_each(pairs) -> None:
    """Each (destination, source) pair of tensors of one shape and dtype: by memcpy where
    both are contiguous host tensors, else by torch (a GPU source)."""
    copies, by_torch = [], []
    for dst, src in pairs:
        if (_plain_host(dst) and _plain_host(src) and dst.dtype == src.dtype
                and dst.shape == src.shape):
            copies.append((dst.data_ptr(), src.data_ptr(), src.nbytes))
        else:
            by_torch.append((dst, src))
    memmove_each(copies)
    for dst, src in by_torch:
        dst.copy_(src.detach())


def copy_to(base: int, starts: list[int], sources) -> bool:
    """Copies each source tensor to address `base` + its start, all contiguous host
    tensors; False, with nothing copied, where any is not (the caller copies with torch)."""
    copies = []
    for start, t in zip(starts, sources):
        if not _plain_host(t):
            return False
        copies.append((base + start, t.data_ptr(), t.nbytes))
    memmove_each(copies)
    return True


def pack_into(out: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """Copies `parts` back to back into `out`, all contiguous host tensors of its dtype;
    False, with nothing copied, where any is not (the caller copies with torch then)."""
    if not _plain_host(out) or not all(_plain_host(t) and t.dtype == out.dtype for t in parts):
        return False
    sizes = [t.nbytes for t in parts]
    if sum(sizes) > out.numel() * out.element_size():
        raise ValueError(f"{sum(sizes)} bytes do not fit a buffer of "
                         f"{out.numel() * out.element_size()}")
    copies, dst = [], out.data_ptr()
    for t, n in zip(parts, sizes):
        copies.append((dst, t.data_ptr(), n))
        dst += n
    memmove_each(copies)
    return True


def _plain_host(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous()
