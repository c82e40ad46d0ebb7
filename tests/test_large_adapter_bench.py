"""benchmarks/large_adapter_bench.py's own logic, in process and in seconds: the adapter's
shapes against the model the servers build, the per-tensor arithmetic, the limits table and
the hostile headers. No timing is asserted."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from benchmarks import large_adapter_bench as bench
from lora_sync import ModelSpec, check_adapter, wire
from lora_sync.errors import BadAdapter

SMALL = replace(bench.LARGE, layers=3, intermediate=96, rank=4)


def test_shape_names_and_sizes_are_those_the_servers_read():
    """The analytic layer table is ModelSpec.from_hf_config's (what the bridges build), and
    the adapter it makes is that model's all-linear LoRA, accepted by check_adapter."""
    from transformers import LlamaConfig
    hf = ModelSpec.from_hf_config(LlamaConfig(**SMALL.hf_config()), SMALL.rank)
    assert list(SMALL.linear().items()) == list(hf.linear.items())
    a = SMALL.adapter(seed=3)
    assert len(a.tensors) == SMALL.tensors == 3 * bench.TENSORS_PER_LAYER
    assert a.nbytes == SMALL.nbytes == sum(SMALL.tensor_sizes())
    assert sum(SMALL.size_classes().values()) == SMALL.tensors
    assert sum(n * c for n, c in SMALL.size_classes().items()) == SMALL.nbytes
    assert all(t.dtype == torch.bfloat16 for t in a.tensors.values())
    assert any(t.abs().sum() > 0 for t in a.tensors.values())
    cfg = check_adapter(a.specs(), a.config, hf)
    assert cfg["target_modules"] == sorted(p for _, p in bench.PROJECTIONS)


def test_a_packed_adapter_is_the_same_adapter_in_one_run():
    """--packed: the same names, order and bytes, every tensor back to back in one buffer
    (as lora_sync.pack_parameters leaves a trainer's), so a push copies it as one."""
    loose, packed = SMALL.adapter(seed=5), SMALL.adapter(seed=5, packed=True)
    assert list(packed.tensors) == list(loose.tensors)
    assert wire.encode_bytes(packed.tensors, {}) == wire.encode_bytes(loose.tensors, {})
    assert len(wire.byte_views(packed.tensors.values())) == 1 < len(loose.tensors)


def test_the_peft_read_is_measured_on_the_adapter_a_push_reads():
    row = bench.peft_read_overhead(2, reps=1)
    assert row["tensors"] == 2 * bench.TENSORS_PER_LAYER
    assert row["through_peft"] > 0 and row["recorded"] > 0


def test_the_large_shape_is_what_the_issue_asks():
    """At least 10,000 tensors and 1 GB, many small tensors and a few large ones; FEW has the
    same bytes in a tenth of the tensors. (Sizes from the table, no tensor is made.)"""
    large = bench.LARGE
    assert large.tensors >= 10_000 and large.nbytes >= 1e9
    classes = large.size_classes()
    small = sum(c for n, c in classes.items() if n <= 16 << 10)
    assert small > 3 * (large.tensors - small)          # most tensors are small
    assert max(classes) >= 25 * min(classes)             # the large ones much larger
    few = bench.FEW
    assert few.nbytes == large.nbytes and few.tensors * 10 == large.tensors
    with pytest.raises(ValueError):
        bench.same_bytes(large, 7)                       # no integer width fits


def test_per_tensor_arithmetic():
    row = bench.per_tensor_overhead(bench.scan_shape(140), reps=1)
    assert row["tensors"] == 140 and row["bytes"] == bench.scan_shape(140).nbytes
    us = bench.us_per_tensor(row)
    assert set(us) == set(bench.OVERHEAD_STEPS)
    for step, value in us.items():
        assert value == pytest.approx(row[step] * 1e6 / 140) and value > 0
    assert row["parse_cached"]  # a small header fits the parse cache
    assert "140" in bench.overhead_table([row])
    # the measurement put the header cap and the caches back as they were
    assert wire.MAX_HEADER_BYTES == bench.wire.MAX_HEADER_BYTES
    assert not wire._KNOWN_ENTRIES
    fake = {"tensors": 1000, **{k: 0.002 for k in bench.OVERHEAD_STEPS}}
    assert bench.us_per_tensor(fake)["view"] == pytest.approx(2.0)


def test_header_cap_is_restored_and_scan_counts_stay_in_bounds():
    old = wire.MAX_HEADER_BYTES
    with bench.header_cap(old * 4):
        assert wire.MAX_HEADER_BYTES == old * 4
    assert wire.MAX_HEADER_BYTES == old
    assert bench.scan_shape(10 ** 7).tensors <= wire.MAX_TENSORS
    assert bench.scan_shape(1_000).tensors == 994


def test_limits_report_derives_what_each_shape_needs():
    """Header bytes per tensor times tensors is the header the encoder writes."""
    per = bench.header_bytes_per_tensor(SMALL)
    header = wire.layout(SMALL.adapter(fill=False).tensors, {"lora_name": "x"})[0]
    assert per * SMALL.tensors + 8 == pytest.approx(len(header))
    rows = bench.limits_report({"small": SMALL})
    assert all(r["fits"] == (r["needs"] <= r["value"]) for r in rows)
    by = {r["limit"]: r for r in rows}
    assert by["wire.MAX_TENSORS"]["needs"] == SMALL.tensors
    assert by["LORA_SYNC_MAX_BODY_MB"]["needs"] >= SMALL.nbytes
    assert "BLOCKS" not in bench.limits_table(rows)


