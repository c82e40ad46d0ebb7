"""A test bed of several "hosts" on one machine, built from Linux network namespaces.

    with HostNet(["trainer", "srv1", "srv2"]) as net:
        p = net.popen("srv1", [sys.executable, "server.py", net.addr("srv1")])
        net.run("trainer", [sys.executable, "client.py", net.addr("srv1")], timeout=60)
        net.cut("srv2")      # srv2 drops off the network (silently)
        net.restore("srv2")  # and comes back

Layout (names carry the creating process's pid, see "Names" below)::

    root namespace: bridge lsn<pid><x>br  (no IP address, no IPv6 link-local)
      |-- lsn<pid><x>v0 ==veth== veth0 in netns lsn<pid><x>-trainer  10.213.0.1/24
      |-- lsn<pid><x>v1 ==veth== veth0 in netns lsn<pid><x>-srv1     10.213.0.2/24
      '-- lsn<pid><x>v2 ==veth== veth0 in netns lsn<pid><x>-srv2     10.213.0.3/24

Each namespace has `lo` up (its 127.0.0.1 is its own) and one interface, `veth0` (IFNAME),
with an address in SUBNET (hosts get .1, .2, ... in the order given). Nothing leaves the
machine: a namespace's only routes are the subnet's connected route and loopback (no default
route: any other destination fails at once with ENETUNREACH, no packet is sent), the bridge
has only our veths as ports and no address, and there is no NAT. IPv6 link-local addresses
are not generated on the test links. The root namespace has no address in the subnet, so it
cannot talk to the hosts (a root-namespace connect to 10.213.0.x would follow the machine's own
default route, away from the bed): drive everything through popen/run. Parallel beds (other
pids, or two HostNets in one process) may all use the same subnet: each is its own bridge,
and the addresses only exist inside its namespaces. MTU is 1500 on every test link whatever
the machine's own NIC has (this VM's eth0 has 1400); the bed never touches the NIC.

Running processes: `popen(host, argv)` / `run(host, argv)` prefix argv with
`ip netns exec <ns>`, which execs argv in place (the Popen's pid is the program's pid). The
environment is inherited, plus `GLOO_SOCKET_IFNAME=veth0` (see "gloo"). Proxy variables
(http_proxy...) are inherited too: clients inside the bed should ignore them.

Cutting a host off: `cut(host)` sets the *bridge-side* veth end (in the root namespace) down.
The host's `veth0` stays administratively up with its address and routes; it only loses
carrier, so its programs get no local error: what they send is dropped by the device, what
is sent to them is dropped by the bridge, and no RST or ICMP comes back. To both sides it is
a host (or cable) that vanished, which only timeouts can tell. `cut(host, side="ns")` downs
`veth0` inside the namespace instead: the kernel also removes the host's connected route, so
the host's *own* new connections fail at once (ENETUNREACH) while the others still see
silence: a host that knows it is offline, less like a crash. `restore(host)` sets both ends
up, waits until the bridge port forwards, and flushes every host's ARP cache (without that,
an ARP lookup that was failing during the cut made the first new connection after the
restore fail with EHOSTUNREACH, every time here).

gloo: torch's ProcessGroupGloo, unless GLOO_SOCKET_IFNAME is set, takes its address from the
machine's hostname. Namespaces share the hostname and /etc/hosts with the root namespace;
here it resolves to 127.0.0.1, which binds in every namespace, so each rank advertises
127.0.0.1 through the store and its peers dial their *own* loopback (if the hostname resolved
to the NIC's address, binding it would fail in the namespace and gloo would fall back to
loopback all the same). Measured: the TCP store on the trainer's address works, then
connectFullMesh fails: "SO_ERROR: Connection refused, remote=[127.0.0.1]:..." on one rank
at once, "Connect timeout" on the others after ~25 s (not the group's timeout). With
GLOO_SOCKET_IFNAME=veth0 gloo binds the veth's address and the group forms (in ~10 ms here);
one value serves every namespace because the interface has the same name in each. popen/run
set it unless env= already does; gloo_ifname=None leaves it out. c10d also logs "[c10d] The
hostname of the client socket cannot be retrieved. err=-3" per connection (no DNS in the
namespaces for the reverse lookup; it fails at once and is harmless).

Names: namespaces are `lsn<pid><x>-<host>`, root-side links `lsn<pid><x>br` (bridge) and
`lsn<pid><x>v<i>` (veth ends), <x> a letter telling the beds of one process apart; the link
names fit IFNAMSIZ (15 characters). On start, `cleanup_stale()` removes such names whose pid
is no longer running (a run killed before its cleanup) or that belong to this process but to
no live bed, after SIGKILLing whatever still runs in those namespaces (`ip netns pids`: e.g.
servers orphaned by the killed run). close() (on exit from `with`, also after an exception,
and at interpreter exit for a bed never closed) kills the processes popen started and
anything else still in the bed's namespaces, then deletes the veths (an end takes its peer
with it), the bridge and the namespaces.

Shaping: `shape(host, rate="1gbit")` gives `host`'s link a rate, as a NIC of that speed on a
switch: a tbf (token bucket) root qdisc on each veth end, `veth0` in the namespace (what the
host sends: its uplink) and the bridge-side end (what the bridge delivers to it: its
downlink). Unshaped links run at memory speed. close() needs nothing more: deleting a veth
deletes the qdiscs of both its ends. Needs `tc` (iproute2, like `ip`).

Needs: root, `ip` from iproute2 (Debian package iproute2), and a kernel with network
namespaces, veth and bridge. `available()` probes exactly that (makes a namespace, a bridge
and a veth into the namespace, runs `ip netns exec`); tests skip with its reason otherwise.
If the machine loads br_netfilter (bridge-nf-call-iptables=1) *and* has an iptables FORWARD
policy of DROP (Docker sets one), bridged traffic between the hosts is dropped: allow it with
`iptables -I FORWARD -i lsn+ -o lsn+ -j ACCEPT` (not needed here: no iptables rules).
"""
from __future__ import annotations

