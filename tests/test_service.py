"""lora-sync's server rules, in-process, on a FAKE engine (tests/engine_fakes.py).

The real client talks HTTP to the real routes, admission, AdapterService, transports and
worker dispatcher; only the engine is fake: its "model" is a hash of the weights the workers
hold, and its completion text is that hash. So these tests check lora-sync's own logic
(names, versions, the retention window, retire, leases, limits, keys, error replies, what
is freed when) in milliseconds, and say nothing about what a real engine generates: the
tests marked `server` (test_versions, test_tensors, test_attacks, test_integrity, test_shm,
test_hostile, ...) check that on vLLM and SGLang. Each test here names the real-server test
whose logic it ports."""
from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
import torch

from lora_sync import (BadAdapter, LoRAAdapter, LoRASyncClient, LoRASyncError, NotFound,
                       Unauthorized, VersionConflict, http, wire)
from lora_sync.server import service as service_module
from lora_sync.trainer.fleet import FleetMemory
from lora_sync.transports import shm

from .conftest import SERVER_ENV
from .engine_fakes import BASE_TEXT, served_text
from .helpers import (AUTH, PROMPT, Background, bad_bodies, blackhole, body_of, greedy,
                      post_body, try_to_take_a_group, versions_of, wait_until)

KEEP = int(SERVER_ENV["LORA_SYNC_KEEP_VERSIONS"])
MAX_BODY = int(float(SERVER_ENV["LORA_SYNC_MAX_BODY_MB"]) * 2 ** 20)
TENSORS = "load_lora_adapter_from_tensors"
DISTRIBUTED = "load_lora_adapter_from_distributed"
INIT_GROUP = "init_lora_update_group"


# -- helpers ------------------------------------------------------------------------------
def route(client, name: str) -> str:
    return client.servers[0].route(name)


def listing(client, name: str) -> dict | None:
    return next((a for a in client.adapters()[0]["adapters"] if a["name"] == name), None)


def held_versions(client, name: str) -> list[int]:
    """Every version the server still holds, retired ones being drained included."""
    entry = listing(client, name)
    if entry is None:
        return []
    return sorted({v["version"] for v in entry["versions"]} |
                  {int(s.rsplit("-v", 1)[1]) for s in entry["draining"]})


def adapter_ids(client, name: str) -> set[int]:
    entry = listing(client, name)
    return {v["adapter_id"] for v in entry["versions"]} if entry else set()


def wait_drained(client, name: str) -> None:
    wait_until(lambda: listing(client, name) is None, what=f"{name} drained")


def complete_raw(server, model: str, headers=None, **extra):
    """(status, reply, headers) of a /v1/completions request naming `model`."""
    return http.request("POST", f"{server.url}/v1/completions", headers=headers,
                        json_body={"model": model, "prompt": PROMPT, "max_tokens": 4, **extra})


def error_of(reply: dict) -> tuple[int | None, str | None]:
    err = reply.get("error") or {}
    return err.get("status"), err.get("code")


def lease(client, nbytes: int) -> shm.Lease:
    return shm.Lease.from_json(http.call("POST", route(client, shm.LEASE_ROUTE),
                                         json_body={"nbytes": nbytes}, headers=AUTH)[0])


def commit(client, ticket) -> tuple[int, dict]:
    if not isinstance(ticket, dict):
        ticket = {"lease_id": ticket.lease_id, "token": ticket.token}
    status, reply, _ = http.request("POST", route(client, shm.COMMIT_ROUTE),
                                    json_body=ticket, headers=AUTH)
    return status, reply


def fill(granted: shm.Lease, parts: list) -> bool:
    """Writes `parts` into a lease as the trainer does; False where it cannot reach it."""
    read_fd = shm.write_lease(granted, parts)
    if read_fd is not None:
        os.close(read_fd)
    return read_fd is not None


def parts_of(adapter, name: str, version=None) -> list:
    return wire.layout(adapter.tensors, adapter.metadata(name, version))


def open_leases(client) -> int:
    return client.info()[0]["open_leases"]


def inflight(client, served: str) -> int:
    for a in client.adapters()[0]["adapters"]:
        for v in a["versions"]:
            if v["served_name"] == served:
                return v["inflight"]
    return 0


@pytest.fixture(autouse=True)
def clean_slate(fake_server, fake_client):
    """After each test: the shared fake server is alive, the fake engine saw nothing a real
    one would crash on, and every name is retired and drained (tests stay independent and
    the server's name limit is never reached by the suite)."""
    yield
    problems = list(fake_server.bridge.violations)
    fake_server.bridge.violations.clear()
    assert fake_server.alive(), fake_server.log_tail()
    if fake_client._group is not None:
        fake_client.destroy_group()
    for entry in fake_client.adapters()[0]["adapters"]:
        try:
            fake_client.retire(entry["name"])
        except NotFound:
            pass  # already retired, still draining
    wait_until(lambda: not fake_client.adapters()[0]["adapters"], what="every name drained")
    assert not problems, problems


# -- versions, aliases, the window ----------------------------------------------------------
@pytest.mark.parametrize("transport", ["tensors", "shm", "broadcast"])
def test_versions_and_alias(fake_client, make_adapter, transport):
    """test_tensors.py::test_versions_and_alias, on every transport."""
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
    assert fake_client.ready_leases.count() == open_leases(fake_client) == 1


@pytest.mark.parametrize("transport", ["tensors", "shm", "broadcast"])
def test_pushed_weights_are_the_weights_on_disk(fake_client, make_adapter, workdir, transport):
    """test_tensors.py::test_tensors_match_disk_and_differ_from_base,
    test_shm.py::test_shm_matches_disk..., test_broadcast.py::test_broadcast_matches_disk:
    what each transport hands the workers is byte for byte what the engine reads from the
    PEFT directory (the fake's text is a hash of the weights)."""
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
    """test_versions.py::test_window_retires_old_versions_with_clear_404, plus: the workers
    hold exactly the versions in the window (the retired ones are freed)."""
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
    """test_versions.py::test_several_names_side_by_side."""
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


def retire_first(c, make_adapter, name: str, seed: int) -> int:
    """Pushes KEEP + 1 versions of `name`: v1 retires. Returns v1's adapter id."""
    c.push(make_adapter(seed=seed), name, transport="tensors")
    [v1_id] = adapter_ids(c, name)
    for i in range(KEEP):
        c.push(make_adapter(seed=seed + 1 + i), name, transport="tensors")
    return v1_id


def free_timing(monkeypatch, quiet_s: float, max_s: float) -> None:
    """The service's FREE_QUIET_S and FREE_DEFER_MAX_S for one test."""
    monkeypatch.setattr(service_module, "FREE_QUIET_S", quiet_s)
    monkeypatch.setattr(service_module, "FREE_DEFER_MAX_S", max_s)


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
    assert len(fake_server.service._deferred) == 1


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
    wait_until(lambda: not fake_server.service._evicting, what="the eviction task let go")
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


# -- names ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["base", "BASE", "Base", "disk-taken", "DISK-TAKEN"])
def test_a_push_never_shadows_an_engine_name(fake_server, fake_client, make_adapter, workdir,
                                            name):
    """test_integrity.py::test_a_push_never_shadows_the_served_model, and the adapters the
    engine loaded itself (any letter case): 409 name_taken, nothing listed."""
    c = fake_client
    make_adapter(seed=310).save(workdir / "disk-taken")
    c.load_from_disk(str(workdir / "disk-taken"), "disk-taken")
    try:
        before = greedy(c, "base"), greedy(c, "disk-taken")
        for transport in ("tensors", "shm"):
            with pytest.raises(LoRASyncError) as e:
                c.push(make_adapter(seed=311), name, transport=transport)
            assert e.value.code == "name_taken" and e.value.status == 409
        assert (greedy(c, "base"), greedy(c, "disk-taken")) == before
        models = http.call("GET", f"{fake_server.url}/v1/models", headers=AUTH)[0]
        assert not any(m["id"].casefold().startswith(f"{name.casefold()}-v")
                       for m in models["data"])
        assert listing(c, name) is None
    finally:
        c.unload_from_disk("disk-taken")


@pytest.mark.parametrize("name", ["nl\n", "a" * 128 + "\n", "ünï", "a" * 129, "", "a/b",
                                  "-lead", "pol-v2", ".."])
def test_names_are_ascii_and_whole(fake_client, make_adapter, name):
    """test_attacks.py::test_names_are_ascii_and_whole."""
    status, reply = post_body(route(fake_client, TENSORS), body_of(make_adapter(seed=641),
                                                                    name=name))
    assert (status, error_of(reply)[1]) == (400, "bad_name"), reply


@pytest.mark.parametrize("version", ["1_0", "\u0663", " 7 ", "+4", "9" * 4300, "0",
                                     str(2 ** 63), "-1", "1e3"])
def test_versions_are_ascii_digits_below_2_63(fake_client, make_adapter, version):
    """test_attacks.py::test_versions_are_ascii_digits_below_2_63: refused, and no
    reservation is left behind (the next push of the name works, at v1)."""
    name = "verdigits"
    meta = make_adapter(seed=651).metadata(name)
    meta["version"] = version
    status, reply = post_body(route(fake_client, TENSORS),
                              wire.encode_bytes(make_adapter(seed=651).tensors, meta))
    assert (status, error_of(reply)[1]) == (400, "bad_version"), reply
    assert fake_client.push(make_adapter(seed=652), name, transport="tensors")[0].version == 1


