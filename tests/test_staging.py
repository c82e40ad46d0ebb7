"""lora_sync.staging in process: staged bodies, the files they are reused in, and how workers
map them.

The rules: a body read back from its staged file is exactly the body sent, whatever file it
lands in, whatever happened to that file before (a longer or shorter body, huge pages given
to it while the body was written); a file kept for reuse gets huge pages (where the kernel
can give them) and a read-only mapping of it then maps them whole."""
import asyncio
import contextlib
import os
import shutil
import tempfile
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_sync import pages, wire
from lora_sync.staging import BodyLimits, StagingArea, open_staged

from .helpers import smaps_kb, wait_until
from .test_pages import collapse_possible

LIMITS = BodyLimits(max_body=64 << 20, max_inflight=256 << 20)


def body_of(nbytes: int, seed: int) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4)
    tensors = {"a": torch.randn(n // 2 + 1, generator=g), "b": torch.randn(n - n // 2, generator=g)}
    return wire.encode(tensors, {"seed": str(seed)}), tensors


async def _chunks(chunks, piece: int):
    for c in chunks:
        c = memoryview(c)
        for i in range(0, len(c), piece):
            yield bytes(c[i:i + piece])


def stage(area: StagingArea, chunks, piece: int = 1 << 20):
    return asyncio.run(area.receive_body(_chunks(chunks, piece), LIMITS,
                                         sum(len(c) for c in chunks)))


def collapses_running() -> bool:
    return any(t.name == "lora-sync-staging-huge-pages" for t in threading.enumerate())


@contextlib.contextmanager
def staging_area():
    """A StagingArea of its own; gone, with its huge-page threads done, on exit."""
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="lora-sync-staging-test-")
    a = StagingArea(spare=2, root=root)
    try:
        yield a
    finally:
        wait_until(lambda: not collapses_running(), 30, "huge-page threads done")
        a.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def area():
    with staging_area() as a:
        yield a


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 7 << 20), min_size=2, max_size=5),
       piece=st.sampled_from([4096, 65536, 1 << 20]))
def test_a_reused_file_reads_back_exactly_each_body(sizes, piece):
    """Bodies of random sizes go through one area, each recycled at once, so the next lands
    in the file just kept while its huge pages are being given (a longer or shorter body
    than the last): each reads back, read-only or private, as the tensors sent."""
    with staging_area() as area:
        for seed, nbytes in enumerate(sizes):
            chunks, tensors = body_of(nbytes, seed)
            staged = stage(area, chunks, piece)
            for read_only in (True, False):
                header, got = open_staged(staged.path, read_only=read_only)
                assert header.metadata["seed"] == str(seed)
                assert all(torch.equal(got[k], tensors[k]) for k in tensors)
                del got
            area.recycle(staged.path)


@pytest.mark.skipif(not collapse_possible(), reason="MADV_COLLAPSE needs Linux 6.1 and "
                    "shmem huge pages not denied")
def test_a_kept_file_gets_huge_pages_and_workers_map_them_whole(area):
    """A file goes back to the area after its version: from then on it is in huge pages, and
    the next body in it maps in 2 MiB pages read-only (the worker's intake)."""
    chunks, _ = body_of(9 << 20, seed=1)
    first = stage(area, chunks)
    area.recycle(first.path)
    wait_until(lambda: not collapses_running(), 30, "huge pages given")
    chunks, tensors = body_of(9 << 20, seed=2)
    second = stage(area, chunks)
    assert second.path == first.path  # reused, not a new file
    _, got = open_staged(second.path, read_only=True)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)  # reads every page
    assert smaps_kb(got["a"].data_ptr(), "ShmemPmdMapped") >= 4 * pages.HUGE_PAGE // 1024


@pytest.mark.skipif(not collapse_possible(), reason="MADV_COLLAPSE needs Linux 6.1 and "
                    "shmem huge pages not denied")
def test_a_kept_file_a_longer_body_grew_is_given_huge_pages_again(area):
    """Bytes a file grows by are new small pages: a file kept at 3 MB that a 20 MB body then
    grew gets huge pages again when it is kept, and the next 20 MB body in it maps in 2 MiB
    pages over its length (a trainer's adapters of rank 8, then rank 64)."""
    first = stage(area, body_of(3 << 20, seed=1)[0])
    area.recycle(first.path)
    wait_until(lambda: not collapses_running(), 30, "huge pages given")
    grown = stage(area, body_of(20 << 20, seed=2)[0])
    assert grown.path == first.path
    area.recycle(grown.path)
    wait_until(lambda: not collapses_running(), 30, "huge pages given again")
    chunks, tensors = body_of(20 << 20, seed=3)
    third = stage(area, chunks)
    assert third.path == first.path
    _, got = open_staged(third.path, read_only=True)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)  # reads every page
    assert smaps_kb(got["a"].data_ptr(), "ShmemPmdMapped") >= 8 * pages.HUGE_PAGE // 1024


def test_a_file_not_kept_is_removed_and_never_given_huge_pages(area):
    """Past `spare` kept files, a recycled file is deleted (no thread starts for it)."""
    staged = [stage(area, body_of(1 << 20, seed)[0]) for seed in range(3)]
    for s in staged:
        area.recycle(s.path)
    assert sorted(area.free) == sorted(s.path for s in staged[:2])
    assert not os.path.exists(staged[2].path)
    assert set(area.huge) == set(area.free)
