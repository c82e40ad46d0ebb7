"""Versioned adapters under load on real vLLM and SGLang servers: retention window, retirement that
never blocks, alias admission, the version reported back, memory staying flat."""
import os
import threading
import time

import pytest

from lora_sync import LoRASyncClient, NotFound, http

from .helpers import AUTH, PROMPT, greedy, staging_dir_of

KEEP = 3  # the session server's LORA_SYNC_KEEP_VERSIONS


def versions_of(client, name):
    for a in client.adapters()[0]["adapters"]:
        if a["name"] == name:
            return [v["version"] for v in a["versions"]]
    return []


def inflight(client, served):
    for a in client.adapters()[0]["adapters"]:
        for v in a["versions"]:
            if v["served_name"] == served:
                return v["inflight"]
    return 0


def test_retiring_a_busy_version_never_blocks(client, make_adapter, server):
    """A long streaming request runs on v1 while pushes retire v1: the pushes return at
    once, the request completes on v1, and v1 is dropped after it ends."""
    client.push(make_adapter(seed=500), "busy", transport="tensors")
    done = {}

    def long_request():
        t0 = time.perf_counter()
        status, body, headers = http.request(
            "POST", f"{server.url}/v1/completions", timeout=300,
            json_body={"model": "busy-v1", "prompt": PROMPT, "max_tokens": 480, "n": 8,
                       "ignore_eos": True, "temperature": 1.0, "stream": True})
        done.update(status=status, seconds=time.perf_counter() - t0,
                    version=headers.get("x-lora-version"))
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.time() + 30
    while inflight(client, "busy-v1") == 0 and time.time() < deadline:
        time.sleep(0.02)  # wait until the request is admitted
    assert inflight(client, "busy-v1") == 1, done
    t0 = time.perf_counter()
    for i in range(KEEP):
        client.push(make_adapter(seed=501 + i), "busy", transport="tensors")
    pushes_s = time.perf_counter() - t0
    [entry] = [a for a in client.adapters()[0]["adapters"] if a["name"] == "busy"]
    v1 = [v for v in entry["versions"] if v["version"] == 1]
    if not (v1 and v1[0]["retired"] and v1[0]["inflight"] == 1):
        t.join(timeout=30)  # say how the request ended, to tell a slow push from a lost one
        pytest.fail(f"v1 must wait: pushes took {pushes_s:.2f}s; {entry}; request {done}")
    t.join(timeout=300)
    assert done["status"] == 200 and done["version"] == "1"
    assert pushes_s < done["seconds"], "pushes waited for generation"
    deadline = time.time() + 10
    while 1 in versions_of(client, "busy") and time.time() < deadline:
        time.sleep(0.1)
    assert versions_of(client, "busy") == [2, 3, 4]
    print(f"\npushes took {pushes_s:.2f}s while the v1 request took {done['seconds']:.2f}s")


def test_soak_200_versions_while_streaming(server, make_adapter):
    """One thread generates (alias and explicit versions) while another pushes 200
    versions. No request fails except documented 404s for retired versions, no request is
    served by the base model, the adapter count equals the window, RSS stays flat."""
    adapters = [make_adapter(seed=600 + i) for i in range(4)]
    pusher = LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key)
    reader = LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key)
    pusher.push(adapters[0], "soak", transport="tensors")
    stop, stats = threading.Event(), {"ok": 0, "retired_404": 0, "bad": []}

    def generate():
        i = 0
        while not stop.is_set():
            i += 1
            latest = versions_of(reader, "soak")[-1]
            model = "soak" if i % 2 else f"soak-v{max(1, latest - 1)}"
            try:
                r = reader.complete(PROMPT, model, 4)
                if r["model"] is None or not r["model"].startswith("soak-v"):
                    stats["bad"].append(("served by", r["model"]))
                else:
                    stats["ok"] += 1
            except NotFound as e:
                stats["retired_404"] += 1
                if "version_retired" != e.code:
                    stats["bad"].append(("404", str(e)))
            except Exception as e:  # any other failure is a defect
                stats["bad"].append((type(e).__name__, str(e)))
    t = threading.Thread(target=generate)
    t.start()
    rss = {}
    try:
        for v in range(2, 201):
            pusher.push(adapters[v % 4], "soak", transport="tensors")
            if v == 20:
                rss["window_full"] = server.rss_bytes()
        rss["after_200"] = server.rss_bytes()
    finally:
        stop.set()
        t.join(timeout=120)
        pusher.close()
        reader.close()
    print(f"\nsoak ({server.engine}): {stats['ok']} completions ok, {stats['retired_404']} retired 404s; "
          f"RSS after 20 pushes {rss['window_full']/2**20:.0f} MiB, "
          f"after 200 {rss['after_200']/2**20:.0f} MiB")
    assert not stats["bad"], stats["bad"][:5]
    assert stats["ok"] > 20
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as c:
        assert versions_of(c, "soak") == [198, 199, 200]
        # Retired versions are freed once the engine has no request on them: let the last
        # ones drain (bounded). Then the worker holds exactly the versions the server lists
        # (the shared server also serves other tests' names, so no count is assumed).
        deadline = time.time() + 30
        while time.time() < deadline and any(a["draining"] for a in c.adapters()[0]["adapters"]):
            time.sleep(0.2)
        listed = {a["name"]: {v["adapter_id"] for v in a["versions"]}
                  for a in c.adapters()[0]["adapters"]}
        info = http.call("GET", c.servers[0].route("lora_sync_info"), headers=AUTH)[0]
    held = set(info["worker_status"][0]["held_ids"])
    known = set().union(*listed.values())
    assert len(listed["soak"]) == 3 and listed["soak"] <= held
    assert held == known, (f"the worker holds ids {sorted(held - known)} that no listed version "
                           f"uses (retired ones leak), and lacks {sorted(known - held)}")
    assert rss["after_200"] - rss["window_full"] < 150 * 2 ** 20