import atexit
import functools
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Sequence

from lora_sync.private_dir import pid_alive

SUBNET = "10.213.0.0/24"  # private, unlikely to be used by anything else on a test machine
IFNAME = "veth0"  # the interface inside every namespace
PREFIX = "lsn"  # "lora-sync netns"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)([a-z])(?:br$|v\d+$|-)")
_HOST_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,40}$")
_LIVE: set[str] = set()  # tags ("lsn<pid><x>") of this process's open beds
_IP_TIMEOUT_S = 30


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs `ip ARGS` (bounded); raises NetnsError with ip's message when check fails."""
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and p.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


def _tc(*args: str) -> subprocess.CompletedProcess:
    """Runs `tc ARGS` (bounded); raises NetnsError with tc's message on failure."""
    p = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if p.returncode != 0:
        raise NetnsError(f"tc {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")


def rate_bits(rate: str) -> float:
    """A tc rate in bit units ("1gbit", "100mbit", "2.5gbit"; SI: 1kbit = 1000 bit) in bits
    per second. tc's byte units ("mbps" = megabytes) and bare numbers (bytes) are refused."""
    m = _RATE_RE.match(rate.strip().lower())
    if not m:
        raise ValueError(f"rate must be a number and one of bit, kbit, mbit, gbit, tbit; "
                         f"got {rate!r}")
    return float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
                                "tbit": 1e12}[m.group(2)]


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(True, "") if namespaces, veths and bridges can be made here, else (False, why)."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None:
        return False, "`ip` (iproute2) not installed"
    tag = f"{PREFIX}{os.getpid()}z"
    ns, link, br = f"{tag}-probe", f"{tag}v0", f"{tag}br"
    try:
        for args in (("netns", "add", ns), ("link", "add", br, "type", "bridge"),
                     ("link", "add", link, "type", "veth", "peer", "name", IFNAME, "netns", ns),
                     ("netns", "exec", ns, "true")):
            p = _ip(*args, check=False)
            if p.returncode != 0:
                return False, f"`ip {' '.join(args[:2])}` failed: {p.stderr.strip()}"
        return True, ""
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"ip failed: {e}"
    finally:
        _ip("link", "del", link, check=False)
        _ip("link", "del", br, check=False)
        _ip("netns", "del", ns, check=False)


