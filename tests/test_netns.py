"""Multi-host tests on one machine: "hosts" are network namespaces on a bridge (tests/netns.py).

Checks the test bed itself (layout, isolation, cleanup, stale cleanup), then what the
trainer <-> server paths need from it: plain TCP and HTTP across hosts, a gloo group whose
ranks live on different hosts, and a host dropping off mid-broadcast (the failure must surface
as an error within the group's timeout, never a hang, and a new group must form once the
host is back). Every wait is bounded; skipped where namespaces cannot be made (not root, no
iproute2, no kernel support)."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .netns import IFNAME, SUBNET, HostNet, available, cleanup_stale, leftovers, rate_bits

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
HOSTS = ["trainer", "srv1", "srv2"]
STARTUP_S = 180  # a python that imports torch, on 2 busy cores
OFF_NET = "203.0.113.1"  # TEST-NET-3: never routed, and not this machine's address


@pytest.fixture
def net():
    ok, why = available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with HostNet(HOSTS) as n:
        yield n
    assert leftovers(n.tag) == []


class Lines:
    """A process's stdout lines, read by a thread so that every wait can have a timeout."""

    def __init__(self, proc: subprocess.Popen, name: str):
        self.proc, self.name, self.seen = proc, name, []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def next_json(self, timeout: float) -> dict:
        """The next JSON line (other lines, e.g. c10d warnings, are kept in .seen)."""
        deadline = time.monotonic() + timeout
        for _ in range(10_000):
            left = deadline - time.monotonic()
            try:
                line = self._q.get(timeout=max(left, 0.01))
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"{self.name} exited (rc {self.proc.poll()}): "
                                     f"{self.seen[-5:]}")
            self.seen.append(line)
            if line.startswith("{"):
                return json.loads(line)
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"{self.name}: no reply within {timeout}s; "
                             f"last lines {self.seen[-5:]}")


