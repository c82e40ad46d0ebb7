"""Transport `relay` (lora_sync/relay.py): one copy per node, in process on the FAKE engine.
Two relays (two "nodes") each with two fake servers in this process: a push through the
chain reaches all four servers as one version, each serving exactly the pushed weights, and
each relay's link carries the body once (the relays count the bytes they read and forward).
Then what a caller can make a relay do: no key or a wrong one (401, nothing read), a body too
large (413), a malformed chain (400), a second push while one runs (429), a relay further
down the chain that is gone (its servers fail, the rest keep the version), and a server's
own refusal (its verdict is its own)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from lora_sync import LoRASyncClient, http
from lora_sync.errors import PushFailed
from lora_sync.relay import CHAIN_HEADER, MAX_HOPS, RELAY_PATH, Relay, RelayServer

from .engine_fakes import FakeEngineServer, served_text
from .helpers import AUTH

KEY = AUTH["Authorization"].removeprefix("Bearer ")
ONE = {"url": "http://127.0.0.1:1", "engine": "vllm"}


def served_by(server) -> dict:
    """A chain's entry for a fake server (whose routes are vLLM's)."""
    return {"url": server.url, "engine": "vllm"}
AUTH_LINE = f"Authorization: {AUTH['Authorization']}"


class CountingRelay(Relay):
    """The relay as it runs, counting the body bytes it took in (one copy per push)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.bodies: list[int] = []

    def _push(self, headers, rfile, length, hops):
        self.bodies.append(length)
        return super()._push(headers, rfile, length, hops)