def test_names_are_capped_and_can_be_retired(make_fake_server, make_adapter):
    """test_attacks.py::test_names_are_capped_and_can_be_retired, on a server of its own
    with LORA_SYNC_MAX_NAMES=3."""
    server = make_fake_server(max_names=3)
    adapter = make_adapter(seed=681)
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        assert c.info()[0]["max_names"] == 3
        for i in range(3):
            c.push(adapter, f"cap{i}", transport="tensors")
        for transport in ("tensors", "shm"):
            with pytest.raises(LoRASyncError) as e:
                c.push(adapter, "cap3", transport=transport)
            assert (e.value.status, e.value.code) == (429, "too_many_names")
        # A name the server already holds still takes pushes.
        assert c.push(adapter, "cap0", transport="tensors")[0].version == 2
        assert len(c.adapters()[0]["adapters"]) == 3
        assert c.retire("cap1")[0]["retired"] == [1]
        with pytest.raises(NotFound) as e:
            c.complete(PROMPT, "cap1", 2)
        assert e.value.code == "version_retired"
        assert c.push(adapter, "cap-new", transport="tensors")[0].version == 1
        with pytest.raises(LoRASyncError) as e:
            c.push(adapter, "cap1", transport="tensors")
        assert e.value.code == "too_many_names"


def test_a_retired_name_stops_counting_while_it_drains(make_fake_server, make_adapter):
    """AdapterService.retire_name: 'the name no longer counts against LORA_SYNC_MAX_NAMES',
    also while a request still runs on one of its versions."""
    server = make_fake_server(max_names=2)
    adapter = make_adapter(seed=682)
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(adapter, "n1", transport="tensors")
        c.push(adapter, "n2", transport="tensors")
        request = Background("POST", f"{server.url}/v1/completions",
                             {"model": "n1", "prompt": PROMPT, "fake_delay_s": 1.0})
        wait_until(lambda: inflight(c, "n1-v1") == 1, what="the request admitted")
        c.retire("n1")
        try:
            assert c.push(adapter, "n3", transport="tensors")[0].version == 1
        finally:
            assert request.join()["status"] == 200


# -- bodies ---------------------------------------------------------------------------------
BAD_BODY_CODES = {
    "not safetensors": (400, "bad_safetensors"), "empty body": (400, "empty_body"),
    "truncated": (400, "bad_safetensors"), "header claims more bytes": (400, "bad_safetensors"),
    "missing lora_name": (400, "bad_name"), "missing adapter_config": (400, "missing_metadata"),
    "adapter_config not JSON": (400, "bad_config"), "adapter_config without r": (400, "bad_config"),
    "rank above max": (400, "rank_too_large"), "unknown module": (400, "unknown_module"),
    "shape does not fit": (400, "bad_shape"), "missing B half": (400, "missing_tensor"),
    "int tensors": (400, "bad_dtype"), "pickle payload": (400, "bad_safetensors"),
    "float64 tensors": (400, "bad_dtype"), "NaN values": (400, "non_finite"),
    "Inf values": (400, "non_finite"), "extra unknown tensor": (400, "unknown_tensor"),
    "lm_head LoRA": (400, "unsupported_module"), "modules_to_save": (400, "unsupported_module"),
    "regex target_modules": (400, "bad_config"), "unknown target module": (400, "unknown_module"),
    "pickle as JSON route": (415, "bad_content_type"),
    "upstream SGLang pickle payload": (415, "bad_content_type"),
    "ForkingPickler payload": (415, "bad_content_type"),
    "ForkingPickler raw body": (400, "bad_safetensors"),
    "duplicate tensor names": (400, "bad_safetensors"), "bad name": (400, "bad_name"),
    "name with version suffix": (400, "bad_name"),
}


def test_bad_inputs_are_refused_and_previous_version_keeps_serving(fake_server, fake_client,
                                                                   make_adapter):
    """test_tensors.py::test_bad_inputs_are_refused_and_previous_version_keeps_serving, each
    case's status and code pinned; every error reply is our JSON error shape."""
    c = fake_client
    good = make_adapter(seed=31)
    c.push(good, "bad", transport="tensors")
    before = greedy(c, "bad")
    held = fake_server.bridge.held_ids()
    max_rank = c.info()[0]["max_lora_rank"]
    seen = {}
    for case, body, ctype in bad_bodies(make_adapter(seed=32), max_rank):
        status, reply = post_body(route(c, TENSORS), body, ctype or "application/octet-stream")
        seen[case] = (status, error_of(reply)[1])
        assert reply["error"]["message"] and reply["error"]["status"] == status, case
        assert greedy(c, "bad") == before, case
    assert seen == BAD_BODY_CODES
    assert versions_of(c, "bad") == [1]
    assert fake_server.bridge.held_ids() == held, "a refused body left something on a worker"


