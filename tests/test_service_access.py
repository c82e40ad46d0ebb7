"""Who may call what: the admin key, the engine's own adapter routes, admission of
generation requests, and the shape of every error reply, in process on the FAKE engine
(tests/service_helpers.py says what these suites check)."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lora_sync import LoRASyncClient, LoRASyncError, Unauthorized, http
from lora_sync.transports import shm

from .engine_fakes import BASE_TEXT, served_text
from .helpers import AUTH, PROMPT, greedy, post_body, versions_of, wait_until
from .service_helpers import TENSORS, DISTRIBUTED, adapter_ids, complete_raw, error_of
from .service_helpers import clean_slate  # noqa: F401  (autouse: it applies to this module)


# -- access --------------------------------------------------------------------------------
def test_admin_routes_need_the_api_key(fake_server, fake_client, make_adapter):
    """Every admin route, and the engine's own adapter routes, refuse a missing or wrong key
    (401) and change nothing; generation, the engine's business, still works."""
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
    """test_attacks.py::test_internal_lora_id_is_refused and
    test_bodies_admission_cannot_read_are_refused, plus JSON too deep, naming a key twice or
    cut short: 400 bad_request (a key named twice on every route, over random bodies:
    test_request_rules.py::test_every_json_body_naming_a_key_twice_is_a_400)."""
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
    serves the adapter the header names, as vLLM's SageMaker routes do)."""
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