def test_sglang_generate_route_and_paused_generation(sglang, make_adapter):
    """SGLang's native /generate names adapters in lora_path (alias or version). With
    generation paused, retiring the version a paused request uses still returns at once
    (upstream's unload would wait for the paused request forever)."""
    with LoRASyncClient(sglang.url, engine="sglang", api_key=sglang.api_key) as c:
        c.push(make_adapter(seed=700), "paused", transport="tensors")
        body = {"text": PROMPT, "lora_path": "paused",
                "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
        status, out, headers = http.request("POST", f"{sglang.url}/generate", json_body=body)
        assert status == 200 and headers["x-lora-version"] == "1"
        assert out["text"] == c.complete(PROMPT, "paused-v1", 12)["text"]

        done = {}
        long = {"text": PROMPT, "lora_path": "paused-v1", "sampling_params": {
            "max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}}
        t = threading.Thread(target=lambda: done.update(zip(
            ("status", "out", "headers"),
            http.request("POST", f"{sglang.url}/generate", json_body=long, timeout=300))))
        t.start()
        deadline = time.time() + 30
        while inflight(c, "paused-v1") == 0 and time.time() < deadline:
            time.sleep(0.02)
        # An admin route of SGLang's: it takes the admin key (lora-sync's) since the hardening.
        http.call("POST", f"{sglang.url}/pause_generation", json_body={"mode": "in_place"},
                  headers=AUTH)
        try:
            t0 = time.perf_counter()
            for i in range(KEEP):  # retires v1 while its request is paused
                c.push(make_adapter(seed=701 + i), "paused", transport="tensors")
            pushes_s = time.perf_counter() - t0
            assert versions_of(c, "paused") == [1, 2, 3, 4]  # v1 drains, not dropped
        finally:
            http.call("POST", f"{sglang.url}/continue_generation", json_body={},
                      headers=AUTH)
        t.join(timeout=300)
        assert done["status"] == 200 and done["headers"]["x-lora-version"] == "1"
        deadline = time.time() + 10
        while 1 in versions_of(c, "paused") and time.time() < deadline:
            time.sleep(0.1)
        assert versions_of(c, "paused") == [2, 3, 4]
        print(f"\npushes during pause took {pushes_s:.2f}s")


@pytest.mark.parametrize("transport", ["tensors", "broadcast"])
def test_retired_versions_memory_is_reused_and_live_versions_stay_intact(client, make_adapter,
                                                                        server, transport):
    """A push reuses what a retired version freed (the staging file of a tensor push, the
    receive buckets of a broadcast). Every version still in the window keeps answering
    exactly as right after its own push."""
    staging = staging_dir_of(server)
    if transport == "broadcast":
        client.init_group()
    try:
        outputs, files = {}, []
        for i in range(KEEP + 4):
            [res] = client.push(make_adapter(seed=700 + i), "reuse", transport=transport)
            outputs[res.name] = greedy(client, res.name)
            for name in list(outputs)[-KEEP:]:
                assert greedy(client, name) == outputs[name], f"{name} changed after a push"
            files.append(sorted(os.listdir(staging)))
    finally:
        if transport == "broadcast":
            client.destroy_group()
    assert len(set(outputs.values())) > KEEP, "the adapters must differ for this test to mean much"
    if transport == "tensors":  # from the first retirement on, the same files are reused
        assert files[KEEP] and files[KEEP:] == [files[KEEP]] * (len(files) - KEEP)