@pytest.mark.parametrize("case,config,code", [
    ("alpha NaN", '{"r": 8, "lora_alpha": NaN, "target_modules": "all-linear"}', "bad_config"),
    ("alpha Infinity", '{"r": 8, "lora_alpha": Infinity, "target_modules": "all-linear"}',
     "bad_config"),
    ("alpha 1e38", '{"r": 8, "lora_alpha": 1e38, "target_modules": "all-linear"}', "bad_config"),
    ("alpha string", '{"r": 8, "lora_alpha": "16", "target_modules": "all-linear"}',
     "bad_config"),
    ("r 8.5", '{"r": 8.5, "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r string", '{"r": "8", "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r 1e400", '{"r": 1e400, "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r true", '{"r": true, "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r 0", '{"r": 0, "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r 65", '{"r": 65, "lora_alpha": 16, "target_modules": "all-linear"}', "rank_too_large"),
    ("dropout NaN", '{"r": 8, "lora_alpha": 16, "lora_dropout": NaN, '
                    '"target_modules": "all-linear"}', "bad_config"),
    ("bias all", '{"r": 8, "lora_alpha": 16, "bias": "all", "target_modules": "all-linear"}',
     "unsupported_module"),
    ("rank_pattern", '{"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}, '
                     '"target_modules": "all-linear"}', "unsupported_module"),
    ("use_dora", '{"r": 8, "lora_alpha": 16, "use_dora": true, "target_modules": "all-linear"}',
     "unsupported_module"),
    ("deep config", '{"r": 8, "lora_alpha": 16, "x": ' + "[" * 5000 + "]" * 5000 + "}",
     "bad_config"),
])
def test_config_poisoning_is_refused(fake_client, make_adapter, case, config, code):
    """test_attacks.py::test_config_poisoning_is_refused."""
    c = fake_client
    c.push(make_adapter(seed=621), "tenant", transport="tensors")
    before = greedy(c, "tenant")
    body = body_of(make_adapter(seed=622), name="poison", config=config)
    status, reply = post_body(route(c, TENSORS), body)
    assert (status, error_of(reply)[1]) == (400, code), (case, reply)
    assert greedy(c, "tenant") == before and greedy(c, "base") == BASE_TEXT
    assert listing(c, "poison") is None


def test_tensors_must_match_r_and_name_each_module_once(fake_client, make_adapter):
    """test_attacks.py::test_tensors_must_match_r_and_name_each_module_once."""
    c = fake_client
    c.push(make_adapter(seed=631), "shape", transport="tensors")
    before = greedy(c, "shape")
    adapter = make_adapter(seed=632)
    t = adapter.tensors
    cases = [("rank-0 tensors with r=8", {k: (v[:0] if "lora_A" in k else v[:, :0])
                                          for k, v in t.items()}, "bad_shape"),
             ("rank-4 tensors with r=8", {k: (v[:4] if "lora_A" in k else v[:, :4])
                                          for k, v in t.items()}, "bad_shape"),
             ("every module twice", {**t, **{k.replace("base_model.model.", ""): v + 1
                                            for k, v in t.items()}}, "duplicate_module")]
    for case, tensors, code in cases:
        status, reply = post_body(route(c, TENSORS), body_of(adapter, name="shape",
                                                             tensors=tensors))
        assert (status, error_of(reply)[1]) == (400, code), (case, reply)
        assert greedy(c, "shape") == before, case
    assert versions_of(c, "shape") == [1]


def test_body_limits(fake_client):
    """test_tensors.py::test_body_above_limit_is_refused and
    test_1gb_body_refused_before_it_is_read (4 MB limit)."""
    status, reply = post_body(route(fake_client, TENSORS), b"\0" * (MAX_BODY + 2 ** 20))
    assert (status, error_of(reply)[1]) == (413, "payload_too_large")
    assert "limit" in reply["error"]["message"]
    from urllib.parse import urlsplit
    u = urlsplit(route(fake_client, TENSORS))
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall((f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}\r\n"
                      f"Authorization: {AUTH['Authorization']}\r\n"
                      "Content-Type: application/octet-stream\r\n"
                      f"Content-Length: {2 ** 30}\r\n\r\n").encode() + b"\0" * 65536)
        head = sock.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head[:200]


@pytest.mark.parametrize("ctype", ["application/json", "application/x-python-pickle",
                                   "text/plain", ""])
def test_wrong_content_type_names_safe_format(fake_client, make_adapter, ctype):
    """test_tensors.py::test_wrong_content_type_names_safe_format: 415 naming safetensors,
    even for a well-formed safetensors body."""
    status, reply = post_body(route(fake_client, TENSORS), body_of(make_adapter(seed=99)),
                              ctype)
    assert (status, error_of(reply)[1]) == (415, "bad_content_type"), reply
    assert "safetensors" in reply["error"]["message"]


def test_header_bomb_is_refused_cheaply(fake_client):
    """test_attacks.py::test_header_bomb_is_refused_cheaply."""
    huge = (9 * 2 ** 20).to_bytes(8, "little") + b"{" * 64
    status, reply = post_body(route(fake_client, TENSORS), huge)
    assert status == 400 and "header length" in reply["error"]["message"], reply
    lists = b'{"a":[' + b"[]," * 1_200_000 + b"[]]}"
    lists += b" " * (-len(lists) % 8)
    status, reply = post_body(route(fake_client, TENSORS), len(lists).to_bytes(8, "little") + lists)
    assert status == 400, reply


# -- access --------------------------------------------------------------------------------
def test_admin_routes_need_the_api_key(fake_server, fake_client, make_adapter):
    """test_hostile.py::test_admin_routes_need_the_api_key, on every admin route and on
    the engine's own adapter routes."""
    c = fake_client
    c.push(make_adapter(seed=111), "guarded", transport="tensors")
    before = greedy(c, "guarded")
    for key in (None, "wrong-key", f"{fake_server.api_key}x"):
        with LoRASyncClient(fake_server.url, api_key=key, timeout=30) as intruder:
            for call in (lambda: intruder.push(make_adapter(seed=112), "guarded",
                                               transport="tensors"),
                         lambda: intruder.push(make_adapter(seed=112), "guarded",
                                               transport="shm"),
                         lambda: intruder.init_group(timeout_s=5),
                         lambda: intruder.retire("guarded"),
                         lambda: intruder.adapters(),
                         lambda: intruder.info(),
                         lambda: intruder.load_from_disk("/tmp", "sneaky")):
                with pytest.raises(Unauthorized) as e:
                    call()
                assert e.value.status == 401
            # Generation is the engine's business (no engine key here): it still works.
            assert intruder.complete(PROMPT, "guarded", 4)["text"] == before
    assert greedy(c, "guarded") == before and versions_of(c, "guarded") == [1]
    assert "sneaky" not in fake_server.bridge.disk


def test_key_schemes_like_vllm(make_fake_server, make_adapter):
    """test_attacks.py::test_key_schemes_on_vllm (the fake engine guards /v1 with its own
    key as vLLM's --api-key does): with only the engine's key G the admin routes are closed;
    with G and LORA_SYNC_API_KEY K, K pushes and generates, G only generates."""
    gen, admin = "generation-key", "admin-key"
    adapter = make_adapter(seed=691)
    closed = make_fake_server(engine_keys=(gen,), api_key=None)
    with LoRASyncClient(closed.url, api_key=gen) as c:
        assert c.complete(PROMPT, "base", 2)["text"] == BASE_TEXT
        for call in (lambda: c.push(adapter, "keys", transport="tensors"),
                     lambda: c.init_group(timeout_s=5)):
            with pytest.raises(LoRASyncError) as e:
                call()
            assert (e.value.status, e.value.code) == (403, "admin_closed")
            assert "LORA_SYNC_API_KEY" in e.value.message
    both = make_fake_server(engine_keys=(gen,), api_key=admin)
    with LoRASyncClient(both.url, api_key=admin) as c:
        assert c.push(adapter, "keys", transport="tensors")[0].version == 1
        served = c.complete(PROMPT, "keys", 4)
    with LoRASyncClient(both.url, api_key=gen) as g:
        assert g.complete(PROMPT, "keys", 4)["text"] == served["text"] == served_text(adapter)
        with pytest.raises(Unauthorized):
            g.push(adapter, "keys", transport="tensors")
    with LoRASyncClient(both.url) as anonymous:
        with pytest.raises(Unauthorized):
            anonymous.complete(PROMPT, "keys", 4)


def test_native_adapter_routes_never_touch_our_names(fake_server, fake_client, make_adapter):
    """test_attacks.py::test_native_adapter_routes_never_touch_our_names (vLLM's routes)."""
    c = fake_client
    c.push(make_adapter(seed=611), "nat", transport="tensors")
    before = greedy(c, "nat")
    native = [("POST", "/v1/load_lora_adapter", {"lora_name": "{v}", "lora_path": "/etc"}),
              ("POST", "/v1/unload_lora_adapter", {"lora_name": "{v}"}),
              ("POST", "/adapters", {"name": "{v}", "src": "/etc"}),
              ("DELETE", "/adapters/{v}", None)]
    for method, path, body in native:
        for target in ("nat-v1", "nat", "nat-v2", "NAT", "other-v9"):
            url = fake_server.url + path.replace("{v}", target)
            payload = json.loads(json.dumps(body).replace("{v}", target)) if body else None
            status, reply, _ = http.request(method, url, json_body=payload)  # no key
            assert status == 401, (method, path, target, status, reply)
            status, reply, _ = http.request(method, url, json_body=payload, headers=AUTH)
            assert (status, error_of(reply)[1]) == (403, "reserved_name"), \
                (method, path, target, status, reply)
    assert versions_of(c, "nat") == [1] and greedy(c, "nat") == before
    assert not fake_server.bridge.disk
    assert c.push(make_adapter(seed=612), "nat", transport="tensors")[0].version == 2


_EXAMPLES = itertools.count()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["load", "unload", "unload-raw", "push"]),
                              st.sampled_from(["d1", "d2", "evx", "evx-v1", "EVX", 7, None,
                                               ["d1"], "x" * 300])),
                    min_size=1, max_size=12))
@example(ops=[("load", "d1"), ("push", None), ("load", "d2"), ("unload-raw", "d2"),
              ("unload", "d1"), ("unload", "evx-v1"), ("unload", "d1")])
def test_native_unloads_evict_only_what_they_unloaded(fake_server, fake_client, make_adapter,
                                                      workdir, ops):
    """Random loads, unloads (any name, any type, keyed or not) and pushes through the
    engine's own routes: an eviction happens only for a disk adapter an unload took away,
    never for one of our versions or a name still loaded; ours keep serving throughout."""
    c, bridge = fake_client, fake_server.bridge
    make_adapter(seed=530).save(workdir / "disk-530")
    loaded, unloaded, evicted_before = {}, set(), set(bridge.evicted)
    example = next(_EXAMPLES)  # disk names of their own: the server outlives each example
    for op, name in ops:
        if isinstance(name, str) and not name.casefold().startswith("evx"):
            name = f"{name}-{example}"
        if op == "push":
            c.push(make_adapter(seed=531), "evx", transport="tensors")
        elif op == "load" and isinstance(name, str):
            status, _, _ = http.request("POST", f"{fake_server.url}/v1/load_lora_adapter",
                                        json_body={"lora_name": name,
                                                   "lora_path": str(workdir / "disk-530")},
                                        headers=AUTH)
            if status == 200:
                loaded[name] = bridge.disk[name][0]
        else:
            headers = AUTH if op == "unload" else {}
            status, _, _ = http.request("POST", f"{fake_server.url}/v1/unload_lora_adapter",
                                        json_body={"lora_name": name}, headers=headers)
            assert status < 500, (op, name, status)
            if status == 200:
                unloaded.add(loaded.pop(name))
    ours = adapter_ids(c, "evx")
    wait_until(lambda: unloaded <= set(bridge.evicted), what="every unloaded copy evicted")
    evicted = set(bridge.evicted) - evicted_before
    assert evicted == unloaded and not evicted & (ours | set(loaded.values()))
    if ours:
        assert greedy(c, "evx") == served_text(make_adapter(seed=531))
    for name in loaded:
        http.request("POST", f"{fake_server.url}/v1/unload_lora_adapter",
                     json_body={"lora_name": name}, headers=AUTH)


# -- admission -----------------------------------------------------------------------------
def test_admission_refuses_what_it_cannot_check(fake_server):
    """test_attacks.py::test_internal_lora_id_is_refused,
    test_bodies_admission_cannot_read_are_refused and test_deep_and_duplicate_json_is_a_400."""
    url = fake_server.url
    for path, body in (("/generate", {"text": PROMPT, "lora_id": "lora-sync-999999"}),
                       ("/v1/completions", {"model": "base", "prompt": PROMPT,
                                            "lora_id": "lora-sync-1"}),
                       ("/vertex_generate", {"instances": [{"text": PROMPT}],
                                             "parameters": {"lora_id": "lora-sync-1"}})):
        status, reply, _ = http.request("POST", url + path, json_body=body)
        assert status == 400 and "lora_id" in reply["error"]["message"], (path, reply)
    for header in ({"X-Body-Compressed": "zstd"}, {"Content-Encoding": "gzip"}):
        status, reply = post_body(f"{url}/v1/completions", b"\x28\xb5\x2f\xfd",
                                  "application/json", headers=header)
        assert status == 400 and "uncompressed" in reply["error"]["message"], (header, reply)
    deep = b'{"model": "base", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    dup = b'{"model": "base", "model": "x", "prompt": "a"}'
    for body in (deep, dup, b'{"model": "base", "prompt": '):
        status, reply = post_body(f"{url}/v1/completions", body, "application/json")
        assert (status, error_of(reply)[1]) == (400, "bad_request"), reply


def test_the_sagemaker_header_is_admitted_like_model(fake_server, fake_client, make_adapter):
    """Admission reads every place a name can be: with the SageMaker adapter header naming
    the alias, the request is rewritten to the newest version and counted (the fake engine
    reads `model`, so only the reply headers show it here)."""
    c = fake_client
    c.push(make_adapter(seed=121), "sage", transport="tensors")
    c.push(make_adapter(seed=122), "sage", transport="tensors")
    status, _, headers = complete_raw(
        fake_server, "base", headers={"X-Amzn-SageMaker-Adapter-Identifier": "sage"})
    assert status == 200 and headers["x-lora-name"] == "sage-v2", headers
    c.retire("sage")
    status, reply, _ = complete_raw(
        fake_server, "base", headers={"X-Amzn-SageMaker-Adapter-Identifier": "sage-v1"})
    assert (status, error_of(reply)[1]) == (404, "version_retired"), reply


