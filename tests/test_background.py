"""lora_sync/background.py: a worker thread lowers its own CPU priority and a thread that
must wait for its work lifts it back; the rest of the process keeps its priority."""
import os
import threading

import pytest

from lora_sync.background import LOWEST, Yielding


def test_a_thread_yields_until_a_waiter_lifts_it():
    if os.geteuid() != 0:
        pytest.skip("lifting a priority back needs CAP_SYS_NICE (root here in CI)")
    yielding, lowered, lifted, seen = Yielding(), threading.Event(), threading.Event(), {}

    def worker():
        tid = threading.get_native_id()
        seen["own"] = os.getpriority(os.PRIO_PROCESS, tid)
        yielding.lower()
        yielding.lower()  # a second readying with no lift between: still lifts to its own
        seen["lowered"] = os.getpriority(os.PRIO_PROCESS, tid)
        lowered.set()
        lifted.wait(10)
        seen["lifted"] = os.getpriority(os.PRIO_PROCESS, tid)
    t = threading.Thread(target=worker)
    t.start()
    assert lowered.wait(10)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == seen["own"]
    yielding.lift()
    lifted.set()
    t.join(10)
    assert seen["lowered"] == LOWEST and seen["lifted"] == seen["own"] != LOWEST
