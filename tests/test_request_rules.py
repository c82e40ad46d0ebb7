"""Two rules over random requests, in process on the FAKE engine (tests/engine_fakes.py):

- every JSON body, on every route (ours, the engine's adapter routes, generation through
  admission), that names a key twice is a 400: which one would count is a parser's choice;
- no request, successful or not, leaves state behind that outlives it, unless that state is
  bounded and named here (BOUNDED)."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lora_sync import http
from lora_sync.server import registry as registry_module
from lora_sync.server.routes import ALIAS_ROUTE, RETIRE_ROUTE, TRANSPORT_ROUTES
from lora_sync.transports import shm

from .helpers import AUTH, PROMPT

# Every route that reads a JSON object: each of ours (but the streamed pushes), the engine's
# own adapter routes and a generation route (admission reads those bodies).
OUR_JSON_ROUTES = sorted(p for p, (_, r) in TRANSPORT_ROUTES.items() if not r.stream) \
    + [RETIRE_ROUTE, ALIAS_ROUTE]
ENGINE_JSON_ROUTES = ["/load_lora_adapter", "/unload_lora_adapter", "/completions"]
# A plausible body per route: the duplicate is put into a body that is otherwise fine.
BODY_KEYS = ["lora_name", "nbytes", "lease_id", "token", "model", "prompt", "client",
             "lora_path", "version", "max_tokens"]


def with_duplicate(body: dict, key: str, values: tuple, nested: bool) -> str:
    """JSON text of `body` with `key` given twice (at the top level, or in `parameters`)."""
    pair = ", ".join(f"{json.dumps(key)}: {json.dumps(v)}" for v in values)
    inner = json.dumps(body)[1:-1]
    if nested:
        return "{" + inner + (", " if inner else "") + '"parameters": {' + pair + "}}"
    return "{" + inner + (", " if inner else "") + pair + "}"


def state_sizes(service) -> dict[str, int]:
    """The size of every container the service (and its version book and lease table)
    holds: what a request could leave behind."""
    sizes = {}
    owners = {"service": service, "registry": service.registry, "access": service.access,
              "tenancy": service.access.tenancy, "book": service.registry.book}
    owners.update({f"ctx.{n}": c.state for n, c in service.contexts.items()
                   if hasattr(c.state, "__dict__")})
    for owner_name, owner in owners.items():
        for attr, value in vars(owner).items():
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
                continue
            try:
                sizes[f"{owner_name}.{attr}"] = len(value)
            except TypeError:
                continue
    return sizes


@pytest.fixture(scope="module")
def fake():
    """This module's own server on the fake engine (its state is measured). Not named
    `server`: conftest marks that name `server` (real engines), and these run in process."""
    from .engine_fakes import FakeEngineServer
    with FakeEngineServer() as s:
        yield s


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(OUR_JSON_ROUTES + ENGINE_JSON_ROUTES),
       key=st.sampled_from(BODY_KEYS) | st.text(min_size=1, max_size=8),
       values=st.tuples(st.one_of(st.text(max_size=8), st.integers(), st.none()),
                        st.one_of(st.text(max_size=8), st.integers(), st.none())),
       nested=st.booleans())
def test_every_json_body_naming_a_key_twice_is_a_400(fake, route, key, values, nested):
    before = fake.service.list_adapters()
    body = {"prompt": PROMPT} if route == "/completions" else {}
    status, reply, _ = http.request(
        "POST", f"{fake.url}/v1{route}", chunks=[with_duplicate(body, key, values, nested)
                                                   .encode()],
        headers={**AUTH, "Content-Type": "application/json"})
    assert status == 400, (route, status, reply)
    assert reply["error"]["code"] == "bad_request" and "twice" in reply["error"]["message"]
    assert fake.service.list_adapters() == before


# State a request may leave on purpose, each bounded by the named limit.
BOUNDED = {"registry.retired_names": registry_module.RETIRED_NAMES_KEPT,
           "book.floors": registry_module.RETIRED_NAMES_KEPT}


def random_requests(fake, rng: random.Random, n: int) -> None:
    """Requests of every kind that a client can send without pushing an adapter: unknown
    names and versions, leases granted then dropped, bad tickets, bad bodies."""
    url = f"{fake.url}/v1"
    for _ in range(n):
        name = "".join(rng.choice("abcxyz-_0123") for _ in range(rng.randint(1, 12)))
        kind = rng.randrange(9)
        if kind == 0:
            http.request("POST", f"{url}{RETIRE_ROUTE}", headers=AUTH,
                         json_body={"lora_name": name})
        elif kind == 1:
            http.request("POST", f"{url}/completions", json_body={
                "model": rng.choice([name, f"{name}-v{rng.randint(1, 9)}"]),
                "prompt": PROMPT, "max_tokens": 1})
        elif kind == 2:
            status, reply, _ = http.request("POST", f"{url}/{shm.LEASE_ROUTE}", headers=AUTH,
                                            json_body={"nbytes": 4096, "client": name})
            if status == 200 and rng.random() < 0.7:
                http.request("POST", f"{url}/{shm.CANCEL_ROUTE}", headers=AUTH,
                             json_body={"lease_id": reply["lease_id"],
                                        "token": reply["token"]})
        elif kind == 3:
            http.request("POST", f"{url}/{shm.COMMIT_ROUTE}", headers=AUTH,
                         json_body={"lease_id": "%032x" % rng.getrandbits(128),
                                    "token": "%064x" % rng.getrandbits(256)})
        elif kind == 4:
            http.request("POST", f"{url}/load_lora_adapter_from_tensors", headers={
                **AUTH, "Content-Type": "application/octet-stream"},
                chunks=[rng.randbytes(rng.randint(0, 64))])
        elif kind == 5:
            http.request("POST", f"{url}/load_lora_adapter", headers=AUTH,
                         json_body={"lora_name": name, "lora_path": f"/nonexistent/{name}"})
        elif kind == 6:
            http.request("POST", f"{url}/{shm.RENEW_ROUTE}", headers=AUTH,
                         json_body={"lease_id": name, "token": name})
        elif kind == 7:
            http.request("POST", f"{url}{ALIAS_ROUTE}", headers=AUTH,
                         json_body={"lora_name": name, "version": rng.choice([None, 1, 7]),
                                    "pin": rng.random() < 0.5})
        else:
            http.request("POST", f"{url}/load_lora_adapter_from_shared", headers=AUTH,
                         json_body={"path": f"/proc/{rng.randint(1, 99999)}/fd/3",
                                    "nbytes": 4096, "claim": "%064x" % rng.getrandbits(256)})


def test_no_request_leaves_state_behind(fake):
    """After a warm-up, 400 more random requests leave every container of the service as
    large as it was, but for the named bounded ones (leases dropped by their holders expire
    within the test servers' TTL, so the lease table is measured after it)."""
    rng = random.Random(43)
    random_requests(fake, rng, 50)
    service = fake.service
    wait_leases_gone(fake)
    before = state_sizes(service)
    random_requests(fake, rng, 400)
    wait_leases_gone(fake)
    after = state_sizes(service)
    grown = {k: (before.get(k), v) for k, v in after.items()
             if v > before.get(k, 0) and k not in BOUNDED}
    assert not grown, f"requests left state behind: {grown}"
    for k, bound in BOUNDED.items():
        assert after.get(k, 0) <= bound, (k, after.get(k))


def wait_leases_gone(fake, timeout_s: float = 15.0) -> None:
    import time
    deadline = time.monotonic() + timeout_s
    while fake.service.contexts["shm"].state.pending:
        assert time.monotonic() < deadline, "leases outlived their TTL"
        time.sleep(0.1)


# Fields of the routes this change added, with values of the wrong type or range.
BAD_FIELDS = [
    (ALIAS_ROUTE, {"lora_name": 5, "version": 1}),
    (ALIAS_ROUTE, {"lora_name": "x", "version": "abc"}),
    (ALIAS_ROUTE, {"lora_name": "x", "version": 2 ** 64}),
    (ALIAS_ROUTE, {"lora_name": "x", "version": -1}),
    (ALIAS_ROUTE, {"lora_name": "x", "version": 1, "pin": "yes"}),
    (ALIAS_ROUTE, {"lora_name": "x" * 10_000, "version": 1}),
    ("/load_lora_adapter_from_shared", {"path": 5, "nbytes": 4096, "claim": "a" * 64}),
    ("/load_lora_adapter_from_shared", {"path": "/proc/1/fd/3", "nbytes": "big",
                                        "claim": "a" * 64}),
    ("/load_lora_adapter_from_shared", {"path": "/proc/1/fd/3", "nbytes": 2 ** 70,
                                        "claim": "a" * 64}),
    ("/load_lora_adapter_from_shared", {"path": "/etc/shadow", "nbytes": 4096,
                                        "claim": "a" * 64}),
    ("/load_lora_adapter_from_shared", {"path": "/proc/1/fd/3", "nbytes": 4096,
                                        "claim": ["x"]}),
]


@pytest.mark.parametrize("route, body", BAD_FIELDS)
def test_the_added_routes_check_every_field(fake, route, body):
    """Wrong types, huge values, paths outside /proc: a 4xx naming the problem, never a
    5xx; without the key, 401; nothing changes."""
    before = fake.service.list_adapters()
    status, reply, _ = http.request("POST", f"{fake.url}/v1{route}", headers=AUTH,
                                    json_body=body)
    assert 400 <= status < 500, (route, body, status, reply)
    assert reply["error"]["message"]
    status, _, _ = http.request("POST", f"{fake.url}/v1{route}", json_body=body)
    assert status == 401
    assert fake.service.list_adapters() == before
