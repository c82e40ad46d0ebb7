"""benchmarks/multihost_bench.py's own arithmetic, in process: gloo's binomial tree, the
floors, the link-counter bookkeeping, the rate parsing of tests/netns.py, the trainer's
reply protocol and the report, on made-up numbers (no namespace, no server, no timing)."""
from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks import multihost_bench as mb
from tests.netns import rate_bits

MB70 = 70_400_000


def test_binomial_tree_matches_gloo():
    # gloo/broadcast.cc: rank 0 sends to 1, 2, 4...; 1 forwards to 3, 5...; 2 to 6...
    assert mb.binomial_sends(1) == [0]
    assert mb.binomial_sends(2) == [1, 0]
    assert mb.binomial_sends(3) == [2, 0, 0]
    assert mb.binomial_sends(5) == [3, 1, 0, 0, 0]
    assert mb.binomial_sends(8) == [3, 2, 1, 1, 0, 0, 0, 0]
    assert mb.binomial_sends(9) == [4, 2, 1, 1, 0, 0, 0, 0, 0]
    for world in range(2, 70):
        sends = mb.binomial_sends(world)
        assert sum(sends) == world - 1  # every other rank receives exactly once
        assert sends[0] == math.ceil(math.log2(world))
    # another root: the same tree, rotated
    assert mb.binomial_sends(5, root=2) == [0, 0, 3, 1, 0]


def test_floors():
    assert mb.floor_ms(MB70, 1e9) == pytest.approx(563.2)
    assert mb.floor_ms(MB70, 1e8, copies=4) == pytest.approx(4 * 5632)
    fl = mb.floors(MB70, 1e9, [1, 2, 4, 8])
    assert [fl[m]["tree_copies"] for m in (1, 2, 4, 8)] == [1, 2, 3, 4]
    assert fl[4]["m_copies"] == pytest.approx(4 * 563.2)
    assert fl[4]["tree"] == pytest.approx(3 * 563.2)
    assert fl[1]["one_copy"] == fl[8]["one_copy"] == pytest.approx(563.2)
    assert fl[1]["one_copy_wire"] == pytest.approx(563.2 * 1514 / 1448)
    # two workers per server: world 1 + 2M
    assert mb.floors(MB70, 1e9, [2], workers=2)[2]["tree_copies"] == 3


def test_rate_bits():
    assert rate_bits("1gbit") == 1e9
    assert rate_bits("100mbit") == 1e8
    assert rate_bits("2.5Gbit") == 2.5e9
    assert rate_bits("64kbit") == 64e3
    for bad in ("1gbps", "100", "mbit", "1 gbit", "-1gbit", ""):
        with pytest.raises(ValueError):
            rate_bits(bad)


def test_counters_delta_and_copies():
    before = {"trainer": [100, 50], "srv1": [10, 20]}
    after = {"trainer": [100 + 3 * MB70, 60], "srv1": [10 + MB70, 20 + MB70]}
    d = mb.delta(before, after)
    assert d == {"trainer": [3 * MB70, 10], "srv1": [MB70, MB70]}
    samples = [{"bytes": d}, {"bytes": {"trainer": [4 * MB70, 0], "srv1": [0, MB70]}},
               {"bytes": {"trainer": [3 * MB70, 0], "srv1": [MB70, MB70]}}]
    c = mb.link_copies(samples, MB70, ["trainer", "srv1"])
    assert c["trainer"][0] == 3.0 and c["srv1"] == [1.0, 1.0]
    assert c["trainer"][1] == pytest.approx(0.0)


def _result(times_ms: dict, sizes=(1, 2, 4)) -> dict:
    """A result as run() returns it (through JSON): transport -> M -> push times (ms);
    tensors' trainer sends M copies, broadcast's the binomial tree's."""
    hosts = ["trainer"] + [f"srv{i}" for i in range(1, max(sizes) + 1)]
    samples = {}
    for t, by_m in times_ms.items():
        for m, xs in by_m.items():
            sends = mb.binomial_sends(m + 1) if t == "broadcast" else [m] + [0] * m
            b = {h: [sends[i] * MB70 if i < len(sends) else 0,
                     MB70 if 0 < i <= m else 0] for i, h in enumerate(hosts)}
            samples.setdefault(str(m), {})[t] = [{"s": x / 1e3, "bytes": b} for x in xs]
    r = {"rate": "1gbit", "rate_bits": 1e9, "rank": 64, "bytes": MB70, "sizes": list(sizes),
         "reps": 3, "transports": list(times_ms), "hosts": hosts, "cpus": 2,
         "load_before": [0.5, 0, 0], "load_after": [0.4, 0, 0],
         "workers": {str(m): [1] * m for m in sizes},
         "floors": {str(m): f for m, f in mb.floors(MB70, 1e9, sizes).items()},
         "samples": samples}
    return json.loads(json.dumps(r))


