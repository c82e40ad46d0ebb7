"""Access control, integrity, concurrency and fuzzing of the added routes (real vLLM)."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import LoRASyncClient, http, wire
from lora_sync.errors import BadAdapter, Unauthorized, VersionConflict

from .helpers import greedy, post_body


def test_admin_routes_need_the_api_key(client, make_adapter):
    client.push(make_adapter(seed=111), "guarded", transport="tensors")
    before = greedy(client, "guarded")
    for key in (None, "wrong-key"):
        with LoRASyncClient(client.servers[0].url, engine=client.servers[0].engine,
                        api_key=key) as intruder:
            with pytest.raises(Unauthorized):
                intruder.push(make_adapter(seed=112), "guarded", transport="tensors")
            with pytest.raises(Unauthorized):
                intruder.init_group()
    assert greedy(client, "guarded") == before
    assert [v["version"] for a in client.adapters()[0]["adapters"] if a["name"] == "guarded"
            for v in a["versions"]] == [1]


def test_checksum_is_verified(client, make_adapter):
    adapter = make_adapter(seed=121)
    assert client.push(adapter, "sum", checksum=True, transport="tensors")[0].version == 1
    before = greedy(client, "sum")
    other = make_adapter(seed=122)
    meta = other.metadata("sum")
    meta["checksum"] = adapter.checksum()  # digest of different weights
    status, reply = post_body(client.servers[0].route("load_lora_adapter_from_tensors"),
                              wire.encode_bytes(other.tensors, meta))
    assert status == 400 and reply["error"]["code"] == "checksum_mismatch"
    assert greedy(client, "sum") == before


def test_concurrent_pushes_of_one_name_are_serialised(client, make_adapter):
    adapters = [make_adapter(seed=130 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda a: client.push(a, "race", transport="tensors")[0], adapters))
    assert sorted(r.version for r in results) == [1, 2, 3, 4, 5, 6]
    newest = max(results, key=lambda r: r.version)
    assert greedy(client, "race") == greedy(client, newest.name)

    def explicit(a):
        try:
            return client.push(a, "race", version=10, transport="tensors")[0].version
        except VersionConflict:
            return "conflict"
    with ThreadPoolExecutor(2) as pool:
        outcomes = sorted(map(str, pool.map(explicit, adapters[:2])))
    assert outcomes == ["10", "conflict"]


def _mutated(body: bytes, cuts, flips, meta_junk):
    b = bytearray(body)
    for pos, val in flips:
        b[pos % len(b)] = val
    if cuts:
        b = b[: cuts % (len(b) + 1)]
    if meta_junk is not None:
        b = bytearray(wire.encode_bytes({}, meta_junk)) + b[8:]
    return bytes(b)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(cuts=st.one_of(st.none(), st.integers(0, 10 ** 6)),
       flips=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), max_size=6),
       meta_junk=st.one_of(st.none(), st.dictionaries(st.sampled_from(
           ["lora_name", "adapter_config", "version", "checksum", "x"]),
           st.text(max_size=30), max_size=4)))
def test_fuzzed_bodies_never_5xx(vllm, make_adapter, cuts, flips, meta_junk):
    base = make_adapter(seed=141)
    body = wire.encode_bytes(base.tensors, base.metadata("fuzz"))
    status, reply = post_body(f"{vllm.url}/v1/load_lora_adapter_from_tensors",
                              _mutated(body, cuts, flips, meta_junk))
    assert status < 500, reply
    assert vllm.healthy()
