"""Integrity rules against real servers (both engines, the shared session servers, prefix /
radix caching on as the engines default):

  identity     a name that comes back (retire, explicit version, a fresh client) serves
               exactly what a never-used name with the same weights serves;
  disjointness our names never shadow the engine's (served model, case variants), and a
               retired or unknown name is a 404, never another model;
  ownership    a broadcast group loads only for the client that created it;
  framing      a broadcast that is not what was declared is a 400, the server lives and the
               previous version keeps serving.
Plus a stateful, model-based fuzz test (hypothesis) of pushes on every transport, lying
broadcasts, retires and requests, whose invariants are checked after every step: the server
is alive, every reply is the version it names (its tokens equal the same weights loaded from
disk) or a 404, no name of ours resolves to another model, and descriptors and memory stay
bounded. LORA_SYNC_FUZZ_STEPS makes it longer (default: CI-sized)."""
from __future__ import annotations

import contextlib
import os
import time

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lora_sync import LoRASyncClient, LoRASyncError, collective, http

from .conftest import SERVER_ENV
from .helpers import AUTH, disk_model, greedy, try_to_take_a_group, versions_of

# Long enough to fill whole KV blocks, so a cache hit would be used.
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)


def long_greedy(client, model):
    return greedy(client, model, LONG_PROMPT, 8)


def disk_output(client, adapter, tag, tmp_path):
    """The reference: what the engine's own disk route serves for these weights, under a
    name never used before."""
    name = f"disk-{tag}-{time.monotonic_ns() % 10 ** 9}"
    adapter.save(tmp_path / name)
    client.load_from_disk(str(tmp_path / name), name)
    try:
        return long_greedy(client, disk_model(client, name))
    finally:
        client.unload_from_disk(name)


@contextlib.contextmanager
def sending_instead(sent):
    """The trainer declares one adapter and sends `sent`'s tensors (a lying broadcast)."""
    real = collective.send_transfer

    def send_other(group, transfer, tensors, kept, *a, **k):
        other = collective.Transfer.plan(sent.specs(), transfer.transfer_id,
                                         transfer.bucket_bytes)
        return real(group, other, sent.tensors, kept, *a, **k)
    collective.send_transfer = send_other
    try:
        yield
    finally:
        collective.send_transfer = real


def drop_refused_group(client):
    """The server dropped the group after the lie; the trainer's end goes too."""
    client.states["broadcast"].group.pg.shutdown()
    client.states["broadcast"].group = None