def start_relay(max_body: int = 8 << 20) -> RelayServer:
    server = RelayServer(("127.0.0.1", 0), CountingRelay(KEY, max_body, 60.0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def nodes():
    """[(relay, [two fake servers])] x 2."""
    made = []
    try:
        for _ in range(2):
            made.append((start_relay(), [FakeEngineServer().start() for _ in range(2)]))
        yield made
    finally:
        for relay, servers in made:
            relay.shutdown()
            relay.server_close()
            for s in servers:
                s.stop()


def client_for(nodes, **kw) -> LoRASyncClient:
    relays = {s.url: relay.url for relay, servers in nodes for s in servers}
    return LoRASyncClient(list(relays), api_key=KEY, relays=relays, timeout=60, **kw)


def text(client, model, server) -> str:
    return client.complete("the quick brown", model, 12, server=server)["text"]


def test_one_copy_per_node_reaches_every_server(nodes, make_adapter):
    a = make_adapter(1401)
    with client_for(nodes) as c:
        before = [len(relay.relay.bodies) for relay, _ in nodes]
        results = c.push(a, "relayed", transport="relay")
        assert [r.version for r in results] == [1, 1, 1, 1]
        assert all(r.ok and r.transport == "shared" for r in results), results
        for i in range(4):
            assert text(c, "relayed", i) == served_text(a)
        # each relay took the body in once, the trainer sent it once (to the first relay)
        assert [len(relay.relay.bodies) - b for (relay, _), b in zip(nodes, before)] == [1, 1]
        assert c.push(make_adapter(1402), "relayed", transport="relay")[0].version == 2
        assert text(c, "relayed", 3) == served_text(make_adapter(1402))
        c.retire("relayed")


def test_a_relay_wants_the_key_before_it_reads_a_byte(nodes, make_adapter):
    relay = nodes[0][0]
    chain = json.dumps([{"relay": relay.url, "servers": [served_by(nodes[0][1][0])]}])
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, reply, _ = http.request("POST", relay.url + RELAY_PATH, chunks=[b"x" * 64],
                                        headers={**headers, CHAIN_HEADER: chain}, timeout=10)
        assert status == 401, reply
    with client_for(nodes) as c:
        c.headers["Authorization"] = "Bearer wrong"
        with pytest.raises(PushFailed):
            c.push(make_adapter(1403), "nokey", transport="relay")


@pytest.mark.parametrize("chain, why", [
    (None, "missing"),
    ("[", "not JSON"),
    ("[]", "1 to"),
    (json.dumps([{"relay": "http://127.0.0.1:1", "servers": []}]), "'servers'"),
    (json.dumps([{"relay": "http://127.0.0.1:1", "servers": ["http://127.0.0.1:1"]}]),
     "'servers'"),
    (json.dumps([{"relay": "file:///etc/passwd", "servers": [ONE]}]), "hop 0"),
    (json.dumps([{"relay": "http://127.0.0.1:1", "servers": [{**ONE, "engine": "x"}]}]),
     "hop 0"),
    (json.dumps([{"relay": "http://127.0.0.1:1", "servers": [ONE]}] * (MAX_HOPS + 1)),
     "1 to"),
])
def test_a_malformed_chain_is_refused_by_name(nodes, chain, why):
    relay = nodes[0][0]
    headers = {**AUTH, **({CHAIN_HEADER: chain} if chain is not None else {})}
    status, reply, _ = http.request("POST", relay.url + RELAY_PATH, chunks=[b"x" * 64],
                                    headers=headers, timeout=10)
    assert status == 400 and why in reply["error"]["message"], reply


def test_a_body_above_the_limit_is_refused_before_it_is_read(nodes):
    small = start_relay(max_body=1024)
    try:
        chain = json.dumps([{"relay": small.url, "servers": [served_by(nodes[0][1][0])]}])
        status, reply, _ = http.request("POST", small.url + RELAY_PATH,
                                        chunks=[b"x" * 4096],
                                        headers={**AUTH, CHAIN_HEADER: chain}, timeout=10)
        assert status == 413 and "1024" in reply["error"]["message"], reply
        assert small.relay.bodies == []
    finally:
        small.shutdown()
        small.server_close()


def test_one_push_at_a_time(nodes):
    relay = nodes[0][0]
    assert relay.relay._one.acquire(timeout=5)  # a push in flight
    try:
        chain = json.dumps([{"relay": relay.url, "servers": [served_by(nodes[0][1][0])]}])
        status, reply, _ = http.request("POST", relay.url + RELAY_PATH, chunks=[b"x" * 64],
                                        headers={**AUTH, CHAIN_HEADER: chain}, timeout=10)
        assert status == 429, reply
    finally:
        relay.relay._one.release()


def test_a_relay_gone_fails_only_its_own_servers(nodes, make_adapter):
    (relay, servers), _ = nodes
    gone = start_relay()
    gone.shutdown()
    gone.server_close()  # nothing listens on its port now
    extra = FakeEngineServer().start()
    try:
        relays = {**{s.url: relay.url for s in servers}, extra.url: gone.url}
        a = make_adapter(1404)
        with LoRASyncClient(list(relays), api_key=KEY, relays=relays, timeout=30) as c:
            results = c.push(a, "partial", transport="relay", on_error="skip")
            assert [r.ok for r in results] == [True, True, False]
            assert results[2].error.code == "unreachable", results[2].error
            assert text(c, "partial", 0) == text(c, "partial", 1) == served_text(a)
            assert extra.served().get("partial") is None
        with LoRASyncClient([s.url for s in servers], api_key=KEY) as held:
            held.retire("partial")
    finally:
        extra.stop()


def test_each_server_keeps_its_own_verdict(nodes, make_adapter):
    with client_for(nodes) as c:
        c.push(make_adapter(1405), "verdict", transport="relay")
        # a second client pushes v1 again: every server refuses it (version_conflict), as
        # it would over any transport, and keeps serving what it had
        results = c.push(make_adapter(1406), "verdict", version=1, transport="relay",
                         on_error="skip")
        assert {r.error.code for r in results} == {"version_conflict"}
        assert text(c, "verdict", 2) == served_text(make_adapter(1405))
        c.retire("verdict")


def test_a_stalled_body_lets_go_of_the_relay(nodes, make_adapter, monkeypatch):
    """A caller that sends a head and part of a body, then nothing: the relay drops it after
    its idle bound, nothing reaches a server, and the next push goes through."""
    import socket

    from lora_sync import relay as relay_module
    monkeypatch.setattr(relay_module._Handler, "timeout", 1.0)
    relay, servers = nodes[0]
    chain = json.dumps([{"relay": relay.url, "servers": [served_by(servers[0])]}])
    host, port = relay.server_address[:2]
    before = servers[0].served()
    with socket.create_connection((host, port), timeout=10) as stalled:
        stalled.sendall((f"POST {RELAY_PATH} HTTP/1.1\r\nHost: x\r\n{AUTH_LINE}\r\n"
                         f"Content-Length: 100000\r\n{CHAIN_HEADER}: {chain}\r\n\r\n").encode()
                        + b"x" * 1000)
        reply = b""  # the relay's answer once it gave up on the body, then it closes
        while chunk := stalled.recv(4096):
            reply += chunk
        assert b" 400 " in reply.split(b"\r\n")[0] and b"the body stopped after" in reply, reply
    assert servers[0].served() == before
    with client_for(nodes) as c:
        assert c.push(make_adapter(1407), "after-stall", transport="relay")[0].ok
        c.retire("after-stall")


def test_connections_beyond_the_bound_are_closed(nodes):
    import socket

    from lora_sync.relay import MAX_CONNECTIONS
    relay = nodes[1][0]
    host, port = relay.server_address[:2]
    held = [socket.create_connection((host, port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)  # the relay took each one
        with socket.create_connection((host, port), timeout=10) as extra:
            extra.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            assert extra.recv(100) == b""  # closed unanswered
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_through_a_relay_a_real_engine_serves_pefts_tokens(engine, vllm, sglang, model_dir):
    """A relay in front of the session's real server (its node of one): the version lands
    through the relay's sealed copy and serves PEFT's own greedy tokens."""
    from .conftest import API_KEY
    from .helpers import PROMPT
    from .peft_oracle import oracle, server_greedy
    server = {"vllm": vllm, "sglang": sglang}[engine]
    relay = RelayServer(("127.0.0.1", 0), Relay(API_KEY, 8 << 20, 120.0))
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    adapter, want = oracle(model_dir, 1411, PROMPT, 12)
    try:
        with LoRASyncClient(server.url, engine=engine, api_key=API_KEY, timeout=120,
                            relays={server.url: relay.url}) as c:
            [r] = c.push(adapter, "relayed-real", transport="relay")
            assert r.ok and r.transport == "shared"
            assert server_greedy(c, "relayed-real", PROMPT, 12) == want
            c.retire("relayed-real")
    finally:
        relay.shutdown()
        relay.server_close()
