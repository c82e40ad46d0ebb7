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
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from starlette.requests import ClientDisconnect

from lora_sync import pages, wire
from lora_sync.background import LOWEST
from lora_sync.server.socket_body import BodyChunks
from lora_sync.errors import TimedOut
from lora_sync.staging import BodyLimits, StagingArea, open_staged

from .helpers import smaps_kb, wait_until
from .test_pages import collapse_possible

LIMITS = BodyLimits(max_body=64 << 20, max_inflight=256 << 20)


def body_of(nbytes: int, seed: int) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4)
    tensors = {"a": torch.randn(n // 2 + 1, generator=g), "b": torch.randn(n - n // 2, generator=g)}
    return wire.encode(tensors, {"seed": str(seed)}), tensors


async def _chunks(chunks, piece: int, stop_after: int | None = None):
    """The body in pieces; `stop_after`: the client vanishes after that many bytes."""
    sent = 0
    for c in chunks:
        c = memoryview(c)
        for i in range(0, len(c), piece):
            if stop_after is not None and sent >= stop_after:
                raise ClientDisconnect()
            sent += len(c[i:i + piece])
            yield bytes(c[i:i + piece])


def stage(area: StagingArea, chunks, piece: int = 1 << 20):
    return asyncio.run(area.receive_body(_chunks(chunks, piece), LIMITS,
                                         sum(len(c) for c in chunks)))


def collapses_running() -> bool:
    """Whether a kept file is still being readied (huge pages, then its mapping)."""
    return any(t.name == "lora-sync-staging-ready" for t in threading.enumerate())


@contextlib.contextmanager
def staging_area(map_kept: bool = True):
    """A StagingArea of its own; gone, with its huge-page threads done, on exit."""
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="lora-sync-staging-test-")
    a = StagingArea(spare=2, root=root, map_kept=map_kept)
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


def _reads_back(staged, tensors: dict, seed: int) -> bool:
    header, got = open_staged(staged.path, read_only=True)
    return header.metadata["seed"] == str(seed) and staged.nbytes == \
        os.path.getsize(staged.path) and all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_a_body_a_kept_files_mapping_spans_lands_in_it(area):
    """A kept file is mapped writable off the push's path; the next body it spans lands in
    that mapping, a shorter one too (the mapping stays for the bodies after), and one longer
    than the mapping is written as before (the mapping goes: the file grows past it)."""
    def receive(nbytes: int, seed: int):
        chunks, tensors = body_of(nbytes, seed)
        total = sum(len(c) for c in chunks)
        staged = asyncio.run(area.receive_body(BodyChunks(None, total, _chunks(chunks, 65536)),
                                               LIMITS, total))
        assert _reads_back(staged, tensors, seed)
        return staged

    first = stage(area, body_of(5 << 20, seed=1)[0])
    area.recycle(first.path)
    wait_until(lambda: not collapses_running(), 30, "kept file readied")
    ready = area.mapped[first.path]
    assert len(ready.result()) == first.nbytes
    for seed, nbytes in ((2, 5 << 20), (3, 2 << 20), (4, 5 << 20)):
        staged = receive(nbytes, seed)
        assert staged.path == first.path and area.mapped[first.path] is ready
        area.recycle(staged.path)
    wait_until(lambda: not collapses_running(), 30, "kept file readied")
    longer = receive(6 << 20, 5)
    assert longer.path == first.path and first.path not in area.mapped


def test_a_body_that_stalls_in_a_kept_mapping_is_cut_and_the_file_serves_the_next(area):
    """A slow client in the mapping's path meets the same bound as any upload (the idle
    timeout): refused with `body_timeout`, the file kept with its mapping, and the next body
    in it reads back exactly."""
    chunks, _ = body_of(3 << 20, seed=1)
    total = sum(len(c) for c in chunks)
    first = stage(area, chunks)
    area.recycle(first.path)
    wait_until(lambda: not collapses_running(), 30, "kept file readied")
    ready = area.mapped[first.path]

    async def half_then_silence():
        sent = 0
        async for piece in _chunks(chunks, 65536):
            if sent >= total // 2:
                await asyncio.sleep(30)
            sent += len(piece)
            yield piece

    quick = BodyLimits(max_body=LIMITS.max_body, max_inflight=LIMITS.max_inflight, idle_s=0.3)
    with pytest.raises(TimedOut) as refused:
        asyncio.run(area.receive_body(BodyChunks(None, total, half_then_silence()), quick,
                                      total))
    assert refused.value.code == "body_timeout"
    assert area.free == [first.path] and area.mapped[first.path] is ready
    chunks, tensors = body_of(3 << 20, seed=2)
    total = sum(len(c) for c in chunks)
    staged = asyncio.run(area.receive_body(BodyChunks(None, total, _chunks(chunks, 65536)),
                                           LIMITS, total))
    assert staged.path == first.path and area.mapped[first.path] is ready
    assert _reads_back(staged, tensors, 2)


@settings(max_examples=15, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from([1 << 20, 3 << 20, (3 << 20) + 4]),
                               st.booleans(), st.booleans(), st.booleans()),
                     min_size=2, max_size=7),
       piece=st.sampled_from([4096, 65536, 1 << 20]))
