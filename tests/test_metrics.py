"""lora-sync's Prometheus metrics, scraped from each engine's own /metrics (vLLM: the one
API server's registry; SGLang --enable-metrics: prometheus_client's multiprocess mode), and
the state snapshot that mode is served from."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections import Counter

import pytest

from lora_sync import http
from lora_sync.transports import shm

from .helpers import AUTH, PROMPT, body_of, post_body

PHASES = ("settle", "receive", "wait", "worker", "handoff", "register")


def scrape(server) -> dict:
    """{(sample name, frozenset of labels): value} of every lora_sync_ sample."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            if family.name.startswith("lora_sync_") for s in family.samples}


def value(samples: dict, metric: str, **labels) -> float:
    return samples.get((metric, frozenset(labels.items())), 0.0)


def series_of(samples: dict, adapter: str) -> dict:
    return {k: v for k, v in samples.items() if ("name", adapter) in k[1]}


def state(client, name: str) -> dict:
    """What lora_adapters says about `name`: servable versions, draining versions, in flight
    per version, alias target."""
    for a in client.adapters()[0]["adapters"]:
        if a["name"] == name:
            return {"retained": sorted(v["version"] for v in a["versions"] if not v["retired"]),
                    "draining": sorted(int(s.rsplit("-v", 1)[1]) for s in a["draining"]),
                    "inflight": {v["version"]: v["inflight"] for v in a["versions"]},
                    "alias": int(a["alias_target"].rsplit("-v", 1)[1])
                    if a["alias_target"] else None}
    return {"retained": [], "draining": [], "inflight": {}, "alias": None}


def gauges(samples: dict, name: str) -> dict:
    """The state gauges for `name`, in the shape of `state`."""
    inflight = {int(dict(k[1])["version"]): v for k, v in samples.items()
                if k[0] == "lora_sync_inflight_requests" and dict(k[1]).get("name") == name}
    return {"retained": value(samples, "lora_sync_versions_retained", name=name),
            "draining": value(samples, "lora_sync_versions_draining", name=name),
            "inflight": inflight,
            "alias": value(samples, "lora_sync_alias_version", name=name) or None}


def wait_for(check, timeout=20.0, what=""):
    """Polls `check()` (-> (ok, detail)) until ok: admission counts a request done just after
    its reply, versions are freed in the background, and SGLang's snapshot lags <= 0.1 s."""
    deadline = time.time() + timeout
    while True:
        ok, detail = check()
        if ok:
            return detail
        if time.time() > deadline:
            pytest.fail(f"{what}: {detail}")
        time.sleep(0.1)


def matches(client, server, name, busy=None, idle=False):
    """(the gauges agree with lora_adapters, detail); `busy`: a version known to have one
    request in flight; `idle`: none may have any."""
    before = state(client, name)
    g = gauges(scrape(server), name)
    after = state(client, name)
    want = {"retained": float(len(after["retained"])), "draining": float(len(after["draining"])),
            "inflight": {v: float(n) for v, n in after["inflight"].items()},
            "alias": after["alias"]}
    # lora_adapters lists draining versions only while requests still run on them; the
    # gauge keeps every version not yet freed.
    g_inflight = {v: n for v, n in g["inflight"].items() if v in want["inflight"] or n}
    ok = before == after and {**g, "inflight": g_inflight} == want and \
        set(g["inflight"]) >= set(after["retained"])
    if busy is not None:
        ok = ok and g["inflight"].get(busy) == 1.0
    if idle:
        ok = ok and not any(g["inflight"].values())
    return ok, {"gauges": g, "adapters": after}