# -- integrity -----------------------------------------------------------------------------
def test_checksum_is_verified(fake_client, make_adapter):
    """test_hostile.py::test_checksum_is_verified."""
    c = fake_client
    adapter = make_adapter(seed=121)
    assert c.push(adapter, "sum", checksum=True, transport="tensors")[0].version == 1
    assert c.push(adapter, "sum", transport="shm", checksum=True)[0].version == 2
    before = greedy(c, "sum")
    other = make_adapter(seed=122)
    meta = other.metadata("sum")
    meta["checksum"] = adapter.checksum()  # digest of different weights
    status, reply = post_body(route(c, TENSORS), wire.encode_bytes(other.tensors, meta))
    assert (status, error_of(reply)[1]) == (400, "checksum_mismatch"), reply
    assert greedy(c, "sum") == before and versions_of(c, "sum") == [1, 2]


@pytest.mark.parametrize("transport", ["tensors", "shm", "broadcast"])
def test_non_finite_weights_are_refused_on_every_transport(fake_server, fake_client,
                                                          make_adapter, transport):
    """NaN/Inf weights (LORA_SYNC_CHECK_FINITE=1 on the test servers) are refused by the
    workers whatever carried them; the previous version keeps serving, nothing is held."""
    c = fake_client
    name = f"finite-{transport}"
    if transport == "broadcast":
        c.init_group(timeout_s=20)
    c.push(make_adapter(seed=131), name, transport=transport)
    before = greedy(c, name)
    held = fake_server.bridge.held_ids()
    bad = make_adapter(seed=132)
    key = next(k for k in bad.tensors if "lora_B" in k)
    bad.tensors[key][0, 0] = float("nan")
    with pytest.raises(LoRASyncError) as e:
        c.push(bad, name, transport=transport)
    assert (e.value.status, e.value.code) == (400, "non_finite"), e.value
    assert greedy(c, name) == before and versions_of(c, name) == [1]
    wait_until(lambda: fake_server.bridge.held_ids() == held, what="the refused copy freed")


def test_engine_refusals_and_worker_bugs_change_nothing(fake_server, fake_client, make_adapter):
    """The engine's own refusal at build is a 400 engine_refused; a worker bug a 500
    worker_failed. Either way the previous version serves, no version number is used up and
    no worker keeps a copy."""
    c = fake_client
    c.push(make_adapter(seed=141), "refused", transport="tensors")
    before = greedy(c, "refused")
    held = fake_server.bridge.held_ids()
    engine = fake_server.bridge.workers[0].engine

    def bug(adapter_id, stored):
        raise RuntimeError("a bug in the engine")
    for refuse, status, code in ((lambda i, s: "LoRA rank not supported", 400, "engine_refused"),
                                 (bug, 500, "worker_failed")):
        engine.refuse = refuse
        try:
            for transport in ("tensors", "shm"):
                with pytest.raises(LoRASyncError) as e:
                    c.push(make_adapter(seed=142), "refused", transport=transport)
                assert (e.value.status, e.value.code) == (status, code), e.value
        finally:
            engine.refuse = None
        assert greedy(c, "refused") == before and versions_of(c, "refused") == [1]
        assert fake_server.bridge.held_ids() == held
    assert c.push(make_adapter(seed=142), "refused", transport="tensors")[0].version == 2


def test_concurrent_pushes_of_one_name_are_serialised(fake_client, make_adapter):
    """test_hostile.py::test_concurrent_pushes_of_one_name_are_serialised."""
    c = fake_client
    adapters = [make_adapter(seed=130 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda a: c.push(a, "race", transport="tensors")[0], adapters))
    assert sorted(r.version for r in results) == [1, 2, 3, 4, 5, 6]
    newest = max(results, key=lambda r: r.version)
    assert greedy(c, "race") == greedy(c, newest.name)
    assert greedy(c, newest.name) == served_text(adapters[results.index(newest)])

    def explicit(a):
        try:
            return c.push(a, "race", version=10, transport="tensors")[0].version
        except VersionConflict:
            return "conflict"
    with ThreadPoolExecutor(2) as pool:
        outcomes = sorted(map(str, pool.map(explicit, adapters[:2])))
    assert outcomes == ["10", "conflict"]


def test_concurrent_pushes_from_independent_clients(fake_server, make_adapter):
    """Two clients (no shared memory of versions) push one name at once: the one that
    loses the race numbers above the winner once, so both land, and the alias ends on the
    newest."""
    adapters = [make_adapter(seed=150 + i) for i in range(2)]

    def push(a):
        with LoRASyncClient(fake_server.url, api_key=fake_server.api_key) as own:
            return own.push(a, "many", transport="tensors")[0].version
    with ThreadPoolExecutor(2) as pool:
        versions = list(pool.map(push, adapters))
    assert sorted(versions) == [1, 2], versions
    with LoRASyncClient(fake_server.url, api_key=fake_server.api_key) as c:
        newest = max(versions)
        assert greedy(c, "many") == served_text(adapters[versions.index(newest)])


def _mutated(body: bytes, cuts, flips, meta_junk):
    b = bytearray(body)
    for pos, val in flips:
        b[pos % len(b)] = val
    if cuts:
        b = b[: cuts % (len(b) + 1)]
    if meta_junk is not None:
        b = bytearray(wire.encode_bytes({}, meta_junk)) + b[8:]
    return bytes(b)


def test_fuzzed_bodies_never_5xx(fake_server, fake_client, make_adapter):
    """test_hostile.py::test_fuzzed_bodies_never_5xx, with more examples: a mutated body is
    a 4xx (or, rarely, a valid push), never a 5xx, and the server keeps serving."""
    base = make_adapter(seed=141)
    body = wire.encode_bytes(base.tensors, base.metadata("fuzz"))
    url = route(fake_client, TENSORS)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)
    @given(cuts=st.one_of(st.none(), st.integers(0, 10 ** 6)),
           flips=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), max_size=6),
           meta_junk=st.one_of(st.none(), st.dictionaries(st.sampled_from(
               ["lora_name", "adapter_config", "version", "checksum", "x"]),
               st.text(max_size=30), max_size=4)))
    def run(cuts, flips, meta_junk):
        status, reply = post_body(url, _mutated(body, cuts, flips, meta_junk))
        assert status < 500, reply
        if status >= 400:
            assert error_of(reply)[0] == status and reply["error"]["message"], reply
    run()
    assert fake_server.alive()


# -- error replies ---------------------------------------------------------------------------
def test_error_replies_are_always_our_json(fake_server):
    """Every refusal by a lora-sync route or admission is JSON {"error": {code, message,
    status}} with the status it is sent with; our routes also name the instance."""
    url = fake_server.url
    v1 = f"{url}/v1"
    cases = [
        ("POST", f"{v1}/{TENSORS}", dict(chunks=[b"x"], headers={"Content-Type": "text/plain"})),
        ("POST", f"{v1}/{TENSORS}", dict(chunks=[b"x"], headers={**AUTH, "Content-Type":
                                                                 "application/octet-stream"})),
        ("POST", f"{v1}/retire_lora_adapter", dict(json_body={"lora_name": "nope"},
                                                   headers=AUTH)),
        ("POST", f"{v1}/retire_lora_adapter", dict(json_body=[1, 2], headers=AUTH)),
        ("POST", f"{v1}/{shm.LEASE_ROUTE}", dict(json_body={"nbytes": -1}, headers=AUTH)),
        ("POST", f"{v1}/{shm.COMMIT_ROUTE}", dict(json_body={"lease_id": "0" * 32,
                                                             "token": "ab"}, headers=AUTH)),
        ("POST", f"{v1}/{DISTRIBUTED}", dict(json_body={}, headers=AUTH)),
        ("GET", f"{v1}/lora_adapters", dict()),
        ("POST", f"{v1}/completions", dict(json_body={"model": "x", "lora_id": 1})),
    ]
    for method, u, kw in cases:
        status, reply, headers = http.request(method, u, **kw)
        assert 400 <= status < 500, (u, status, reply)
        err = reply.get("error")
        assert isinstance(err, dict) and set(err) >= {"code", "message", "status"}, reply
        assert err["status"] == status and isinstance(err["code"], str), reply
        assert headers.get("content-type", "").startswith("application/json"), headers
        if not u.endswith("/completions"):
            assert reply["instance_id"] == headers["x-lora-sync-instance"], headers


# -- shm leases ------------------------------------------------------------------------------
def test_committed_bytes_cannot_change(fake_client, make_adapter):
    """test_shm.py::test_committed_bytes_cannot_change."""
    c = fake_client
    c.push(make_adapter(seed=811), "seal", transport="shm")
    before = greedy(c, "seal")
    parts = parts_of(make_adapter(seed=812), "seal")
    granted = lease(c, shm.total_bytes(parts))
    assert fill(granted, parts)
    fd = os.open(granted.path, os.O_RDWR)
    held = mmap.mmap(fd, granted.nbytes)  # still mapped writable at commit time
    status, reply = commit(c, granted)
    assert (status, error_of(reply)[1]) == (409, "lease_mapped"), reply
    held.close()
    os.close(fd)
    assert versions_of(c, "seal") == [1] and greedy(c, "seal") == before

    granted = lease(c, shm.total_bytes(parts))
    assert fill(granted, parts)
    fd = os.open(granted.path, os.O_RDWR)  # kept open across the commit
    try:
        status, reply = commit(c, granted)
        assert status == 200, reply
        after = greedy(c, "seal")
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 4096, 4096)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, granted.nbytes)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 8)
    finally:
        os.close(fd)
    assert greedy(c, "seal") == after == served_text(make_adapter(seed=812)) != before


