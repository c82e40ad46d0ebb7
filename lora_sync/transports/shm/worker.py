"""A worker's read of a sealed lease: mapped read-only, or copied for an engine that writes."""
from __future__ import annotations

import os

import torch

from ... import pages, wire
from ...errors import BadAdapter
from ..base import Received
from .memfd import is_sealed, read_header


def read_sealed(path: str, take_buffer) -> tuple[wire.Header, dict, torch.Tensor] | None:
    """A sealed body (a committed shm lease) copied, for an engine that may write what it is
    given: a read-only mapping would kill it, and a private one costs a fault per page plus
    a fresh page per page written. One read into `take_buffer(nbytes)`, a reused buffer,
    costs about a memcpy. Returns None when `path` is not sealed."""
    with open(path, "rb") as f:
        fd = f.fileno()
        if not is_sealed(fd):
            return None
        header = read_header(fd, os.fstat(fd).st_size)
        buf = take_buffer(header.total_bytes - header.data_start)
        view = memoryview(buf.numpy())
        done = 0
        while done < len(view):  # a read may return less than asked
            n = os.preadv(fd, [view[done:]], header.data_start + done)
            if n <= 0:
                raise BadAdapter("the sealed body ended early", code="bad_safetensors")
            done += n
    return header, wire.view_tensors(view, header, data_only=True), buf


def map_sealed(path: str) -> tuple[wire.Header, dict] | None:
    """A sealed body mapped shared and read-only: no copy. Its page tables fill as the
    engine first reads each part (a read fault maps 16 pages at once). Filling them up
    front cost the same in all (vLLM, rank 64: intake, build and register took as long
    either way) but held the intake's reply; an engine that first reads at a
    request has them filled on a thread (`fill_page_tables`). Returns None when `path` is
    not sealed."""
    with open(path, "rb") as f:
        return view_sealed(f.fileno())


def view_sealed(fd: int) -> tuple[wire.Header, dict] | None:
    """The tensors of a sealed file, viewing a read-only shared mapping of it: nobody, this
    process included, can write those bytes. None when the file is not sealed."""
    mapped = map_read_only(fd)
    return None if mapped is None else wire.view_mapped(mapped)


def map_read_only(fd: int) -> memoryview | None:
    """A sealed file mapped shared and read-only, at a huge page's boundary (None when it is
    not sealed): see `pages.map_read_only`."""
    if not is_sealed(fd):
        return None
    return pages.map_read_only(fd, os.fstat(fd).st_size)


def receive_sealed(path: str, pool) -> Received | None:
    """A sealed file (a committed lease, a shared copy) as a worker takes it in: mapped
    read-only where the engine never writes what it is given (`pool.maps_read_only`), else
    read into a reused buffer (`read_sealed`). None when `path` is not sealed."""
    if pool.maps_read_only:
        sealed = map_sealed(path)
        if sealed is not None:
            header, tensors = sealed
            return Received(tensors, header.total_bytes - header.data_start, read_only=True)
        return None
    sealed = read_sealed(path, lambda n: pool.take_buffer(torch.uint8, n, "cpu"))
    if sealed is None:
        return None
    header, tensors, buf = sealed
    return Received(tensors, header.total_bytes - header.data_start, [buf])
