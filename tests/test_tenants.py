"""Shared servers: tenants with their own keys, name scopes and quotas (lora_sync/server/
tenants.py), rollback and pinning of an alias. In process on the FAKE engine (engine_fakes.py:
the real routes, admission, service and dispatcher), then one short test per real engine.

Four tenants share the server with the operator (LORA_SYNC_API_KEY):
  alice  prefix "alice-"                       generate: own
  bob    prefix "bob-"                         generate: own
  carol  prefix "carol-" and the name "shared-eval"   generate: all
  dave   prefix "dave-"                        generate: base
"""
from __future__ import annotations

import hashlib
import math
import os
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lora_sync import LoRASyncClient, LoRASyncError, http
from lora_sync.server.tenants import Tenancy, load_tenants

from .conftest import API_KEY, GENERATION_KEY, PROMPT, SERVER_ENV
from .engine_fakes import BASE_MODEL, BASE_TEXT, FakeEngineServer, served_text, \
    settings_like_test_servers
from .helpers import wait_until

KEYS = {"alice": "key-alice", "bob": "key-bob", "carol": "key-carol", "dave": "key-dave",
        "operator": API_KEY}
LEVELS = {"alice": "own", "bob": "own", "carol": "all", "dave": "base"}
QUOTA_NAMES, QUOTA_LEASES, KEEP = 2, 2, 2
STAGING, PUSH_RATE = 3 * 2 ** 19, 10_000  # max_staging_mb = 1.5; the rate: out of the way
SAGEMAKER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenants_toml(pushes_per_minute: int = PUSH_RATE) -> str:
    quotas = (f"max_names = {QUOTA_NAMES}\nkeep_versions = {KEEP}\n"
              f"max_staging_mb = {STAGING / 2 ** 20}\nmax_leases = {QUOTA_LEASES}\nmax_groups = 1\n"
              f"pushes_per_minute = {pushes_per_minute}\n")
    return textwrap.dedent(f"""\
        # three training runs on one fleet
        [tenants.alice]
        key_sha256 = "{sha(KEYS['alice'])}"
        prefix = "alice-"
        generate = "own"
        """) + quotas + textwrap.dedent(f"""
        [tenants.bob]
        key_sha256 = "{sha(KEYS['bob'])}"
        prefix = "bob-"
        """) + quotas + textwrap.dedent(f"""
        [tenants.carol]
        key_sha256 = "{sha(KEYS['carol'])}"
        prefix = "carol-"
        names = ["shared-eval"]
        generate = "all"
        """) + quotas + textwrap.dedent(f"""
        [tenants.dave]
        key_sha256 = "{sha(KEYS['dave'])}"
        prefix = "dave-"
        generate = "base"
        """) + quotas


def write_tenants(directory, text: str) -> str:
    path = os.path.join(directory, "tenants.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def tenant_settings(path: str):
    return settings_like_test_servers(env={"LORA_SYNC_TENANTS": path})


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A fake-engine server shared by the three tenants and the operator."""
    path = write_tenants(tmp_path_factory.mktemp("tenants"), tenants_toml())
    with FakeEngineServer(settings=tenant_settings(path)) as server:
        yield server


@pytest.fixture(scope="module")
def adapters(make_adapter):
    return [make_adapter(seed=4500 + i) for i in range(6)]


def client(server, who: str, **kw) -> LoRASyncClient:
    """A fresh client (no memory of versions) for `who` (a tenant, the operator, or a
    key nobody has)."""
    return LoRASyncClient(server.url, engine=server.engine, api_key=KEYS.get(who, who),
                          timeout=30, lease_ahead=False, **kw)


def auth(who: str) -> dict:
    key = KEYS.get(who, who)
    return {"Authorization": f"Bearer {key}"} if key else {}


def route_url(server, route: str) -> str:
    """lora-sync's `route` on `server`: under /v1 on vLLM (and the fake), at the root on
    SGLang."""
    return f"{server.url}{'/v1' if server.engine == 'vllm' else ''}/{route}"


def post(server, route: str, who: str, body: dict):
    return http.request("POST", route_url(server, route), headers=auth(who), json_body=body)


# Generation routes (the fake engine serves completions only; admission reads them all).
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/invocations")


def complete(server, who: str, model: str, headers=None, route="/v1/completions", **extra):
    """A generation request naming `model`, on `route` (a chat, and SGLang's /invocations:
    the prompt as a message)."""
    chat = "chat" in route or (route == "/invocations" and server.engine == "sglang")
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    return http.request("POST", f"{server.url}{route}", headers={**auth(who), **(headers or {})},
                        json_body={"model": model, **prompt, "max_tokens": 4, **extra})


def cancel(server, granted: list) -> None:
    """Cancels leases, each given as (who, its lora_sync_lease reply)."""
    for who, lease in granted:
        post(server, "lora_sync_lease_cancel", who, {k: lease[k] for k in ("lease_id", "token")})


def set_up_group(server, who: str, name: str):
    """A group's set-up as init_group() asks it, for a refusal: no rendezvous waits on it
    (a trainer's would outlive the test)."""
    return post(server, "init_lora_update_group", who,
                {"group_name": name, "master_address": "127.0.0.1", "master_port": 1,
                 "rank_offset": 1, "world_size": 2})


def listed_models(server, who: str) -> set[str]:
    """The ids of the engine's GET /v1/models for `who`."""
    status, body, _ = http.request("GET", f"{server.url}/v1/models", headers=auth(who))
    assert status == 200, body
    return {m["id"] for m in body["data"]}


def names_seen(server, who: str) -> set[str]:
    with client(server, who) as c:
        return {a["name"] for a in c.adapters()[0]["adapters"]}


@pytest.fixture(autouse=True)
def clean(shared):
    yield
    clear(shared)


def clear(server) -> None:
    """Every name retired and drained, every open lease gone (the fixture's server is
    shared by the tests of this module). On a real server: the names (its leases are the
    tests' own to cancel)."""
    with client(server, "operator") as op:
        for entry in op.adapters()[0]["adapters"]:
            try:
                op.retire(entry["name"])
            except LoRASyncError:
                pass
        wait_until(lambda: not op.adapters()[0]["adapters"], what="every name drained")
    if isinstance(server, FakeEngineServer):
        server.service.contexts["shm"].state.close()
        assert not server.bridge.violations, server.bridge.violations


def error(reply) -> tuple[int, str | None]:
    status, body, _ = reply
    err = body.get("error") if isinstance(body, dict) else None
    return status, err.get("code") if isinstance(err, dict) else None


def scrape(server, who: str, path: str = "/metrics") -> tuple[int, str]:
    """GET the engine's /metrics (or a path its mount also serves) with `who`'s key."""
    status, raw, _ = http.exchange("GET", f"{server.url}{path}", headers=auth(who))
    return status, raw.decode(errors="replace")


def check_metrics_are_the_operators(server, names: set[str]) -> None:
    """With tenants, /metrics (every path its mount serves) answers the operator's key alone:
    a tenant's key 403, no key or another 401, none of them a byte of the text; the operator
    gets every tenant's `names` among the labels."""
    for path in ("/metrics", "/metrics/", "/metricsx"):
        for who, code in (("", 401), ("wrong-key", 401), (f"{KEYS['alice']} ", 401),
                          ("alice", 403), ("bob", 403), ("carol", 403)):
            status, text = scrape(server, who, path)
            assert status == code, (path, who, status, text[:200])
            assert not any(n in text for n in names), (path, who)

    def operator_sees_them() -> bool:  # (SGLang's multiprocess snapshot lags <= 0.1 s)
        status, text = scrape(server, "operator")
        return status == 200 and all(f'name="{n}"' in text for n in names)
    wait_until(operator_sees_them, timeout_s=10, what=f"the operator's /metrics names {names}")


# -- the file --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, says", [
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\n[tenants.a]\nprefix = 'b-'\n", "line 4"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\n"
     "[tenants.b]\nkey_sha256 = '{a}'\nprefix = 'b-'\n", "same key"),
    ("[tenants.a]\nkey_sha256 = '{op}'\nprefix = 'a-'\n", "operator"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'team-'\n"
     "[tenants.b]\nkey_sha256 = '{b}'\nprefix = 'TEAM-b-'\n", "overlap"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\n"
     "[tenants.b]\nkey_sha256 = '{b}'\nnames = ['A-eval']\n", "overlap"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = ''\n", "empty prefix"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'alice'\n", "ending in"),
    ("[tenants.a]\nkey_sha256 = '{a}'\n", "no scope"),
    ("[tenants.a]\nkey_sha256 = 'secret'\nprefix = 'a-'\n", "64 lowercase hex"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\nmax_leases = 0\n", "max_leases"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\nmax_staging_mb = 1\nmax_leases = 9\n",
     "leases quotas add up"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\ngenerate = 'every'\n", "generate"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\nquota = 3\n", "unknown key"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\nmax_staging_mb = 7\n", "total"),
    ("[tenants.a]\nkey_sha256 = '{a}'\nprefix = 'a-'\nmax_staging_mb = 1\nkeep_versions = 4\n",
     "KEEP_VERSIONS"),
    ("[tenants.a\nkey_sha256 = 1\n", "line 1"),
    ("[server]\nx = 1\n", "one [tenants"),
])
def test_a_bad_tenants_file_stops_the_server_naming_why(tmp_path, text, says):
    path = write_tenants(tmp_path, text.format(a=sha("ka"), b=sha("kb"), op=sha(API_KEY)))
    with pytest.raises(RuntimeError, match="LORA_SYNC_TENANTS") as e:
        tenant_settings(path)
    assert says in str(e.value)


