"""Python's full garbage collections, kept out of a push.

A full collection walks every object the process tracks. A server holding a 10,000-tensor
adapter beside the engine's start-up heap tracks about half a million, and one walk of
them takes hundreds of ms. CPython starts one when the objects promoted since the last
outnumber a quarter of those it holds, which a push of many tensors brings on by itself:
the pause then lands inside the push, on both sides of it. Two remedies, as the engines
use them (vLLM freezes its start-up heap; SGLang defers full collections around its
multimodal steps):

  * `during_push(freeze=True)` (the server's processes) freezes the heap once, at the
    first push: by then the engine has started, and what it holds for good is never walked
    again. Skipped where the engine froze its heap itself. The trainer's process is the
    user's: it is never frozen.
  * Full collections wait while a push is in flight in the process (young ones still run,
    so short-lived cycles are freed as usual) and resume when the last push ends.

`during_push` also counts the full collections that ran anyway (an explicit gc.collect,
another thread's block ending): the push's `gc` time, in its timings.

LORA_SYNC_FULL_GC=engine (in the server's or the trainer's environment) leaves the
collector as the engine or the trainer set it, and still counts: the A/B of this module.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
import time

NEVER = 2 ** 31 - 1  # threshold2: no full collection starts by itself
MODES = ("defer", "engine")

_lock = threading.Lock()
_blocks = 0                 # pushes in flight in this process
_thresholds = gc.get_threshold()
_frozen = False
_full_s = 0.0               # seconds in full collections in this process so far
_started: float | None = None


def _on_collection(phase: str, info: dict) -> None:
    global _full_s, _started
    if info.get("generation") != 2:
        return
    if phase == "start":
        _started = time.perf_counter()
    elif _started is not None:
        _full_s += time.perf_counter() - _started
        _started = None


class Block:
    """What `during_push` saw: `ms` of full collections in this process meanwhile."""
    __slots__ = ("_start", "ms")

    def __init__(self):
        self._start, self.ms = _full_s, 0.0

    def end(self) -> None:
        self.ms = (_full_s - self._start) * 1e3


@contextlib.contextmanager
def during_push(freeze: bool = False):
    """A push in this process: full collections wait until the last one ends. `freeze`:
    the process is a server's, whose start-up heap is frozen at its first push."""
    block = Block()  # the freeze's one collection is this push's too
    deferring = mode() == "defer"
    if deferring:
        if freeze:
            _freeze_once()
        _defer()
    pid = os.getpid()
    try:
        yield block
    finally:
        block.end()
        if deferring and os.getpid() == pid:  # a forked child restored its own (_after_fork)
            _resume()


def _defer() -> None:
    global _blocks, _thresholds
    with _lock:
        if _blocks == 0:
            _thresholds = gc.get_threshold()
            gc.set_threshold(_thresholds[0], _thresholds[1], NEVER)
        _blocks += 1


def _resume() -> None:
    global _blocks
    with _lock:
        _blocks -= 1
        if _blocks == 0:
            gc.set_threshold(*_thresholds)


def mode() -> str:
    value = os.environ.get("LORA_SYNC_FULL_GC", "defer")
    if value not in MODES:
        raise ValueError(f"LORA_SYNC_FULL_GC must be one of {MODES}, not {value!r}")
    return value


def _freeze_once() -> None:
    global _frozen
    with _lock:
        if _frozen:
            return
        _frozen = True
        if gc.get_freeze_count() > 0:  # the engine froze its own (vLLM)
            return
        gc.collect()  # what is garbage now is freed, not frozen
        gc.freeze()


def _after_fork() -> None:
    global _lock, _blocks
    _lock = threading.Lock()
    if _blocks:
        _blocks = 0
        gc.set_threshold(*_thresholds)


gc.callbacks.append(_on_collection)  # returns at once unless a collection is a full one
os.register_at_fork(after_in_child=_after_fork)