def test_a_commit_waits_for_the_trainers_unmap_then_seals_what_is_there(fake_client,
                                                                        make_adapter):
    """The trainer commits while its unmap still runs (shm.write_then_unmap): the server's
    seal waits for the writable mapping to go (at most SEAL_WAIT_S; held longer: 409, see
    above) and serves the bytes as they are then, sealed from there on."""
    c = fake_client
    parts = parts_of(make_adapter(seed=813), "unmap")
    granted = lease(c, shm.total_bytes(parts))
    fd = os.open(granted.path, os.O_RDWR)
    held = mmap.mmap(fd, granted.nbytes)
    os.close(fd)
    gate = threading.Event()  # the unmap waits behind it, on the client's unmap thread
    blocker = shm._UNMAPPER.submit(gate.wait, 30)
    threading.Timer(0.3, gate.set).start()
    try:
        unmapping = shm.write_then_unmap(held, parts)
        mapped_at_commit = not unmapping.done()
        status, reply = commit(c, granted)  # the old code: 409 lease_mapped at once
    finally:
        gate.set()
        blocker.result()
    unmapping.result()
    assert mapped_at_commit and status == 200, reply
    assert greedy(c, "unmap") == served_text(make_adapter(seed=813))
    fd = os.open(granted.path, os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, granted.nbytes)
    finally:
        os.close(fd)


class _TrainerDied(Exception):
    pass


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(copied=st.integers(0, 200), seed=st.integers(0, 2 ** 16))
def test_a_commit_ahead_of_its_copy_serves_only_a_whole_file(fake_client, make_adapter,
                                                             copied, seed):
    """A push into a ready lease commits first and copies while the server waits for its
    seal (ShmTransport._commit). Whenever the copy stops (`copied` tensors in: it failed, or
    the trainer died and its mapping went with it) the server seals a lease whose header
    length was never stored (the last store) and refuses it: the push fails with the copy's
    own error, the previous version keeps serving and the next push lands."""
    c = fake_client
    c.push(make_adapter(seed=seed), "ahead", transport="shm")  # readies the next lease
    ready_ticket(c)  # granted once what that push retired is freed
    before, held = greedy(c, "ahead"), versions_of(c, "ahead")
    new = make_adapter(seed=seed + 1)
    stores, refusals = [0], []
    real_memmove, real_post = shm._memmove, shm._post

    def dies_midway(copies):
        for copy in copies:
            if stores[0] >= copied:
                raise _TrainerDied(f"stopped after {copied} tensors")
            real_memmove([copy])
            stores[0] += 1

    def post(server, route, ctx, body, on_sent=None):
        try:
            return real_post(server, route, ctx, body, on_sent)
        except LoRASyncError as e:
            refusals.append((route, on_sent is not None, e.code))
            raise
    whole = copied >= len(new.tensors)
    with mock.patch.object(shm, "_memmove", dies_midway), mock.patch.object(shm, "_post", post):
        if whole:
            c.push(new, "ahead", transport="shm")
        else:
            with pytest.raises(_TrainerDied):
                c.push(new, "ahead", transport="shm")
    if whole:
        assert greedy(c, "ahead") == served_text(new) and not refusals
        return
    assert refusals == [(shm.COMMIT_ROUTE, True, "bad_safetensors")]
    assert versions_of(c, "ahead") == held and greedy(c, "ahead") == before
    c.push(new, "ahead", transport="shm")
    assert greedy(c, "ahead") == served_text(new)


def test_abused_leases_are_refused_and_change_nothing(fake_client, make_adapter):
    """test_shm.py::test_abused_leases_are_refused_and_change_nothing."""
    c = fake_client
    c.push(make_adapter(seed=821), "abuse", transport="shm")
    before = greedy(c, "abuse")
    parts = parts_of(make_adapter(seed=822), "abuse")
    size = shm.total_bytes(parts)

    granted = lease(c, size)
    assert fill(granted, parts)
    status, reply = commit(c, {"lease_id": granted.lease_id, "token": "0" * 64})
    assert (status, error_of(reply)[1]) == (403, "bad_token"), reply
    for bad_id in ("../../etc/passwd", "/proc/1/fd/0", "0" * 31 + "g", granted.path):
        status, reply = commit(c, {"lease_id": bad_id, "token": granted.token})
        assert status == 400, (bad_id, reply)
    assert commit(c, granted)[0] == 200          # the real one still commits, once
    status, reply = commit(c, granted)            # reused token
    assert (status, error_of(reply)[1]) == (404, "unknown_lease"), reply
    assert versions_of(c, "abuse") == [1, 2]
    after = greedy(c, "abuse")

    wrong = lease(c, size + 4096)                 # a lease of the wrong size
    assert fill(wrong, parts)
    status, reply = commit(c, wrong)
    assert (status, error_of(reply)[1]) == (400, "bad_safetensors"), reply
    short = lease(c, size - 4096)                 # the header promises more bytes
    assert fill(short, parts[:1])
    status, reply = commit(c, short)
    assert status == 400, reply
    for nbytes in (0, -1, 2 ** 62, "10", 1.5, MAX_BODY + 1):
        status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE),
                                        json_body={"nbytes": nbytes}, headers=AUTH)
        assert 400 <= status < 500, (nbytes, status, reply)
    status, _, _ = http.request("POST", route(c, shm.LEASE_ROUTE), json_body={"nbytes": 4096})
    assert status == 401
    keyless = lease(c, size)
    for r in (shm.COMMIT_ROUTE, shm.CANCEL_ROUTE, shm.RENEW_ROUTE):  # a token alone: nothing
        status, _, _ = http.request("POST", route(c, r), json_body={
            "lease_id": keyless.lease_id, "token": keyless.token})
        assert status == 401, r
    assert http.call("POST", route(c, shm.CANCEL_ROUTE), headers=AUTH,
                     json_body={"lease_id": keyless.lease_id, "token": keyless.token})[0]
    for bad in ({"lease_id": 7, "token": "x"}, {"lease_id": "0" * 32}, {"token": ["x"]}):
        status, _, _ = http.request("POST", route(c, shm.COMMIT_ROUTE), json_body=bad,
                                    headers=AUTH)
        assert status == 400, bad
    assert versions_of(c, "abuse") == [1, 2] and greedy(c, "abuse") == after
    assert greedy(c, "abuse-v1") == before
    assert c.ready_leases.count() == open_leases(c)


def test_leases_never_committed_expire(make_fake_server):
    """test_shm.py::test_leases_never_committed_expire (a server of its own: 0.3 s TTL)."""
    server = make_fake_server(lease_ttl_s=0.3)
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        granted = lease(c, 1 << 20)
        assert open_leases(c) == 1
        wait_until(lambda: open_leases(c) == 0, timeout_s=5, what="the lease expired")
        status, reply = commit(c, granted)
        assert (status, error_of(reply)[1]) == (404, "unknown_lease"), reply
        assert not fill(granted, [b"late"])  # its descriptor is closed


def ready_ticket(client) -> dict:
    client.ready_leases.count()  # waits for the one being readied
    ready = client.ready_leases.ready_for(client.servers[0].url)
    assert ready is not None, "no lease was readied"
    return ready.lease.ticket()


def test_a_push_readies_the_next_lease_and_the_next_push_fills_it(make_fake_server,
                                                                  make_adapter):
    """After an shm push the client holds one lease ready for that name (granted, mapped);
    the next push of the name commits that one. Another name's push cancels it."""
    server = make_fake_server()
    small, large = make_adapter(seed=851), make_adapter(seed=852, rank=16)
    assert small.nbytes != large.nbytes
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(small, "ahead", transport="shm")
        first = ready_ticket(c)
        assert c.ready_leases.count() == open_leases(c) == 1
        c.push(make_adapter(seed=853), "ahead", transport="shm")
        assert greedy(c, "ahead") == served_text(make_adapter(seed=853))
        assert commit(c, first)[0] == 404  # committed by the push: it is gone
        second = ready_ticket(c)
        assert second != first and open_leases(c) == 1
        c.push(large, "other", transport="shm")  # another size: the ready one is cancelled
        assert commit(c, second)[0] == 404
        assert ready_ticket(c) not in (first, second) and open_leases(c) == 1
        assert status_of_renew(c, second) == 404
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        assert open_leases(c) == 0  # the closed client cancelled what it held


def ahead_grant(client) -> Background:
    """A lease asked for ahead (as the client readies one), on its own thread."""
    return Background("POST", route(client, shm.LEASE_ROUTE),
                      {"nbytes": 4096, "ahead": True, "client": "ahead-test"}, AUTH)


def cancel(client, granted) -> None:
    """Cancels a lease: a Lease, or a Background grant's reply."""
    if isinstance(granted, Background):
        granted = shm.Lease.from_json(granted.result["reply"])
    http.call("POST", route(client, shm.CANCEL_ROUTE), headers=AUTH, json_body=granted.ticket())


