"""Completion notices (lora_sync/notices.py), in process: a worker's notice file plus a ping
on the waiter's socket. No engine: the writer is a second process, as a worker is."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from lora_sync import notices
from lora_sync.messages import WorkerReply

WRITER = """
import sys
from lora_sync.messages import WorkerReply
from lora_sync.notices import write_notice
write_notice(sys.argv[1], WorkerReply.run(lambda: {"rank": int(sys.argv[2])}))
"""


@pytest.fixture(autouse=True)
def own_directory(monkeypatch):
    """Notices in a short directory of the test's own (a socket path has 107 bytes at most)."""
    root = tempfile.mkdtemp(prefix="ls-notices-", dir="/tmp")
    monkeypatch.setattr(notices, "staging_dir", lambda: root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def write_from_another_process(path: str, rank: int) -> None:
    subprocess.run([sys.executable, "-c", WRITER, path, str(rank)], check=True, timeout=60)


def wait(paths, timeout_s):
    return asyncio.run(notices.wait_notices(paths, timeout_s))


def later(fn, *args):
    t = threading.Timer(0.3, fn, args)
    t.start()
    return t


def test_a_ping_wakes_the_waiter_without_its_poll(monkeypatch):
    """The safety-net poll is longer than the wait: every wait must end by a ping."""
    monkeypatch.setattr(notices, "WOKEN_POLL_S", 3600.0)
    woken, real = [], notices._woken

    async def recording(sock, timeout_s):
        woken.append(await real(sock, timeout_s))
        return woken[-1]
    monkeypatch.setattr(notices, "_woken", recording)
    paths = notices.notice_paths(2)
    writers = [later(write_from_another_process, p, r) for r, p in enumerate(paths)]
    replies = wait(paths, 20)
    for t in writers:
        t.join()
    assert [r.ok for r in replies] == [True, True], replies
    assert [r.data["rank"] for r in replies] == [0, 1]
    assert woken and all(woken), woken
    assert not any(os.path.exists(p) for p in [*paths, notices.wake_path(paths[0])])


def test_a_notice_written_before_the_wait_is_read(monkeypatch):
    monkeypatch.setattr(notices, "WOKEN_POLL_S", 3600.0)
    [path] = notices.notice_paths(1)
    write_from_another_process(path, 0)  # nobody listens yet: the ping goes nowhere
    [reply] = wait([path], 30)
    assert reply.ok and reply.data == {"rank": 0}


def test_without_a_socket_the_waiter_polls(monkeypatch):
    monkeypatch.setattr(notices, "_listen", lambda path: None)
    [path] = notices.notice_paths(1)
    writer = later(notices.write_notice, path, WorkerReply.run(lambda: {"rank": 5}))
    [reply] = wait([path], 30)
    writer.join()
    assert reply.ok and reply.data == {"rank": 5}


def test_a_missing_notice_is_a_transfer_failure_at_the_timeout():
    paths = notices.notice_paths(2)
    notices.write_notice(paths[0], WorkerReply.run(lambda: {"rank": 0}))
    first, second = wait(paths, 0.2)
    assert first.ok and not second.ok
    assert second.code == "transfer_failed" and "did not finish" in second.message


def test_a_notice_renamed_while_new_paths_are_made_is_passed_over(monkeypatch):
    """A worker's `.tmp` becomes its notice (os.replace) between the sweep's listing and its
    look at the file: the next call's paths are still made (it was a 500 under load)."""
    [path] = notices.notice_paths(1)
    notices.write_notice(path, WorkerReply.run(lambda: {"rank": 0}))
    listing = os.scandir

    def renamed_after_listing(directory):
        entries = list(listing(directory))
        for entry in entries:
            os.replace(entry.path, entry.path + ".moved")
        return iter(entries)
    monkeypatch.setattr(notices.os, "scandir", renamed_after_listing)
    assert len(notices.notice_paths(2)) == 2
