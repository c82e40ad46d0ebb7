"""lora_sync.pages in process: a lease's huge pages and aligned read-only mappings.

The rules: giving a memfd huge pages never changes a byte of it and leaves no mapping
behind; a read-only mapping shows the file's bytes, refuses writes, and is gone once nothing
views it. On this machine's kernel (6.1 or later, shmem huge pages not denied) the huge
pages must also be had; elsewhere that part is skipped, and the rest must hold anyway."""
import gc
import os
import platform
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lora_sync import pages

from .helpers import smaps_kb

HUGE = pages.HUGE_PAGE
NAME = "lora-sync-pages-test"


def collapse_possible() -> bool:
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", platform.release()).groups())
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        setting = re.search(r"\[(\w+)\]", f.read()).group(1)
    return (major, minor) >= (6, 1) and setting != "deny"


def our_mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if NAME in line]


def memfd_with(nbytes: int, writes: list[tuple[int, bytes]]) -> tuple[int, bytearray]:
    fd = os.memfd_create(NAME, os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    expected = bytearray(nbytes)
    for offset, data in writes:
        data = data[:max(0, nbytes - offset)]
        os.pwrite(fd, data, offset)
        expected[offset:offset + len(data)] = data
    return fd, expected


def read_all(fd: int, nbytes: int) -> bytes:
    return os.pread(fd, nbytes, 0) if nbytes else b""


# anywhere, or near a block's first page (the page the collapse itself makes present)
OFFSETS = st.one_of(st.integers(0, 3 * HUGE + 5000),
                    st.builds(lambda block, delta: max(0, block * HUGE + delta),
                              st.integers(0, 3), st.integers(-4096, 4096)))


@settings(max_examples=40, deadline=None)
@given(nbytes=st.integers(0, 3 * HUGE + 5000),
       writes=st.lists(st.tuples(OFFSETS, st.binary(min_size=1, max_size=9000)), max_size=6))
@example(nbytes=2 * HUGE + 1, writes=[(0, b"\xff" * 8), (HUGE - 4, b"\xee" * 8)])
def test_huge_pages_never_change_a_byte_nor_stay_mapped(nbytes, writes):
    """Random bytes at random places (some blocks written, some holes), any size: after
    give_huge_pages the file reads the same, and no mapping of it is left."""
    fd, expected = memfd_with(nbytes, writes)
    try:
        pages.give_huge_pages(fd, nbytes)
        assert read_all(fd, nbytes) == bytes(expected)
        assert our_mappings() == []
    finally:
        os.close(fd)


@pytest.mark.skipif(not collapse_possible(), reason="MADV_COLLAPSE needs Linux 6.1 and "
                    "shmem huge pages not denied")
def test_a_lease_gets_huge_pages_whatever_the_shmem_setting():
    """Whole 2 MiB blocks come back as huge pages, mapped one fault each by an aligned
    read-only mapping; a file smaller than a block gets none (and is left as it was)."""
    nbytes = 3 * HUGE + 4096
    fd, _ = memfd_with(nbytes, [])
    try:
        assert pages.give_huge_pages(fd, nbytes)
        mapped = pages.map_read_only(fd, nbytes)
        address = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
        assert address % HUGE == 0
        assert bytes(mapped[::4096]) == bytes(len(range(0, nbytes, 4096)))  # touch each page
        assert smaps_kb(address, "ShmemPmdMapped") == 3 * HUGE // 1024
    finally:
        os.close(fd)
    small, _ = memfd_with(HUGE - 1, [])
    try:
        assert not pages.give_huge_pages(small, HUGE - 1)
    finally:
        os.close(small)


def test_a_read_only_mapping_shows_the_file_refuses_writes_and_goes_with_its_views():
    nbytes = HUGE + 12345
    payload = os.urandom(nbytes)
    fd, _ = memfd_with(nbytes, [(0, payload)])
    try:
        mapped = pages.map_read_only(fd, nbytes)
        assert len(mapped) == nbytes and bytes(mapped) == payload
        with pytest.raises(TypeError):
            mapped[0] = 1
        tensor = torch.frombuffer(mapped, dtype=torch.uint8)[HUGE:]
        del mapped
        gc.collect()
        assert len(our_mappings()) == 1  # the tensor still views it
        assert bytes(tensor[:16].tolist()) == payload[HUGE:HUGE + 16]
        del tensor
        assert our_mappings() == []  # no cycle to wait for: gone with the last view
    finally:
        os.close(fd)


def test_what_cannot_be_mapped_is_an_error_and_leaves_nothing():
    write_only = os.open("/dev/null", os.O_WRONLY)
    try:
        with pytest.raises(OSError):
            pages.map_read_only(write_only, 4096)
        with pytest.raises(ValueError):
            pages.map_read_only(write_only, 0)
    finally:
        os.close(write_only)
    fd = os.memfd_create(NAME)
    os.ftruncate(fd, 2 * HUGE)
    read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    try:
        assert not pages.give_huge_pages(read_only, 2 * HUGE)  # it needs a writable file
        assert our_mappings() == []
    finally:
        os.close(read_only)
        os.close(fd)


@pytest.mark.skipif(not collapse_possible(), reason="MADV_COLLAPSE needs Linux 6.1 and "
                    "shmem huge pages not denied")
def test_only_a_lease_readied_ahead_gets_huge_pages(make_fake_server):
    """The client readies a lease off the push's path in huge pages; a lease it writes on
    the push's path stays in small ones (making huge pages can cost 80-200 ms on a VM that
    hands free memory back to its host). Checked on the lease's own read-only descriptor."""
    from lora_sync import LoRASyncClient
    from lora_sync.transports import shm
    server = make_fake_server()
    nbytes = HUGE + 4096
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as client:
        client.states["shm"].ready.want(client.servers[0], "huge", nbytes)
        client.states["shm"].ready.start()
        assert client.states["shm"].ready.count() == 1
        ready = client.states["shm"].ready.ready_for(server.url)
        fresh = shm.Lease.from_json(client.states["shm"].ready._post(
            client.servers[0], shm.LEASE_ROUTE, {"nbytes": nbytes}), server.url, nbytes)
        read_fd = shm.write_lease(fresh, [bytes(nbytes)])
        try:
            for fd, huge_kb in ((ready.read_fd, HUGE // 1024), (read_fd, 0)):
                mapped = pages.map_read_only(fd, nbytes)
                bytes(mapped[::4096])  # one read per page maps them all
                address = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
                assert smaps_kb(address, "ShmemPmdMapped") == huge_kb
                del mapped
        finally:
            os.close(read_fd)


def test_lengths_share_a_mapping_type_per_huge_page():
    """What a client's choice of lease length can make a worker keep: one mapping type per
    2 MiB multiple (ctypes keeps every array type it makes), not one per length."""
    fd, _ = memfd_with(2 * HUGE, [])
    try:
        before = pages._mapping_type.cache_info().currsize
        for n in (1, 4097, HUGE - 1, HUGE, HUGE + 1, 2 * HUGE - 3, 2 * HUGE):
            mapped = pages.map_read_only(fd, n)
            assert len(mapped) == n
            del mapped
        assert pages._mapping_type.cache_info().currsize - before <= 2
        assert our_mappings() == []
    finally:
        os.close(fd)
