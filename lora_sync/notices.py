"""Completion notices: a worker that takes an adapter in (or joins a group) on a background
thread reports through a small file, so the API process can wait without keeping an engine
RPC, and with it the engine loop, busy for the whole transfer.

Notices live in this API process's staging directory, so they go with it when the server
stops (and with the orphan sweep after a kill -9); a notice written after its waiter gave
up is swept once it is NOTICE_MAX_AGE_S old. The waiter listens on a datagram socket beside
them, which each writer pings once its notice is in place: it wakes at once instead of on
its next poll (a poll added half its interval, on average, to every broadcast push)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid

from .errors import TransferFailed
from .messages import WorkerReply
from .private_dir import NOFOLLOW, subdir
from .staging import staging_dir, discard

NOTICE_MAX_AGE_S = 600.0
POLL_S = 0.002        # without a wake-up socket
WOKEN_POLL_S = 0.05   # with one: a safety net only


def notice_paths(workers: int) -> list[str]:
    directory = subdir(staging_dir(), "notices")
    old = time.time() - NOTICE_MAX_AGE_S
    for entry in os.scandir(directory):
        try:
            stale = entry.stat().st_mtime < old
        except FileNotFoundError:  # a worker's `.tmp` renamed into its notice meanwhile
            continue
        if stale:
            discard(entry.path)
    base = os.path.join(directory, uuid.uuid4().hex)
    return [f"{base}-{rank}.json" for rank in range(workers)]


def wake_path(notice_path: str) -> str:
    """The waiter's socket, shared by the notices of one call (`<base>-<rank>.json`)."""
    return notice_path.rsplit("-", 1)[0] + ".wake"


def write_notice(path: str, reply: WorkerReply) -> None:
    tmp = path + ".tmp"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW, 0o600),
                  "w") as f:
            json.dump(reply.to_json(), f)
        os.replace(tmp, path)  # atomic: readers never see half a notice
    except FileNotFoundError:
        return  # the server stopped (its directory went): nobody waits for this notice
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            s.sendto(b"!", wake_path(path))
    except OSError:
        pass  # nobody listens (the waiter gave up, or polls): the file is the notice


def _listen(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.bind(path)
    except OSError:  # e.g. a path too long for a socket: poll instead
        s.close()
        return None
    s.setblocking(False)
    return s


async def _woken(sock: socket.socket, timeout_s: float) -> bool:
    """Whether a ping came (else the wait timed out)."""
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 64), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False


async def wait_notices(paths: list[str], timeout_s: float) -> list[WorkerReply]:
    """Every worker's notice; one missing after `timeout_s` is a TransferFailed reply."""
    deadline = time.monotonic() + timeout_s
    results: dict[str, WorkerReply] = {}
    wake = wake_path(paths[0]) if paths else None
    # Listening before the first look: a notice written earlier is seen by that look, one
    # written later pings the socket.
    sock = _listen(wake) if wake else None
    try:
        while len(results) < len(paths):
            for p in paths:
                if p not in results and os.path.exists(p):
                    with open(p) as f:
                        results[p] = WorkerReply.from_json(json.load(f))
            if len(results) < len(paths):
                left = deadline - time.monotonic()
                if left < 0:
                    late = WorkerReply.failed(TransferFailed(
                        f"{len(paths) - len(results)} worker(s) did not finish receiving "
                        f"within {timeout_s:.0f}s"))
                    return [results.get(p, late) for p in paths]
                if sock is None:
                    await asyncio.sleep(POLL_S)
                else:
                    await _woken(sock, min(WOKEN_POLL_S, left + 0.001))
        return [results[p] for p in paths]
    finally:
        if sock is not None:
            sock.close()
            discard(wake)
        for p in paths:
            discard(p)