def test_bodies_in_kept_mappings_read_back_exactly(plan, piece):
    """Random bodies (size, read into a mapping where one is ready, kept files readied
    before it or not, the client vanishing halfway): every body staged reads back exactly
    as sent and its file is its length, whatever the file held or how it was mapped."""
    with staging_area() as area:
        for seed, (nbytes, into, settle, cut) in enumerate(plan):
            chunks, tensors = body_of(nbytes, seed)
            total = sum(len(c) for c in chunks)
            if settle:
                wait_until(lambda: not collapses_running(), 30, "kept files readied")
            source = _chunks(chunks, piece, stop_after=total // 2 if cut else None)
            if into:
                source = BodyChunks(None, total, source)
            received = area.receive_body(source, LIMITS, total)
            if cut:
                with pytest.raises(ClientDisconnect):
                    asyncio.run(received)
                continue
            staged = asyncio.run(received)
            assert _reads_back(staged, tensors, seed)
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


def test_a_kept_file_is_readied_at_the_lowest_cpu_priority(area, monkeypatch):
    """Readying runs while the engine serves the version just pushed: it must yield the CPU
    to the engine (its second completion was 5 ms slower than after a disk load at full
    priority, on SGLang, 12 pairs)."""
    seen = []

    def give_huge_pages(fd, nbytes):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return False
    monkeypatch.setattr(pages, "give_huge_pages", give_huge_pages)
    area.recycle(stage(area, body_of(1 << 20, seed=1)[0]).path)
    wait_until(lambda: not collapses_running(), 30, "file readied")
    assert seen == [LOWEST]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < LOWEST  # ours kept


def test_without_socket_bodies_a_kept_file_is_never_mapped(monkeypatch):
    """Bodies read through uvicorn are written, never read into a mapping: a kept file then
    gets its huge pages once, and no mapping is made for it at any recycle."""
    calls = {"huge": 0, "mapped": 0}
    huge, mapped = pages.give_huge_pages, pages.map_filled

    def count(key, fn):
        def counted(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return counted
    monkeypatch.setattr(pages, "give_huge_pages", count("huge", huge))
    monkeypatch.setattr(pages, "map_filled", count("mapped", mapped))
    with staging_area(map_kept=False) as area:
        for seed in range(3):
            body, tensors = body_of(3 << 20, seed)
            staged = stage(area, body)
            _, got = open_staged(staged.path, read_only=True)
            assert all(torch.equal(got[k], tensors[k]) for k in tensors)
            del got
            area.recycle(staged.path)
            wait_until(lambda: not collapses_running(), 30, "file readied")
    assert calls == {"huge": 1, "mapped": 0}


def test_a_file_not_kept_is_removed_and_never_given_huge_pages(area):
    """Past `spare` kept files, a recycled file is deleted (no thread starts for it)."""
    staged = [stage(area, body_of(1 << 20, seed)[0]) for seed in range(3)]
    for s in staged:
        area.recycle(s.path)
    assert sorted(area.free) == sorted(s.path for s in staged[:2])
    assert not os.path.exists(staged[2].path)
    assert set(area.huge) == set(area.free)


def test_a_body_that_never_sends_a_byte_is_cut_at_the_idle_bound(tmp_path):
    """The first wait is bounded like every later one (it once read an absolute time as a
    delay, so a client that sent headers and nothing else held its claim for hours)."""

    async def silent():
        await asyncio.sleep(3600)
        yield b""
    area = StagingArea(spare=0, root=str(tmp_path), map_kept=False)
    limits = BodyLimits(max_body=1 << 20, max_inflight=1 << 22, idle_s=0.2)

    async def receive():
        t0 = time.monotonic()
        with pytest.raises(TimedOut):
            await asyncio.wait_for(area.receive_body(silent(), limits, 100), 10)
        return time.monotonic() - t0
    assert asyncio.run(receive()) < 5
    assert area.inflight == 0