def test_a_lease_readied_ahead_takes_the_memory_retired_versions_give_back(
        fake_server, fake_client, make_adapter, monkeypatch):
    """A lease asked for ahead is granted once the versions being retired are freed (at the
    next pause in serving, not sooner); a push's own lease frees them first; the wait is
    bounded in time and in how many wait at once."""
    free_timing(monkeypatch, quiet_s=60.0, max_s=120.0)
    c = fake_client
    v1_id = retire_first(c, make_adapter, "recycle", seed=880)
    waiting = ahead_grant(c)
    time.sleep(0.3)
    assert not waiting.result and v1_id not in fake_server.bridge.freed
    cancel(c, lease(c, 4096))  # a push's own lease: v1 is freed first
    assert v1_id in fake_server.bridge.freed
    assert waiting.join(10)["status"] == 200
    cancel(c, waiting)
    monkeypatch.setattr(service_module, "FREES_WAIT_S", 0.5)
    monkeypatch.setattr(service_module, "FREES_WAITERS", 1)
    v2_id = retire_first(c, make_adapter, "recycle-b", seed=890)
    first = ahead_grant(c)
    wait_until(lambda: fake_server.service._waiting_for_frees == 1, what="one waiting")
    second = ahead_grant(c)
    assert second.join(10)["status"] == 200 and not first.result  # granted at once
    assert first.join(10)["status"] == 200  # at the time bound
    assert v2_id not in fake_server.bridge.freed
    for done in (first, second):
        cancel(c, done)
    for bad in ("yes", 1, [True]):
        status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE), headers=AUTH,
                                        json_body={"nbytes": 4096, "ahead": bad})
        assert (status, error_of(reply)[1]) == (400, "bad_request"), reply


def test_a_push_before_its_ready_lease_is_granted_leases_the_usual_way(
        make_fake_server, make_adapter, monkeypatch):
    """The lease readied after a push that retired a version waits for that version to be
    freed; the next push does not wait for it: it leases the usual way (freeing the
    retired version at once), and the late grant is cancelled, leaving no lease behind."""
    free_timing(monkeypatch, quiet_s=60.0, max_s=120.0)
    monkeypatch.setattr(service_module, "FREES_WAIT_S", 3.0)  # within the client's timeout
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(make_adapter(seed=900), "early", transport="shm")
        [v1_id] = adapter_ids(c, "early")
        for i in range(KEEP):  # the last push retires v1: the next lease waits for it
            c.push(make_adapter(seed=901 + i), "early", transport="shm")
        wait_until(lambda: server.service._waiting_for_frees == 1, what="the lease waits")
        [res] = c.push(make_adapter(seed=950), "early", transport="shm")
        assert "copy" not in res.reply["timings_ms"]  # not into a ready lease
        assert v1_id in server.bridge.freed
        assert greedy(c, "early") == served_text(make_adapter(seed=950))
        assert c.ready_leases.count() == open_leases(c) <= 1  # the late one was cancelled
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        assert open_leases(c) == 0


def test_a_ready_lease_held_for_the_frees_outlasts_a_short_client_timeout(
        make_fake_server, make_adapter, monkeypatch):
    """The server may hold a lease asked for ahead until the retired versions go: a client
    whose own calls time out sooner still waits for it (else the server would grant it to
    nobody, holding it until its time)."""
    free_timing(monkeypatch, quiet_s=1.0, max_s=5.0)
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key, timeout=2.0) as c:
        assert c.ready_leases.timeout < 1.0
        for i in range(KEEP):
            c.push(make_adapter(seed=960 + i), "patient", transport="tensors")
        c.push(make_adapter(seed=970), "patient", transport="shm")  # retires v1: 1 s to go
        assert c.ready_leases.count() == open_leases(c) == 1


def test_what_an_shm_push_keeps_for_a_resync_is_the_sealed_lease(make_fake_server,
                                                                 make_adapter):
    """After an shm push the client's resync copy views the sealed lease (no copy of its
    own): the bytes as pushed, whatever the trainer does next, and still there after the
    server that holds the lease is gone."""
    adapter = make_adapter(seed=871)
    pushed = {k: t.clone() for k, t in adapter.tensors.items()}
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(adapter, "kept", transport="shm")
        kept = c.memory.newest["kept"]
        assert kept.flat is None and kept.sealed is not None  # nothing copied on the client
        for t in adapter.tensors.values():
            t.add_(1.0)  # the optimizer step after the push
        server.stop()  # closes the server's descriptor of the lease
        [(_, lent)] = c.memory.newest_copies(lambda name, version: True)
        assert all(torch.equal(lent.adapter.tensors[k], pushed[k]) for k in pushed)
    other = make_fake_server()
    with LoRASyncClient(other.url, api_key=other.api_key) as c:
        c.push(lent.adapter, "kept", version=1, transport="tensors")
        assert greedy(c, "kept") == served_text(LoRAAdapter(pushed, adapter.config))


def status_of_renew(client, ticket: dict) -> int:
    return http.request("POST", route(client, shm.RENEW_ROUTE), json_body=ticket,
                        headers=AUTH)[0]


def test_a_ready_lease_is_renewed_and_one_that_lapsed_is_replaced(make_fake_server,
                                                                  make_adapter):
    """A ready lease outlives its time while the client renews it (a trainer step may be
    longer than the TTL); one that lapsed anyway makes the push take a fresh lease."""
    server = make_fake_server(lease_ttl_s=0.4)
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(make_adapter(seed=861), "renewed", transport="shm")
        ticket = ready_ticket(c)
        time.sleep(1.4)  # three times the TTL
        assert open_leases(c) == 1 and ready_ticket(c) == ticket
        c.push(make_adapter(seed=862), "renewed", transport="shm")
        assert commit(c, ticket)[0] == 404
        assert greedy(c, "renewed") == served_text(make_adapter(seed=862))

        c.ready_leases.count()
        c.ready_leases.ready_for(server.url).timer.cancel()  # its renewals stop
        wait_until(lambda: open_leases(c) == 0, timeout_s=5, what="the ready lease lapsed")
        [res] = c.push(make_adapter(seed=863), "renewed", transport="shm")
        assert res.version == 3 and greedy(c, "renewed") == served_text(make_adapter(seed=863))
    bad = {"lease_id": "0" * 32, "token": "ab" * 32}
    with LoRASyncClient(server.url, api_key=server.api_key, lease_ahead=False) as c:
        granted = lease(c, 4096)
        assert status_of_renew(c, {**granted.ticket(), "token": "0" * 64}) == 403
        assert status_of_renew(c, bad) == 404
        assert status_of_renew(c, {"lease_id": 5, "token": "x"}) == 400
        assert status_of_renew(c, granted.ticket()) == 200
        c.push(make_adapter(seed=864), "plain", transport="shm")
        assert c.ready_leases is None and open_leases(c) == 1  # only the one granted above


def test_lease_bounds_rest_on_no_client_declared_id(fake_client):
    """A client id is self-declared, so it bounds nothing: leases asked under ever new ids
    still stop at the server's total (8), and every id gets the same 429 there."""
    c = fake_client
    c.ready_leases.release()
    held = []
    try:
        for i in range(12):
            status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE), headers=AUTH,
                                            json_body={"nbytes": 4096, "client": f"id-{i}"})
            if status != 200:
                break
            held.append(shm.Lease.from_json(reply))
        assert len(held) == 8, f"{len(held)} leases: the total bound is 8, whatever the ids"
        assert (status, error_of(reply)[1]) == (429, "too_many_leases"), reply
        status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE), headers=AUTH,
                                        json_body={"nbytes": 4096, "client": "id-0"})
        assert status == 429, "an id that already holds one is refused alike"
    finally:
        for granted in held:
            cancel(c, granted)
    assert c.ready_leases.count() == open_leases(c)


def test_open_leases_and_uploads_share_one_staging_budget(fake_client, make_adapter):
    """test_shm.py::test_open_leases_and_uploads_share_one_staging_budget (6 MB)."""
    c = fake_client
    c.ready_leases.release()  # a lease readied by an earlier push holds budget too
    leases = [lease(c, 3 * 2 ** 20) for _ in range(2)]
    try:
        with pytest.raises(LoRASyncError) as refused:
            c.push(make_adapter(seed=841), "budget", transport="tensors")
        assert (refused.value.status, refused.value.code) == (429, "staging_full")
        status, reply, _ = http.request("POST", route(c, shm.LEASE_ROUTE), headers=AUTH,
                                        json_body={"nbytes": 2 ** 20})
        assert (status, error_of(reply)[1]) == (429, "staging_full"), reply
        # transport="auto" falls back to HTTP when a lease is refused for room: refused too.
        with pytest.raises(LoRASyncError):
            c.push(make_adapter(seed=841), "budget")
    finally:
        for granted in leases:
            cancel(c, granted)
    assert open_leases(c) == 0
    assert c.push(make_adapter(seed=841), "budget", transport="tensors")[0].version == 1


# -- broadcast groups ------------------------------------------------------------------------
BAD_GROUP_FIELDS = [
    (INIT_GROUP, {"timeout_s": "abc"}), (INIT_GROUP, {"timeout_s": 1e300}),
    (INIT_GROUP, {"master_port": 70000}), (INIT_GROUP, {"group_name": [1]}),
    (INIT_GROUP, {"world_size": 1e30}), (INIT_GROUP, {"world_size": True}),
    (INIT_GROUP, {"master_address": {"a": 1}}), (INIT_GROUP, {"backend": "mpi"}),
    (INIT_GROUP, {"rank_offset": 2, "world_size": 2}),
    (INIT_GROUP, {"streams": 0}), (INIT_GROUP, {"streams": 17}), (INIT_GROUP, {"streams": "4"}),
    (DISTRIBUTED, {"bucket_bytes": "abc"}), (DISTRIBUTED, {"tensors": "x"}),
    (DISTRIBUTED, {"tensors": [{"name": "a", "dtype": "F32", "shape": ["8"]}]}),
    (DISTRIBUTED, {"version": 1.5}), (DISTRIBUTED, {"checksum": 7}),
]


