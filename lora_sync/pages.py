"""How shared memory holding an adapter (an shm lease, a staged HTTP body) is mapped and
paged: huge pages whatever the host's setting, mappings at a huge page's boundary, and
madvise(2) without the GIL.

A 70 MB lease in 4 KiB pages is 17,000 pages: the trainer's mapping fills 17,000 page-table
entries ahead (several times the cost of the copy into them), its unmap tears them down on
the push's path (and the server's seal waits for it), and each worker that maps the sealed
lease faults them in again. Held in 2 MiB pages (folios), the same work is per 512 pages.

Linux gives shared memory huge pages only where the operator allows it
(`transparent_hugepage/shmem_enabled`, `never` by default), but `MADV_COLLAPSE` (Linux 6.1)
turns a mapped range into huge pages regardless: only `deny` forbids it. It needs the range
mapped at a 2 MiB boundary, which Python's mmap cannot ask for, so the mappings here that
need one are made through libc (`_map_at_boundary`)."""
from __future__ import annotations

import ctypes
import functools
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14 (Python's mmap lacks them)
_MADV_COLLAPSE = 25                                  # Linux 6.1
_PROT_NONE, _MAP_FIXED = 0, 0x10                     # Python's mmap lacks them too
_MAP_FAILED = ctypes.c_void_p(-1).value
_LIBC = ctypes.CDLL(None, use_errno=True)  # its calls let go of the GIL
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def map_filled(fd: int, nbytes: int, huge_pages: bool = False) -> mmap.mmap:
    """A shared writable mapping of a lease just granted, its pages allocated and page
    tables filled; `huge_pages`: in huge pages where the kernel gives them
    (`give_huge_pages`), which Python's mapping, at any address, maps in batches."""
    if huge_pages:
        give_huge_pages(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    try:
        advise(mapping, mmap.MADV_HUGEPAGE)  # the tail too, where the operator allows it
        advise(mapping, _MADV_POPULATE_WRITE)
        return mapping
    except OSError:  # a kernel before 5.14: fill it the older way
        mapping.close()
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


def give_huge_pages(fd: int, nbytes: int) -> bool:
    """Backs the whole 2 MiB blocks of the first `nbytes` of a memfd (open read-write, at
    least that long) with huge pages, its bytes unchanged (new ones are zero, as in any new
    page). False where the kernel would not (before 6.1, `deny`, no huge page to be had):
    the file then fills with small pages as before. No mapping stays.

    What it costs depends on where the huge pages come from. While recently freed memory is
    at hand, about what copying the bytes costs (and a mapping of it then fills in under a
    third of the time small pages take); an order of magnitude more once a VM's guest has
    handed free 2 MiB blocks back to the host (KVM free page reporting, after a short idle
    spell) and the host must back them again. So it is done only off the push's path, for a
    lease readied ahead."""
    span = nbytes // HUGE_PAGE * HUGE_PAGE
    start = _map_at_boundary(fd, span, mmap.PROT_READ | mmap.PROT_WRITE) if span else None
    if start is None:
        return False
    try:
        # MADV_COLLAPSE wants a page of each block present (it fails on an empty range)
        for offset in range(0, span, HUGE_PAGE):
            if _LIBC.madvise(start + offset, mmap.PAGESIZE, _MADV_POPULATE_WRITE) != 0:
                return False
        return _LIBC.madvise(start, span, _MADV_COLLAPSE) == 0
    finally:
        _LIBC.munmap(start, span)


def map_read_only(fd: int, nbytes: int) -> memoryview:
    """A file mapped shared and read-only at a 2 MiB boundary, where each huge page of it
    maps in one fault (Python's mmap, at any address, maps a few small pages per fault, so
    reading it all takes dozens of times as many faults). A read-only memoryview of
    `nbytes`; the mapping goes once nothing views it any more. OSError where it cannot be
    mapped."""
    if nbytes <= 0:
        raise ValueError("cannot map an empty file")
    # Mapped in whole huge pages (past the end of the file nothing is ever read): the types
    # below are made once per length, so lengths must come from a bounded set.
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    start = _map_at_boundary(fd, span, mmap.PROT_READ)
    if start is None:
        raise _last_error()
    # a ctypes array owns the mapping (it unmaps on its last reference, which every view
    # and every tensor viewing them holds); Python-level writes raise, a torch write faults
    array = _mapping_type(span).from_address(start)
    return memoryview(array).cast("B")[:nbytes].toreadonly()


@functools.lru_cache(maxsize=None)  # one per 2 MiB multiple up to the largest lease
def _mapping_type(span: int) -> type:
    return type("ReadOnlyMapping", (ctypes.c_ubyte * span,), {"__del__": _unmap_array})


def _unmap_array(array, munmap=_LIBC.munmap, addressof=ctypes.addressof,
                 sizeof=ctypes.sizeof) -> None:
    # bound here: at interpreter exit this module's globals may already be None
    munmap(addressof(array), sizeof(array))


def _map_at_boundary(fd: int, span: int, prot: int) -> int | None:
    """Maps `span` bytes of the file, shared, at a 2 MiB boundary (None: errno says why):
    inside a reservation one huge page larger, whose unused ends are then given back."""
    reserved = _LIBC.mmap(None, span + HUGE_PAGE, _PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if reserved in (None, _MAP_FAILED):
        return None
    start = -(-reserved // HUGE_PAGE) * HUGE_PAGE
    if _LIBC.mmap(start, span, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0) != start:
        err = ctypes.get_errno()
        _LIBC.munmap(reserved, span + HUGE_PAGE)
        ctypes.set_errno(err)
        return None
    if start > reserved:
        _LIBC.munmap(reserved, start - reserved)
    _LIBC.munmap(start + span, reserved + HUGE_PAGE - start)  # start < reserved + 2 MiB
    return start


def advise(mapping: mmap.mmap, advice: int) -> None:
    """madvise(2) on the whole mapping, letting go of the GIL meanwhile: Python's
    `mmap.madvise` holds it, and filling a lease's pages on the client's thread then stalled
    every other thread of the trainer for the whole fill, which grows with the lease;
    through this function they run on meanwhile."""
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        madvise(ctypes.addressof(anchor), len(mapping), advice)
    finally:
        del anchor


def madvise(address: int, length: int, advice: int) -> None:
    if _LIBC.madvise(address, length, advice) != 0:
        raise _last_error()


def _last_error() -> OSError:
    err = ctypes.get_errno()
    return OSError(err, os.strerror(err))


def fill_page_tables(tensors: dict[str, torch.Tensor]) -> None:
    """Maps every page of the memory `tensors` view into this process's page tables ahead
    of its first read, letting go of the GIL (a kernel before 5.14: does nothing)."""
    page = mmap.PAGESIZE
    for storage in {t.untyped_storage().data_ptr(): t.untyped_storage()
                    for t in tensors.values()}.values():
        start = storage.data_ptr() // page * page
        try:
            madvise(start, storage.data_ptr() + storage.nbytes() - start,
                    _MADV_POPULATE_READ)
        except OSError:  # the kernel does not know the advice: the faults stay lazy
            return
