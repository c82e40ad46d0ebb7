"""Data-parallel replicas on real CPU servers: vLLM `--data-parallel-size 2` and SGLang
`--dp-size 2`. Every version must land on every replica (each serves it token-identically to
the same adapter loaded from disk), broadcast ranks must count every replica's workers, and
retiring frees it on every replica. Requests are pinned to one replica (vLLM's
X-data-parallel-rank header, SGLang's routed_dp_rank). SGLang refuses its own disk route
under data parallelism ("data-parallel replicas are not supported for dynamic lora
loading"), so its disk reference comes from the session's single-replica SGLang server."""
from __future__ import annotations

import time

import pytest

from lora_sync import LoRASyncClient, http

from .conftest import API_KEY, PROMPT, SERVER_ENV, SGLANG_PYTHON, SGLANG_TEST_PATH, _vllm
from .helpers import body_of, post_body

REPLICAS = 2


# Extended (CI time): a data-parallel server takes the longest to start of all. The replica
# rule's logic is tested in process (test_service_broadcast.py's data-parallel test).
@pytest.fixture(scope="module", params=[pytest.param("vllm", marks=pytest.mark.extended),
                                        pytest.param("sglang", marks=pytest.mark.extended)])
def dp_server(request, model_dir):
    if request.param == "vllm":
        server = _vllm(model_dir, extra_args=["--data-parallel-size", str(REPLICAS)],
                       env=SERVER_ENV)
    else:
        if not SGLANG_PYTHON.exists():
            pytest.skip("no .venv-sglang: run scripts/install.sh")
        from testbed.processes import sglang_server
        # SGLang's CPU engine binds each replica to cores of its own ('|' between replicas).
        server = sglang_server(model_dir, python=str(SGLANG_PYTHON),
                               extra_args=["--dp-size", str(REPLICAS)],
                               env={**SERVER_ENV, "PYTHONPATH": SGLANG_TEST_PATH,
                                    "SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    server.api_key = API_KEY
    with server:
        yield server


def on_replica(server, model: str | None, replica: int | None) -> str:
    """Greedy text from one replica (None: wherever the server sends it)."""
    if server.engine == "vllm":
        body, _ = http.call("POST", f"{server.url}/v1/completions",
                            json_body={"model": model or "base", "prompt": PROMPT,
                                       "max_tokens": 12, "temperature": 0.0},
                            headers={} if replica is None else
                            {"X-data-parallel-rank": str(replica)})
        return body["choices"][0]["text"]
    body, _ = http.call("POST", f"{server.url}/generate",
                        json_body={"text": PROMPT, "lora_path": model,
                                   "sampling_params": {"temperature": 0.0, "max_new_tokens": 12},
                                   **({} if replica is None else {"routed_dp_rank": replica})})
    return body["text"]


def held_ids(client) -> list[set]:
    return [set(w["held_ids"]) for w in client.info()[0]["worker_status"]]


def from_disk(server, path, name: str) -> str:
    """Greedy text of an adapter loaded by the engine's own disk route."""
    with LoRASyncClient(server.url, engine=server.engine, api_key=API_KEY) as client:
        client.load_from_disk(str(path), name)
        try:
            return on_replica(server, name, None)
        finally:
            client.unload_from_disk(name)


def test_every_version_lands_on_every_replica(dp_server, make_adapter, tmp_path, request):
    disk_server = dp_server if dp_server.engine == "vllm" else request.getfixturevalue("sglang")
    with LoRASyncClient(dp_server.url, engine=dp_server.engine, api_key=API_KEY) as client:
        info = client.info()[0]
        assert info["workers"] == REPLICAS
        assert sorted(w["rank"] for w in info["worker_status"]) == list(range(REPLICAS))
        assert {w["world_size"] for w in info["worker_status"]} == {REPLICAS}

        reference = {}
        for seed, name in ((711, "dp-t"), (712, "dp-b")):
            make_adapter(seed).save(tmp_path / name)
            reference[name] = [from_disk(disk_server, tmp_path / name, f"{name}-disk")] * REPLICAS
        base = [on_replica(dp_server, None, r) for r in range(REPLICAS)]

        [pushed] = client.push(make_adapter(711), "dp-t", transport="tensors")
        client.init_group()  # world = trainer + every replica's workers
        assert client.states["broadcast"].group.world_size == 1 + REPLICAS
        [broadcast] = client.push(make_adapter(712), "dp-b", transport="broadcast")
        client.destroy_group()
        ids = {r["adapter_id"] for r in (pushed.reply, broadcast.reply) if "adapter_id" in r}
        listing = client.adapters()[0]["adapters"]
        ids |= {v["adapter_id"] for a in listing for v in a["versions"]
                if a["name"] in ("dp-t", "dp-b")}
        assert all(ids <= held for held in held_ids(client)), "a replica lacks a version"

        for name in ("dp-t", "dp-b"):
            served = [on_replica(dp_server, name, r) for r in range(REPLICAS)]
            assert served == reference[name], name
            assert served != base

        # Every replica refuses a body whose checksum is wrong: the push fails as a whole and
        # both keep serving the previous version, with nothing new held.
        held_before = held_ids(client)
        bad = make_adapter(713)
        status, reply = post_body(client.servers[0].route("load_lora_adapter_from_tensors"),
                                  body_of(bad, meta={**bad.metadata("dp-t"),
                                                     "checksum": "sha256:" + "0" * 64}))
        assert (status, reply["error"]["code"]) == (400, "checksum_mismatch"), reply
        assert [on_replica(dp_server, "dp-t", r) for r in range(REPLICAS)] == reference["dp-t"]
        assert held_ids(client) == held_before

        client.retire("dp-t")
        client.retire("dp-b")
        deadline = time.monotonic() + 30
        while any(ids & held for held in held_ids(client)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(ids & held for held in held_ids(client)), "a replica kept a version"
