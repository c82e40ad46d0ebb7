"""Versions, the alias, the retention window, retire, and when what a version held is freed,
in process on the FAKE engine (tests/service_helpers.py says what these suites check)."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import pytest

from lora_sync import LoRASyncClient, NotFound, VersionConflict, http

from .engine_fakes import BASE_TEXT, served_text
from .helpers import AUTH, PROMPT, Background, greedy, versions_of, wait_until
from .service_helpers import (KEEP, listing, held_versions, adapter_ids, wait_drained,
                              complete_raw, error_of, open_leases, inflight, retire_first,
                              free_timing)
from .service_helpers import clean_slate  # noqa: F401  (autouse: it applies to this module)


# -- versions, aliases, the window ----------------------------------------------------------
@pytest.mark.parametrize("transport", ["tensors", "shm", "broadcast"])
def test_versions_and_alias(fake_client, make_adapter, transport):
    """Each push is a new version, served as <name>-v<N> and under the alias <name> (the
    newest); explicit versions must go up, and a refused one changes nothing. On every
    transport."""
    c = fake_client
    name = f"ver-{transport}"
    if transport == "broadcast":
        c.init_group(timeout_s=20)
    v1, v2 = make_adapter(seed=21), make_adapter(seed=22)
    [r1] = c.push(v1, name, transport=transport)
    assert (r1.name, r1.version, r1.transport) == (f"{name}-v1", 1, transport)
    assert r1.bytes == v1.nbytes and r1.reply["load_ms"] > 0
    assert greedy(c, name) == greedy(c, f"{name}-v1") == served_text(v1)
    [r2] = c.push(v2, name, transport=transport)
    assert r2.name == f"{name}-v2"
    assert greedy(c, name) == served_text(v2) != served_text(v1)
    assert greedy(c, f"{name}-v1") == served_text(v1)
    # Explicit versions must go up; a refused one changes nothing.
    if transport != "broadcast":  # a refused broadcast leaves the group out of step
        assert c.push(v1, name, version=7, transport=transport)[0].name == f"{name}-v7"
        for stale in (7, 3):
            with pytest.raises(VersionConflict) as e:
                c.push(v2, name, version=stale, transport=transport)
            assert e.value.code == "version_conflict" and e.value.status == 409
        assert greedy(c, name) == served_text(v1)
        assert versions_of(c, name) == [1, 2, 7]


def test_auto_picks_shm_on_the_same_host_and_leaks_no_lease_detail(fake_client, make_adapter):
    """test_shm.py::test_shm_matches_disk_and_is_chosen_on_the_same_host (choice and reply)."""
    [res] = fake_client.push(make_adapter(seed=801), "shm801")  # transport="auto"
    assert res.transport == "shm" and res.version == 1
    listed = json.dumps(fake_client.adapters()[0]) + json.dumps(res.reply)
    assert "/proc/" not in listed and "token" not in listed and "lease_id" not in listed
    # The only lease left open is the one readied for this name's next push.
    assert fake_client.states["shm"].ready.count() == open_leases(fake_client) == 1


@pytest.mark.parametrize("transport", ["tensors", "shm", "broadcast"])
def test_pushed_weights_are_the_weights_on_disk(fake_client, make_adapter, workdir, transport):
    """test_tensors.py::test_tensors_match_disk_and_differ_from_base,
    test_shm.py::test_shm_matches_disk_and_is_chosen_on_the_same_host and
    test_broadcast.py::test_broadcast_matches_disk: what each transport hands the workers is
    byte for byte what the engine reads from the PEFT directory (the fake's text is a hash
    of the weights)."""
    c = fake_client
    adapter = make_adapter(seed=11)
    disk = f"disk-11-{transport}"
    adapter.save(workdir / disk)
    c.load_from_disk(str(workdir / disk), disk)
    try:
        if transport == "broadcast":
            c.init_group(timeout_s=20)
        [res] = c.push(adapter, f"t11-{transport}", transport=transport)
        assert res.bytes == adapter.nbytes
        from_disk = greedy(c, disk)
        assert from_disk == served_text(adapter)
        assert greedy(c, res.name) == greedy(c, f"t11-{transport}") == from_disk
        assert greedy(c, "base") == BASE_TEXT != from_disk
    finally:
        c.unload_from_disk(disk)


def test_window_retires_old_versions_with_clear_404(fake_server, fake_client, make_adapter):
    """The window keeps the newest KEEP versions: an older one is a 404 version_retired that
    names the versions still served, the alias and its reply headers name the newest, and
    the workers hold exactly the versions in the window (the retired ones are freed)."""
    c = fake_client
    for seed in range(5):
        c.push(make_adapter(seed=200 + seed), "win", transport="tensors")
    assert versions_of(c, "win") == [3, 4, 5]
    reply = c.complete(PROMPT, "win", 4)
    assert reply["version"] == 5 and reply["model"] == "win-v5"
    assert reply["text"] == served_text(make_adapter(seed=204))
    with pytest.raises(NotFound) as e:
        c.complete(PROMPT, "win-v1", 4)
    assert e.value.code == "version_retired"
    assert "win-v3" in str(e.value) and "win-v5" in str(e.value)
    _, _, headers = complete_raw(fake_server, "win")
    assert headers["x-lora-version"] == "5" and headers["x-lora-name"] == "win-v5"
    live = adapter_ids(c, "win")
    wait_until(lambda: fake_server.bridge.held_ids() == [live], what="retired versions freed")


def test_several_names_side_by_side(fake_client, make_adapter):
    """Two names pushed in turn keep a window each, each alias serving its own newest."""
    c = fake_client
    for i in range(4):
        c.push(make_adapter(seed=300 + i), "left", transport="tensors")
        c.push(make_adapter(seed=400 + i), "right", transport="tensors")
    assert versions_of(c, "left") == versions_of(c, "right") == [2, 3, 4]
    assert greedy(c, "left") == served_text(make_adapter(seed=303))
    assert greedy(c, "right") == served_text(make_adapter(seed=403))


def test_retiring_a_busy_version_never_blocks(fake_server, fake_client, make_adapter):
    """test_versions.py::test_retiring_a_busy_version_never_blocks: a request runs on v1
    while pushes retire v1; the pushes return at once, the request finishes on v1, and v1
    is freed only after it ends (the fake engine records a free under a running request)."""
    c = fake_client
    c.push(make_adapter(seed=500), "busy", transport="tensors")
    v1_text = greedy(c, "busy-v1")
    [v1_id] = adapter_ids(c, "busy")
    request = Background("POST", f"{fake_server.url}/v1/completions",
                         {"model": "busy-v1", "prompt": PROMPT, "fake_delay_s": 1.0})
    wait_until(lambda: inflight(c, "busy-v1") == 1, what="the request admitted")
    for i in range(KEEP):
        c.push(make_adapter(seed=501 + i), "busy", transport="tensors")
    entry = listing(c, "busy")  # the request still runs: the pushes did not wait for it
    [v1] = [v for v in entry["versions"] if v["version"] == 1]
    assert v1["retired"] and v1["inflight"] == 1, entry
    assert entry["draining"] == ["busy-v1"]
    assert all(v1_id in held for held in fake_server.bridge.held_ids())
    done = request.join()
    assert done["status"] == 200 and done["headers"]["x-lora-version"] == "1", done
    assert done["reply"]["choices"][0]["text"] == v1_text
    wait_until(lambda: held_versions(c, "busy") == [2, 3, 4], what="v1 freed")
    assert v1_id in fake_server.bridge.freed


# -- freeing retired versions ---------------------------------------------------------------
def long_request(server, model: str, seconds: float) -> Background:
    return Background("POST", f"{server.url}/v1/completions",
                      {"model": model, "prompt": PROMPT, "fake_delay_s": seconds})


def test_a_retired_version_is_freed_after_the_requests_that_follow_its_push(
        fake_server, fake_client, make_adapter, monkeypatch):
    """Freeing takes the engine's own thread (SGLang zeroes a memory-pool slot): a retired
    version waits while a request on the new version runs, past the quiet time, and is freed
    once it ends."""
    free_timing(monkeypatch, quiet_s=1.0, max_s=60.0)
    c = fake_client
    v1_id = retire_first(c, make_adapter, "pause", seed=530)
    request = long_request(fake_server, "pause", 3.0)
    wait_until(lambda: inflight(c, f"pause-v{KEEP + 1}") == 1, what="the request admitted")
    time.sleep(1.5)  # past the quiet time, the request still runs
    assert v1_id not in fake_server.bridge.freed
    assert inflight(c, f"pause-v{KEEP + 1}") == 1
    assert request.join()["status"] == 200
    wait_until(lambda: v1_id in fake_server.bridge.freed, what="v1 freed once requests paused")
    assert held_versions(c, "pause") == list(range(2, KEEP + 2))


def test_a_push_frees_retired_versions_waiting_for_a_pause_first(
        fake_server, fake_client, make_adapter, monkeypatch):
    """A push never finds retired versions still held (their memory is what it reuses):
    those waiting for requests to pause are freed before it."""
    free_timing(monkeypatch, quiet_s=60.0, max_s=120.0)
    c = fake_client
    v1_id = retire_first(c, make_adapter, "settle", seed=540)
    time.sleep(0.2)
    assert v1_id not in fake_server.bridge.freed  # waiting for requests to pause
    v2_id = next(v["adapter_id"] for v in listing(c, "settle")["versions"]
                 if v["version"] == 2)
    c.push(make_adapter(seed=549), "settle", transport="tensors")
    assert v1_id in fake_server.bridge.freed  # freed before the push went on
    assert v2_id not in fake_server.bridge.freed  # retired by that push: it waits
    # Its wait starts on the server's loop after the push's reply (a CI run read the set
    # before it had): bounded, then it stays waiting.
    wait_until(lambda: len(fake_server.service.registry._deferred) == 1, 10, "v2 waiting for a pause")
    time.sleep(0.2)
    assert v2_id not in fake_server.bridge.freed and len(fake_server.service.registry._deferred) == 1


def test_a_retired_version_is_freed_in_bounded_time_under_endless_requests(
        fake_server, fake_client, make_adapter, monkeypatch):
    """Requests that never pause hold a retired version's memory FREE_DEFER_MAX_S at most."""
    free_timing(monkeypatch, quiet_s=0.1, max_s=0.5)
    c = fake_client
    v1_id = retire_first(c, make_adapter, "endless", seed=550)
    request = long_request(fake_server, "endless", 5.0)
    wait_until(lambda: v1_id in fake_server.bridge.freed, what="v1 freed at the bound")
    assert inflight(c, f"endless-v{KEEP + 1}") == 1  # while the request still ran
    assert request.join()["status"] == 200