def wait_drained(client, name, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(a["name"] == name for a in client.adapters()[0]["adapters"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} still listed after {timeout_s}s")


def test_a_name_that_comes_back_never_meets_old_cache(client, server, make_adapter, tmp_path):
    a, b = make_adapter(seed=301), make_adapter(seed=302)
    expect_b = disk_output(client, b, "b", tmp_path)
    client.push(a, "kvback", transport="tensors")
    out_a = long_greedy(client, "kvback")
    assert long_greedy(client, "kvback") == out_a  # now cached under v1's identity
    client.retire("kvback")
    wait_drained(client, "kvback")
    # Retire, then the name starts again at v1 with other weights.
    [res] = client.push(b, "kvback", version=1, transport="tensors")
    assert res.name == "kvback-v1"
    assert long_greedy(client, "kvback") == expect_b != out_a
    # A fresh client re-pushing the same name and weights again (explicit version path).
    client.retire("kvback")
    wait_drained(client, "kvback")
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as other:
        other.push(a, "kvback", version=1, transport="tensors")
        assert long_greedy(other, "kvback-v1") == out_a
        other.retire("kvback")


@pytest.mark.parametrize("name", ["base", "BASE", "Base"])
def test_a_push_never_shadows_the_served_model(client, make_adapter, name):
    before = greedy(client, "base")
    with pytest.raises(LoRASyncError) as e:
        client.push(make_adapter(seed=310), name, transport="tensors")
    assert e.value.code == "name_taken" and e.value.status == 409
    assert greedy(client, "base") == before
    models = http.call("GET", f"{client.servers[0].url}/v1/models", headers=AUTH)[0]
    assert not any(m["id"].casefold().startswith(f"{name.casefold()}-v")
                   for m in models.get("data", []))


def test_retired_names_are_404_never_another_model(client, server, make_adapter):
    client.push(make_adapter(seed=320), "gone", transport="tensors")
    client.retire("gone")  # right after retire, before the versions are freed
    for model in ("gone", "gone-v1"):
        status, reply, _ = http.request("POST", f"{server.url}/v1/completions", json_body={
            "model": model, "prompt": "x", "max_tokens": 2}, headers=AUTH)
        assert (status, reply["error"]["code"]) == (404, "version_retired"), (model, reply)
    wait_drained(client, "gone")
    status, reply, _ = http.request("POST", f"{server.url}/v1/completions", json_body={
        "model": "gone", "prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert (status, reply["error"]["code"]) == (404, "version_retired"), reply


def test_unknown_model_is_404_on_both_engines(server):
    for model in ("never-pushed", "base:never-pushed"):
        status, reply, _ = http.request("POST", f"{server.url}/v1/completions", json_body={
            "model": model, "prompt": "x", "max_tokens": 2}, headers=AUTH)
        assert status == 404, (model, status, reply)


def test_sglang_extra_key_cannot_reach_our_cache_keys(sglang):
    status, reply, _ = http.request("POST", f"{sglang.url}/generate", json_body={
        "text": "x", "extra_key": "lora-sync-0123-1", "sampling_params": {"max_new_tokens": 1}},
        headers=AUTH)
    assert status == 400 and "extra_key" in reply["error"]["message"]


def test_a_group_loads_only_for_its_owner(client, server, make_adapter):
    """Another client naming my group (no token, a made-up one) can neither load on it nor
    destroy it; my next broadcast is untouched and in step."""
    client.init_group(timeout_s=20)
    client.broadcast(make_adapter(seed=330), "owned")
    before = greedy(client, "owned")
    good = make_adapter(seed=331)
    try_to_take_a_group(client.servers[0].route("load_lora_adapter_from_distributed"),
                        client.servers[0].route("destroy_lora_update_group"), good)
    client.broadcast(good, "owned")
    assert greedy(client, "owned-v1") == before and greedy(client, "owned") != before
    assert "stolen" not in {a["name"] for a in client.adapters()[0]["adapters"]}
    client.destroy_group()
    client.retire("owned")


LIE_REFUSED = ("transfer_mismatch", "transfer_failed", "push_failed")


@pytest.mark.parametrize("lie", ["bigger", "smaller"])
def test_a_broadcast_that_lies_about_its_size_is_refused(client, server, make_adapter, lie):
    """The trainer declares one adapter and sends another (rank 16 vs 8): the workers see
    the header disagree before posting any bucket receive."""
    client.init_group(timeout_s=10)
    client.broadcast(make_adapter(seed=340), "liar")
    before = greedy(client, "liar")
    declared, sent = make_adapter(seed=341, rank=8), make_adapter(seed=342, rank=16)
    if lie == "smaller":
        declared, sent = sent, declared
    with sending_instead(sent), pytest.raises(LoRASyncError) as e:
        client.broadcast(declared, "liar")
    assert e.value.code in LIE_REFUSED, e.value
    assert server.alive()
    assert greedy(client, "liar") == before and versions_of(client, "liar") == [1]
    drop_refused_group(client)
    client.init_group(timeout_s=10)  # a new group works
    client.broadcast(make_adapter(seed=343), "liar")
    assert versions_of(client, "liar")[-1] == 2
    client.destroy_group()
    client.retire("liar")


# -- the model-based fuzz test ----------------------------------------------------------
FUZZ_STEPS = int(os.environ.get("LORA_SYNC_FUZZ_STEPS", "10"))
SEEDS = (401, 402, 403)
KEEP = int(SERVER_ENV["LORA_SYNC_KEEP_VERSIONS"])
NAMES = ("fz-a", "fz-b")


def resources(server) -> tuple[int, int]:
    """(open descriptors of the API process, RSS of the server's processes)."""
    return len(os.listdir(f"/proc/{server.proc.pid}/fd")), server.rss_bytes()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_random_operation_sequences_keep_the_invariants(request, make_adapter, engine,
                                                        tmp_path):
    server = request.getfixturevalue(engine)
    client = LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key)
    adapters = {s: make_adapter(seed=s) for s in SEEDS}
    expected = {s: disk_output(client, adapters[s], f"fz{s}", tmp_path) for s in SEEDS}
    base = long_greedy(client, "base")
    transports = ["tensors", "shm"] + (["broadcast"] if engine == "vllm" else [])
    liar = make_adapter(seed=409, rank=16)  # what a lying broadcast sends
    fds0, rss0 = resources(server)

    class Fuzz(RuleBasedStateMachine):
        @initialize()
        def start(self):
            for name in NAMES:  # a clean slate for every run
                try:
                    client.retire(name)
                except LoRASyncError:
                    pass
            self.served = {}      # name -> {version: seed}, as the model says
            self.retired = set()  # names retired and not pushed since

        @rule(name=st.sampled_from(NAMES), seed=st.sampled_from(SEEDS),
              transport=st.sampled_from(transports))
        def push(self, name, seed, transport):
            if transport == "broadcast" and client.states["broadcast"].group is None:
                client.init_group(timeout_s=20)
            [res] = client.push(adapters[seed], name, transport=transport)
            versions = self.served.setdefault(name, {})
            versions[res.version] = seed
            for old in sorted(versions)[:-KEEP]:
                del versions[old]
            self.retired.discard(name)

        @precondition(lambda self: "broadcast" in transports)
        @rule(name=st.sampled_from(NAMES), seed=st.sampled_from(SEEDS))
        def lying_broadcast(self, name, seed):
            """Declares one adapter, sends another: refused, and nothing changes."""
            if client.states["broadcast"].group is None:
                client.init_group(timeout_s=20)
            with sending_instead(liar), pytest.raises(LoRASyncError) as e:
                client.push(adapters[seed], name, transport="broadcast")
            assert e.value.code in LIE_REFUSED, e.value
            drop_refused_group(client)

        @rule(name=st.sampled_from(NAMES))
        def retire(self, name):
            try:
                client.retire(name)
            except LoRASyncError as e:
                assert e.code == "not_found" and not self.served.get(name), e
            self.served.pop(name, None)
            self.retired.add(name)

        @rule(name=st.sampled_from(NAMES), pick=st.integers(0, 3))
        def generate(self, name, pick):
            versions = self.served.get(name, {})
            model = name if pick == 0 or not versions else \
                f"{name}-v{sorted(versions)[pick % len(versions)]}"
            status, reply, headers = http.request(
                "POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                json_body={"model": model, "prompt": LONG_PROMPT, "max_tokens": 8,
                           "temperature": 0})
            if not versions:
                assert status == 404, (model, status, reply)  # never another model
                return
            assert status == 200, (model, status, reply)
            version = int(headers.get("x-lora-version") or headers.get("X-LoRA-Version"))
            want = versions[max(versions)] if model == name else versions[version]
            text = reply["choices"][0]["text"]
            assert text == expected[want] != base, (model, version, text)

        @invariant()
        def alive(self):
            assert server.alive(), server.log_tail()

        @invariant()
        def bounded(self):
            # A few versions of two names are held at most: descriptors and memory that
            # grow step after step are a leak.
            fds, rss = resources(server)
            assert fds <= fds0 + 64, (fds0, fds)
            assert rss <= rss0 + (768 << 20), (rss0, rss)

    Fuzz.TestCase.settings = settings(
        max_examples=2, stateful_step_count=FUZZ_STEPS, deadline=None,
        suppress_health_check=list(HealthCheck))
    try:
        Fuzz.TestCase().runTest()
    finally:
        if client.states["broadcast"].group is not None:
            client.destroy_group()
        for name in NAMES:
            try:
                client.retire(name)
            except LoRASyncError:
                pass
        client.close()