def _ours_names() -> tuple[list[str], list[str]]:
    """(namespace names, root-namespace link names) that follow our naming scheme."""
    ns = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _ip("-o", "link", "show").stdout.splitlines() if ":" in line]
    return [n for n in ns if _NAME_RE.match(n)], [n for n in links if _NAME_RE.match(n)]


def _stale(name: str) -> bool:
    m = _NAME_RE.match(name)
    pid = int(m.group(1))
    tag = f"{PREFIX}{m.group(1)}{m.group(2)}"
    if pid == os.getpid():
        return tag not in _LIVE
    return not pid_alive(pid)


def _kill_ns_pids(ns: str, wait_s: float = 10.0) -> None:
    """SIGKILLs whatever still runs in namespace `ns` (a bed's own processes, e.g. a server
    orphaned by a killed test run) and waits, bounded, until none is left."""
    deadline = time.monotonic() + wait_s
    for _ in range(1000):
        p = _ip("netns", "pids", ns, check=False)
        pids = [int(x) for x in p.stdout.split()] if p.returncode == 0 else []
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def cleanup_stale() -> list[str]:
    """Deletes beds left by dead processes (or by this one, unowned), after killing what
    still runs in their namespaces; returns the names removed. Links go first (a veth's root
    end takes its namespace end along), then namespaces."""
    removed = []
    namespaces, links = _ours_names()
    for ns in namespaces:
        if _stale(ns):
            _kill_ns_pids(ns)
    for link in sorted(links, key=lambda n: n.endswith("br")):  # veths before bridges
        if _stale(link) and _ip("link", "del", link, check=False).returncode == 0:
            removed.append(link)
    for ns in namespaces:
        if _stale(ns) and _ip("netns", "del", ns, check=False).returncode == 0:
            removed.append(ns)
    return removed


def leftovers(tag: str | None = None) -> list[str]:
    """Names of this scheme still present (only those of bed `tag` when given)."""
    namespaces, links = _ours_names()
    return [n for n in namespaces + links if tag is None or n.startswith(tag)]