def test_a_retired_name_is_freed_at_once_and_numbers_again_from_1(
        fake_server, fake_client, make_adapter, monkeypatch):
    """Only versions a push retired wait for requests to pause: a name retired whole has no
    new version whose requests come first. Its versions go at once, and a fresh client (it
    numbers above the newest version a server still lists) starts the name again at 1."""
    free_timing(monkeypatch, quiet_s=60.0, max_s=120.0)
    c = fake_client
    c.push(make_adapter(seed=560), "again", transport="tensors")
    c.push(make_adapter(seed=561), "again", transport="tensors")
    ids = adapter_ids(c, "again")
    c.retire("again")
    wait_until(lambda: ids <= set(fake_server.bridge.freed), 5, "the retired name's versions freed")
    with LoRASyncClient(fake_server.url, engine=fake_server.engine,
                        api_key=fake_server.api_key) as fresh:
        [res] = fresh.push(make_adapter(seed=562), "again", transport="tensors")
    assert res.version == 1


def test_a_version_the_engine_still_uses_waits_for_it(fake_server, fake_client, make_adapter):
    """A request that reached the engine uncounted by admission (EngineBridge.in_use): the
    retired version is unlisted for new requests but freed only once the engine is done."""
    c = fake_client
    c.push(make_adapter(seed=510), "pinned", transport="tensors")
    [v1_id] = adapter_ids(c, "pinned")
    with fake_server.bridge.engine_busy(v1_id):
        for i in range(KEEP):
            c.push(make_adapter(seed=511 + i), "pinned", transport="tensors")
        status, reply, _ = complete_raw(fake_server, "pinned-v1")
        assert (status, error_of(reply)[1]) == (404, "version_retired"), reply
        time.sleep(0.2)  # several drain polls
        assert v1_id not in fake_server.bridge.freed
        assert listing(c, "pinned")["draining"] == ["pinned-v1"]
    wait_until(lambda: v1_id in fake_server.bridge.freed, what="v1 freed after the engine")
    assert held_versions(c, "pinned") == [2, 3, 4]


