"""Host-to-host copies by plain memcpy (ctypes.memmove, which lets go of the GIL), not
torch's copy.

A torch copy on a thread other than the trainer's starts a second OpenMP team whose threads
spin against the trainer's own and against whatever else runs meanwhile, such as gloo's
socket threads during a broadcast: on a host with few cores that costs more than the copy
itself (docs/benchmarks.md, "What each piece bought")."""
from __future__ import annotations

import ctypes

import torch


def memmove_each(copies) -> None:
    """Every (destination address, source address, bytes) copy, in order, on this thread."""
    for dst, src, n in copies:
        ctypes.memmove(dst, src, n)


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
