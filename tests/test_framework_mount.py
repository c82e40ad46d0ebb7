"""lora-sync mounted into a vLLM server a framework builds itself, through the public API
alone (vllm_ext/mount.py): testbed/framework_server.py builds AsyncLLM, vLLM's app and its
uvicorn the way verl 0.9.1's vLLMHttpServer does, with a worker extension of its own.

On that real server: pushes by tensors and by broadcast serve the adapter token-identical to
the same adapter on the launcher's server; the framework's own generation path (a Ray-style
call to AsyncLLM.generate, no HTTP admission) resolves the alias to the newest version and
reports which served it; the framework's worker extension still answers beside ours; and
admission guards the framework's app as it guards vLLM's."""
from __future__ import annotations

import pytest

from lora_sync import LoRASyncClient, http

from .conftest import API_KEY
from .helpers import PROMPT, push_by
from .peft_oracle import server_greedy

pytestmark = pytest.mark.server

N = 12


@pytest.fixture(scope="module")
def framework_client(framework_vllm):
    with LoRASyncClient(framework_vllm.url, engine="vllm", api_key=API_KEY) as c:
        yield c


def framework_generate(server, adapter: str, prompt_ids: list[int]) -> tuple[int, dict]:
    status, reply, _ = http.request("POST", f"{server.url}/framework/generate", json_body={
        "prompt_ids": prompt_ids, "max_tokens": N, "adapter": adapter}, timeout=120)
    return status, reply


def prompt_ids(client) -> list[int]:
    """The prompt as the engine tokenizes it (the framework sends token ids, as verl does)."""
    body = client.complete(PROMPT, "base", 1, return_token_ids=True)["raw"]
    return list(body["choices"][0]["prompt_token_ids"])


@pytest.mark.parametrize("transport", ["tensors", "broadcast"])
def test_a_mounted_server_serves_what_the_launchers_serves(framework_vllm, framework_client,
                                                           vllm, make_adapter, transport):
    adapter = make_adapter(701)
    with LoRASyncClient(vllm.url, engine="vllm", api_key=API_KEY) as launched:
        name = f"mount-{transport}"
        push_by(launched, adapter, name, "tensors")
        push_by(framework_client, adapter, name, transport)
        want = server_greedy(launched, name, PROMPT, N)
        assert server_greedy(framework_client, name, PROMPT, N) == want
        assert want != server_greedy(framework_client, "base", PROMPT, N)
        launched.retire(name)
        framework_client.retire(name)


def test_the_frameworks_own_path_resolves_our_names(framework_vllm, framework_client,
                                                    make_adapter):
    ids = prompt_ids(framework_client)
    for version, seed in ((1, 711), (2, 712)):
        [r] = framework_client.push(make_adapter(seed), "policy", transport="tensors")
        assert r.version == version
        status, reply = framework_generate(framework_vllm, "policy", ids)
        assert status == 200 and reply["served_by"] == f"policy-v{version}", reply
        # the tokens the HTTP route gives for the same version
        assert reply["token_ids"] == server_greedy(framework_client, f"policy-v{version}",
                                                   PROMPT, N)
    status, reply = framework_generate(framework_vllm, "policy-v1", ids)  # a pinned version
    assert status == 200 and reply["served_by"] == "policy-v1"
    framework_client.retire("policy")
    status, reply = framework_generate(framework_vllm, "policy", ids)
    assert status == 404 and reply["error"]["code"] == "version_retired", reply
    status, reply = framework_generate(framework_vllm, "nobody", ids)
    assert status == 404 and reply["error"]["code"] == "model_not_found", reply
    [listing] = framework_client.adapters()
    assert all(a["inflight"] == 0 for a in listing["adapters"])  # every `using` let go


def test_the_frameworks_worker_extension_lives_beside_ours(framework_vllm):
    status, reply, _ = http.request("POST", f"{framework_vllm.url}/framework/workers",
                                    json_body={}, timeout=60)
    assert status == 200 and reply["results"], reply
    assert all(r.endswith("holding lora_sync_call: True") for r in reply["results"]), reply


def test_admission_guards_the_frameworks_app(framework_vllm, framework_client, make_adapter):
    framework_client.push(make_adapter(721), "guarded", transport="tensors")
    url = framework_vllm.url
    status, reply, _ = http.request("POST", f"{url}/v1/completions", json_body={
        "model": "guarded-v9", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and reply["error"]["code"] == "version_retired", reply
    status, reply, _ = http.request("GET", f"{url}/v1/lora_sync_info")
    assert status == 401, reply  # admin routes need the key
    status, reply, _ = http.request("POST", f"{url}/v1/load_lora_adapter", json_body={
        "lora_name": "guarded-v2", "lora_path": "/tmp"},
        headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 403 and reply["error"]["code"] == "reserved_name", reply
    framework_client.retire("guarded")
