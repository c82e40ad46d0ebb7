"""Servers on other hosts: a trainer and two vLLM servers, each in its own network namespace
(tests/netns.py), talk over a private test subnet. HTTP tensors and broadcast run across the
hosts; a link cut in the middle of a broadcast fails that server's push only, and the trainer
forms groups without the cut host and, once the link is back, with it again. The trainer runs
tests/netns_trainer.py inside its namespace; this process controls the bed."""
from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from .conftest import API_KEY, REPO, SERVER_ENV, _vllm
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


def wait_for(path, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"the trainer never wrote {path.name}"
        time.sleep(0.05)


def test_two_hosts_http_broadcast_and_a_link_cut(model_dir, tmp_path):
    env = {**SERVER_ENV, "LORA_SYNC_ALLOWED_TRAINERS": netns.SUBNET}
    with netns.HostNet(["trainer", "srv1", "srv2"]) as net:
        servers = [place(net, h, _vllm(model_dir, env=env)) for h in ("srv1", "srv2")]
        starts = [threading.Thread(target=s.start) for s in servers]
        for t in starts:
            t.start()
        for t in starts:
            t.join(timeout=400)
        try:
            assert all(s.proc is not None and s.proc.poll() is None for s in servers)
            control, out = tmp_path / "control", tmp_path / "report.json"
            control.mkdir()
            trainer = net.popen("trainer", [
                sys.executable, str(REPO / "tests" / "netns_trainer.py"), str(out),
                str(control), str(model_dir), net.addr("trainer"), *(s.url for s in servers)],
                cwd=REPO, env={**net.env(), "LORA_SYNC_TEST_KEY": API_KEY,
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
    report = json.loads(out.read_text())
    print(f"\nrank-64 broadcast ({report['rank64_bytes']} B): 1 host "
          f"{report['bcast_ms_1_host']:.1f} ms, 2 hosts {report['bcast_ms_2_hosts']:.1f} ms; "
          f"link cut: {report['cut_error']!r} after {report['cut_error_s']:.1f} s")
    assert report["tensors"] == [1, 1] and report["broadcast"] == [2, 2]
    assert report["tensors_out"][0] == report["tensors_out"][1]
    assert report["broadcast_out"][0] == report["broadcast_out"][1] != report["tensors_out"][0]
    # The cut server's push failed with an error naming it, within its timeout.
    assert report["cut_error"] and servers[1].url.split("//")[1] in report["cut_error"]
    assert report["cut_error_s"] < 5 + 60 + 10  # group timeout + the POST's margin
    # The other server took the version and serves it.
    [mh] = [a for a in report["srv1_alias_after_cut"] if a["name"] == "mh"]
    assert mh["alias_target"] == "mh-v3"
    assert report["without_srv2"] == [4]
    assert report["with_srv2_again"] == [5, 5]
    assert report["with_srv2_out"][0] == report["with_srv2_out"][1]
