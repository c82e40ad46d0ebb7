"""The benchmark's quick mode runs against the real server and writes well-formed output
(no timing is asserted: performance is measured, not tested)."""
import json

from benchmarks.sync_bench import TRANSPORTS, WITHIN_PHASES, goals_report, print_table, run, \
    rss_growth, soak
from lora_sync import LoRASyncClient


def test_rss_growth_follows_the_top_not_the_level_a_sample_catches():
    """Run V's SGLang soak: two levels 67 MB apart (the window's contents), each flat. The
    first and last samples, or the halves' medians, read that as +35 MB per 100 pushes."""
    sglang_v = [4624.1, 4692.2, 4692.9, 4692.9, 4693.0, 4625.8, 4625.9, 4693.1, 4626.6, 4626.9,
                4694.2, 4627.0, 4627.0, 4694.2, 4694.2, 4694.3, 4694.3, 4627.1, 4627.2, 4694.3]
    assert abs(rss_growth(sglang_v, 200) - 1.2) < 1e-6  # 4693.1 -> 4694.3
    leaking = [level + 0.5 * i for i, level in enumerate([4600, 4670] * 10)]  # 0.5 MB a sample
    assert abs(rss_growth(leaking, 200) - 5.0) < 1e-9  # 0.5 MB per 10 pushes
    assert rss_growth([4600.0], 10) == 0.0


def test_quick_benchmark_produces_well_formed_output(vllm, sglang, model_dir, workdir,
                                                    monkeypatch):
    import benchmarks.sync_bench
    monkeypatch.setattr(benchmarks.sync_bench, "IDLE_S", 0.0)
    out = workdir / "bench"
    result = run(model_dir, [8], 2, [("vllm", vllm.url), ("sglang", sglang.url)], out,
                 "float32", progress=False, api_key=vllm.api_key)
    saved = json.loads((out / "results.json").read_text())
    assert saved["machine"]["vllm"] == "0.32.0"
    kinds = {(s["engine"], s["transport"]) for s in saved["samples"]}
    assert {(e, t) for t in TRANSPORTS for e in ("vllm", "sglang")} <= kinds
    assert {("raw", "http_post"), ("raw", "asgi_post"), ("raw", "gloo_broadcast"),
            ("raw", "memcpy")} <= kinds
    for s in saved["samples"]:
        assert s["bytes"] > 0 and s["phases"]["total"] > 0
        if s["engine"] != "raw":  # every millisecond is in a named phase
            parts = sum(v for k, v in s["phases"].items()
                        if k not in ("total", *WITHIN_PHASES))
            assert abs(parts - s["phases"]["total"]) < 1e-6, s
    # The rounds that fill the retention window (3 on the test servers) are reported apart.
    vllm_tensors = [s for s in saved["samples"] if (s["engine"], s["transport"]) ==
                    ("vllm", "tensors")]
    assert [s["cold"] for s in vllm_tensors] == [True] * 3 + [False] * 2
    rows = {(r["engine"], r["transport"]): r for r in result["summary"]}
    for engine in ("vllm", "sglang"):
        assert rows[(engine, "tensors")]["x_limit"] > 0
        assert rows[(engine, "tensors")]["x_asgi_limit"] > 0
        assert rows[(engine, "broadcast")]["speedup_over_disk"] > 0
        assert rows[(engine, "broadcast")]["cold_s"] > 0
        assert rows[(engine, "shm")]["x_limit"] > 0
        assert set(rows[(engine, "tensors")]["phases_s"]) >= {
            "client", "http", "receive", "intake", "build", "handoff", "register",
            "server_other", "total"}
        # a broadcast's intake split: waiting on the trainer, then the wire; its packing
        assert {"header_wait", "transfer", "pack"} <= set(rows[(engine, "broadcast")]["phases_s"])
        # the warm rounds' copy goes into a lease readied ahead, after the commit
        assert {"lease", "write", "copy"} <= set(rows[(engine, "shm")]["phases_s"])
    # Ratios to disk per round, with their spread; whether the machine was quiet.
    for engine in ("vllm", "sglang"):
        spread = rows[(engine, "shm")]["speedup_per_round"]
        assert spread["rounds"] == 2 and spread["min"] <= spread["median"] <= spread["max"]
    assert set(saved["quiet"]) == {"loadavg_before", "loadavg_after", "other_servers",
                                   "other_processes_cores", "steal_cores", "quiet"}
    assert saved["memory"] == []  # the soak runs on servers the benchmark starts itself
    with LoRASyncClient(vllm.url, engine="vllm", api_key=vllm.api_key) as client:
        memory = soak(client, vllm, model_dir, 8, 20, "float32")
    assert len(memory["rss_mb_every_10"]) == 2 and memory["max_mb"] >= memory["first_mb"] > 0
    assert (out / "results.png").stat().st_size > 0
    assert "tensors" in print_table(result["summary"])
    report = goals_report(result["summary"])
    for engine in ("vllm", "sglang"):
        goal = rows[(engine, "broadcast")]["goal"]
        assert goal["ratio"] == 1.5 and goal["floor_s"] > 0 and goal["budget_s"] > 0
        assert f"goal {engine} broadcast rank 8: 1.5x disk" in report
        # the broadcast's floor per round: the raw transfer of that round, from this process
        raws = [s["raw_transfer_s"] for s in saved["samples"]
                if (s["engine"], s["transport"]) == (engine, "broadcast")]
        assert len(raws) == 5 and all(r > 0 for r in raws)
        floor = rows[(engine, "broadcast")]["x_floor_per_round"]
        assert floor["rounds"] == 2 and floor["min"] <= floor["median"] <= floor["max"]
        assert f"goal {engine} broadcast rank 8: within 1.3x its floor" in report
        first = rows[(engine, "shm")]["first_vs_disk_s"]
        assert first["rounds"] == 2 and first["min"] <= first["median"] <= first["max"]
        assert f"goal {engine} shm rank 8: first completion no slower" in report
    # vLLM's metrics split the first completion: the part outside the engine is lora-sync's
    outside = rows[("vllm", "shm")]["first_vs_disk_s"]["outside_engine"]
    assert outside["min"] <= outside["median"] <= outside["max"]
    assert "outside the engine" in report
