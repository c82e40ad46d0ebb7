"""lora_sync.full_gc: full collections wait while a push is in flight, the start-up heap of a
server's process is frozen once, and the full collections that ran anyway are counted."""
import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from lora_sync import full_gc


def test_a_push_defers_full_collections_and_restores_the_thresholds():
    before = gc.get_threshold()
    with full_gc.during_push():
        assert gc.get_threshold() == (before[0], before[1], full_gc.NEVER)
        with full_gc.during_push():  # a second push in the same process
            assert gc.get_threshold()[2] == full_gc.NEVER
        assert gc.get_threshold()[2] == full_gc.NEVER  # the first is still in flight
    assert gc.get_threshold() == before


def test_concurrent_pushes_restore_when_the_last_one_ends():
    before = gc.get_threshold()
    inside, release = threading.Event(), threading.Event()

    def other():
        with full_gc.during_push():
            inside.set()
            release.wait(10)
    t = threading.Thread(target=other)
    with full_gc.during_push():
        t.start()
        assert inside.wait(10)
    assert gc.get_threshold()[2] == full_gc.NEVER  # the thread's push is still in flight
    release.set()
    t.join(10)
    assert gc.get_threshold() == before


def test_thresholds_come_back_after_an_error():
    before = gc.get_threshold()
    try:
        with full_gc.during_push():
            raise RuntimeError("the push failed")
    except RuntimeError:
        pass
    assert gc.get_threshold() == before


def test_full_collections_that_ran_anyway_are_counted():
    with full_gc.during_push() as quiet:
        pass
    with full_gc.during_push() as collected:
        gc.collect()
    assert quiet.ms == 0.0
    assert collected.ms > 0.0


def test_no_full_collection_starts_by_itself_inside_a_push():
    seen = []

    def watch(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(info)
    gc.callbacks.append(watch)
    try:
        # Enough surviving objects to bring on full collections (CPython's rule: promoted
        # since the last > a quarter of those held): they do outside a push...
        keep = [[i] for i in range(2_000_000)]
        assert seen
        del keep
        seen.clear()
        with full_gc.during_push() as block:  # ...and not inside one
            keep = [[i] for i in range(2_000_000)]
        del keep
    finally:
        gc.callbacks.remove(watch)
    assert seen == []
    assert block.ms == 0.0


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_server_process_freezes_its_heap_once_and_a_trainer_never():
    out = _run("""
        import gc
        from lora_sync import full_gc
        with full_gc.during_push():
            pass
        trainer = gc.get_freeze_count()
        with full_gc.during_push(freeze=True):
            pass
        first = gc.get_freeze_count()
        junk = [[i] for i in range(1000)]
        with full_gc.during_push(freeze=True):
            pass
        print(trainer, first > 10_000, gc.get_freeze_count() == first)
    """)
    assert out == "0 True True"


def test_a_heap_the_engine_froze_is_left_as_it_is():
    out = _run("""
        import gc
        from lora_sync import full_gc
        gc.freeze()
        engine = gc.get_freeze_count()
        junk = [[i] for i in range(1000)]
        with full_gc.during_push(freeze=True):
            pass
        print(gc.get_freeze_count() == engine)
    """)
    assert out == "True"


def test_a_child_forked_inside_a_push_collects_as_before():
    out = _run("""
        import gc, os
        from lora_sync import full_gc
        before = gc.get_threshold()
        with full_gc.during_push():
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, repr(gc.get_threshold() == before).encode())
                os._exit(0)
            os.waitpid(pid, 0)
            child = os.read(r, 64).decode()
        print(child, gc.get_threshold() == before)
    """)
    assert out == "True True"


def test_engine_mode_leaves_the_collector_alone_and_still_counts(monkeypatch):
    monkeypatch.setenv("LORA_SYNC_FULL_GC", "engine")
    before = gc.get_threshold()
    with full_gc.during_push(freeze=True) as block:
        assert gc.get_threshold() == before
        gc.collect()
    assert block.ms > 0.0


def test_an_unknown_mode_stops_the_server_at_start_up(monkeypatch):
    from lora_sync.server.settings import Settings
    monkeypatch.setenv("LORA_SYNC_FULL_GC", "off")
    with pytest.raises(ValueError, match="LORA_SYNC_FULL_GC .*'off'"):
        Settings.from_env()


def test_only_a_server_of_its_own_process_freezes_it():
    """An in-process server (a test's, on the FAKE engine) leaves the heap of the process it
    runs in as it was; an engine's bridge and workers (freezes_heap) freeze theirs."""
    out = _run("""
        import gc, torch
        from lora_sync import LoRAAdapter, LoRASyncClient
        from testbed.tiny_model import TINY_CONFIG
        from tests.engine_fakes import FakeEngineServer
        hidden = TINY_CONFIG["hidden_size"]
        module = "base_model.model.model.layers.0.self_attn.q_proj"
        adapter = LoRAAdapter({f"{module}.lora_A.weight": torch.randn(2, hidden),
                               f"{module}.lora_B.weight": torch.randn(hidden, 2)},
                              {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
        with FakeEngineServer() as server, LoRASyncClient(
                server.url, engine=server.engine, api_key=server.api_key) as client:
            client.push(adapter, "a", transport="tensors")
            in_process = gc.get_freeze_count()
            server.bridge.freezes_heap = True
            for w in server.bridge.workers:
                w.engine.freezes_heap = True
            [result] = client.push(adapter, "a", transport="tensors")
        print(in_process, gc.get_freeze_count() > 10_000, result.reply["timings_ms"]["gc"] > 0)
    """)
    assert out == "0 True True"  # the freeze's one collection is the push's gc time