def test_tenants_need_the_operators_key(tmp_path):
    path = write_tenants(tmp_path, tenants_toml())
    with pytest.raises(RuntimeError, match="LORA_SYNC_API_KEY"):
        settings_like_test_servers(env={"LORA_SYNC_TENANTS": path, "LORA_SYNC_API_KEY": ""})


def test_the_example_file_loads(tmp_path):
    tenants = load_tenants(write_tenants(tmp_path, tenants_toml()), API_KEY)
    assert [t.name for t in tenants] == ["alice", "bob", "carol", "dave"]
    assert [t.generate for t in tenants] == [LEVELS[t.name] for t in tenants]
    carol = tenants[2]
    assert carol.covers("shared-eval") and carol.covers("carol-x") and carol.covers("CAROL-x")
    assert not carol.covers("carolx") and not carol.covers("shared-eval2")


def test_keys_resolve_to_their_tenant_and_nothing_else():
    t = Tenancy(tuple(load_tenants_from_text(tenants_toml())), API_KEY)
    assert t.resolve(f"Bearer {KEYS['bob']}").label == "bob"
    assert t.resolve(f"bearer {KEYS['bob']}").label == "bob"
    assert t.resolve(f"Bearer {API_KEY}").kind == "operator"
    for wrong in (None, "", "Bearer", f"Bearer {KEYS['bob']}x", KEYS["bob"],
                  f"Bearer {sha(KEYS['bob'])}"):
        assert t.resolve(wrong).kind == "anonymous", wrong


def load_tenants_from_text(text: str):
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        return load_tenants(write_tenants(d, text), API_KEY)


# -- attacks: A's key on B's names, on every route ---------------------------------------------
def test_a_tenants_key_on_another_tenants_names_gets_not_found_everywhere(shared, adapters):
    """bob's names through alice's key, on every route and in every form a name takes: the
    same 404 as a name that does not exist, and bob's state unchanged."""
    with client(shared, "bob") as bob:
        bob.push(adapters[0], "bob-policy", transport="tensors")
        bob.push(adapters[1], "bob-policy", transport="tensors")
    before = {"listing": names_seen(shared, "bob"), "text": served_text(adapters[1])}
    absent_reply = error(post(shared, "retire_lora_adapter", "alice", {"lora_name": "alice-nope"}))
    assert absent_reply == (404, "not_found")
    for name in ("bob-policy", "BOB-policy", "Bob-Policy", "bob-nothing"):
        assert error(post(shared, "retire_lora_adapter", "alice", {"lora_name": name})) == \
            absent_reply
        assert error(post(shared, "lora_sync_alias", "alice",
                          {"lora_name": name, "version": 1})) == absent_reply
    with client(shared, "alice") as alice:
        for name in ("bob-policy", "BOB-policy"):
            for transport in ("tensors", "shm", "shared", "broadcast"):
                if transport == "broadcast":  # in a group of alice's (a refusal ends it)
                    alice.init_group(timeout_s=10)
                with pytest.raises(LoRASyncError) as e:
                    alice.push(adapters[2], name, transport=transport)
                assert (e.value.status, e.value.code) == absent_reply, transport
            alice.destroy_group()
        assert "bob-policy" not in {a["name"] for a in alice.adapters()[0]["adapters"]}
    # generation, on every route admission reads (chat and SageMaker's /invocations too:
    # refused before the engine, which here serves completions only): alias, version, case
    # variants, lora_path, SageMaker header; a name that is not there gets the same reply
    nobody = error(complete(shared, "alice", "bob-nothing-at-all"))
    assert nobody == (404, "model_not_found")
    for model, extra, headers in [
            ("bob-policy", {}, None), ("bob-policy-v1", {}, None), ("bob-policy-v2", {}, None),
            ("BOB-policy", {}, None), ("bob-POLICY-v2", {}, None),
            ("base", {"lora_path": "bob-policy"}, None),
            ("base", {"lora_path": ["bob-policy-v2"]}, None),
            ("base", {"parameters": {"lora_path": "bob-policy"}}, None),
            ("base", {}, {SAGEMAKER_HEADER: "bob-policy"})]:
        for who in ("alice", "nobody-key", ""):
            for route in GENERATION_ROUTES:
                assert error(complete(shared, who, model, headers, route, **extra)) == nobody, \
                    (who, model, extra, route)
    # the engine's own adapter routes (vLLM's, and SageMaker's /adapters) are the operator's
    for method, path, body in [
            ("POST", "/v1/load_lora_adapter", {"lora_name": "bob-x", "lora_path": "/tmp"}),
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "bob-policy-v1"}),
            ("POST", "/adapters", {"name": "bob-policy", "src": "/tmp"}),
            ("DELETE", "/adapters/bob-policy-v1", None), ("DELETE", "/adapters/bob-policy", None)]:
        reply = http.request(method, f"{shared.url}{path}", headers=auth("alice"),
                             json_body=body)
        assert error(reply) == (403, "forbidden"), (method, path, reply)
    # /v1/models: bob's names are not listed to alice or to no key
    for who in ("alice", ""):
        status, body, _ = http.request("GET", f"{shared.url}/v1/models", headers=auth(who))
        assert status == 200 and not any(m["id"].startswith("bob-") for m in body["data"])
    status, body, _ = http.request("GET", f"{shared.url}/v1/models", headers=auth("bob"))
    assert {"bob-policy-v1", "bob-policy-v2"} <= {m["id"] for m in body["data"]}
    # nothing of bob's changed
    assert names_seen(shared, "bob") == before["listing"]
    status, body, headers = complete(shared, "bob", "bob-policy")
    assert status == 200 and body["choices"][0]["text"] == before["text"]
    # carol (generate: all) and the operator may generate on it; they see it in listings
    # only where they own it (carol) or over everything (operator)
    assert complete(shared, "carol", "bob-policy")[0] == 200
    assert "bob-policy" not in names_seen(shared, "carol")
    assert "bob-policy" in names_seen(shared, "operator")