def test_metrics_count_pushes_and_failures(client, server, make_adapter):
    name = "met"
    before = scrape(server)
    # Served from the start (zero series for every transport).
    assert ("lora_sync_pushes_total", frozenset({("transport", "broadcast")})) in before
    pushed = []
    for seed in (901, 902):
        pushed += client.push(make_adapter(seed=seed), name, transport="tensors")
    pushed += client.push(make_adapter(seed=903), name, transport="shm")
    client.init_group(backend="gloo")
    pushed += client.broadcast(make_adapter(seed=904), name)
    client.destroy_group()
    assert [r.transport for r in pushed] == ["tensors", "tensors", "shm", "broadcast"]
    assert [r.version for r in pushed] == [1, 2, 3, 4]

    # Refused pushes: a bad name (400), no key (401), an shm commit of a lease never granted.
    route = client.servers[0].route("load_lora_adapter_from_tensors")
    bad = body_of(make_adapter(seed=905), name="a/b")
    for _ in range(2):
        status, reply = post_body(route, bad)
        assert (status, reply["error"]["code"]) == (400, "bad_name")
    status, _, _ = http.request("POST", route, chunks=[bad],
                                headers={"Content-Type": "application/octet-stream"})
    assert status == 401
    status, reply, _ = http.request("POST", client.servers[0].route(shm.COMMIT_ROUTE),
                                    json_body={"lease_id": "0" * 32, "token": "0" * 64},
                                    headers=AUTH)
    assert (status, reply["error"]["code"]) == (404, "unknown_lease")
    refused = Counter({("tensors", "bad_name"): 2, ("shm", "unknown_lease"): 1})
    if server.engine == "vllm":
        refused["tensors", "unauthorized"] = 1
    # else SGLang's own middleware refuses a request without its --admin-api-key (ours)
    # before lora-sync's route sees it: not a lora-sync failure, not counted.

    after = scrape(server)

    def delta(metric, **labels):
        return value(after, metric, **labels) - value(before, metric, **labels)
    by_transport = Counter(r.transport for r in pushed)
    for t in ("tensors", "shm", "broadcast"):
        assert delta("lora_sync_pushes_total", transport=t) == by_transport[t], t
        assert delta("lora_sync_push_bytes_total", transport=t) == \
            sum(r.bytes for r in pushed if r.transport == t), t
        assert delta("lora_sync_push_seconds_count", transport=t) == by_transport[t], t
        phases = Counter(p for r in pushed if r.transport == t for p in r.reply["timings_ms"]
                         if p in PHASES)
        assert phases, t
        for phase, n in phases.items():
            assert delta("lora_sync_push_phase_seconds_count", transport=t, phase=phase) == n
        assert delta("lora_sync_push_seconds_bucket", transport=t, le="+Inf") == \
            by_transport[t], t
    for (t, code), n in refused.items():
        assert delta("lora_sync_push_failures_total", transport=t, code=code) == n, (t, code)
    failures = {k: v - before.get(k, 0.0) for k, v in after.items()
                if k[0] == "lora_sync_push_failures_total" and v != before.get(k, 0.0)}
    assert sum(failures.values()) == sum(refused.values()), failures
    assert delta("lora_sync_route_errors_total", route="load_lora_adapter_from_tensors",
                 code="bad_name") == 2

    # State: 3 versions kept (the session servers' LORA_SYNC_KEEP_VERSIONS), v1 retired and
    # freed, alias on v4, nothing in flight.
    detail = wait_for(lambda: matches(client, server, name, idle=True),
                      what="gauges vs lora_adapters")
    assert detail["adapters"]["retained"] == [2, 3, 4] and detail["gauges"]["retained"] == 3
    assert detail["gauges"]["alias"] == 4 and set(detail["gauges"]["inflight"]) == {2, 3, 4}
    assert not any(detail["gauges"]["inflight"].values())

    # A long request on v3 is in flight, in the gauge of exactly that version, then done.
    done = {}

    def long_request():
        done["status"] = http.request(
            "POST", f"{server.url}/v1/completions", timeout=300,
            json_body={"model": f"{name}-v3", "prompt": PROMPT, "max_tokens": 480, "n": 8,
                       "ignore_eos": True, "temperature": 1.0, "stream": True})[0]
    t = threading.Thread(target=long_request)
    t.start()
    try:
        wait_for(lambda: matches(client, server, name, busy=3), timeout=60,
                 what="one request in flight on v3")
    finally:
        t.join(timeout=300)
    assert done["status"] == 200
    t0 = time.time()
    wait_for(lambda: matches(client, server, name, idle=True), what="in flight back to 0")
    print(f"\nin flight back to 0 {time.time() - t0:.2f}s after the reply ended")

    # Retiring the name drops every series of it once its versions are freed.
    client.retire(name)
    wait_for(lambda: (not series_of(scrape(server), name), series_of(scrape(server), name)),
             what="series of a retired name")


def test_snapshot_drops_freed_versions_in_multiprocess_mode(tmp_path):
    """prometheus_client's multiprocess mode cannot remove a series; the state snapshot holds
    exactly the current ones (no server: a process in that mode, read by the collector an
    engine serves /metrics with)."""
    script = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        from lora_sync import naming
        from lora_sync.server import metrics
        from lora_sync.server.registry import AdapterRecord

        class Registry:
            def __init__(self):
                self.book, self.records = naming.VersionBook(), {}

        class Service:
            registry = Registry()
        service = Service()
        s = service.registry
        for v in (1, 2, 3):
            s.book.reserve("p", v)
            s.book.commit("p", v, 2)
            s.records[f"p-v{v}"] = AdapterRecord("p", v, f"p-v{v}", v, 8, 8, "tensors", 1.0)
        s.records["p-v1"].retired, s.records["p-v2"].inflight = True, 2
        assert metrics.install(service) and metrics._metrics.multiprocess
        metrics.observe("/load_lora_adapter_from_tensors", 200, {
            "transport": "tensors", "bytes": 8, "load_ms": 3.0, "lora_name": "p",
            "version": 3, "name": "p-v3", "timings_ms": {"worker": 1.0}}, 0.003, "tensors")
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        def show():
            return sorted(l for l in generate_latest(registry).decode().splitlines()
                          if l.startswith(("lora_sync_inflight", "lora_sync_versions",
                                           "lora_sync_pushes_total{transport=\\"tensors")))
        print(show())
        del s.records["p-v1"]
        metrics.state_changed()
        print(show())
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=repo, check=True,
                         capture_output=True, text=True, timeout=120).stdout.splitlines()
    first, second = (eval(line) for line in out[-2:])  # noqa: S307 (our own printout)
    assert 'lora_sync_inflight_requests{name="p",version="1"} 0.0' in first
    assert 'lora_sync_inflight_requests{name="p",version="2"} 2.0' in first
    assert 'lora_sync_versions_draining{name="p"} 1.0' in first
    assert 'lora_sync_pushes_total{transport="tensors"} 1.0' in first
    assert not any('version="1"' in line for line in second), second
    assert 'lora_sync_versions_draining{name="p"} 0.0' in second
    assert 'lora_sync_versions_retained{name="p"} 2.0' in second
    assert not list(tmp_path.glob("*lorasync*")), "the snapshot outlives its process"