def start(net: HostNet, host: str, code: str, *args: str) -> Lines:
    p = net.popen(host, [PY, "-u", "-c", code, *map(str, args)], stdin=subprocess.PIPE,
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return Lines(p, host)


# ---------------------------------------------------------------- the bed itself

def test_layout_only_subnet_and_loopback(net):
    assert [net.addr(h) for h in HOSTS] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    for h in HOSTS:
        links = net.run(h, ["ip", "-o", "link", "show"], capture_output=True, text=True,
                        check=True).stdout
        names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
        assert names == sorted(["lo", IFNAME])
        assert any(f" {IFNAME}@" in line and "LOWER_UP" in line for line in links.splitlines())
        routes = net.run(h, ["ip", "route", "show", "table", "all"], capture_output=True,
                         text=True, check=True).stdout
        routes6 = net.run(h, ["ip", "-6", "route", "show", "table", "all"],
                          capture_output=True, text=True).stdout
        assert "default" not in routes + routes6, routes + routes6
        assert f"{SUBNET} dev {IFNAME}" in routes
        v4 = net.run(h, ["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                     check=True).stdout
        assert sorted(line.split()[3] for line in v4.splitlines()) == \
            sorted(["127.0.0.1/8", f"{net.addr(h)}/24"])
        v6 = net.run(h, ["ip", "-6", "-o", "addr", "show", "dev", IFNAME], capture_output=True,
                     text=True).stdout
        assert v6.strip() == ""  # no IPv6 link-local either
    # the bridge and its ports carry no address in the root namespace (nothing routes in/out)
    for link in [net.bridge] + [net.link(h) for h in HOSTS]:
        out = subprocess.run(["ip", "-o", "addr", "show", "dev", link], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        assert out.strip() == "", out
    ports = subprocess.run(["ip", "-o", "link", "show", "master", net.bridge],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert len(ports.splitlines()) == len(HOSTS)
    assert all(net.is_up(h) for h in HOSTS)


def test_cleanup_after_exception_and_of_killed_run():
    ok, why = available()
    if not ok:
        pytest.skip(why)
    with pytest.raises(ZeroDivisionError):
        with HostNet(["a", "b"]) as n:
            tag = n.tag
            assert len(leftovers(tag)) == 5  # 2 namespaces, 2 veth ends, the bridge
            1 / 0
    assert leftovers(tag) == []
    # a run killed before its cleanup leaves its bed and a process running in it; the next
    # cleanup_stale() kills that process and removes the bed
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from tests.netns import HostNet;"
            "n = HostNet(['x', 'y']).start(); c = n.popen('y', ['sleep', '300']);"
            "print(n.tag, c.pid, flush=True); time.sleep(120)")
    p = subprocess.Popen([PY, "-c", code, str(REPO)], stdout=subprocess.PIPE, text=True)
    try:
        tag, orphan = Lines(p, "victim")._q.get(timeout=60).split()
        assert tag.startswith(f"lsn{p.pid}")
        assert len(leftovers(tag)) == 5
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    assert _running(int(orphan))
    removed = cleanup_stale()  # (may also remove other dead runs' beds)
    assert sorted(n for n in removed if n.startswith(tag)) == \
        sorted([f"{tag}br", f"{tag}v0", f"{tag}v1", f"{tag}-x", f"{tag}-y"])
    assert leftovers(tag) == []
    for _ in range(100):  # the orphan was SIGKILLed: gone, or a zombie until init reaps it
        if not _running(int(orphan)):
            break
        time.sleep(0.05)
    assert not _running(int(orphan))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------- TCP, HTTP

ECHO_SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
s.settimeout(60)
print('{"listening": true}', flush=True)
for _ in range(int(sys.argv[3])):
    c, peer = s.accept()
    with c:
        c.settimeout(10)
        c.sendall(("pong %s to %s: " % (sys.argv[4], peer[0])).encode() + c.recv(100))
"""

CLIENT = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    c.sendall(b"ping")
    c.settimeout(10)
    print("REPLY", c.recv(200).decode())
except OSError as e:
    print("ERROR", type(e).__name__, e.errno)
"""


def client(net, host, addr, port, timeout_s=5.0) -> str:
    return net.run(host, [PY, "-c", CLIENT, addr, str(port), str(timeout_s)],
                   capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def test_tcp_across_hosts_and_isolation(net):
    srv1 = start(net, "srv1", ECHO_SERVER, "0.0.0.0", 7000, 2, "srv1")
    assert srv1.next_json(60) == {"listening": True}
    # the trainer reaches srv1 at its address, and srv1 sees the trainer's address
    assert client(net, "trainer", net.addr("srv1"), 7000) == "REPLY pong srv1 to 10.213.0.1: ping"
    assert client(net, "srv2", net.addr("srv1"), 7000) == "REPLY pong srv1 to 10.213.0.3: ping"
    # a listener on the trainer's loopback is the trainer's alone
    lo = start(net, "trainer", ECHO_SERVER, "127.0.0.1", 7001, 1, "trainer-lo")
    assert lo.next_json(60) == {"listening": True}
    assert client(net, "srv1", "127.0.0.1", 7001) == "ERROR ConnectionRefusedError 111"
    assert client(net, "srv1", net.addr("trainer"), 7001) == "ERROR ConnectionRefusedError 111"
    assert client(net, "trainer", "127.0.0.1", 7001) == "REPLY pong trainer-lo to 127.0.0.1: ping"
    # no route off the subnet: fails at once, nothing is sent
    t0 = time.monotonic()
    assert client(net, "trainer", OFF_NET, 80) == "ERROR OSError 101"  # ENETUNREACH
    assert time.monotonic() - t0 < 30
    for p in (srv1.proc, lo.proc):
        assert p.wait(timeout=30) == 0


def test_cut_sides(net):
    """side="bridge": the host is silent both ways (timeouts only); side="ns": the host itself
    knows (ENETUNREACH at once), the others still see silence. restore() undoes both."""
    servers = [start(net, h, ECHO_SERVER, "0.0.0.0", 7000, 2, h) for h in ("srv1", "srv2")]
    for s in servers:
        assert s.next_json(60) == {"listening": True}
    for side, own_error in (("bridge", "ERROR TimeoutError None"), ("ns", "ERROR OSError 101")):
        net.cut("srv2", side=side)
        assert not net.is_up("srv2")
        assert client(net, "srv2", net.addr("srv1"), 7000, timeout_s=1) == own_error
        assert client(net, "trainer", net.addr("srv2"), 7000, timeout_s=1) == \
            "ERROR TimeoutError None"
        net.restore("srv2")
        assert net.is_up("srv2")
        assert client(net, "srv2", net.addr("srv1"), 7000).startswith("REPLY pong srv1")
        assert client(net, "trainer", net.addr("srv2"), 7000).startswith("REPLY pong srv2")
    for s in servers:
        assert s.proc.wait(timeout=30) == 0


def test_shape_puts_a_token_bucket_on_both_ends_of_a_link(net):
    """HostNet.shape (the multi-host benchmark's links): a tbf of the given rate on the
    host's own veth0 (its uplink) and on the bridge-side end (its downlink), replaced when
    shaped again; the link still carries traffic. A rate in byte units is refused."""
    for rate, shown in (("100mbit", "100Mbit"), ("1gbit", "1Gbit")):
        inside, bridge_side = net.shape("srv1", rate=rate)
        for qdisc in (inside, bridge_side):
            assert qdisc.startswith("qdisc tbf") and f"rate {shown}" in qdisc, qdisc
            assert qdisc.count("qdisc") == 1, qdisc  # replaced, not stacked
    server = start(net, "srv1", ECHO_SERVER, "0.0.0.0", 7000, 1, "srv1")
    assert server.next_json(60) == {"listening": True}
    assert client(net, "trainer", net.addr("srv1"), 7000).startswith("REPLY pong srv1")
    assert server.proc.wait(timeout=30) == 0
    with pytest.raises(ValueError, match="bit"):
        rate_bits("10mbps")


def test_http_server_on_host_address_reachable_from_trainer(net, tmp_path):
    (tmp_path / "hello.txt").write_text("hello from srv1")
    http = net.popen("srv1", [PY, "-u", "-m", "http.server", "--bind", net.addr("srv1"),
                              "--directory", str(tmp_path), "8000"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fetch = r"""
import sys, time, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # ignore *_proxy env
for attempt in range(100):
    try:
        print(opener.open(sys.argv[1], timeout=5).read().decode()); break
    except OSError as e:
        time.sleep(0.1)
else:
    print("GAVE UP", e)
"""
    out = net.run("trainer", [PY, "-c", fetch, f"http://{net.addr('srv1')}:8000/hello.txt"],
                  capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "hello from srv1"
    assert http.poll() is None


# ---------------------------------------------------------------- gloo across hosts

# One rank, driven through stdin: "group PORT TIMEOUT_S", "bcast PORT SEED", "quit"; answers
# one JSON line per command. Rank 0 hosts the TCP store on the trainer's address.
RANK = r"""
import datetime, json, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
rank, world, master = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
groups = {}
def say(**kw):
    print(json.dumps(kw), flush=True)
say(event="ready")
for line in sys.stdin:
    cmd, t0 = line.split(), time.monotonic()
    try:
        if cmd[0] == "group":
            port, timeout = int(cmd[1]), datetime.timedelta(seconds=float(cmd[2]))
            store = dist.TCPStore(master, port, world, is_master=rank == 0, timeout=timeout,
                                  wait_for_workers=False)
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"g{port}", store), rank, world, timeout)
            groups[port] = (store, pg)  # the store must outlive the group
            say(event="ok", s=time.monotonic() - t0)
        elif cmd[0] == "bcast":
            port, seed, n = int(cmd[1]), int(cmd[2]), 256 * 1024  # 1 MiB of float32
            want = torch.arange(n, dtype=torch.float32) + seed
            t = want.clone() if rank == 0 else torch.zeros(n)
            groups[port][1].broadcast(t, 0).wait()
            say(event="ok" if torch.equal(t, want) else "wrong values", s=time.monotonic() - t0)
        elif cmd[0] == "quit":
            break
    except Exception as e:
        say(event="error", s=time.monotonic() - t0, type=type(e).__name__, msg=str(e)[:500])
"""


class Ranks:
    def __init__(self, net: HostNet, hosts: list[str]):
        self.hosts = hosts
        self.lines = [start(net, h, RANK, r, len(hosts), net.addr(hosts[0]))
                      for r, h in enumerate(hosts)]
        for ln in self.lines:
            assert ln.next_json(STARTUP_S) == {"event": "ready"}

    def all(self, cmd: str, timeout: float) -> dict[str, dict]:
        """Sends cmd to every rank; {host: reply}, each reply awaited at most `timeout`."""
        for ln in self.lines:
            ln.proc.stdin.write(cmd + "\n")
            ln.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        return {h: ln.next_json(max(deadline - time.monotonic(), 0.1))
                for h, ln in zip(self.hosts, self.lines)}

    def quit(self) -> list[int]:
        for ln in self.lines:
            ln.proc.stdin.write("quit\n")
            ln.proc.stdin.flush()
        return [ln.proc.wait(timeout=60) for ln in self.lines]


def test_gloo_broadcast_across_hosts(net):
    ranks = Ranks(net, HOSTS)
    t0 = time.monotonic()
    formed = ranks.all("group 29500 60", timeout=90)
    print(f"\ngroup formed across namespaces in {time.monotonic() - t0:.3f}s: "
          f"{ {h: round(r['s'], 3) for h, r in formed.items()} }")
    assert all(r["event"] == "ok" for r in formed.values()), formed
    for seed in (1, 2):
        got = ranks.all(f"bcast 29500 {seed}", timeout=60)
        assert {h: r["event"] for h, r in got.items()} == dict.fromkeys(HOSTS, "ok"), got
    assert ranks.quit() == [0, 0, 0]


def test_link_cut_mid_broadcast_fails_in_bounded_time_then_regroups(net):
    timeout_s = 5
    ranks = Ranks(net, HOSTS)
    assert all(r["event"] == "ok" for r in ranks.all(f"group 29500 {timeout_s}", 90).values())
    got = ranks.all("bcast 29500 1", timeout=60)
    assert all(r["event"] == "ok" for r in got.values()), got

    net.cut("srv2")
    assert not net.is_up("srv2")
    t0 = time.monotonic()
    got = ranks.all("bcast 29500 2", timeout=timeout_s + 60)
    surfaced = time.monotonic() - t0
    print(f"\nafter cut: replies within {surfaced:.2f}s: {json.dumps(got, indent=1)}")
    # the sender and the cut-off receiver each get gloo's own timeout (no RST, no ICMP: the
    # host is silent), after the group timeout and well before any TCP-level timeout
    for h, kind in (("trainer", "send"), ("srv2", "recv")):
        assert got[h]["event"] == "error", got
        assert f"Timed out waiting {timeout_s * 1000}ms for {kind} operation" in got[h]["msg"]
        assert timeout_s - 0.5 <= got[h]["s"] < timeout_s + 20, got[h]
    # at world size 3 the root sends to each rank itself, so srv1 still gets its data
    assert got["srv1"]["event"] == "ok", got

    net.restore("srv2")
    assert net.is_up("srv2")
    t0 = time.monotonic()
    formed = ranks.all(f"group 29501 {timeout_s}", timeout=90)  # same processes, new port
    print(f"new group after restore in {time.monotonic() - t0:.3f}s")
    assert all(r["event"] == "ok" for r in formed.values()), formed
    got = ranks.all("bcast 29501 3", timeout=60)
    assert {h: r["event"] for h, r in got.items()} == dict.fromkeys(HOSTS, "ok"), got
    assert ranks.quit() == [0, 0, 0]