def test_a_tenants_key_opens_the_route_the_engines_key_does_not_guard(tmp_path, make_adapter):
    """vLLM's /invocations is outside its --api-key middleware, so admission asks for a key
    there: a tenant's key opens it as it opens the guarded routes (within its generate
    level), no key or a wrong one gets 401, and the engine's own key the names outside every
    scope. (The pushes are the operator's: the fake's stand-in for vLLM's middleware knows
    no tenants; the real vLLM tenant server is started with --api-key for that.)"""
    server = FakeEngineServer(settings=tenant_settings(write_tenants(tmp_path, tenants_toml())),
                              engine_keys=(GENERATION_KEY,))
    completions = next(r.endpoint for r in server.app.routes
                       if getattr(r, "path", None) == "/v1/completions")
    server.app.add_api_route("/invocations", completions, methods=["POST"])  # as vLLM's does
    a, b = make_adapter(seed=4800), make_adapter(seed=4801)

    def invoke(key: str, model: str, header: bool = False):
        return complete(server, key, BASE_MODEL if header else model,
                        {SAGEMAKER_HEADER: model} if header else None, "/invocations")
    with server, client(server, "operator") as op:
        op.push(a, "alice-inv", transport="tensors")
        op.push(b, "op-inv", transport="tensors")
        status, body, headers = invoke("alice", "alice-inv")
        assert status == 200 and body["choices"][0]["text"] == served_text(a), body
        assert headers["x-lora-version"] == "1"
        assert invoke("alice", "alice-inv", header=True)[2]["x-lora-version"] == "1"
        for who, model in (("alice", "op-inv"), ("carol", "alice-inv"), (GENERATION_KEY, "op-inv"),
                           ("operator", "alice-inv")):
            assert invoke(who, model)[0] == 200, (who, model)
        for who, model in (("bob", "alice-inv"), ("dave", "alice-inv"), ("dave", "op-inv"),
                           (GENERATION_KEY, "alice-inv")):
            assert error(invoke(who, model)) == (404, "model_not_found"), (who, model)
        for who in ("", "wrong-key", KEYS["alice"] + "x"):
            assert error(invoke(who, "op-inv")) == (401, "unauthorized"), who
        clear(server)


def test_generate_base_means_the_base_model_alone(shared, adapters, tmp_path):
    """dave's key (generate = "base") generates with the base model only: not on its own
    names, nor the operator's outside every scope, nor an adapter the engine loaded itself,
    in any form (each answered as a name that is not served); /v1/models lists it the model
    alone. alice (own) gets her names and those outside every scope; no key: the latter."""
    adapters[0].save(tmp_path / "disk")
    with client(shared, "operator") as op, client(shared, "dave") as dave:
        op.push(adapters[1], "op-open", transport="tensors")
        op.load_from_disk(tmp_path / "disk", "engine-own")
        dave.push(adapters[2], "dave-x", transport="tensors")  # pushed for others to use
        try:
            status, body, _ = complete(shared, "dave", BASE_MODEL)
            assert status == 200 and body["choices"][0]["text"] == BASE_TEXT
            nobody = error(complete(shared, "dave", "dave-nothing"))
            assert nobody == (404, "model_not_found")
            for model, extra, headers in [
                    ("dave-x", {}, None), ("dave-x-v1", {}, None), ("op-open", {}, None),
                    ("op-open-v1", {}, None), ("engine-own", {}, None),
                    (BASE_MODEL, {"lora_path": "op-open"}, None),
                    (BASE_MODEL, {"lora_path": [BASE_MODEL, "engine-own"]}, None),
                    (BASE_MODEL, {"parameters": {"lora_path": "dave-x"}}, None),
                    (BASE_MODEL, {}, {SAGEMAKER_HEADER: "op-open-v1"}),
                    (BASE_MODEL, {}, {SAGEMAKER_HEADER: "engine-own"})]:
                assert error(complete(shared, "dave", model, headers, **extra)) == nobody, \
                    (model, extra, headers)
            assert listed_models(shared, "dave") == {BASE_MODEL}
            for who, model, text in (("alice", "op-open", served_text(adapters[1])),
                                     ("alice", "engine-own", served_text(adapters[0])),
                                     ("", "op-open", served_text(adapters[1])),
                                     ("carol", "dave-x", served_text(adapters[2])),
                                     ("operator", "dave-x", served_text(adapters[2]))):
                status, body, _ = complete(shared, who, model)
                assert status == 200 and body["choices"][0]["text"] == text, (who, model, body)
            assert listed_models(shared, "alice") == {BASE_MODEL, "op-open-v1", "engine-own"}
            assert "dave-x-v1" in listed_models(shared, "carol")
        finally:
            op.unload_from_disk("engine-own")


def test_a_timing_probe_learns_nothing(shared, adapters):
    """'Not yours' and 'not there' take one code path: the same reply, and times that a
    probe cannot tell apart (the median of each within 2 ms of the other)."""
    with client(shared, "bob") as bob:
        bob.push(adapters[0], "bob-secret", transport="tensors")

    def times(name: str) -> list[float]:
        out = []
        for _ in range(40):
            t0 = time.perf_counter()
            reply = post(shared, "retire_lora_adapter", "alice", {"lora_name": name})
            out.append(time.perf_counter() - t0)
            assert error(reply) == (404, "not_found")
        return sorted(out)
    there, absent = times("bob-secret"), times("bob-absent")
    assert abs(there[20] - absent[20]) < 2e-3, (there[20], absent[20])
    assert "bob-secret" in names_seen(shared, "bob")


def test_quota_exhaustion_by_one_tenant_leaves_the_others_pushing(shared, adapters):
    """alice takes all she may (names, leases, staging bytes): refused by the quota that
    says so (429, before a byte is staged), while bob still pushes on every transport."""
    with client(shared, "alice") as alice:
        for i in range(QUOTA_NAMES):
            alice.push(adapters[i], f"alice-n{i}", transport="tensors")
        with pytest.raises(LoRASyncError) as e:
            alice.push(adapters[3], "alice-one-more", transport="tensors")
        assert (e.value.status, e.value.code) == (429, "quota_names")
        alice.push(adapters[4], "alice-n0", transport="shm")  # a held name: fine
    leases = [post(shared, "lora_sync_lease", "alice", {"nbytes": 4096, "client": f"id{i}"})
              for i in range(QUOTA_LEASES + 3)]  # the client label is no identity
    assert [r[0] for r in leases] == [200] * QUOTA_LEASES + [429] * 3
    assert error(leases[-1]) == (429, "quota_leases")
    # staging bytes: a body above what alice has left is refused from its Content-Length
    status, body, _ = http.request(
        "POST", f"{shared.url}/v1/load_lora_adapter_from_tensors",
        headers={**auth("alice"), "Content-Type": "application/octet-stream"},
        chunks=[b"\0" * (2 << 20)])
    assert (status, body["error"]["code"]) == (429, "quota_staging")
    # alice's lease is hers alone: bob cannot cancel, renew or commit it
    ticket = {k: leases[0][1][k] for k in ("lease_id", "token")}
    for route in ("lora_sync_lease_cancel", "lora_sync_lease_renew",
                  "load_lora_adapter_from_lease"):
        assert error(post(shared, route, "bob", ticket)) == (404, "unknown_lease")
    with client(shared, "bob") as bob:
        for transport in ("tensors", "shm", "tensors"):
            assert bob.push(adapters[5], "bob-works", transport=transport)[0].ok
        bob.push(adapters[5], "bob-second", transport="shm")
    info = client(shared, "alice").info()[0]
    assert info["tenant"]["usage"]["names"] == QUOTA_NAMES
    assert info["open_leases"] == QUOTA_LEASES and info["max_names"] == QUOTA_NAMES