def test_the_engines_own_unload_evicts_its_copy_once_idle(fake_server, fake_client,
                                                         make_adapter, workdir):
    """test_tensors.py::test_the_engines_own_unload_frees_the_worker_copy: a disk adapter
    unloaded by name through the engine's route is evicted from the engine, never while
    the engine still has a request on it; a refused unload evicts nothing."""
    c = fake_client
    make_adapter(seed=520).save(workdir / "disk-520")
    c.load_from_disk(str(workdir / "disk-520"), "disk-520")
    disk_id = fake_server.bridge.disk["disk-520"][0]
    with fake_server.bridge.engine_busy(disk_id):
        c.unload_from_disk("disk-520")
        time.sleep(0.2)  # several drain polls
        assert disk_id not in fake_server.bridge.evicted
    wait_until(lambda: disk_id in fake_server.bridge.evicted, what="disk copy evicted")
    wait_until(lambda: not fake_server.service.registry._evicting, what="the eviction task let go")
    evicted = list(fake_server.bridge.evicted)
    status, _, _ = http.request("POST", f"{fake_server.url}/v1/unload_lora_adapter",
                                json_body={"lora_name": "disk-520"}, headers=AUTH)
    assert status == 404
    time.sleep(0.2)
    assert fake_server.bridge.evicted == evicted


