"""Broadcast groups (their fields, trainer addresses, ownership, rendezvous) and servers with
several workers, in process on the FAKE engine
(tests/service_helpers.py says what these suites check)."""
from __future__ import annotations

import time

import pytest

from lora_sync import BadAdapter, LoRASyncClient, LoRASyncError, http

from .engine_fakes import BASE_TEXT, served_text
from .helpers import (AUTH, PROMPT, Background, blackhole, greedy, try_to_take_a_group,
                      versions_of, wait_until)
from .service_helpers import DISTRIBUTED, INIT_GROUP, route, listing, adapter_ids, error_of
from .service_helpers import clean_slate  # noqa: F401  (autouse: it applies to this module)


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
    """A trainer address that is not allowed (LORA_SYNC_ALLOWED_TRAINERS) or resolves to
    nothing is refused (403 trainer_not_allowed, or 400) before any worker dials it."""
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
    """The logic of
    test_attacks.py::test_rendezvous_blackhole_neither_blocks_generation_nor_outlives_its_timeout
    with a 1 s group timeout."""
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