def test_concurrent_new_names_never_pass_the_names_quota_together(shared, adapters):
    """N pushes of N new names by one tenant, all at once (each under its own name's lock):
    exactly max_names succeed, the rest get 429 quota_names, and the tenant holds exactly
    max_names names. A push of a name it already holds, at the same moment, succeeds.
    (Fails if the quota's count and the name's reservation are ever split by an await.)"""
    n = 8

    def push_all(names: list[str]) -> list:
        barrier = threading.Barrier(len(names))

        def one(i: int):
            with client(shared, "alice") as c:
                barrier.wait()
                try:
                    return c.push(adapters[i % len(adapters)], names[i],
                                  transport="tensors")[0].version
                except LoRASyncError as e:
                    return e.status, e.code
        with ThreadPoolExecutor(len(names)) as pool:
            return list(pool.map(one, range(len(names))))

    for _ in range(3):  # the threads interleave differently each round
        out = push_all([f"alice-race{i}" for i in range(n)])
        assert sum(isinstance(r, int) for r in out) == QUOTA_NAMES, out
        assert [r for r in out if not isinstance(r, int)] == \
            [(429, "quota_names")] * (n - QUOTA_NAMES), out
        assert client(shared, "alice").info()[0]["tenant"]["usage"]["names"] == QUOTA_NAMES
        assert len(names_seen(shared, "alice")) == QUOTA_NAMES
        clear(shared)
    # one name held: its push is never refused by the quota, new names are still counted
    with client(shared, "alice") as alice:
        alice.push(adapters[0], "alice-held", transport="tensors")
    out = push_all(["alice-held"] + [f"alice-new{i}" for i in range(n - 1)])
    assert out[0] == 2, out
    assert sum(isinstance(r, int) for r in out[1:]) == QUOTA_NAMES - 1, out
    assert names_seen(shared, "alice") >= {"alice-held"} and \
        len(names_seen(shared, "alice")) == QUOTA_NAMES


def test_push_rate_quota(tmp_path, make_adapter):
    path = write_tenants(tmp_path, tenants_toml(pushes_per_minute=2))
    with FakeEngineServer(settings=tenant_settings(path)) as server, \
            client(server, "alice") as alice, client(server, "bob") as bob:
        adapter = make_adapter(seed=4600)
        alice.push(adapter, "alice-r", transport="tensors")
        alice.push(adapter, "alice-r", transport="tensors")
        with pytest.raises(LoRASyncError) as e:
            alice.push(adapter, "alice-r", transport="tensors")
        assert (e.value.status, e.value.code) == (429, "quota_pushes")
        assert bob.push(adapter, "bob-r", transport="tensors")[0].version == 1
        clear(server)


def test_a_broadcast_group_is_its_tenants_alone(shared, adapters):
    """Groups are named in their tenant's scope, where init_group() names one by default. A
    name outside it is refused naming the caller's own scope only, alike for a group that
    exists and one that does not; bob cannot name alice's group, token or not (the reply of a
    group that does not exist), nor take her group quota."""
    with client(shared, "alice") as alice, client(shared, "bob") as bob:
        group = alice.init_group(timeout_s=10)
        assert group.name == "alice-default"
        token = group.tokens[shared.url]
        messages = set()
        for name in ("alice-default", "alice-nothing", "default"):
            status, body, _ = set_up_group(shared, "bob", name)
            assert (status, body["error"]["code"]) == (400, "no_group"), body
            message = body["error"]["message"].replace(repr(name), "NAME")
            assert "'bob-'" in message and "alice" not in message, message
            messages.add(message)
        assert len(messages) == 1, messages  # alice's group or none: one reply
        for route, body in [("destroy_lora_update_group", {}),
                            ("load_lora_adapter_from_distributed",
                             {"lora_name": "bob-x", "tensors": [], "transfer_id": 1})]:
            assert error(post(shared, route, "bob", {**body, "group_name": "alice-default",
                                                     "group_token": token})) == (400, "no_group")
        assert error(set_up_group(shared, "alice", "alice-h")) == (429, "quota_groups")
        alice.broadcast(adapters[0], "alice-b")
        assert bob.init_group(timeout_s=10).name == "bob-default"
        bob.broadcast(adapters[1], "bob-b")
        assert client(shared, "bob").info()[0]["worker_status"][0]["groups"] == ["bob-default"]
        bob.destroy_group()
        alice.destroy_group()
    assert complete(shared, "alice", "alice-b")[1]["choices"][0]["text"] == \
        served_text(adapters[0])


def test_the_default_group_name_is_in_the_callers_scope():
    from lora_sync.trainer.client import default_group_name
    tenant = {"prefix": None, "names": ["x-eval", "a-eval"]}
    assert default_group_name([{}, {}]) == "default"
    assert default_group_name([{"tenant": tenant}]) == "a-eval"
    assert default_group_name([{"tenant": {**tenant, "prefix": "x."}}] * 2) == "x.default"
    with pytest.raises(ValueError, match="group_name"):
        default_group_name([{"tenant": tenant}, {}])


# -- rollback and pinning ----------------------------------------------------------------------
def test_rollback_points_the_alias_and_the_next_push_moves_it(shared, adapters):
    with client(shared, "alice") as alice:
        for i in range(2):
            alice.push(adapters[i], "alice-rl", transport="tensors")
        [reply] = alice.rollback("alice-rl", 1)
        assert (reply["alias_target"], reply["pinned"]) == ("alice-rl-v1", False)
        assert alice.complete(PROMPT, "alice-rl")["version"] == 1
        entry = alice.adapters()[0]["adapters"][0]
        assert (entry["alias_target"], entry["pinned"]) == ("alice-rl-v1", False)
        alice.push(adapters[2], "alice-rl", transport="tensors")  # unpinned: moves to v3
        assert alice.complete(PROMPT, "alice-rl")["version"] == 3
        # pinned: pushes leave it, and keep v2 beyond the window of 2
        alice.rollback("alice-rl", 2, pin=True)
        for i in (3, 4):
            alice.push(adapters[i], "alice-rl", transport="tensors")
        done = alice.complete(PROMPT, "alice-rl")
        assert (done["version"], done["text"]) == (2, served_text(adapters[1]))
        entry = alice.adapters()[0]["adapters"][0]
        assert sorted(v["version"] for v in entry["versions"]) == [2, 4, 5]
        assert entry["pinned"] is True
        with pytest.raises(LoRASyncError) as e:
            alice.rollback("alice-rl", 3)  # out of the window by now
        assert (e.value.status, e.value.code) == (404, "version_retired")
        alice.rollback("alice-rl", None)  # follow the newest again
        assert alice.complete(PROMPT, "alice-rl")["version"] == 5