def test_soak_versions_while_generating(fake_server, make_adapter):
    """test_versions.py::test_soak_200_versions_while_streaming (its logic; memory is the
    real engine's): one thread generates on the alias and on the previous version while
    another pushes; no request fails but documented 404s, none is served by the base model,
    and at the end the workers hold exactly the listed versions."""
    adapters = [make_adapter(seed=600 + i) for i in range(4)]
    texts = [served_text(a) for a in adapters]
    pusher = LoRASyncClient(fake_server.url, api_key=fake_server.api_key)
    reader = LoRASyncClient(fake_server.url, api_key=fake_server.api_key)
    pusher.push(adapters[1], "soak", transport="tensors")
    stop, stats = threading.Event(), {"ok": 0, "retired_404": 0, "bad": []}

    def generate():
        i = 0
        while not stop.is_set():
            i += 1
            vs = versions_of(reader, "soak")
            model = "soak" if i % 2 or not vs else f"soak-v{max(1, vs[-1] - 1)}"
            try:
                r = reader.complete(PROMPT, model, 4)
                if not (r["model"] or "").startswith("soak-v") or \
                        r["text"] != texts[r["version"] % 4]:
                    stats["bad"].append(("served", model, r["model"], r["text"]))
                else:
                    stats["ok"] += 1
            except NotFound as e:
                stats["retired_404"] += 1
                if e.code != "version_retired":
                    stats["bad"].append(("404", str(e)))
            except Exception as e:  # noqa: BLE001 - any other failure is a defect
                stats["bad"].append((type(e).__name__, str(e)))
    t = threading.Thread(target=generate)
    t.start()
    try:
        for v in range(2, 61):
            pusher.push(adapters[v % 4], "soak", transport="shm" if v % 3 else "tensors")
    finally:
        stop.set()
        t.join(timeout=60)
        pusher.close()
        reader.close()
    assert not stats["bad"], stats["bad"][:5]
    assert stats["ok"] > 5, stats
    with LoRASyncClient(fake_server.url, api_key=fake_server.api_key) as c:
        assert versions_of(c, "soak") == [58, 59, 60]
        wait_until(lambda: not listing(c, "soak")["draining"], what="soak drained")
        listed = adapter_ids(c, "soak")
        worker = c.info()[0]["worker_status"][0]
    assert len(listed) == KEEP
    assert set(worker["held_ids"]) == listed, "a retired version leaked on the worker"
    assert set(worker["cached_ids"]) == listed


@pytest.mark.parametrize("transport", ["tensors", "shm", "broadcast"])
def test_live_versions_stay_intact_while_memory_is_reused(fake_server, fake_client,
                                                         make_adapter, transport):
    """test_versions.py::test_retired_versions_memory_is_reused_and_live_versions_stay_intact:
    a push reuses what a retired version freed (staged files, broadcast buckets), never what
    a live version still uses: the fake hashes the workers' weights at every request."""
    c = fake_client
    staging = fake_server.service.staging.dir
    if transport == "broadcast":
        c.init_group(timeout_s=20)
    outputs, files = {}, []
    for i in range(KEEP + 4):
        adapter = make_adapter(seed=700 + i)
        [res] = c.push(adapter, f"reuse-{transport}", transport=transport)
        outputs[res.name] = served_text(adapter)
        for name in list(outputs)[-KEEP:]:
            assert greedy(c, name) == outputs[name], f"{name} changed after a push"
        files.append(sorted(e.name for e in os.scandir(staging) if e.is_file()))
    if transport == "tensors":  # from the first retirement on, the same files are reused
        assert files[KEEP] and files[KEEP:] == [files[KEEP]] * (len(files) - KEEP), files


