"""Completion notices: a worker that takes an adapter in (or joins a group) on a background
thread reports through a small file, so the API process can wait without keeping an engine
RPC, and with it the engine loop, busy for the whole transfer.

Notices live in this API process's staging directory, so they go with it when the server
stops (and with the orphan sweep after a kill -9); a notice written after its waiter gave
up is swept once it is NOTICE_MAX_AGE_S old."""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

from .errors import TransferFailed
from .messages import WorkerReply
from .staging import staging_dir, discard

NOTICE_MAX_AGE_S = 600.0


def notice_paths(workers: int) -> list[str]:
    directory = os.path.join(staging_dir(), "notices")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    old = time.time() - NOTICE_MAX_AGE_S
    for entry in os.scandir(directory):
        if entry.stat().st_mtime < old:
            discard(entry.path)
    base = os.path.join(directory, uuid.uuid4().hex)
    return [f"{base}-{rank}.json" for rank in range(workers)]


def write_notice(path: str, reply: WorkerReply) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(reply.to_json(), f)
        os.replace(tmp, path)  # atomic: readers never see half a notice
    except FileNotFoundError:
        pass  # the server stopped (its directory went): nobody waits for this notice


async def wait_notices(paths: list[str], timeout_s: float,
                       poll_s: float = 0.002) -> list[WorkerReply]:
    """Every worker's notice; one missing after `timeout_s` is a TransferFailed reply."""
    deadline = time.monotonic() + timeout_s
    results: dict[str, WorkerReply] = {}
    try:
        while len(results) < len(paths):
            for p in paths:
                if p not in results and os.path.exists(p):
                    with open(p) as f:
                        results[p] = WorkerReply.from_json(json.load(f))
            if len(results) < len(paths):
                if time.monotonic() > deadline:
                    late = WorkerReply.failed(TransferFailed(
                        f"{len(paths) - len(results)} worker(s) did not finish receiving "
                        f"within {timeout_s:.0f}s"))
                    return [results.get(p, late) for p in paths]
                await asyncio.sleep(poll_s)
        return [results[p] for p in paths]
    finally:
        for p in paths:
            discard(p)