def rollbacks_under_load(server, name: str, texts: dict[int, str], threads: int, flips: int,
                         pause_s: float, max_requests: int, **extra) -> dict:
    """alice's requests on her alias `name` (at v2), from `threads` threads (`max_requests`
    each at most), while her rollbacks point it at v1 and v2 in turn, `flips` times,
    `pause_s` apart. Returns the counts: requests, rollbacks, requests in flight across a
    rollback, failed (not a 200) and wrong:
    replies whose X-LoRA-Version was at no moment of the request the alias target (a
    target holds from its rollback's sending, at the earliest, to the next rollback's
    reply, at the latest), or whose tokens are not that version's (`texts`)."""
    records, lock, stop = [], threading.Lock(), threading.Event()

    def load():
        for _ in range(max_requests):
            if stop.is_set():
                return
            t0 = time.monotonic()
            status, body, headers = complete(server, "alice", name, temperature=0, **extra)
            with lock:
                records.append((t0, time.monotonic(), status, body, headers))
    targets, replied = [(-math.inf, 2)], []  # (rollback sent, its target); its reply's time
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(load) for _ in range(threads)]
        time.sleep(pause_s)
        with client(server, "alice") as alice:
            for i in range(flips):
                sent = time.monotonic()
                alice.rollback(name, 1 if i % 2 == 0 else 2)
                targets.append((sent, 1 if i % 2 == 0 else 2))
                replied.append(time.monotonic())
                time.sleep(pause_s)
        stop.set()
        for f in futures:
            f.result()
    until = replied + [math.inf]

    def good(t0, t1, status, body, headers) -> bool:
        version = headers.get("x-lora-version", "")
        held = {str(v) for (sent, v), end in zip(targets, until) if sent <= t1 and end >= t0}
        return version in held and body["choices"][0]["text"] == texts[int(version)]
    counts = {"requests": len(records), "rollbacks": flips,
              # in flight while a rollback was being made
              "across_a_rollback": sum(1 for r in records if any(
                  sent <= r[1] and r[0] <= end for (sent, _), end in zip(targets[1:], replied))),
              "failed": sum(1 for r in records if r[2] != 200),
              "wrong": sum(1 for r in records if r[2] == 200 and not good(*r))}
    print(f"rollback under load ({server.engine}, {threads} threads): {counts}")
    return counts


def test_rollback_is_atomic_under_load(shared, adapters):
    """Requests on the alias run without pause while it is pointed back and forth between
    two versions: none fails, and each reply is of a version that was the alias target
    during the request, with that version's weights."""
    with client(shared, "alice") as alice:
        alice.push(adapters[0], "alice-live", transport="tensors")
        alice.push(adapters[1], "alice-live", transport="tensors")
    counts = rollbacks_under_load(shared, "alice-live", {1: served_text(adapters[0]),
                                                         2: served_text(adapters[1])},
                                  threads=8, flips=12, pause_s=0.15, max_requests=10_000,
                                  fake_delay_s=0.01)
    assert counts["requests"] > 100 and counts["across_a_rollback"] > 12, counts
    assert counts["failed"] == counts["wrong"] == 0, counts


def test_cli_rollback_and_ls_show_the_callers_view(shared, adapters, capsys):
    from lora_sync.trainer import cli
    with client(shared, "bob") as bob:
        bob.push(adapters[0], "bob-cli", transport="tensors")
        bob.push(adapters[1], "bob-cli", transport="tensors")
    with client(shared, "alice") as alice:
        alice.push(adapters[2], "alice-cli", transport="tensors")
    base = ["--server", shared.url, "--engine", "vllm", "--api-key", KEYS["bob"]]
    assert cli.main(base + ["rollback", "bob-cli", "1", "--pin"]) == 0
    assert "bob-cli -> bob-cli-v1 (pinned)" in capsys.readouterr().out
    assert cli.main(base + ["ls"]) == 0
    out = capsys.readouterr().out
    assert "bob-cli -> bob-cli-v1 (pinned)" in out and "alice-cli" not in out
    assert cli.main(base + ["rollback", "alice-cli", "1"]) == 1
    assert "not_found" in capsys.readouterr().err
    assert cli.main(base + ["rollback", "bob-cli", "v1"]) == 2


def test_without_a_tenants_file_nothing_changes(fake_server, fake_client, adapters):
    """The operator's key alone: all names, the alias route, listings as before."""
    c = fake_client
    c.push(adapters[0], "plain", transport="tensors")
    c.push(adapters[1], "plain", transport="tensors")
    assert c.rollback("plain", 1)[0]["alias_target"] == "plain-v1"
    assert c.complete(PROMPT, "plain")["version"] == 1
    info = c.info()[0]
    assert "tenant" not in info and not fake_server.service.access.tenancy.enabled
    c.retire("plain")


# -- the invariant fuzz ------------------------------------------------------------------------
WHO = ("alice", "bob", "carol", "dave", "operator")
NAMES = ("alice-a", "alice-b", "alice-c", "bob-a", "carol-a", "dave-a", "shared-eval", "op-a",
         "alice_a", "alicea", "shared-eval2", "BOB-a")  # the last four: just outside a scope
# Keys of no tenant: none, a wrong one, and the engine's own generation key (on a server
# started with --api-key it generates on the names outside every scope, as before tenants).
NOBODY = ("", "wrong-key", GENERATION_KEY)
# Where a generation request names the adapter: `model` (the alias, or the alias target's
# -v<N>), `lora_path`, the SageMaker header.
FORMS = ("model", "versioned", "lora_path", "sagemaker")
# Groups set up by the fuzz; None: init_group()'s default name, in the caller's scope.
GROUPS = (None, "default", "alice-g", "bob-g", "carol-x")


def in_process(machine) -> bool:
    return not machine.over_http


