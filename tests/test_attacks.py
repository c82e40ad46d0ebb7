"""The security review's attacks, replayed against real servers (docs/security.md).

Each case that killed a server or poisoned other tenants' output is a regression test here,
on every engine where the route exists. After each attack the server must be alive and the
previous version must answer exactly as before."""
from __future__ import annotations

import json
import socket
import time

import pytest

from lora_sync import LoRAAdapter, LoRASyncClient, http
from lora_sync.engines import ENGINES

from .conftest import GENERATION_KEY
from .helpers import AUTH, PROMPT, Background, blackhole, greedy, post_body, versions_of

KEEP = 3  # the session servers' LORA_SYNC_KEEP_VERSIONS


def held_versions(client, name):
    """Every version the server still holds, retired ones being drained included."""
    return sorted({v["version"] for a in client.adapters()[0]["adapters"] if a["name"] == name
                   for v in a["versions"]} |
                  {int(s.rsplit("-v", 1)[1]) for a in client.adapters()[0]["adapters"]
                   if a["name"] == name for s in a["draining"]})


def wait_inflight(client, name, n, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        entry = [a for a in client.adapters()[0]["adapters"] if a["name"] == name]
        if entry and entry[0]["inflight"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{n} requests on {name} were never admitted")


LONG = {"max_tokens": 300, "ignore_eos": True, "temperature": 1.0}


def shapes(engine: str, name: str, url: str):
    """Every request shape that named an adapter outside admission in the review: (label,
    method, url, body, headers). Each asks for a long generation."""
    if engine == "vllm":
        return [
            ("/v1/responses", "POST", f"{url}/v1/responses",
             {"model": name, "input": PROMPT, "max_output_tokens": 300,
              "temperature": 1.0, "ignore_eos": True}, None),
            ("/v1/messages", "POST", f"{url}/v1/messages",
             {"model": name, "max_tokens": 300, "ignore_eos": True,
              "messages": [{"role": "user", "content": PROMPT}]}, None),
            ("/invocations header, no key", "POST", f"{url}/invocations",
             {"prompt": PROMPT, **LONG, "stream": True},
             {"X-Amzn-SageMaker-Adapter-Identifier": name}),
            ("/v1/chat/completions/batch", "POST", f"{url}/v1/chat/completions/batch",
             {"model": name, "messages": [[{"role": "user", "content": PROMPT}]], **LONG},
             None),
        ]
    sampling = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 1.0}
    return [
        ("PUT /generate", "PUT", f"{url}/generate",
         {"text": PROMPT, "lora_path": name, "sampling_params": sampling}, None),
        ("/generate lora_path list", "POST", f"{url}/generate",
         {"text": [PROMPT, PROMPT], "lora_path": [name, name], "sampling_params": sampling}, None),
        ("/v1/completions model base + lora_path", "POST", f"{url}/v1/completions",
         {"model": "base", "lora_path": name, "prompt": PROMPT, **LONG}, None),
        ("/invocations base:name", "POST", f"{url}/invocations",
         {"model": f"base:{name}", "messages": [{"role": "user", "content": PROMPT}], **LONG},
         None),
        ("/vertex_generate parameters.lora_path", "POST", f"{url}/vertex_generate",
         {"instances": [{"text": PROMPT}],
          "parameters": {"lora_path": name, "sampling_params": sampling}}, None),
    ]


# lora-sync's own rules (fields, limits, names, groups) are checked with the fake engine in
# test_service_*.py. These two involve the engine's own HTTP server and worker threads: one
# real engine proves them.
ONE_ENGINE = pytest.mark.parametrize("server", ["vllm"], indirect=True)


def test_every_route_that_names_an_adapter_is_admitted(client, server, make_adapter):
    """Review items 1 and 15: requests outside admission, then pushes that retire their
    version, killed EngineCore / the scheduler. Now each is admitted and counted: the
    version waits for it, the request finishes on it, the server lives."""
    name = f"adm-{server.engine}"
    client.push(make_adapter(seed=601), name, transport="tensors")
    cases = shapes(server.engine, name, server.url)
    running = [(label, Background(method, url, body, headers))
               for label, method, url, body, headers in cases]
    wait_inflight(client, name, len(cases) + (1 if server.engine == "sglang" else 0))
    for i in range(KEEP):  # v1 leaves the window while every request still runs on it
        client.push(make_adapter(seed=602 + i), name, transport="tensors")
    assert 1 in held_versions(client, name), "v1 was freed under running requests"
    for label, req in running:
        result = req.join()
        assert result.get("status") == 200, (label, result, server.log_tail(30))
        assert result["headers"].get("x-lora-version", "").split(",")[0] == "1", label
    assert server.alive(), server.log_tail()
    deadline = time.time() + 30
    while 1 in held_versions(client, name) and time.time() < deadline:
        time.sleep(0.1)
    assert held_versions(client, name) == [2, 3, 4]
    assert greedy(client, name) == greedy(client, f"{name}-v4")


def test_internal_lora_id_is_refused(client, server):
    """Review item 14: one unauthenticated /generate with an unknown lora_id killed SGLang."""
    for route, body in (("/generate", {"text": PROMPT, "lora_id": "lora-sync-999999"}),
                        ("/v1/completions", {"model": "base", "prompt": PROMPT,
                                             "lora_id": "lora-sync-1"}),
                        ("/vertex_generate", {"instances": [{"text": PROMPT}],
                                              "parameters": {"lora_id": "lora-sync-1"}})):
        status, reply, _ = http.request("POST", server.url + route, json_body=body)
        assert status == 400 and "lora_id" in reply["error"]["message"], (route, reply)
    assert server.alive()


def test_bodies_admission_cannot_read_are_refused(client, server):
    """A compressed body (SGLang's x-body-compressed middleware, a Content-Encoding) would
    reach the engine with adapter names admission never read: refused."""
    for header in ({"X-Body-Compressed": "zstd"}, {"Content-Encoding": "gzip"}):
        status, reply = post_body(f"{server.url}/v1/completions", b"\x28\xb5\x2f\xfd",
                                  "application/json", headers=header)
        assert status == 400 and "uncompressed" in reply["error"]["message"], (header, reply)
    assert server.alive()


def _native(engine):
    routes = ENGINES[engine]
    native = [("POST", routes.native_load, {"lora_name": "{v}", "lora_path": "/etc"}),
              ("POST", routes.native_unload, {"lora_name": "{v}"})]
    if engine == "vllm":  # SageMaker's adapter routes, which vLLM serves too
        native += [("POST", "/adapters", {"name": "{v}", "src": "/etc"}),
                   ("DELETE", "/adapters/{v}", None)]
    return native


def test_native_adapter_routes_never_touch_our_names(client, server, make_adapter):
    """Review items 6 and 17: the engines' own load/unload routes removed our versions and
    squatted the next one, without a key."""
    name = f"nat-{server.engine}"
    client.push(make_adapter(seed=611), name, transport="tensors")
    before = greedy(client, name)
    for method, path, body in _native(server.engine):
        for target in (f"{name}-v1", name, f"{name}-v2", "other-v9"):
            url = server.url + path.replace("{v}", target)
            payload = json.loads(json.dumps(body).replace("{v}", target)) if body else None
            status, reply, _ = http.request(method, url, json_body=payload)  # no key
            assert status == 401, (method, path, target, status, reply)
            status, reply, _ = http.request(method, url, json_body=payload, headers=AUTH)
            assert status == 403 and reply["error"]["code"] == "reserved_name", \
                (method, path, target, status, reply)
    assert versions_of(client, name) == [1]
    assert greedy(client, name) == before
    assert client.push(make_adapter(seed=612), name, transport="tensors")[0].version == 2
    assert server.alive()


def _rank_mismatch_bodies(adapter):
    t = adapter.tensors
    zero = {k: (v[:0] if "lora_A" in k else v[:, :0]) for k, v in t.items()}
    half = {k: (v[:4] if "lora_A" in k else v[:, :4]) for k, v in t.items()}
    doubled = {**t, **{k.replace("base_model.model.", ""): v + 1 for k, v in t.items()}}
    return [("rank-0 tensors with r=8", zero), ("rank-4 tensors with r=8", half),
            ("every module twice under two names", doubled)]


@ONE_ENGINE
def test_rendezvous_blackhole_neither_blocks_generation_nor_outlives_its_timeout(
        client, server, make_adapter):
    """Review items 3 and 18: a trainer address that accepts and never answers blocked
    generation for 40 s and the init answered 500 after 45 s."""
    port, close = blackhole()
    try:
        init = Background("POST", client.servers[0].route("init_lora_update_group"),
                          {"master_address": "127.0.0.1", "master_port": port,
                           "rank_offset": 1, "world_size": 2, "group_name": "hole",
                           "timeout_s": 4}, AUTH, timeout=60)
        time.sleep(0.5)
        completion = client.complete(PROMPT, "base", 4)  # the engine keeps generating
        assert completion["text"] is not None
        assert init.thread.is_alive(), "the init returned before the completion ran"
        result = init.join(60)
    finally:
        close()
    assert result["status"] == 502 and result["reply"]["error"]["code"] == "transfer_failed", \
        result
    assert server.alive()
    # The failed group left nothing behind: a real group and broadcast work.
    adapter = make_adapter(seed=661)
    client.init_group(group_name="default", timeout_s=60)
    try:
        [res] = client.broadcast(adapter, f"after-hole-{server.engine}")
    finally:
        client.destroy_group()
    assert greedy(client, res.name) == greedy(client, f"after-hole-{server.engine}")


def _stalled_upload(url: str, announced: int, sent: int) -> socket.socket:
    """Starts an authorised upload that announces `announced` bytes, sends `sent`, stalls."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    path = "/" + url.split("//")[1].split("/", 1)[1]
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                  f"application/octet-stream\r\nContent-Length: {announced}\r\n"
                  f"Authorization: {AUTH['Authorization']}\r\n\r\n").encode())
    if sent:  # a plausible header length first, so the body is not refused at once
        sock.sendall((1024).to_bytes(8, "little") + b" " * (sent - 8))
    return sock


def _read_reply(sock: socket.socket) -> str:
    """Everything the server sends until it closes the connection (bounded: 30 s)."""
    sock.settimeout(30)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data.decode(errors="replace")


@ONE_ENGINE
def test_slow_uploads_are_bounded(client, server, make_adapter):
    """Review item 12: stalled uploads held 320 MB of staging for 30 s and more. The session
    servers allow 6 MB of bodies in flight and a 2 s pause."""
    route = client.servers[0].route("load_lora_adapter_from_tensors")
    first = _stalled_upload(route, 3_500_000, 1_000_000)
    try:
        time.sleep(0.3)
        second = _stalled_upload(route, 3_500_000, 0)
        reply = _read_reply(second)
        assert " 429 " in reply.split("\r\n")[0] and "staging_full" in reply, reply
        # The stalled one is cut off: a 408 and a closed connection, not a held slot.
        reply = _read_reply(first)
        assert " 408 " in reply.split("\r\n")[0] and "body_timeout" in reply, reply
    finally:
        first.close()
    assert client.push(make_adapter(seed=671), f"slow-{server.engine}", transport="tensors")[0].version == 1


def attention_adapter(moe_dir, seed: int) -> LoRAAdapter:
    """A LoRA the MoE servers take (their model has no dense MLP)."""
    from .peft_oracle import peft_model
    return LoRAAdapter.from_peft_model(peft_model(
        moe_dir, seed, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def test_key_schemes_on_vllm(moe_vllm, moe_dir):
    """Review items 4 and 5, on a server with vLLM's --api-key G and LORA_SYNC_API_KEY K
    (conftest's moe_vllm): K works on every route (it used to be locked out) and G only
    generates. (With G alone the admin routes are closed: lora-sync's own rule, checked with
    the fake engine in test_service_access.py::test_key_schemes_like_vllm.)"""
    from lora_sync.errors import Unauthorized
    server, gen, admin = moe_vllm, GENERATION_KEY, moe_vllm.api_key
    adapter = attention_adapter(moe_dir, 691)
    with LoRASyncClient(server.url, api_key=admin) as c:
        assert c.push(adapter, "keys", transport="tensors")[0].version == 1
        served = c.complete(PROMPT, "keys", 4)
    with LoRASyncClient(server.url, api_key=gen) as g:
        assert g.complete(PROMPT, "keys", 4)["text"] == served["text"]
        with pytest.raises(Unauthorized):
            g.push(adapter, "keys", transport="tensors")
    for key in (None, gen):  # /invocations is outside vLLM's guard: checked by admission
        status, _, _ = http.request(
            "POST", f"{server.url}/invocations", json_body={"prompt": PROMPT, "max_tokens": 2},
            headers={"X-Amzn-SageMaker-Adapter-Identifier": "keys",
                     **({"Authorization": f"Bearer {key}"} if key else {})})
        assert status == (401 if key is None else 200)


def test_key_schemes_on_sglang(moe_sglang, moe_dir):
    """Review items 4 and 5 on SGLang, on a server with --api-key G and LORA_SYNC_API_KEY K
    (conftest's moe_sglang; our launcher makes K SGLang's --admin-api-key): K pushes, G
    generates and is refused on admin routes, ours and SGLang's. (G alone: see
    test_key_schemes_on_vllm.)"""
    from lora_sync.errors import Unauthorized
    s, gen, admin = moe_sglang, GENERATION_KEY, moe_sglang.api_key
    adapter = attention_adapter(moe_dir, 695)
    status, _, _ = http.request(  # SGLang's own adapter route: not for G either
        "POST", f"{s.url}/unload_lora_adapter", json_body={"lora_name": "x"},
        headers={"Authorization": f"Bearer {gen}"})
    assert status in (401, 403)
    with LoRASyncClient(s.url, engine="sglang", api_key=admin) as c:
        assert c.push(adapter, "keys", transport="tensors")[0].version == 1
    with LoRASyncClient(s.url, engine="sglang", api_key=gen) as g:
        served = g.complete(PROMPT, "keys", 4)
        assert served["version"] == 1
        with pytest.raises(Unauthorized):
            g.push(adapter, "keys", transport="tensors")
    with LoRASyncClient(s.url, engine="sglang") as anonymous:
        with pytest.raises(Unauthorized):
            anonymous.complete(PROMPT, "keys", 4)
    assert s.alive()