# -- retire -------------------------------------------------------------------------------
def test_retired_names_are_404_and_come_back_from_v1(fake_server, fake_client, make_adapter):
    """test_integrity.py::test_retired_names_are_404_never_another_model and the naming
    part of test_a_name_that_comes_back_never_meets_old_cache: after retire_lora_adapter the
    name and its versions are 404 version_retired (never another model), and a push starts
    the name again at v1 with the new weights."""
    c = fake_client
    a, b = make_adapter(seed=301), make_adapter(seed=302)
    c.push(a, "gone", transport="tensors")
    c.push(a, "gone", transport="tensors")
    out = c.retire("gone")[0]
    assert out["lora_name"] == "gone" and out["retired"] == [1, 2]
    for model in ("gone", "gone-v1", "gone-v2"):
        status, reply, _ = complete_raw(fake_server, model)
        assert (status, error_of(reply)[1]) == (404, "version_retired"), (model, reply)
    wait_drained(c, "gone")
    status, reply, _ = complete_raw(fake_server, "gone")
    assert (status, error_of(reply)[1]) == (404, "version_retired"), reply
    with pytest.raises(NotFound) as e:
        c.retire("gone")
    assert e.value.code == "not_found"
    [res] = c.push(b, "gone", version=1, transport="tensors")
    assert res.name == "gone-v1"
    assert greedy(c, "gone") == greedy(c, "gone-v1") == served_text(b)
    # A fresh client, the same name and weights again, numbered by the server.
    c.retire("gone")
    wait_drained(c, "gone")
    with LoRASyncClient(fake_server.url, api_key=fake_server.api_key) as other:
        assert other.push(a, "gone", transport="shm")[0].version == 1
        assert greedy(other, "gone") == served_text(a)


def test_registration_identities_never_repeat_across_starts():
    """The identity rule's restart half (a server restart is a new API process, so a new
    bridge): every registration's identity, the key the engine caches by, is new to the
    engine, within a start and across starts, and not guessable from the adapter id."""
    from .engine_fakes import FakeBridge
    seen = set()
    for _start in range(3):
        bridge = FakeBridge()
        ids = [bridge.identity(adapter_id) for adapter_id in range(1, 50)]
        assert len(set(ids)) == len(ids) and not seen & set(ids)
        assert all(len(i.split("-")[0]) == 16 for i in ids)  # a 64-bit secret nonce
        seen |= set(ids)


@pytest.mark.parametrize("busy", ["newest", "older", "engine-only"])
def test_a_push_right_after_retire_while_a_version_drains(fake_server, fake_client,
                                                          make_adapter, busy):
    """Retire v1..v3 while a request still runs on one of them (the newest; an older one;
    or one the engine runs without admission's count), then push the name again with the
    client's own numbering: the push must succeed, above the draining version, and serve
    the new weights; the old request still finishes on its version."""
    c = fake_client
    a, b = make_adapter(seed=311), make_adapter(seed=312)
    for _ in range(3):
        c.push(a, "redo", transport="tensors")
    version = {"newest": 3, "older": 1, "engine-only": 3}[busy]
    [busy_id] = [v["adapter_id"] for v in listing(c, "redo")["versions"]
                 if v["version"] == version]
    request = None
    with fake_server.bridge.engine_busy(busy_id) if busy == "engine-only" else \
            contextlib.nullcontext():
        if busy != "engine-only":
            request = Background("POST", f"{fake_server.url}/v1/completions",
                                 {"model": f"redo-v{version}", "prompt": PROMPT,
                                  "fake_delay_s": 0.8})
            wait_until(lambda: inflight(c, f"redo-v{version}") == 1, what="request admitted")
        assert c.retire("redo")[0]["retired"] == [1, 2, 3]
        try:
            [res] = c.push(b, "redo", transport="tensors")
        finally:
            if request is not None:
                assert request.join()["status"] == 200
    assert res.version > version and greedy(c, "redo") == served_text(b)


def test_unknown_models_are_404(fake_server):
    """test_integrity.py::test_unknown_model_is_404_on_both_engines (here: admission lets
    names that are not ours through to the engine, which answers 404)."""
    for model in ("never-pushed", "never-pushed-v3", "base:never-pushed"):
        status, reply, _ = complete_raw(fake_server, model, headers=AUTH)
        assert status == 404, (model, status, reply)