class SharedServer(RuleBasedStateMachine):
    """Random operations by four tenants and the operator; the model says what each
    should see, and every reply and listing is checked against it. On the fake engine;
    RealSharedServer runs the same rules on a real server, over HTTP only (the rules marked
    `in_process` look inside the fake, or cost a real server too much time)."""
    server: FakeEngineServer = None
    adapters: list = []
    over_http = False
    engine_key: str | None = None  # the engine's own --api-key, when it has one

    def __init__(self):
        super().__init__()
        clear(self.server)
        self.tenancy = self.tenancy_of_server()
        self.versions: dict[str, dict[int, int]] = {}  # name -> version -> adapter index
        self.alias: dict[str, int] = {}
        self.pinned: set[str] = set()

    def owner(self, name: str):
        t = self.tenancy.owner_of(name)
        return t.name if t else None

    def sees(self, who: str, name: str) -> bool:
        return who == "operator" or self.owner(name) == who

    def keep(self, name: str) -> int:
        return KEEP if self.owner(name) else int(SERVER_ENV["LORA_SYNC_KEEP_VERSIONS"])

    # -- what the fake engine lets the machine see beyond HTTP (RealSharedServer: HTTP) --
    def tenancy_of_server(self) -> Tenancy:
        return self.server.service.access.tenancy

    def check_text(self, name: str, version: int, text: str) -> None:
        """The reply's tokens are those of the adapter pushed as `version`."""
        assert text == served_text(self.adapters[self.versions[name][version]])

    def check_quotas(self) -> None:
        for tenant in self.tenancy.tenants.values():
            usage = self.server.service.access.usage(tenant)
            for quota in ("names", "leases", "staging_bytes", "groups"):
                assert usage[quota] <= getattr(tenant.quotas, quota), (tenant.name, usage)
        assert not self.server.bridge.violations, self.server.bridge.violations

    def pushed(self, who: str, name: str, pick: int, send) -> None:
        """`send()` pushes adapter `pick` as `name` with `who`'s key, by any transport: its
        reply (or refusal) is checked against the model, and the model follows it."""
        owned = [n for n in self.versions if self.owner(n) == self.owner(name)]
        over = bool(self.owner(name)) and name not in self.versions and len(owned) >= QUOTA_NAMES
        try:
            [r] = send()
        except LoRASyncError as e:
            expected = (404, "not_found") if not self.sees(who, name) else \
                (429, "quota_names") if over else None
            assert (e.status, e.code) == expected, (who, name, e)
            return
        assert self.sees(who, name) and not over, (who, name)
        held = self.versions.setdefault(name, {})
        assert r.name == f"{name}-v{r.version}" and r.version > max(held, default=0)
        held[r.version] = pick
        if name not in self.pinned:
            self.alias[name] = r.version
        window = sorted(held)[-self.keep(name):]
        for v in list(held):
            if v not in window and not (name in self.pinned and v == self.alias[name]):
                del held[v]

    @rule(who=st.sampled_from(WHO), name=st.sampled_from(NAMES),
          transport=st.sampled_from(["tensors", "shm", "shared"]), pick=st.integers(0, 5))
    def push(self, who, name, transport, pick):
        with client(self.server, who) as c:
            self.pushed(who, name, pick,
                        lambda: c.push(self.adapters[pick], name, transport=transport))

    @precondition(in_process)
    @rule(who=st.sampled_from(WHO), group=st.sampled_from(GROUPS), name=st.sampled_from(NAMES),
          pick=st.integers(0, 5), thief=st.sampled_from(("alice", "bob")))
    def broadcast(self, who, group, name, pick, thief):
        """`who` sets up a group (in its scope, or refused naming the scope), is refused a
        second one by its group quota, `thief` cannot end it even with its token, and `name`
        is pushed by broadcast in it; the group ends with the step."""
        group_name = group or (f"{who}-default" if who in LEVELS else "default")
        if not self.sees(who, group_name):  # refused before any rendezvous
            status, body, _ = set_up_group(self.server, who, group_name)
            assert (status, body["error"]["code"]) == (400, "no_group"), body
            assert (who in LEVELS) == ("scope" in body["error"]["message"]), body
            return
        with client(self.server, who) as c:
            made = c.init_group(group_name=group, timeout_s=10)
            assert made.name == group_name
            try:
                if who in LEVELS:
                    reply = set_up_group(self.server, who, f"{who}-second")
                    assert error(reply) == (429, "quota_groups"), reply
                if not self.sees(thief, group_name):
                    reply = post(self.server, "destroy_lora_update_group", thief,
                                 {"group_name": group_name,
                                  "group_token": made.tokens[self.server.url]})
                    assert error(reply) == (400, "no_group"), reply
                self.pushed(who, name, pick, lambda: c.broadcast(self.adapters[pick], name))
            finally:
                c.destroy_group()

    @rule(who=st.sampled_from(WHO), name=st.sampled_from(NAMES))
    def retire(self, who, name):
        reply = post(self.server, "retire_lora_adapter", who, {"lora_name": name})
        if self.sees(who, name) and name in self.versions:
            assert reply[0] == 200, reply
            del self.versions[name]
            self.alias.pop(name, None)
            self.pinned.discard(name)
            with client(self.server, "operator") as op:  # its numbering starts again once drained
                wait_until(lambda: name not in {a["name"] for a in op.adapters()[0]["adapters"]},
                           what=f"{name} drained")
        else:
            assert error(reply) == (404, "not_found"), reply

    @rule(who=st.sampled_from(WHO), name=st.sampled_from(NAMES), back=st.integers(0, 3),
          pin=st.booleans())
    def rollback(self, who, name, back, pin):
        held = sorted(self.versions.get(name, {}))
        version = held[-1 - back] if back < len(held) else (held[0] - 1 if held else 1) or 1
        reply = post(self.server, "lora_sync_alias", who,
                     {"lora_name": name, "version": version, "pin": pin})
        if not self.sees(who, name) or name not in self.versions:
            assert error(reply) == (404, "not_found"), reply
        elif version not in held:
            assert error(reply) == (404, "version_retired"), reply
        else:
            assert reply[0] == 200 and reply[1]["alias_target"] == f"{name}-v{version}"
            self.alias[name] = version
            self.pinned.discard(name)
            if pin:
                self.pinned.add(name)

    @rule(who=st.sampled_from(WHO + NOBODY), name=st.sampled_from(NAMES),
          form=st.sampled_from(FORMS))
    def generate(self, who, name, form):
        target = self.alias.get(name)
        model = f"{name}-v{target}" if form == "versioned" and target else name
        if form == "lora_path":
            reply = complete(self.server, who, BASE_MODEL, lora_path=model, temperature=0)
        elif form == "sagemaker":
            reply = complete(self.server, who, BASE_MODEL, {SAGEMAKER_HEADER: model},
                             temperature=0)
        else:
            reply = complete(self.server, who, model, temperature=0)
        status, body, headers = reply
        if self.engine_key and who in NOBODY and who != self.engine_key:
            assert status == 401, (who, model, reply)  # the engine's key middleware
            return
        if form == "sagemaker" and self.server.engine == "sglang":  # a header it never reads
            assert error(reply) == (400, "bad_request"), reply
            return
        owner, level = self.owner(name), LEVELS.get(who)
        allowed = who == "operator" or level == "all" or \
            (level in ("own", None) and owner is None) or (level == "own" and owner == who)
        if not allowed and (owner is not None or target is not None):
            # never a hint that it exists
            assert (status, error(reply)[1]) == (404, "model_not_found"), (who, model, reply)
            return
        if target is None:  # not there (retired, or never pushed); unscoped: the engine's
            assert "x-lora-version" not in headers and (status == 404 or owner is None and form
                                                        in ("lora_path", "sagemaker")), reply
            return
        if form == "lora_path":
            # The fake engine reads `model` only, as vLLM does: it would serve the base model
            # under the adapter's name, so the request is refused (server/applied.py).
            assert error(reply) == (400, "route_ignores_adapter"), (who, model, reply)
            return
        assert status == 200, (who, model, form, body)
        assert headers["x-lora-version"] == str(target)
        if form in ("model", "versioned"):  # the other forms: the engine may read `model`
            self.check_text(name, target, body["choices"][0]["text"])

    @rule(who=st.sampled_from(("alice", "bob", "carol")), other=st.sampled_from(("alice", "bob")))
    def leases_to_the_quota(self, who, other):
        """`who` opens leases up to its quota and one more (refused); meanwhile `other`
        still gets one and cannot touch `who`'s; all cancelled at the end."""
        granted = []
        try:
            for i in range(QUOTA_LEASES + 1):
                reply = post(self.server, "lora_sync_lease", who, {"nbytes": 4096,
                                                                   "client": f"c{i}"})
                if i < QUOTA_LEASES:
                    assert reply[0] == 200, reply
                    granted.append((who, reply[1]))
                else:
                    assert error(reply) == (429, "quota_leases")
            if other != who:
                reply = post(self.server, "lora_sync_lease", other, {"nbytes": 4096})
                assert reply[0] == 200, reply
                granted.append((other, reply[1]))
                ticket = {k: granted[0][1][k] for k in ("lease_id", "token")}
                assert error(post(self.server, "lora_sync_lease_cancel", other, ticket)) == \
                    (404, "unknown_lease")
        finally:
            cancel(self.server, granted)

    @rule(who=st.sampled_from(("alice", "dave")), held=st.sampled_from((4096, STAGING // 2)))
    def staging_to_the_quota(self, who, held):
        """A lease holding `held` bytes of `who`'s max_staging_mb, then one of a page more
        than what is left (429 quota_staging) and one of exactly what is left (granted):
        the quota is reached, never passed."""
        granted = []
        try:
            for nbytes, code in ((held, None), (STAGING - held + 4096, "quota_staging"),
                                 (STAGING - held, None)):
                reply = post(self.server, "lora_sync_lease", who, {"nbytes": nbytes})
                if code is None:
                    assert reply[0] == 200, reply
                    granted.append((who, reply[1]))
                else:
                    assert error(reply) == (429, code), reply
        finally:
            cancel(self.server, granted)

    @precondition(in_process)
    @rule(who=st.sampled_from(("alice", "bob")), other=st.sampled_from(("bob", "carol")))
    def pushes_to_the_rate(self, who, other):
        """`who` one push short of its pushes_per_minute: one more push starts (an shm
        lease: a push's first step), the next gets 429 quota_pushes, and `other` still
        pushes. (The minute is filled in the fake's ledger: the rate is set high for the
        other rules.)"""
        times = self.server.service.access.tenancy.pushes[who]
        kept = list(times)
        times.clear()
        times.extend([time.monotonic()] * (PUSH_RATE - 1))
        granted = []
        try:
            for caller, status in [(who, 200), (who, 429)] + [(other, 200)] * (other != who):
                reply = post(self.server, "lora_sync_lease", caller, {"nbytes": 4096})
                if status == 200:
                    assert reply[0] == 200, reply
                    granted.append((caller, reply[1]))
                else:
                    assert error(reply) == (429, "quota_pushes"), reply
        finally:
            times.clear()
            times.extend(kept)
            cancel(self.server, granted)

    @rule(key=st.sampled_from(["", "wrong", KEYS["alice"] + " ", sha(KEYS["alice"])]))
    def wrong_key(self, key):
        for route in ("retire_lora_adapter", "lora_sync_alias"):
            assert error(post(self.server, route, key, {"lora_name": "alice-a"}))[0] == 401
        status, _, _ = http.request("GET", route_url(self.server, "lora_adapters"),
                                    headers=auth(key))
        assert status == 401

    @invariant()
    def listings_are_each_callers_view(self):
        for who in WHO:
            status, listing, _ = http.request("GET", route_url(self.server, "lora_adapters"),
                                              headers=auth(who))
            assert status == 200, listing
            seen = {a["name"]: a for a in listing["adapters"]}
            expected = {n for n in self.versions if self.sees(who, n)}
            assert set(seen) == expected, (who, set(seen), expected)
            for name in expected:
                entry = seen[name]
                assert {v["version"] for v in entry["versions"]} == set(self.versions[name]), \
                    (name, entry, self.versions[name])
                assert entry["alias_target"] == f"{name}-v{self.alias[name]}"
                assert entry["pinned"] == (name in self.pinned)

    @invariant()
    def quotas_hold(self):
        self.check_quotas()


class RealSharedServer(SharedServer):
    """The same rules and invariants on a real engine, over HTTP: the tenants from the file
    the server was started with, quotas from each tenant's own lora_sync_info, and a reply's
    tokens compared with what the same adapter generated before (greedy, one request at a
    time: the real tokens are not known ahead)."""
    texts: dict[int, str] = {}  # adapter index -> its greedy completion on this server
    over_http = True

    @initialize()
    def a_name_each(self):
        """Each (short) example starts with a name of alice's, bob's and the operator's,
        each generated on once: its steps then meet live names, replies and quotas."""
        for who, name, pick in (("alice", "alice-a", 0), ("bob", "bob-a", 1),
                                ("operator", "op-a", 2)):
            self.push(who, name, "tensors", pick)
            self.generate(who, name, "model")
            assert self.versions[name] and pick in self.texts

    def tenancy_of_server(self) -> Tenancy:
        return Tenancy(tuple(load_tenants_from_text(tenants_toml())), API_KEY)

    def check_text(self, name: str, version: int, text: str) -> None:
        pick = self.versions[name][version]
        assert self.texts.setdefault(pick, text) == text, (name, version, pick, self.texts)

    def check_quotas(self) -> None:
        for who in LEVELS:
            with client(self.server, who) as c:
                tenant = c.info()[0]["tenant"]
            for quota in ("names", "leases", "staging_bytes", "groups"):
                assert tenant["usage"][quota] <= tenant["quotas"][quota], (who, tenant)
            assert tenant["usage"]["names"] == sum(1 for n in self.versions
                                                   if self.owner(n) == who), (who, tenant)


def test_the_shared_server_fuzz(shared, adapters):
    SharedServer.server, SharedServer.adapters = shared, adapters
    runner = SharedServer.TestCase
    runner.settings = settings(max_examples=int(os.environ.get("TENANT_FUZZ_EXAMPLES", 12)),
                               stateful_step_count=12, deadline=None,
                               suppress_health_check=list(HealthCheck))
    runner().runTest()


# -- real engines: two tenants and the operator on one server ----------------------------------
# Extended (CI time: a server of its own per engine): tenancy is lora-sync's own admission and
# service, the same on both engines and fuzzed in process; the one engine seam, its key
# middleware letting tenants' keys through, is tested in process against vLLM's own class
# (test_vllm_seams). These prove it all on real engines.
@pytest.fixture(scope="module", params=[pytest.param("vllm", marks=pytest.mark.extended),
                                        pytest.param("sglang", marks=pytest.mark.extended)])
def tenant_server(request, model_dir, tmp_path_factory):
    """A real server of its own with a tenants file (the session's shared servers have
    none), stopped at the end of this module's tests on it. Each runs with its engine's own
    --api-key too (`engine_key`): tenants' keys and the operator's pass its middleware."""
    from .conftest import real_server
    path = write_tenants(tmp_path_factory.mktemp("real-tenants"), tenants_toml())
    engine_key = GENERATION_KEY
    with real_server(request.param, model_dir, {**SERVER_ENV, "LORA_SYNC_TENANTS": path},
                     ("--api-key", engine_key) if engine_key else ()) as server:
        server.engine_key = engine_key
        yield server


def test_two_tenants_and_the_operator_share_a_real_server(tenant_server, make_adapter):
    """Push on each tenant's key, generate its own, the other's names answered as absent,
    rollback (and rollback under load, measured), and the operator sees both; every key
    through the engine's own --api-key middleware: a tenant's generates within its generate
    level, a wrong one gets 401."""
    s = tenant_server
    a1, a2, b1 = (make_adapter(seed=4700 + i) for i in range(3))
    with LoRASyncClient(s.url, engine=s.engine, api_key=KEYS["alice"]) as alice, \
            LoRASyncClient(s.url, engine=s.engine, api_key=KEYS["bob"]) as bob, \
            LoRASyncClient(s.url, engine=s.engine, api_key=API_KEY) as op:
        alice.push(a1, "alice-real", transport="tensors")
        alice.push(a2, "alice-real", transport="shm")
        bob.push(b1, "bob-real", transport="tensors")
        check_metrics_are_the_operators(s, {"alice-real", "bob-real"})
        v2 = alice.complete(PROMPT, "alice-real", 8)
        assert v2["version"] == 2
        assert bob.complete(PROMPT, "bob-real", 8)["version"] == 1
        for call in (lambda: bob.complete(PROMPT, "alice-real", 8),
                     lambda: bob.complete(PROMPT, "alice-real-v1", 8),
                     lambda: bob.retire("alice-real"),
                     lambda: bob.rollback("alice-real", 1),
                     lambda: bob.push(b1, "alice-real", transport="tensors")):
            with pytest.raises(LoRASyncError) as e:
                call()
            assert e.value.status == 404, e.value
        check_keys_and_routes_on_a_real_server(s)
        assert {a["name"] for a in bob.adapters()[0]["adapters"]} == {"bob-real"}
        texts = {v: complete(s, "alice", f"alice-real-v{v}", temperature=0)[1]["choices"][0]
                 ["text"] for v in (1, 2)}
        counts = rollbacks_under_load(s, "alice-real", texts, threads=3, flips=8, pause_s=0.3,
                                      max_requests=150)
        assert counts["across_a_rollback"] >= 8 and counts["failed"] == counts["wrong"] == 0, \
            counts
        alice.rollback("alice-real", 1)
        v1 = alice.complete(PROMPT, "alice-real", 8)
        assert v1["version"] == 1
        assert v1["text"] == alice.complete(PROMPT, "alice-real-v1", 8)["text"]
        assert {a["name"] for a in op.adapters()[0]["adapters"]} == {"alice-real", "bob-real"}
        assert op.complete(PROMPT, "bob-real", 8)["version"] == 1
        alice.retire("alice-real")
        bob.retire("bob-real")
    assert s.alive(), s.log_tail()


def check_keys_and_routes_on_a_real_server(s) -> None:
    """alice's alice-real at v2, bob's bob-real: each key on the real engine's generation
    routes (its --api-key middleware first), alice-real named in every form the engine
    reads (SGLang's base:adapter, vLLM's SageMaker header on /invocations, which that
    middleware skips: admission answers a request without a tenant's key there), on
    completions and chat."""
    def check(who: str, model: str, want, headers=None, route="/v1/completions"):
        reply = complete(s, who, model, headers, route)
        assert (reply[0] if isinstance(want, int) else error(reply)) == want, \
            (who, model, headers, route, reply)
        if reply[0] == 200:  # the version admission gave it; none for the base model
            assert reply[2].get("x-lora-version") == (None if model == BASE_MODEL and not
                                                      headers else "2"), reply
    hidden = (404, "model_not_found")
    guarded = 401 if s.engine_key else hidden  # no key or a wrong one, on alice-real
    forms = [("alice-real", None, route, guarded) for route in GENERATION_ROUTES[:2]]
    if s.engine == "sglang":
        forms += [(f"{BASE_MODEL}:alice-real", None, route, guarded)
                  for route in ("/v1/chat/completions", "/invocations")]
    else:
        forms += [(BASE_MODEL, {SAGEMAKER_HEADER: "alice-real"}, "/invocations", hidden)]
    for model, headers, route, no_key in forms:
        for who, want in (("alice", 200), ("carol", 200), ("operator", 200), ("bob", hidden),
                          ("dave", hidden), (GENERATION_KEY, hidden), ("", no_key),
                          ("wrong-key", no_key), (KEYS["alice"] + "x", no_key)):
            check(who, model, want, headers, route)
    for who, want in (("dave", 200), (GENERATION_KEY, 200), ("bob", 200),
                      ("", 401 if s.engine_key else 200), ("wrong-key", 401 if s.engine_key
                                                           else 200)):
        check(who, BASE_MODEL, want)  # the base model: every key the engine lets through
    check("dave", "bob-real", hidden)  # generate = "base": no adapter at all
    assert listed_models(s, "dave") == {BASE_MODEL}
    assert not any(m.startswith("alice") for m in listed_models(s, "bob"))


def test_the_shared_server_fuzz_on_a_real_server(tenant_server, adapters):
    """The invariant fuzz above, shorter, on the real server of each engine kind: the same
    rules (pushes on tensors and shm, retires, rollbacks and pins, generation with every
    key, leases to the quota, wrong keys, names just outside a scope) and invariants, over
    HTTP. TENANT_REAL_FUZZ_EXAMPLES (default 15) x 10 steps, not shrunk (a failure shows
    its steps as found): a few seconds per engine on the tiny CPU model."""
    s = tenant_server
    RealSharedServer.server, RealSharedServer.adapters = s, adapters
    RealSharedServer.engine_key = s.engine_key
    RealSharedServer.texts = {}
    runner = RealSharedServer.TestCase
    runner.settings = settings(max_examples=int(os.environ.get("TENANT_REAL_FUZZ_EXAMPLES", 15)),
                               stateful_step_count=10, deadline=None, database=None,
                               phases=(Phase.explicit, Phase.generate),
                               suppress_health_check=list(HealthCheck))
    try:
        runner().runTest()
    finally:
        clear(s)
    assert s.alive(), s.log_tail()


def test_metrics_per_tenant(shared, adapters):
    """Pushes, bytes and refusals by code per tenant, and each quota's use and limit; the
    label values are the file's tenants and "operator" only."""
    from prometheus_client import REGISTRY

    from lora_sync.server import metrics
    assert metrics.install(shared.service)

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0
    pushes, refused = sample("lora_sync_tenant_pushes_total", tenant="alice"), \
        sample("lora_sync_tenant_refusals_total", tenant="alice", code="not_found")
    with client(shared, "alice") as alice:
        [r] = alice.push(adapters[0], "alice-m", transport="tensors")
    post(shared, "retire_lora_adapter", "alice", {"lora_name": "bob-m"})
    assert sample("lora_sync_tenant_pushes_total", tenant="alice") == pushes + 1
    assert sample("lora_sync_tenant_push_bytes_total", tenant="alice") >= r.bytes
    assert sample("lora_sync_tenant_refusals_total", tenant="alice", code="not_found") == \
        refused + 1
    use = dict(next(s for n, _, _, s in metrics.state_samples()
                    if n == "lora_sync_tenant_quota_use"))
    assert use[("alice", "names")] == 1 and use[("bob", "names")] == 0
    tenants = {labels.get("tenant") for m in REGISTRY.collect() if m.name.startswith(
        "lora_sync_tenant") for s in m.samples for labels in [s.labels]}
    assert tenants <= {*LEVELS, "operator"}


def test_metrics_are_the_operators_alone(shared, adapters, fake_server):
    """/metrics labels name adapters (and tenants), and needs no key on either engine: with
    tenants it is the operator's alone (admission: one rule for every label, the engine's
    own included). Without a tenants file it stays open, as the engine serves it."""
    from lora_sync.server import metrics
    assert metrics.install(shared.service)
    with client(shared, "alice") as alice, client(shared, "bob") as bob:
        alice.push(adapters[0], "alice-scraped", transport="tensors")
        bob.push(adapters[1], "bob-scraped", transport="tensors")
    check_metrics_are_the_operators(shared, {"alice-scraped", "bob-scraped"})
    assert scrape(fake_server, "")[0] == 200  # no tenants: unchanged
