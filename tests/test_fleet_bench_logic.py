"""benchmarks/fleet_bench.py's bookkeeping, in process: the round order, the curves, phases,
per-server cost and the fake-vs-real report, on made-up samples (no server, no timing)."""
from __future__ import annotations

from benchmarks import fleet_bench as fb
from benchmarks import fleet_server


def _samples(ms_by_k: dict[int, list[float]], phases: dict | None = None) -> dict:
    """size -> {transport 'shm': samples} with the given push times (ms); every server of a
    sample reports `phases`."""
    return {k: {"shm": [{"s": ms / 1e3, "timings_ms": [dict(phases or {})] * k}
                        for ms in xs]}
            for k, xs in ms_by_k.items()}


def test_engine_order_alternates_and_keeps_every_engine():
    assert fb.engine_order(0, ["fake", "vllm"]) == ["fake", "vllm"]
    assert fb.engine_order(1, ["fake", "vllm"]) == ["vllm", "fake"]
    assert fb.engine_order(2, {"fake": [], "vllm": []}) == ["fake", "vllm"]
    assert fb.engine_order(5, ["fake"]) == ["fake"]
    for rnd in range(6):
        assert sorted(fb.engine_order(rnd, "abc")) == ["a", "b", "c"]


def test_curve_ratio_and_per_extra_server():
    curve = fb.curve_of(_samples({1: [10, 12, 30], 3: [20, 22, 50]}), [1, 3], ["shm"])
    row = curve["shm"]
    assert row[1] == {"median": 12.0, "min": 10.0, "max": 30.0, "n": 3}
    assert row[3]["median"] == 22.0
    assert fb.per_extra_server(row, [1, 3]) == 5.0
    assert fb.ratios(row, [1, 3]) == {3: 22.0 / 12.0}
    assert fb.per_extra_server({1: row[1]}, [1]) == 0.0


def test_phases_take_every_server_of_every_round():
    samples = _samples({2: [5, 6]}, {"server": 4.0, "register": 1.0, "other": 9.0})
    samples[2]["shm"][1]["timings_ms"][1] = {"server": 8.0}
    got = fb.phases_of(samples, [2], ["shm"])["shm"][2]
    assert got == {"server": 4.0, "register": 1.0}  # median of 4,4,4,8; unknown phase left out


def test_memory_check():
    assert fb.fits_in_memory(3, 3 * fb.REAL_SERVER_BYTES)
    assert not fb.fits_in_memory(3, 3 * fb.REAL_SERVER_BYTES - 1)
    assert fb.fits_in_memory(2, 10, per_server=5)


def test_both_fleets_share_settings_and_key():
    # the comparison only holds if real and fake servers run lora-sync alike
    assert fleet_server.ENV["LORA_SYNC_API_KEY"] == fb.API_KEY == fleet_server.API_KEY


def _result(curves: dict, sizes, phases=None) -> dict:
    return {"rank": 64, "bytes": 70_400_000, "sizes": sizes, "reps": 3,
            "load_before": (0.5, 0, 0), "load_after": (1.0, 0, 0), "cpus": 2,
            "curve": curves["fake"],
            "floors": {"memcpy": fb._stats([11.0]),
                       **{f"gloo_{k}": fb._stats([30.0 * k]) for k in sizes}},
            **({"curves": curves, "phases": phases} if len(curves) > 1 else {})}


def test_report_compare_puts_both_curves_side_by_side():
    sizes = [1, 2, 3]
    fake = fb.curve_of(_samples({1: [10], 2: [12], 3: [14]}), sizes, ["shm"])
    real = fb.curve_of(_samples({1: [40], 2: [70], 3: [100]}), sizes, ["shm"])
    phases = {e: {"shm": {k: {"server": 1.0 * k, "register": 2.0} for k in sizes}}
              for e in ("fake", "vllm")}
    result = _result({"fake": fake, "vllm": real}, sizes, phases)
    result.update(start_s=[40.0, 41.0, 42.0], rss_bytes=[3 << 30] * 3)
    text = fb.report(result)
    assert "fake-engine vs vllm servers" in text
    assert "| shm | fake | 10.0 [10.0-10.0] | 12.0 [12.0-12.0] | 14.0 [14.0-14.0] | 2.0 |" in text
    assert "| shm | vllm | 40.0 [40.0-40.0] |" in text and "| 30.0 | 2: 1.75x, 3: 2.50x |" in text
    assert "shm       ratio 1.40x vs 2.50x; per server +2.0 vs +30.0; fixed +30.0" in text
    assert "shm       vllm  1.0/3.0  nan/nan  nan/nan  nan/nan  2.0/2.0" in text
    assert "RSS 3.0, 3.0, 3.0 GiB" in text
    assert "| floor: raw gloo broadcast | 30.0 | 60.0 | 90.0 |" in text


def test_report_fake_only_keeps_its_table_and_goals():
    sizes = [1, 4]
    curve = fb.curve_of(_samples({1: [10], 4: [12]}), sizes, ["shm"])
    curve["shared"] = curve["shm"]
    text = fb.report(_result({"fake": curve}, sizes))
    assert "| shm | 10.0 [10.0-10.0] | 12.0 [12.0-12.0] | 0.7 | 4: 1.20x |" in text
    assert "goal shared: push(4)/push(1) = 1.20 (goal <= 1.3): met" in text
    assert "engine" not in text


def test_client_peak_rises_by_what_a_push_holds_and_resets_between_pushes():
    """The trainer's memory per push: the peak RSS since client_peak_start rises by a
    buffer touched in between, and the next start measures from the current RSS again."""
    rss0 = fb.client_peak_start()
    buf = bytearray(64 << 20)  # 64 MiB, zero-filled: touched
    rise = fb.client_peak_over(rss0)
    assert 60 << 20 <= rise <= 80 << 20, rise
    del buf
    assert fb.client_peak_over(fb.client_peak_start()) < 8 << 20


def test_client_memory_is_the_largest_rise_per_size_and_is_reported():
    sizes = [1, 4]
    samples = {k: {"shm": [{"s": 0.01, "client_peak": mb << 20, "timings_ms": []}
                           for mb in (3, 5)]} for k in sizes}
    assert fb.client_memory_of(samples, sizes, ["shm"]) == {"shm": {1: 5.0, 4: 5.0}}
    result = _result({"fake": fb.curve_of(samples, sizes, ["shm"])}, sizes)
    result["client_peak_mb"] = {"fake": fb.client_memory_of(samples, sizes, ["shm"])}
    assert "  shm       5.0 / 5.0" in fb.report(result)
