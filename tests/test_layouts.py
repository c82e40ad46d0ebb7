"""A broadcast names a layout its group declared before instead of listing every tensor
again (transports/broadcast.py, Groups.layout_of): in process, on the FAKE engine (see
tests/engine_fakes.py; test_broadcast.py pushes the same way to real vLLM and SGLang and
checks their tokens against disk).

The rule, held by construction: what the workers receive into is always a declaration the
group's owner made over HTTP and the server checked (size limit, model); a push can name only
the layout its own group's last successful push declared (a refused push changes nothing),
and a push that names anything else is refused with a 400 before any worker is asked to
receive."""
from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import BadAdapter, LoRASyncClient, LoRASyncError, collective, http
from lora_sync.wire import TensorSpec

from .engine_fakes import served_text
from .helpers import AUTH, greedy

LOAD = "load_lora_adapter_from_distributed"
RUNS = itertools.count()  # each example's own names and groups


@pytest.fixture
def sent_bodies(monkeypatch):
    """Every JSON body the client posts to the broadcast load route, in order."""
    bodies, call = [], http.call

    def recording(method, url, **kw):
        if url.endswith(LOAD):
            bodies.append(kw.get("json_body"))
        return call(method, url, **kw)
    monkeypatch.setattr(http, "call", recording)
    return bodies


def test_a_layout_is_declared_once_then_named(make_fake_server, make_adapter, sent_bodies):
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.init_group(timeout_s=20)
        for seed in (1, 2, 3):
            c.broadcast(make_adapter(seed), "lay")
        assert greedy(c, "lay") == served_text(make_adapter(3))
        assert greedy(c, "lay-v2") == served_text(make_adapter(2))
        c.broadcast(make_adapter(4, rank=16), "lay")  # another layout: declared again
        c.broadcast(make_adapter(5, rank=16), "lay")
        assert greedy(c, "lay") == served_text(make_adapter(5, rank=16))
        c.destroy_group()
        c.init_group(timeout_s=20)  # a new group holds no layout yet
        c.broadcast(make_adapter(6, rank=16), "lay")
        assert greedy(c, "lay") == served_text(make_adapter(6, rank=16))
    declared = ["tensors" in b for b in sent_bodies]
    assert declared == [True, False, False, True, False, True], declared
    assert len({b["layout"] for b in sent_bodies}) == 2