class HostNet:
    """A bridge plus one namespace per host, each on a veth to the bridge (see module doc)."""

    def __init__(self, hosts: Sequence[str], subnet: str = SUBNET):
        hosts = list(hosts)
        if not hosts or len(set(hosts)) != len(hosts) or not all(_HOST_RE.match(h) for h in hosts):
            raise ValueError(f"hosts must be distinct simple names, got {hosts!r}")
        addrs = list(ipaddress.ip_network(subnet).hosts())
        if len(hosts) > min(len(addrs), 100):
            raise ValueError(f"{len(hosts)} hosts do not fit {subnet} (or exceed 100)")
        self.hosts = hosts
        self.subnet = subnet
        self._prefixlen = ipaddress.ip_network(subnet).prefixlen
        self._addr = {h: str(addrs[i]) for i, h in enumerate(hosts)}
        self._index = {h: i for i, h in enumerate(hosts)}
        self.tag = ""
        self._procs: list[subprocess.Popen] = []
        self._started = False

    # ---- names and addresses ----
    def ns(self, host: str) -> str:
        """The namespace name of `host`."""
        return f"{self.tag}-{self._check(host)}"

    def addr(self, host: str) -> str:
        """`host`'s IPv4 address (on its veth0)."""
        return self._addr[self._check(host)]

    def link(self, host: str) -> str:
        """The bridge-side veth end of `host` (a link in the root namespace)."""
        return f"{self.tag}v{self._index[self._check(host)]}"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def _check(self, host: str) -> str:
        if host not in self._addr:
            raise KeyError(f"unknown host {host!r}; hosts are {self.hosts}")
        return host

    # ---- life cycle ----
    def __enter__(self) -> "HostNet":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "HostNet":
        if self._started:
            return self
        cleanup_stale()
        taken = {n[:len(f"{PREFIX}{os.getpid()}") + 1] for n in leftovers()}
        for letter in "abcdefghijklmnopqrstuvwxy":  # "z" is available()'s probe
            tag = f"{PREFIX}{os.getpid()}{letter}"
            if tag not in _LIVE and tag not in taken:
                break
        else:
            raise NetnsError("no free bed name left for this process")
        self.tag = tag
        _LIVE.add(tag)
        self._started = True
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        br = self.bridge
        _ip("link", "add", "name", br, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("link", "set", "dev", br, "addrgenmode", "none", check=False)  # no IPv6 link-local
        _ip("link", "set", "dev", br, "up")
        for h in self.hosts:
            ns, link = self.ns(h), self.link(h)
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("link", "set", "dev", link, "addrgenmode", "none", check=False)
            _ip("link", "set", "dev", link, "master", br)
            _ip("link", "set", "dev", link, "up")
            _ip("-n", ns, "link", "set", "dev", "lo", "up")
            _ip("-n", ns, "link", "set", "dev", IFNAME, "addrgenmode", "none", check=False)
            _ip("-n", ns, "addr", "add", f"{self._addr[h]}/{self._prefixlen}", "dev", IFNAME)
            _ip("-n", ns, "link", "set", "dev", IFNAME, "up")
        for h in self.hosts:
            self._wait_forwarding(h)

    def _wait_forwarding(self, host: str, timeout_s: float = 10.0) -> None:
        """Until the bridge port of `host` forwards and its veth has carrier (bounded)."""
        link = self.link(host)
        deadline = time.monotonic() + timeout_s
        for _ in range(1000):
            try:
                with open(f"/sys/class/net/{link}/brport/state") as f:
                    state = f.read().strip()
                with open(f"/sys/class/net/{link}/carrier") as f:
                    carrier = f.read().strip()
            except OSError:
                state = carrier = "?"
            if state == "3" and carrier == "1":  # BR_STATE_FORWARDING
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        raise NetnsError(f"{link}: bridge port not forwarding after {timeout_s}s "
                         f"(state {state}, carrier {carrier})")

    def close(self) -> None:
        """Kills the processes popen started, deletes links and namespaces. Idempotent."""
        if not self._started:
            return
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        present = set(_ours_names()[0])
        for h in self.hosts:
            if self.ns(h) in present:
                _kill_ns_pids(self.ns(h))  # e.g. children of the processes popen started
        errors = []
        for h in self.hosts:
            if os.path.exists(f"/sys/class/net/{self.link(h)}"):
                p = _ip("link", "del", self.link(h), check=False)
                if p.returncode:
                    errors.append(p.stderr.strip())
        if os.path.exists(f"/sys/class/net/{self.bridge}"):
            p = _ip("link", "del", self.bridge, check=False)
            if p.returncode:
                errors.append(p.stderr.strip())
        for h in self.hosts:
            if self.ns(h) in present:
                p = _ip("netns", "del", self.ns(h), check=False)
                if p.returncode:
                    errors.append(p.stderr.strip())
        _LIVE.discard(self.tag)
        self._started = False
        atexit.unregister(self.close)
        if errors:
            raise NetnsError("cleanup: " + "; ".join(errors))

    # ---- processes ----
    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    @staticmethod
    def env(env: dict | None = None, gloo_ifname: str | None = IFNAME) -> dict:
        """`env` (default: this process's environment) with GLOO_SOCKET_IFNAME=`gloo_ifname`
        unless `env` sets it; gloo_ifname=None removes it (gloo then goes by the hostname)."""
        env = dict(os.environ if env is None else env)
        if gloo_ifname is None:
            env.pop("GLOO_SOCKET_IFNAME", None)
        else:
            env.setdefault("GLOO_SOCKET_IFNAME", gloo_ifname)
        return env

    def popen(self, host: str, argv: Sequence[str], gloo_ifname: str | None = IFNAME,
              **popen_kw) -> subprocess.Popen:
        """subprocess.Popen of argv in `host`'s namespace (env: see env()); the process is
        killed at close() if still running."""
        if not self._started:
            raise NetnsError("HostNet not started")
        popen_kw["env"] = self.env(popen_kw.get("env"), gloo_ifname)
        p = subprocess.Popen(self.argv(host, argv), **popen_kw)
        self._procs.append(p)
        return p

    def run(self, host: str, argv: Sequence[str], timeout: float = 60.0,
            gloo_ifname: str | None = IFNAME, **run_kw) -> subprocess.CompletedProcess:
        """subprocess.run of argv in `host`'s namespace, always with a timeout (env: see
        env())."""
        if not self._started:
            raise NetnsError("HostNet not started")
        run_kw["env"] = self.env(run_kw.get("env"), gloo_ifname)
        return subprocess.run(self.argv(host, argv), timeout=timeout, **run_kw)

    # ---- links ----
    def cut(self, host: str, side: str = "bridge") -> None:
        """Takes `host` off the network. side="bridge" (default): down its bridge-side veth
        end, so the host silently loses carrier (a vanished host: no errors, only
        timeouts, on both sides). side="ns": down veth0 inside the namespace (the host
        itself gets ENETUNREACH at once, the others still see silence)."""
        if side == "bridge":
            _ip("link", "set", "dev", self.link(host), "down")
        elif side == "ns":
            _ip("-n", self.ns(host), "link", "set", "dev", IFNAME, "down")
        else:
            raise ValueError(f"side must be 'bridge' or 'ns', got {side!r}")

    def restore(self, host: str) -> None:
        """Undoes cut() (either side) and waits until the host's bridge port forwards. After a
        side="ns" cut the kernel re-adds the connected route when veth0 comes up. Also
        flushes every host's ARP cache: a lookup that was still failing when the link came
        back otherwise fails new connections with EHOSTUNREACH for up to ~3 s."""
        _ip("-n", self.ns(host), "link", "set", "dev", IFNAME, "up")
        _ip("link", "set", "dev", self.link(host), "up")
        self._wait_forwarding(host)
        for h in self.hosts:
            _ip("-n", self.ns(h), "neigh", "flush", "dev", IFNAME, check=False)

    def shape(self, host: str, rate: str = "1gbit", burst: str | None = None,
              latency: str = "20ms") -> list[str]:
        """Limits `host`'s link to `rate` each way (tc's units: "1gbit", "100mbit"), a tbf
        qdisc on both veth ends (see "Shaping"); again on a host replaces its shaping.
        `burst`: the bucket, by default 2 ms at `rate` and at least 64 KiB (a TSO segment
        passes whole); `latency`: the longest a packet may queue before tbf drops it (TCP
        backs off, as on a full switch port). Returns `tc qdisc show` of both ends."""
        bits = rate_bits(rate)
        burst = burst or str(max(64 * 1024, int(bits / 8 * 0.002)))
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        ends = ((["-n", self.ns(host)], IFNAME), ([], self.link(host)))
        for netns_arg, dev in ends:
            _tc(*netns_arg, "qdisc", "replace", "dev", dev, *tbf)
        return [_tc(*netns_arg, "qdisc", "show", "dev", dev).stdout.strip()
                for netns_arg, dev in ends]

    def is_up(self, host: str) -> bool:
        """Whether `host`'s veth pair carries traffic (both ends up)."""
        try:
            with open(f"/sys/class/net/{self.link(host)}/carrier") as f:
                return f.read().strip() == "1"
        except OSError:  # reading carrier of a down link fails with EINVAL
            return False