def test_group_fields_are_type_and_range_checked(fake_server, fake_client):
    """Every group field of the broadcast routes is typed and ranged before a worker is
    asked anything (the parsing is ours, the same on every engine)."""
    good = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
            "world_size": 2, "lora_name": "grp", "tensors": [], "adapter_config": {"r": 8}}
    joins = fake_server.bridge.calls.count("init_group")
    for r, bad in BAD_GROUP_FIELDS:
        status, reply, _ = http.request("POST", route(fake_client, r),
                                        json_body={**good, **bad}, headers=AUTH)
        assert 400 <= status < 500 and error_of(reply)[0] == status, (r, bad, status, reply)
    assert fake_server.bridge.calls.count("init_group") == joins, "a worker was asked to join"


def test_trainer_address_must_be_allowed(fake_server, fake_client):
    """test_attacks.py::test_trainer_address_must_be_allowed."""
    joins = fake_server.bridge.calls.count("init_group")
    for host in ("10.11.12.13", "192.0.2.1", "not-a-host.invalid"):
        status, reply, _ = http.request(
            "POST", route(fake_client, INIT_GROUP), headers=AUTH,
            json_body={"master_address": host, "master_port": 29500, "rank_offset": 1,
                       "world_size": 2, "timeout_s": 2})
        assert status in (400, 403), (host, status, reply)
        if status == 403:
            assert reply["error"]["code"] == "trainer_not_allowed"
            assert "LORA_SYNC_ALLOWED_TRAINERS" in reply["error"]["message"]
    assert fake_server.bridge.calls.count("init_group") == joins, "a worker dialled it"


def test_a_group_loads_only_for_its_owner(fake_server, fake_client, make_adapter):
    """test_integrity.py::test_a_group_loads_only_for_its_owner."""
    c = fake_client
    c.init_group(timeout_s=20)
    c.broadcast(make_adapter(seed=330), "owned")
    before = greedy(c, "owned")
    good = make_adapter(seed=331)
    try_to_take_a_group(route(c, DISTRIBUTED), route(c, "destroy_lora_update_group"), good)
    c.broadcast(good, "owned")  # the owner's group is untouched and still in step
    assert greedy(c, "owned-v1") == before and greedy(c, "owned") == served_text(good)
    assert listing(c, "stolen") is None


def test_bad_metadata_refused_before_any_collective(fake_client, make_adapter):
    """test_broadcast.py::test_bad_metadata_refused_before_any_collective (client side)."""
    c = fake_client
    c.init_group(timeout_s=20)
    c.broadcast(make_adapter(seed=81), "meta")
    before = greedy(c, "meta")
    with pytest.raises(BadAdapter, match="rank"):
        c.broadcast(make_adapter(seed=82, rank=128), "meta")  # the server's max rank is 64
    c.broadcast(make_adapter(seed=83), "meta")  # still in step
    assert greedy(c, "meta-v1") == before != greedy(c, "meta")


def test_what_a_broadcast_keeps_for_a_resync_is_its_packed_frames(make_fake_server,
                                                                   make_adapter, monkeypatch):
    """On CPU the frames a broadcast packs are the client's resync copy: no second copy
    (FleetMemory.snapshot never runs); each push packs into a buffer that is not the newest,
    so a copy already kept never changes; and a resync gives back the bytes as pushed."""
    monkeypatch.setattr(FleetMemory, "snapshot", lambda *a: pytest.fail("copied twice"))
    a, b = make_adapter(seed=881), make_adapter(seed=882)
    pushed = {k: t.clone() for k, t in a.tensors.items()}
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.init_group(bucket_bytes=64 * 1024, timeout_s=20)  # several buckets per push
        c.broadcast(a, "packed")
        first = c.memory.newest["packed"]
        for t in a.tensors.values():
            t.add_(1.0)  # the optimizer step after the push
        c.broadcast(b, "packed")
        second = c.memory.newest["packed"]
        assert second.flat.data_ptr() != first.flat.data_ptr()
        assert all(torch.equal(first.adapter.tensors[k], pushed[k]) for k in pushed)
        assert all(torch.equal(second.adapter.tensors[k], b.tensors[k]) for k in b.tensors)
        c.broadcast(a, "packed")  # the first push's buffer, a spare now, is packed again
        assert c.memory.newest["packed"].flat.data_ptr() == first.flat.data_ptr()
        server.stop()
        [(_, lent)] = c.memory.newest_copies(lambda name, version: True)
        assert all(torch.equal(lent.adapter.tensors[k], a.tensors[k]) for k in a.tensors)
    monkeypatch.undo()  # a tensors push copies alongside
    other = make_fake_server()
    with LoRASyncClient(other.url, api_key=other.api_key) as c:
        c.push(lent.adapter, "packed", version=3, transport="tensors")
        assert greedy(c, "packed") == served_text(a)


def test_the_resync_copy_waits_until_every_body_has_left(make_fake_server, make_adapter,
                                                         monkeypatch):
    """A tensors push to two servers and one that is down: the client copies the adapter
    for a resync only once both bodies have left (beside the sending, the copy took a core
    from it), a server that never takes its body does not hold the copy back, and the
    copy kept is the adapter as pushed."""
    events = []
    real_exchange, real_snapshot = http.exchange, FleetMemory.snapshot

    def exchange(*args, on_sent=None, **kw):
        def sent():
            events.append("sent")
            on_sent()
        return real_exchange(*args, on_sent=sent if on_sent else None, **kw)

    def snapshot(memory, *args):
        events.append("copy")
        return real_snapshot(memory, *args)
    monkeypatch.setattr(http, "exchange", exchange)
    monkeypatch.setattr(FleetMemory, "snapshot", snapshot)
    one, two = make_fake_server(), make_fake_server()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{unused.getsockname()[1]}"
    adapter = make_adapter(seed=901)
    with LoRASyncClient([one.url, down, two.url], api_key=one.api_key, timeout=20) as c:
        results = c.push(adapter, "late-copy", transport="tensors", on_error="skip")
        assert [r.ok for r in results] == [True, False, True]
        assert events == ["sent", "sent", "copy"]
        kept = c.memory.newest["late-copy"].adapter
        assert all(torch.equal(kept.tensors[k], adapter.tensors[k]) for k in adapter.tensors)
        assert greedy(c, "late-copy") == served_text(adapter)


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_copies_kept_across_mixed_transports_reuse_three_buffers(make_fake_server,
                                                                 make_adapter, seed):
    """Any sequence of tensors, shm and broadcast pushes of one name: what the client keeps
    is always the newest push, as pushed, and no buffer is ever dropped to take another:
    three at most (the newest and two spares) serve every layout in turn (a buffer dropped
    and allocated again costs fresh pages, several ms at rank 64 here)."""
    kinds = ["tensors", "shm", "broadcast"]
    rng = random.Random(seed)  # None: the benchmark's order, round after round
    order = kinds * 4 if seed is None else kinds + [rng.choice(kinds) for _ in range(9)]
    server = make_fake_server()
    seen: list = []  # every copy buffer the client held, kept alive so none is mistaken
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.init_group(bucket_bytes=64 * 1024, timeout_s=20)
        for i, transport in enumerate(order):
            adapter = make_adapter(seed=900 + i)
            c.push(adapter, "mixed", transport=transport)
            newest = c.memory.newest["mixed"]
            held = newest.lent().adapter.tensors
            assert all(torch.equal(held[k], adapter.tensors[k]) for k in adapter.tensors)
            buffers = [newest.flat, *c.memory._spares.get("mixed", [])]
            seen += [b for b in buffers if b is not None and all(b is not s for s in seen)]
            assert len(seen) <= 3, (i, transport, order)


def test_ten_versions_in_one_group_follow_the_weights(fake_client, make_adapter):
    """test_broadcast.py::test_ten_versions_in_one_group_follow_the_weights."""
    c = fake_client
    a, b = make_adapter(seed=61), make_adapter(seed=62)
    c.init_group(bucket_bytes=64 * 1024, timeout_s=20)  # several buckets per sync
    for v in range(1, 11):
        [res] = c.broadcast(a if v % 2 else b, "ten")
        assert res.version == v
        assert greedy(c, "ten") == greedy(c, f"ten-v{v}") == served_text(a if v % 2 else b)


def test_rendezvous_blackhole_does_not_block_and_times_out(fake_server, fake_client,
                                                           make_adapter):
    """test_attacks.py::test_rendezvous_blackhole_neither_blocks_generation_nor_outlives_its
    _timeout (a 1 s group timeout)."""
    c = fake_client
    port, close = blackhole()
    try:
        init = Background("POST", route(c, INIT_GROUP),
                          {"master_address": "127.0.0.1", "master_port": port,
                           "rank_offset": 1, "world_size": 2, "group_name": "hole",
                           "timeout_s": 1}, AUTH)
        time.sleep(0.2)
        assert c.complete(PROMPT, "base", 4)["text"] == BASE_TEXT  # the engine is not blocked
        result = init.join(30)
    finally:
        close()
    assert result["status"] == 502 and result["reply"]["error"]["code"] == "transfer_failed", \
        result
    wait_until(lambda: not c.info()[0]["worker_status"][0]["groups"], what="no group left")
    c.init_group(timeout_s=20)  # a real group works afterwards
    [res] = c.broadcast(make_adapter(seed=661), "after-hole")
    assert greedy(c, res.name) == served_text(make_adapter(seed=661))


