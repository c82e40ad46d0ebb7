"""Shared by the test_service_*.py suites: lora-sync's server rules, in process, on a FAKE
engine (tests/engine_fakes.py).

The real client talks HTTP to the real routes, admission, AdapterService, transports and
worker dispatcher; only the engine is fake: its "model" is a hash of the weights the workers
hold, and its completion text is that hash. So these tests check lora-sync's own logic
(names, versions, the retention window, retire, leases, limits, keys, error replies, what
is freed when) in milliseconds, and say nothing about what a real engine generates: the
tests marked `server` (test_versions, test_tensors, test_attacks, test_integrity, test_shm,
test_broadcast, ...) check that on vLLM and SGLang. Where a real-server test checks the
same logic, the test here names it; where none is named, the check here is the only one.

Here: the suites' settings, small helpers, and `clean_slate`, the autouse fixture every
test_service_*.py module imports (an imported autouse fixture applies to that module)."""
from __future__ import annotations

import pytest

from lora_sync import NotFound, http
from lora_sync.server import registry as registry_module

from .conftest import SERVER_ENV
from .helpers import PROMPT, wait_until

KEEP = int(SERVER_ENV["LORA_SYNC_KEEP_VERSIONS"])
MAX_BODY = int(float(SERVER_ENV["LORA_SYNC_MAX_BODY_MB"]) * 2 ** 20)
TENSORS = "load_lora_adapter_from_tensors"
DISTRIBUTED = "load_lora_adapter_from_distributed"
INIT_GROUP = "init_lora_update_group"


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


def open_leases(client) -> int:
    return client.info()[0]["open_leases"]


def inflight(client, served: str) -> int:
    for a in client.adapters()[0]["adapters"]:
        for v in a["versions"]:
            if v["served_name"] == served:
                return v["inflight"]
    return 0


def retire_first(c, make_adapter, name: str, seed: int) -> int:
    """Pushes KEEP + 1 versions of `name`: v1 retires. Returns v1's adapter id."""
    c.push(make_adapter(seed=seed), name, transport="tensors")
    [v1_id] = adapter_ids(c, name)
    for i in range(KEEP):
        c.push(make_adapter(seed=seed + 1 + i), name, transport="tensors")
    return v1_id


def free_timing(monkeypatch, quiet_s: float, max_s: float) -> None:
    """The service's FREE_QUIET_S and FREE_DEFER_MAX_S for one test."""
    monkeypatch.setattr(registry_module, "FREE_QUIET_S", quiet_s)
    monkeypatch.setattr(registry_module, "FREE_DEFER_MAX_S", max_s)


@pytest.fixture(autouse=True)
def clean_slate(fake_server, fake_client):
    """After each test: the shared fake server is alive, the fake engine saw nothing a real
    one would crash on, and every name is retired and drained (tests stay independent and
    the server's name limit is never reached by the suite)."""
    yield
    problems = list(fake_server.bridge.violations)
    fake_server.bridge.violations.clear()
    assert fake_server.alive(), fake_server.log_tail()
    if fake_client.states["broadcast"].group is not None:
        fake_client.destroy_group()
    for entry in fake_client.adapters()[0]["adapters"]:
        try:
            fake_client.retire(entry["name"])
        except NotFound:
            pass  # already retired, still draining
    wait_until(lambda: not fake_client.adapters()[0]["adapters"], what="every name drained")
    assert not problems, problems
