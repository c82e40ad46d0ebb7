"""The control plane of a push, per server: the HTTP requests a trainer makes to each server
for one push stay the same in number whatever the fleet's size, for every transport (issue
#46: what scales with N must be the bytes a transport has to move, never extra calls).
Counted at lora_sync.http.exchange, the one place every request of the trainer goes through,
against fake-engine servers in this process (lora-sync's real routes and service)."""
from __future__ import annotations

import collections
import threading
from unittest import mock
from urllib.parse import urlsplit

import pytest

from lora_sync import LoRASyncClient, http

TRANSPORTS = ("tensors", "shm", "shared", "broadcast")


class Counted:
    """Requests per (server, route) while active."""

    def __init__(self):
        self.calls = collections.Counter()
        self._lock = threading.Lock()
        self._real = http.exchange

    def exchange(self, method, url, **kw):
        parts = urlsplit(url)
        with self._lock:
            self.calls[(parts.netloc, parts.path)] += 1
        return self._real(method, url, **kw)

    def per_server(self) -> dict[str, collections.Counter]:
        out = collections.defaultdict(collections.Counter)
        for (server, route), n in self.calls.items():
            out[server][route] += n
        return out


def pushes_per_server(servers, adapter, transport: str, pushes: int = 3) -> list[dict]:
    """The requests each server got over `pushes` pushes after a first one (which sets up
    what a transport keeps: a readied lease, a group)."""
    with LoRASyncClient([s.url for s in servers], api_key=servers[0].api_key) as client:
        if transport == "broadcast":
            client.init_group(timeout_s=20)
        client.push(adapter, f"cp-{transport}", transport=transport)
        counted = Counted()
        with mock.patch.object(http, "exchange", counted.exchange):
            for _ in range(pushes):
                results = client.push(adapter, f"cp-{transport}", transport=transport)
                assert {r.transport for r in results} == {transport}
        if transport == "broadcast":
            client.destroy_group()
    by_server = counted.per_server()
    assert len(by_server) == len(servers)
    return [dict(c) for c in by_server.values()]


# Per transport: the routes a push may call on each server, and how many calls a push makes
# there at most (shm: the commit and the lease it readies for the next push; a push that
# overtakes its ready lease also leases the usual way and cancels the late one).
PER_PUSH = {"tensors": ({"/v1/load_lora_adapter_from_tensors"}, 1),
            "shared": ({"/v1/load_lora_adapter_from_shared"}, 1),
            "broadcast": ({"/v1/load_lora_adapter_from_distributed"}, 1),
            "shm": ({"/v1/lora_sync_lease", "/v1/load_lora_adapter_from_lease",
                     "/v1/lora_sync_lease_cancel", "/v1/lora_sync_lease_renew"}, 4)}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_server_gets_the_same_requests_per_push_whatever_the_fleet_size(
        make_fake_server, make_adapter, transport):
    """One server, then four: each server gets the same few requests per push (tensors,
    shared and broadcast one call, shm its commit and the lease it readies for the next
    one, two more when a push overtakes that lease), on its transport's routes only:
    nothing a push sends grows with the fleet."""
    adapter = make_adapter(seed=71)
    routes, per_push = PER_PUSH[transport]
    pushes = 3
    for fleet in ([make_fake_server()], [make_fake_server() for _ in range(4)]):
        for calls in pushes_per_server(fleet, adapter, transport, pushes):
            assert set(calls) <= routes, calls
            assert pushes <= sum(calls.values()) <= per_push * pushes, (len(fleet), calls)
