"""A name's output is its adapter's (lora_sync/server/applied.py): a request that names an
adapter reaches the engine carrying exactly that adapter, or is refused, 400
`route_ignores_adapter` naming the route. No route is listed: each engine's seam reports what
every request it hands the engine carries.

Found before: vLLM's /invocations with the adapter in the body (its SageMaker decorator
rewrote `model` after admission), SGLang's /v1/messages, /v1/score, /api/generate, /api/chat
and /generate with `parameters.lora_path` served the base model labelled as the adapter.

In process (fake engine): the rule's logic. Real servers: the live app's whole route table
(its OpenAPI listing), each POST route asked with an adapter named and with the base model:
a reply labelled with the adapter is never the base model's."""
from __future__ import annotations

import json

import pytest

from lora_sync import LoRASyncClient, http
from lora_sync.engines import ENGINES
from lora_sync.server import applied
from lora_sync.server.routes import own_paths

from .engine_fakes import BASE_ONLY_ROUTE, BASE_TEXT
from .helpers import PROMPT


# -- in process -----------------------------------------------------------------------------
def test_a_route_that_drops_the_adapter_is_refused_and_counts_nothing(fake_server, fake_client,
                                                                      make_adapter, tmp_path):
    c = fake_client
    [res] = c.push(make_adapter(seed=520), "applies", transport="tensors")
    for model in ("applies", res.name):
        status, reply, headers = http.request("POST", fake_server.url + BASE_ONLY_ROUTE,
                                              json_body={"model": model})
        assert status == 400 and reply["error"]["code"] == "route_ignores_adapter", reply
        assert BASE_ONLY_ROUTE in reply["error"]["message"] and res.name in \
            reply["error"]["message"]
        assert "x-lora-name" not in headers
    # the engine's own adapters too
    make_adapter(seed=521).save(tmp_path / "own")
    c.load_from_disk(str(tmp_path / "own"), "engine-own")
    try:
        status, reply, _ = http.request("POST", fake_server.url + BASE_ONLY_ROUTE,
                                        json_body={"model": "engine-own"})
        assert status == 400 and reply["error"]["code"] == "route_ignores_adapter", reply
    finally:
        c.unload_from_disk("engine-own")
    status, reply, _ = http.request("POST", fake_server.url + BASE_ONLY_ROUTE,
                                    json_body={"model": "base"})
    assert (status, reply) == (200, {"text": BASE_TEXT})
    entry = next(a for a in c.adapters()[0]["adapters"] if a["name"] == "applies")
    assert entry["inflight"] == 0
    assert c.complete(PROMPT, "applies", 4)["version"] == res.version


def test_the_rule_itself():
    """Exactly the admitted adapters on every engine request; a successful reply that is not
    a stream must have run one; a stream and an error reply pass as they are."""
    def expected():
        return applied.Expected("/r", frozenset({"a-v1"}))
    ok = {"status": 200, "headers": [(b"content-type", b"application/json")]}
    stream = {"status": 200, "headers": [(b"content-type", b"text/event-stream; x=y")]}
    for carried in (["a-v1"], ["a-v1", "a-v1"]):
        e = expected()
        token = applied.expect(e)
        try:
            applied.engine_request(carried)
        finally:
            applied.done(token)
        assert e.refusal(ok) is None
    for carried in ([None], ["b-v1"], ["a-v1", None], [None, None]):
        e = expected()
        token = applied.expect(e)
        try:
            with pytest.raises(applied.BadRequest) as err:
                applied.engine_request(carried)
        finally:
            applied.done(token)
        assert err.value.code == "route_ignores_adapter" and e.refusal(ok) is err.value
    assert expected().refusal(ok).code == "route_ignores_adapter"  # ran nothing
    assert expected().refusal(stream) is None
    assert expected().refusal({"status": 404, "headers": []}) is None
    applied.engine_request([None, "x"])  # outside an admitted request: anything goes


# -- real servers: the live route table -----------------------------------------------------
GREEDY = 1e-7
# Fields a route may read a prompt and greedy settings from; a route reads what it knows
# (an unknown field is ignored, or the route answers 4xx: then it served nothing).
def _body(model: str, nested: bool = False) -> dict:
    """Naming `model` where most routes read it, or (`nested`) only in parameters.lora_path
    (SGLang's /generate ignores `parameters`, /vertex_generate reads it)."""
    # greedy on both engines (below their sampling epsilon), and > 0 where a route needs it
    sampling = {"max_new_tokens": 4, "temperature": GREEDY}
    where = {"parameters": {"lora_path": model, "sampling_params": sampling}} if nested else \
        {"model": model}
    return {**where, "prompt": PROMPT, "text": PROMPT, "input": PROMPT, "query": PROMPT,
            "items": [PROMPT], "label_token_ids": [5, 9], "instances": [{"text": PROMPT}],
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
            "max_new_tokens": 4, "temperature": GREEDY, "stream": False,
            "sampling_params": sampling}


_VOLATILE = {"id", "created", "created_at", "model", "object", "system_fingerprint",
             "request_id", "meta_info", "usage", "e2e_latency", "created_time"}


def _content(reply):
    """The reply less what differs between any two requests (ids, times, the model's name)."""
    if isinstance(reply, dict):
        return {k: _content(v) for k, v in reply.items() if k not in _VOLATILE}
    if isinstance(reply, list):
        return [_content(v) for v in reply]
    return reply


def test_every_route_serves_the_named_adapter_or_refuses(server, make_adapter):
    """Walks the server's own route table (GET /openapi.json: every route the engine and
    lora-sync mounted, whatever this engine version adds). Each POST route that is neither
    lora-sync's nor an adapter-loading route is asked twice, naming the adapter and naming
    the base model, without a key (admin routes stay shut): a 2xx labelled with the adapter
    must differ from the base model's reply; anything else is a 4xx. At least the two
    OpenAI generation routes serve it."""
    status, spec, _ = http.request("GET", f"{server.url}/openapi.json")
    assert status == 200, spec
    skip = set(own_paths(ENGINES[server.engine].route_prefix)) | {
        p for p in spec["paths"] if "lora_adapter" in p or p.startswith("/adapters")}
    routes = sorted(p for p, ops in spec["paths"].items() if "post" in ops and p not in skip
                    and "{" not in p)
    assert "/v1/completions" in routes, routes
    served, refused = [], []
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as c:
        [res] = c.push(make_adapter(seed=522), "walk", transport="tensors")
        for route, nested in [(r, n) for r in routes for n in (False, True)]:
            url, label = f"{server.url}{route}", route + (" parameters" if nested else "")
            status, reply, headers = http.request("POST", url, json_body=_body("walk", nested),
                                                  timeout=60)
            base = http.request("POST", url, json_body=_body("base", nested), timeout=60)
            if status >= 500:
                assert base[0] >= 500, (label, status, reply)  # not the adapter's doing
                continue
            if not 200 <= status < 300:
                error = reply.get("error") if isinstance(reply, dict) else None
                refused.append((label, status, error.get("code")
                                if isinstance(error, dict) else None))
                continue
            assert headers.get("x-lora-name") == res.name, (label, headers)
            assert _content(reply) != _content(base[1]), \
                f"{label} served the base model's reply under {res.name}: {json.dumps(reply)[:300]}"
            served.append(label)
        c.retire("walk")
    assert {"/v1/completions", "/v1/chat/completions"} <= set(served), (served, refused)
    assert server.alive(), server.log_tail()
    print(f"\n{server.engine}: served {served}\nrefused {refused}")
