"""Servers on other hosts: a trainer and two servers, each in its own network namespace
(tests/netns.py), talk over a private test subnet. HTTP tensors and broadcast run across the
hosts, and through a relay on each server's host (the trainer's link carries one copy); a
link cut in the middle of a broadcast fails that server's push only, and the trainer
forms groups without the cut host and, once the link is back, with it again. The trainer runs
tests/netns_trainer.py inside its namespace; this process controls the bed.

The servers are lora-sync on the FAKE engine, each a process of its own
(tests/fake_server_main.py): lora-sync's real routes, admission, service, transports and
worker dispatcher, whose fake worker does the real gloo receive of a broadcast. What this
test checks is networking across hosts (addresses, the trainer allow-list, gloo over the
namespaces' interfaces, a vanished host), none of it the engine's; a fake server starts in
seconds where a vLLM CPU server takes most of a minute. Their text is a digest of the weights
their workers hold (engine_fakes.served_text), so each "serves the pushed weights" is checked
against the adapter itself. A broadcast into real vLLM servers (one group, two servers) is
tests/test_broadcast.py's."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from .conftest import API_KEY, REPO
from .engine_fakes import served_text
from .fake_server_main import fake_engine_process
from . import netns

ok, why = netns.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no network namespaces here: {why}")
HEALTH = ("import http.client, sys; c = http.client.HTTPConnection(sys.argv[1], "
          "int(sys.argv[2]), timeout=2); c.request('GET', '/health'); "
          "sys.exit(c.getresponse().status != 200)")


def place(net, host: str, server):
    """Moves a not yet started ServerProcess into `host`, bound to its address; its health
    is checked from the trainer's host (this namespace cannot reach the subnet)."""
    addr = net.addr(host)
    server.cmd = net.argv(host, [addr if a == "127.0.0.1" else a for a in server.cmd])
    server.url = f"http://{addr}:{server.port}"
    server.env = net.env(server.env)
    server.healthy = lambda: net.run("trainer", [sys.executable, "-c", HEALTH, addr,
                                                 str(server.port)], timeout=10,
                                     capture_output=True).returncode == 0
    return server


def start_relay(net, host: str, tmp_path) -> tuple[str, object]:
    """lora_sync.relay on `host`, with the servers' key: (its URL, its process)."""
    log = tmp_path / f"{host}-relay.log"
    with open(log, "w") as f:
        proc = net.popen(host, [sys.executable, "-m", "lora_sync.relay", "--host",
                                net.addr(host), "--port", "9100"], cwd=REPO,
                         env={**net.env(), "LORA_SYNC_API_KEY": API_KEY,
                              "PYTHONPATH": str(REPO)}, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "relay ready" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    return f"http://{net.addr(host)}:9100", proc


def wait_for(path, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"the trainer never wrote {path.name}"
        time.sleep(0.05)


# The trainer's wait for a cut server's reply past the group timeout (the library's default is
# REPLY_GRACE_S, 20 s; the test's own, to wait less).
REPLY_GRACE_S = 3.0


def test_two_hosts_http_broadcast_and_a_link_cut(model_dir, make_adapter, tmp_path):
    env = {"LORA_SYNC_ALLOWED_TRAINERS": netns.SUBNET}  # on top of the test servers' SERVER_ENV
    with netns.HostNet(["trainer", "srv1", "srv2"]) as net:
        servers = [place(net, h, fake_engine_process(env=env)) for h in ("srv1", "srv2")]
        starts = [threading.Thread(target=s.start) for s in servers]
        for t in starts:
            t.start()
        for t in starts:
            t.join(timeout=120)
        relays = []
        try:
            assert all(s.proc is not None and s.proc.poll() is None for s in servers)
            relays = [start_relay(net, h, tmp_path) for h in ("srv1", "srv2")]
            control, out = tmp_path / "control", tmp_path / "report.json"
            control.mkdir()
            trainer = net.popen("trainer", [
                sys.executable, str(REPO / "tests" / "netns_trainer.py"), str(out),
                str(control), str(model_dir), net.addr("trainer"), *(s.url for s in servers)],
                cwd=REPO, env={**net.env(), "LORA_SYNC_TEST_KEY": API_KEY,
                               "LORA_SYNC_TEST_REPLY_GRACE_S": str(REPLY_GRACE_S),
                               "LORA_SYNC_TEST_RELAYS": ",".join(
                                   f"{s.url}={r}" for s, (r, _) in zip(servers, relays)),
                               "PYTHONPATH": str(REPO)})
            wait_for(control / "posted")
            net.cut("srv2")
            (control / "cut").touch()
            wait_for(control / "restore")
            net.restore("srv2")
            (control / "restored").touch()
            assert trainer.wait(timeout=300) == 0
        finally:
            for s in servers:
                s.stop()
            for _, proc in relays:
                proc.terminate()
                proc.wait(timeout=20)
    report = json.loads(out.read_text())
    print(f"\nlink cut: {report['cut_error']!r} after {report['cut_error_s']:.1f} s")
    # What each server serves is the weights the trainer pushed (netns_trainer.adapter(seed)
    # is make_adapter(seed)).
    tensors_text, broadcast_text, again_text = (served_text(make_adapter(seed))
                                                for seed in (1, 2, 6))
    assert report["tensors"] == [1, 1] and report["broadcast"] == [2, 2]
    assert report["tensors_out"] == [tensors_text, tensors_text]
    assert report["broadcast_out"] == [broadcast_text, broadcast_text] != report["tensors_out"]
    # Through the relays: both servers took the node's shared copy and serve its weights.
    relay_text = served_text(make_adapter(7))
    assert report["relay"] == [[1, "shared"], [1, "shared"]]
    assert report["relay_out"] == [relay_text, relay_text]
    # The cut server's push failed with an error naming it, within its timeout.
    assert report["cut_error"] and servers[1].url.split("//")[1] in report["cut_error"]
    # group timeout + the reply's grace + slack
    assert report["cut_error_s"] < 4 + REPLY_GRACE_S + 10
    # The other server took the version and serves it.
    [mh] = [a for a in report["srv1_alias_after_cut"] if a["name"] == "mh"]
    assert mh["alias_target"] == "mh-v3"
    assert report["without_srv2"] == [4]
    assert report["with_srv2_again"] == [5, 5]
    assert report["with_srv2_out"] == [again_text, again_text]
    # Nothing a real engine would have crashed on (engine_fakes.FakeBridge.violations).
    assert report["violations"] == [[], []]