def test_two_servers_one_group(fake_server, make_fake_server, make_adapter):
    """test_broadcast.py::test_two_servers_one_group: one group across two fake servers."""
    other = make_fake_server()
    adapter = make_adapter(seed=71)
    with LoRASyncClient([fake_server.url, other.url], api_key=fake_server.api_key) as c:
        group = c.init_group(timeout_s=20)
        assert group.world_size == 3  # trainer + one worker per server
        results = c.broadcast(adapter, "two")
        assert [r.name for r in results] == ["two-v1", "two-v1"]
        assert greedy(c, "two") == c.complete(PROMPT, "two", 4, server=1)["text"] \
            == served_text(adapter)
        c.destroy_group()
        c.retire("two")


def test_every_version_lands_on_every_worker(make_fake_server, make_adapter):
    """test_data_parallel.py::test_every_version_lands_on_every_replica (its logic): a
    server with two workers; every transport lands on both, a refusal on one worker fails
    the push for both with nothing held, and retire frees both."""
    server = make_fake_server(workers=2)
    bridge = server.bridge
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        info = c.info()[0]
        assert info["workers"] == 2
        assert sorted(w["rank"] for w in info["worker_status"]) == [0, 1]
        assert {w["world_size"] for w in info["worker_status"]} == {2}
        c.push(make_adapter(seed=711), "dp-t", transport="tensors")
        c.push(make_adapter(seed=712), "dp-s", transport="shm")
        group = c.init_group(timeout_s=20)
        assert group.world_size == 3
        c.push(make_adapter(seed=713), "dp-b", transport="broadcast")
        c.destroy_group()
        ids = set().union(*(adapter_ids(c, n) for n in ("dp-t", "dp-s", "dp-b")))
        assert len(ids) == 3 and bridge.held_ids() == [ids, ids]
        for name, seed in (("dp-t", 711), ("dp-s", 712), ("dp-b", 713)):
            assert greedy(c, name) == served_text(make_adapter(seed=seed))
        bridge.workers[1].engine.refuse = lambda i, s: "rank 1 says no"
        try:
            with pytest.raises(LoRASyncError) as e:
                c.push(make_adapter(seed=714), "dp-t", transport="tensors")
            assert e.value.code == "engine_refused"
        finally:
            bridge.workers[1].engine.refuse = None
        wait_until(lambda: bridge.held_ids() == [ids, ids], what="the refused copy freed")
        assert versions_of(c, "dp-t") == [1]
        for name in ("dp-t", "dp-s", "dp-b"):
            c.retire(name)
        wait_until(lambda: bridge.held_ids() == [set(), set()], what="both workers freed")


# -- the model-based fuzz test ---------------------------------------------------------------
FUZZ_STEPS = int(os.environ.get("LORA_SYNC_FAKE_FUZZ_STEPS", "40"))
FUZZ_EXAMPLES = int(os.environ.get("LORA_SYNC_FAKE_FUZZ_EXAMPLES", "20"))
SEEDS = (401, 402, 403)
WHICH = st.sampled_from([0, 1])  # which of the run's two names


def test_random_operation_sequences_keep_the_invariants(fake_server, make_adapter):
    """test_integrity.py::test_random_operation_sequences_keep_the_invariants, longer: random
    pushes (every transport, auto and explicit versions), retires and requests (alias,
    versions in and out of the window, retired names). After every step: the server lists
    exactly the versions the model says, each request is served by the version it names with
    that version's weights (or is a 404, version_retired for our names), and the fake engine
    saw nothing a real one would crash on. At the end the workers hold no version nobody
    lists. Each run has names of its own (runs do not see each other's retired names)."""
    client = LoRASyncClient(fake_server.url, api_key=fake_server.api_key)
    adapters = {s: make_adapter(seed=s) for s in SEEDS}
    expected = {s: served_text(adapters[s]) for s in SEEDS}
    bridge = fake_server.bridge
    runs = itertools.count()
    used: list[str] = []

    class Fuzz(RuleBasedStateMachine):
        @initialize()
        def start(self):
            run = next(runs)
            self.names = (f"fz{run}-a", f"fz{run}-b")
            used.extend(self.names)
            self.served = {}   # name -> {version: seed}, as the model says
            self.gone = {}     # name -> versions that left the window or were retired
            self.retired = set()  # names the server remembers as retired

        def _took(self, name, version, seed):
            versions = self.served.setdefault(name, {})
            versions[version] = seed
            self.gone.setdefault(name, set()).discard(version)
            for old in sorted(versions)[:-KEEP]:
                del versions[old]
                self.gone[name].add(old)
            self.retired.discard(name)

        @rule(which=WHICH, seed=st.sampled_from(SEEDS),
              transport=st.sampled_from(["tensors", "shm", "auto", "broadcast"]))
        def push(self, which, seed, transport):
            name = self.names[which]
            if transport == "broadcast" and client._group is None:
                client.init_group(timeout_s=20)
            [res] = client.push(adapters[seed], name, transport=transport)
            assert res.version == max(self.served.get(name, {}), default=0) + 1, res
            self._took(name, res.version, seed)
            self._bounded_after_push()

        @rule(which=WHICH, seed=st.sampled_from(SEEDS), step=st.sampled_from([-1, 0, 1, 2, 5]),
              transport=st.sampled_from(["tensors", "shm"]))
        def push_explicit(self, which, seed, step, transport):
            name = self.names[which]
            newest = max(self.served.get(name, {}), default=0)
            version = newest + step
            if version < 1:
                return
            try:
                [res] = client.push(adapters[seed], name, version=version, transport=transport)
            except VersionConflict:
                assert step <= 0, (name, version, newest)
                return
            assert step > 0 and res.version == version, (name, version, newest)
            self._took(name, version, seed)
            self._bounded_after_push()

        @staticmethod
        def _bounded_after_push():
            """What a push finds waiting for requests to pause is freed before it goes on:
            past it, the workers hold at most one version nobody serves (the one it retired)."""
            served = {v["adapter_id"] for a in client.adapters()[0]["adapters"]
                      for v in a["versions"] if not v["retired"]}
            for held in bridge.held_ids():
                assert len(held - served) <= 1, (sorted(held), sorted(served))

        @rule(which=WHICH)
        def retire(self, which):
            name = self.names[which]
            try:
                out = client.retire(name)[0]
            except NotFound as e:
                assert e.code == "not_found" and not self.served.get(name), e
                return
            assert out["retired"] == sorted(self.served.get(name, {})), out
            self.gone.setdefault(name, set()).update(self.served.pop(name, {}))
            self.retired.add(name)
            wait_drained(client, name)  # then numbering starts again at v1

        @rule(which=WHICH)
        def generate_alias(self, which):
            self._request(self.names[which], None)

        @rule(which=WHICH, pick=st.integers(0, 5))
        def generate_version(self, which, pick):
            name = self.names[which]
            versions, gone = sorted(self.served.get(name, {})), sorted(self.gone.get(name, ()))
            choices = (gone if pick % 2 and gone else versions or gone) or [pick + 1]
            self._request(name, choices[pick % len(choices)])

        def _request(self, name, version):
            """The alias (version None) or a versioned name, served exactly as the model
            says: that version's weights, or a 404 (version_retired for our names)."""
            versions = self.served.get(name, {})
            model = name if version is None else f"{name}-v{version}"
            status, reply, headers = complete_raw(fake_server, model)
            if version is None and not versions:
                assert status == 404, (model, status, reply)  # never another model
                if name in self.retired:
                    assert error_of(reply)[1] == "version_retired", reply
                return
            if version is not None and version not in versions:
                assert status == 404, (model, status, reply)
                if version in self.gone.get(name, ()) or name in self.retired:
                    assert error_of(reply)[1] == "version_retired", (model, reply)
                return
            assert status == 200, (model, status, reply)
            want = max(versions) if version is None else version
            assert int(headers["x-lora-version"]) == want, (model, headers)
            assert reply["model"] == f"{name}-v{want}", (model, reply)
            assert reply["choices"][0]["text"] == expected[versions[want]], (model, reply)

        def teardown(self):
            """Whatever the sequence, no lease is left that the client does not hold ready:
            the late grant of one a push overtook is cancelled once it comes."""
            wait_until(lambda: client.ready_leases.count() == open_leases(client),
                       timeout_s=10, what="the server's open leases are the client's ready ones")

        @invariant()
        def listing_matches_the_model(self):
            for name in getattr(self, "names", ()):
                assert versions_of(client, name) == sorted(self.served.get(name, {})), name
            assert not bridge.violations, bridge.violations

    Fuzz.TestCase.settings = settings(
        max_examples=FUZZ_EXAMPLES, stateful_step_count=FUZZ_STEPS, deadline=None,
        suppress_health_check=list(HealthCheck), derandomize=True)
    try:
        Fuzz.TestCase().runTest()
        for name in used:
            try:
                client.retire(name)
            except NotFound:
                pass
            wait_drained(client, name)
        # Unlisted first, freed right after: the workers then hold nothing.
        wait_until(lambda: bridge.held_ids() == [set()], timeout_s=5,
                   what="the workers free every retired version")
    finally:
        if client._group is not None:
            client.destroy_group()
        client.close()