@pytest.mark.parametrize("kind, code", [("junk", "unknown_tensor"), ("peft", "unknown_module")])
def test_hostile_headers_are_refused_with_a_4xx(kind, code):
    body = bench.hostile_header(kind, n=300, shape=SMALL)
    h = wire.parse_header(memoryview(body))
    assert len(h.specs) == 300 and h.total_bytes == len(body)
    assert all(s.nbytes == 0 for s in h.specs)
    got = bench.hostile_in_process(body, SMALL.spec())
    assert got["outcome"] == f"400 {code}"
    with pytest.raises(BadAdapter):
        check_adapter(h.specs, json.loads(h.metadata["adapter_config"]), SMALL.spec())


def test_the_widest_hostile_header_fills_the_cap():
    body = bench.hostile_header("widest")
    assert wire.MAX_HEADER_BYTES - 64 <= len(body) - 8 <= wire.MAX_HEADER_BYTES
    assert body[8:].count(b'"data_offsets"') > wire.MAX_TENSORS


def test_server_rows_and_goals():
    """Phases per tensor and the goal lines from summarize-like rows."""
    phases = {"receive": 0.2, "intake": 0.01, "checks": 0.0, "build": 0.03, "register": 0.001,
              "server_other": 0.02, "total": 0.4}
    rows = [{"engine": "fake", "transport": "shm", "rank": 10_080, "mb": 1108.9,
             "median_s": 0.45,
             "phases_s": phases, "speedup_per_round": {"median": 2.5}, "x_limit": 1.5,
             "limit_s": 0.3, "registration_s": 0.05, "label": ""},
            {"engine": "fake", "transport": "disk", "rank": 10_080, "mb": 1108.9,
             "phases_s": {"total": 1.0}},
            {"engine": "raw", "transport": "memcpy", "rank": 10_080, "mb": 1108.9,
             "phases_s": {"total": 0.25}}]
    [row] = bench.server_overhead(rows)
    assert row["tensors"] == 10_080 and row["build"] == 0.03
    assert "2.98" in bench.phase_table([row])  # 30 ms over 10,080 tensors
    lines = bench.goals(rows)
    assert lines[0].endswith("2.50x (met)") and lines[1].endswith("1.50x (met)")
    assert "memcpy 250 + engine 50" in lines[1]
    assert "(281 ms): 1.60x (met)" in lines[2]  # 450 ms over memcpy 250 + build 30 + register 1


@pytest.mark.parametrize("soak", ["5", "14"])
def test_a_soak_too_short_to_sample_is_refused_before_anything_runs(soak, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--soak", soak, "--out", "/nonexistent/never-made"])
    assert "--soak takes 0 (none) or at least 15 pushes" in capsys.readouterr().err


def test_cost_per_extra_tensor_leaves_out_the_engines_registration():
    """Same bytes in 10,080 and 20,160 tensors: 50.4 ms more in all, 30.24 of it the engine's
    registration, so 2.0 us of lora-sync's own per extra tensor."""
    def row(tensors, total, register, intake):
        phases = {k: 0.0 for k in bench.PHASE_KEYS}
        phases.update(total=total, register=register, intake=intake)
        return {"engine": "sglang", "transport": "shm", "rank": tensors, "mb": 1109.0,
                "phases_s": phases, "label": ""}
    rows = bench.server_overhead([row(20_160, 0.4504, 0.2302, 0.03),
                                  row(10_080, 0.4, 0.2, 0.01)])
    [line] = bench.per_extra_tensor(rows)
    assert line.startswith("per extra tensor, shm 10080 -> 20160: lora-sync's own 2.0 us "
                           "(the engine's own: registration 3.0, build 0.0;")
    assert "intake 2.0" in line


def test_the_paired_shapes_are_one_model_and_their_differences_per_extra_tensor():
    """--paired: both shapes are layers of one model (the second's after the first's), their
    adapters' names do not meet, and each round's difference is divided by the extra
    tensors; `ours` leaves out the engine's own build and registration."""
    shapes = bench.paired_shapes(replace(bench.LARGE, layers=4, rank=4))
    few, many = shapes["large"], shapes["many"]
    assert many.tensors == 2 * few.tensors and abs(many.nbytes / few.nbytes - 1) < 0.05
    assert not set(few.linear()) & set(many.linear())
    assert not set(few.adapter().tensors) & set(many.adapter().tensors)

    def sample(rep, tensors, total, engine_build, register=0.0):
        return {"transport": "shm", "label": str(tensors), "rep": rep, "tensors": tensors,
                "phases": {"total": total, "engine_build": engine_build, "register": register,
                           "receive": total / 2}}
    samples = [sample(0, 100, 9.0, 0.0), sample(0, 200, 1.0, 0.0),  # cold: left out
               sample(1, 100, 0.010, 0.001), sample(1, 200, 0.012, 0.0015),
               sample(2, 200, 0.013, 0.001), sample(2, 100, 0.010, 0.001)]
    [row] = bench.paired_per_extra_tensor(samples)
    assert row["rounds"] == 2
    assert row["ours_min"] == pytest.approx(15.0) and row["ours_max"] == pytest.approx(30.0)
    assert row["ours"] == pytest.approx(22.5) and row["engine_build"] == pytest.approx(2.5)
    assert row["receive"] == pytest.approx(12.5)
    assert "lora-sync's own 22.50 us [15.00 to 30.00]" in bench.paired_lines([row], 100, 200)[0]