NOT_INTS = ["abc", 1.5, True, [1], {"a": 1}, -1, 2 ** 64]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("push"), st.sampled_from([8, 16]), st.integers(0, 3)),
    st.tuples(st.just("name"), st.sampled_from(["random", "earlier", "other_groups"]),
              st.booleans()),
    st.tuples(st.just("contradict"), st.sampled_from([8, 16]), st.booleans()),
    st.tuples(st.just("bad_field"), st.sampled_from(NOT_INTS), st.booleans()),
    st.tuples(st.just("refused"), st.sampled_from(["unknown_module", "rank"]), st.booleans()),
), min_size=1, max_size=8))
def test_a_push_can_name_only_a_layout_its_group_holds(fake_server, make_adapter, ops):
    """Random sequences of honest pushes (two layouts) and raw requests by the group's owner
    that name a layout the group does not hold (a random digest, one it held earlier, the
    other group's), in its own group or the other one; whose `layout` contradicts its
    `tensors`; whose `layout` is not a 64-bit unsigned integer; or that declare tensors the
    server refuses once it has read them (a module the model lacks, a rank above its
    limit). Invariant after every step: a raw request is a 400 and no worker is asked to
    receive; the honest client's next push still lands (its group stays in step); the name
    serves exactly the last honest push."""
    bridge, url = fake_server.bridge, fake_server.url
    run = next(RUNS)
    name = f"lo{run}"
    with LoRASyncClient(url, api_key=fake_server.api_key) as mine, \
            LoRASyncClient(url, api_key=fake_server.api_key) as other:
        mine.init_group(timeout_s=20, group_name=f"g{run}")
        other.init_group(timeout_s=20, group_name=f"h{run}")
        other.broadcast(make_adapter(90, rank=32), f"other{run}")
        groups = {"mine": mine.states["broadcast"].group, "other": other.states["broadcast"].group}
        held_before = []

        def honest(rank, seed):
            adapter = make_adapter(10 * rank + seed, rank=rank)
            mine.broadcast(adapter, name)
            held_before.append(groups["mine"].declared[url])
            return adapter

        last = honest(8, 0)
        for op, a, b in ops:
            if op == "push":
                last = honest(a, b)
                continue
            target = groups["other" if op == "name" and b else "mine"]
            holds = target.declared[url]
            body = {"lora_name": name, "adapter_config": last.config, "transfer_id": 7,
                    "group_name": target.name, "group_token": target.tokens[url]}
            if op == "name":
                body["layout"] = {"random": (holds * 31 + 7) % 2 ** 64,
                                  "earlier": held_before[0],
                                  "other_groups": groups["mine"].declared[url] if b
                                  else groups["other"].declared[url]}[a]
                if body["layout"] == holds:  # (the same shapes: that one it does hold)
                    continue
            elif op == "contradict":
                specs = make_adapter(1, rank=a).specs()
                body["tensors"] = [s.to_json() for s in specs]
                body["layout"] = collective.layout_digest(specs) ^ (1 if b else 2)
            elif op == "refused":  # a declaration the server refuses after reading it
                specs = make_adapter(1, rank=128).specs() if a == "rank" else \
                    [TensorSpec("base_model.model.model.layers.9.mlp.up_proj.lora_A.weight",
                                "F32", (8, 128))]
                body["tensors"] = [s.to_json() for s in specs]
                if b:
                    body["layout"] = collective.layout_digest(specs)
            else:
                body["layout"] = a
                if b:
                    body["tensors"] = [s.to_json() for s in last.specs()]
            intakes = bridge.calls.count("intake")
            status, reply, _ = http.request("POST", mine.servers[0].route(LOAD),
                                            json_body=body, headers=AUTH, timeout=30)
            assert status == 400, (op, a, b, status, reply)
            assert bridge.calls.count("intake") == intakes, "a worker was asked to receive"
            assert greedy(mine, name) == served_text(last)
        last = honest(8, 3)  # still in step after whatever was refused
        assert greedy(mine, name) == served_text(last)
        assert not bridge.violations, bridge.violations



def test_the_trainer_checks_every_changed_layout_again(fake_server, make_adapter, sent_bodies):
    """A group keeps the last layout it checked (TrainerGroup.plan): a push whose tensors or
    config differ from it, even by a config edited in place, is checked again and refused
    before any request or collective call."""
    with LoRASyncClient(fake_server.url, api_key=fake_server.api_key) as c:
        c.init_group(timeout_s=20)
        adapter = make_adapter(1)
        c.broadcast(adapter, "chk")
        adapter.config["target_modules"] = [*adapter.config["target_modules"], "no_such_proj"]
        with pytest.raises(BadAdapter, match="no_such_proj"):
            c.broadcast(adapter, "chk")
        with pytest.raises(BadAdapter, match="rank"):
            c.broadcast(make_adapter(2, rank=128), "chk")
        c.broadcast(make_adapter(3), "chk")
        assert greedy(c, "chk") == served_text(make_adapter(3))
        c.destroy_group()
    assert len(sent_bodies) == 2


def test_a_push_whose_request_never_left_breaks_the_group_without_waiting(make_fake_server,
                                                                           make_adapter):
    """The trainer starts packing and sending once a request has left (Outgoing.start); when
    none leaves (the server went away), the push still ends with the server's error, well
    inside the group's timeout, and the group is marked broken."""
    server = make_fake_server()
    with LoRASyncClient(server.url, api_key=server.api_key, timeout=60) as c:
        group = c.init_group(timeout_s=30)
        c.broadcast(make_adapter(1), "gone")
        server.stop()
        t0 = time.monotonic()
        with pytest.raises(LoRASyncError) as e:
            c.broadcast(make_adapter(2), "gone")
        assert time.monotonic() - t0 < 15, "the push waited out the group's timeout"
        assert e.value.code in ("unreachable", "connection_failed"), e.value
        assert group.broken
        c.states["broadcast"].group = None  # nothing left to destroy on a stopped server