def test_summary_and_report():
    r = _result({"tensors": {1: [600, 610, 650], 2: [1190, 1200, 1250],
                             4: [2370, 2380, 2500]},
                 "broadcast": {1: [598, 600, 700], 2: [1190, 1192, 1193],
                               4: [1850, 1900, 1970]}})
    s = mb.summarize(r)
    assert s["curve"]["tensors"][4] == {"median": 2380.0, "min": 2370.0, "max": 2500.0,
                                        "n": 3}
    assert s["copies"]["tensors"][4]["trainer"] == [4.0, 0.0]
    assert s["copies"]["broadcast"][4]["trainer"] == [3.0, 0.0]
    assert s["copies"]["broadcast"][4]["srv1"] == [1.0, 1.0]  # srv1 forwards to srv3
    assert set(s["copies"]["tensors"][2]) == {"trainer", "srv1", "srv2"}
    text = mb.report(r)
    row = next(x for x in text.splitlines() if x.startswith("| tensors"))
    assert "2380 [2370-2500]" in row and "4: 3.90x" in row and "| 590 |" in row
    assert "| 4.00 / 2.00" not in row and "1.00 / 2.00 / 4.00" in row
    bc = next(x for x in text.splitlines() if x.startswith("| broadcast"))
    assert "1.00 / 2.00 / 3.00" in bc
    assert "| floor: gloo's binomial tree from the root | 563 | 1126 | 1690 |" in text
    assert "world 5: sends per rank [3, 1, 0, 0, 0]" in text


class _Proc:
    """What Trainer needs of a Popen: stdin, stdout (a pipe written here), wait."""

    def __init__(self):
        r, w = os.pipe()
        self.stdout, self._w = os.fdopen(r, "rb", buffering=0), w
        self.stdin = open(os.devnull, "wb")

    def feed(self, text: str):
        os.write(self._w, text.encode())

    def wait(self, timeout=None):
        return 0

    def close(self):
        self.stdout.close()
        self.stdin.close()
        try:
            os.close(self._w)
        except OSError:
            pass


def test_trainer_replies_skip_other_output_and_fail_on_errors():
    p = _Proc()
    try:
        t = mb.Trainer(p)
        p.feed("some log line\n" + mb.REPLY + '{"s": 1.5}\n' + mb.REPLY + '{"closed": ')
        assert t.read(5) == {"s": 1.5}
        p.feed('true}\n')
        assert t.ask(5, op="close") == {"closed": True}
        p.feed(mb.REPLY + json.dumps({"error": "RuntimeError: failed pushes"}) + "\n")
        with pytest.raises(RuntimeError, match="failed pushes"):
            t.read(5)
        with pytest.raises(TimeoutError):
            t.read(0.05)
        os.close(p._w)
        with pytest.raises(RuntimeError, match="exited"):
            t.read(5)
    finally:
        p.close()


def test_the_relay_goal_pairs_each_round():
    r = _result({"one": {1: [600, 600, 600], 4: [600, 610, 590]},
                 "relay": {1: [620, 640, 630], 4: [700, 900, 690]}}, sizes=(1, 4))
    r["per_node"] = 2
    line = mb.relay_goal(r)[0]
    # medians 700 / 600; per round 700/600, 900/610, 690/590
    assert "4 nodes x 2 servers 700 ms against 1 node x 1 server 600 ms: 1.17x" in line
    assert "[per round 1.17-1.48]" in line and "(met)" in line
    r["samples"]["4"]["relay"] = [{"s": 0.9, "bytes": {}}] * 3
    assert mb.relay_goal(r)[0].endswith("(missed)")
    assert mb.relay_goal(_result({"tensors": {1: [1], 2: [1], 4: [1]}})) == []
