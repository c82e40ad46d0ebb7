"""Push cost against the number of servers on hosts with rate-limited links (issue #46).

    flock /tmp/lora-sync-server.lock .venv/bin/python -m benchmarks.multihost_bench
    ... -m benchmarks.multihost_bench --rate 100mbit --sizes 1 2 4 --reps 5
    ... -m benchmarks.multihost_bench --quick             # 1 2 servers, rank 8, 2 rounds

A multi-host bed on one machine (tests/netns.py): a trainer and M servers, each host a
network namespace on a veth to one bridge, every link shaped to --rate each way (a tbf
qdisc on both veth ends, HostNet.shape: a NIC of that speed on a switch). Each server is a
fake-engine server of its own (benchmarks/fleet_server.py: lora-sync's real routes, service
and worker dispatcher, one worker, a fake engine that knows Qwen2.5-0.5B's shapes) bound to
its host's address, admitting the trainer's subnet (LORA_SYNC_ALLOWED_TRAINERS). The largest
fleet is started once; a fleet of M is its first M servers.

The trainer is this module run with --role trainer inside the trainer's namespace; this
process (root namespace, which cannot reach the subnet) drives it a command at a time over
its stdin/stdout and reads every link's byte counters before and after each push. For each M
it opens a client to M servers (and a broadcast group, master = the trainer's address), then
each round pushes the same adapter (rank 64, bf16, all linear modules, ~70 MB:
fleet_bench.adapter) with every transport, the order rotated per round, after an idle pause:

  tensors    the body over HTTP to each server: the trainer's uplink carries a copy each
  broadcast  one gloo group of the trainer and every server's worker
  relay      one copy per node: the trainer sends to the first node's relay (lora_sync/relay.py,
             one per node), which passes it on and shares it with its node's servers
  one        tensors to the first server alone: the 1 node x 1 server reference

`--per-node K` puts K servers on each node (ports SERVER_PORT + i) and, for `relay`, a relay
beside them; M counts nodes.

It prints median [min-max] ms per M, push(M)/push(1), the cost per server beyond the first,
the copies of the adapter each link carried (bytes counted on the veths / adapter bytes:
one copy reads ~1.00, see WIRE_FACTOR), and the floors of the trainer's uplink: one copy at
the link rate (bytes / rate; with the headers tbf counts, x1.046), M copies, and the copies
gloo's broadcast sends from the root.

gloo's broadcast (gloo/broadcast.cc, what torch's ProcessGroupGloo.broadcast runs) is a
binomial tree: rank 0 sends to ranks 1, 2, 4, ... (ceil(log2(world)) copies, concurrently),
each receiver forwards to its own subtree. `binomial_sends` computes each rank's sends; the
byte counters show what the links actually carried. Writes runs/multihost/results.json and
table.txt. Every wait is bounded; the bed (namespaces, servers, trainer) is removed on the
way out, SIGTERM included."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `one`: tensors to the first server alone, the 1 node x 1 server reference, in the same rounds
TRANSPORTS = ("tensors", "broadcast", "relay", "one")
REPLY = "@@multihost "  # the prefix of the trainer's replies on its stdout
SERVER_PORT = 18000  # every server host has its own port space: its servers from here
RELAY_PORT = 19100
# One TCP segment on a 1500-byte MTU link with timestamps: 1448 payload bytes in 1514 bytes
# (Ethernet 14 + IP 20 + TCP 32 header bytes). tbf counts every segment's headers (a GSO
# packet's length is taken as the segments it will be), so payload goes at rate / 1.046 at
# best (measured: 0.953 Gbit/s of one TCP stream on a 1gbit link); the veths' byte counters
# see the GSO packets, one set of headers per up to 64 KiB, so one copy reads ~1.00 there.
WIRE_FACTOR = 1514 / 1448


# ---- arithmetic (tests/test_multihost_bench_logic.py) ----------------------------------
def floor_ms(nbytes: int, rate_bits: float, copies: float = 1.0) -> float:
    """`copies` of `nbytes` through one link of `rate_bits` bit/s, in ms (payload only)."""
    return copies * nbytes * 8 / rate_bits * 1e3


def binomial_sends(world: int, root: int = 0) -> list[int]:
    """How many times each rank sends the buffer in gloo's broadcast (gloo/broadcast.cc):
    in step i, virtual rank v (rank - root) sends to v + 2**i when v's bits from i up are
    zero and that peer exists. The root sends ceil(log2(world)) copies."""
    dim = math.ceil(math.log2(world)) if world > 1 else 0
    sends = [0] * world
    for rank in range(world):
        v = (rank - root) % world
        mask = (1 << dim) - 1
        for i in range(dim):
            mask ^= 1 << i
            if v & mask:
                continue
            peer = v ^ (1 << i)
            if peer < world and not v & (1 << i):
                sends[rank] += 1
    return sends


def delta(before: dict, after: dict) -> dict:
    """Byte counters (host -> [sent, received]) after minus before."""
    return {h: [a - b for a, b in zip(after[h], before[h])] for h in after}


def link_copies(samples: list[dict], nbytes: int, hosts: list[str]) -> dict:
    """host -> [copies sent, copies received], the median over `samples` of each push's
    bytes on that host's link / the adapter's bytes."""
    return {h: [statistics.median(x["bytes"][h][i] / nbytes for x in samples)
                for i in (0, 1)] for h in hosts}


def floors(nbytes: int, rate_bits: float, sizes, workers: int = 1, per_node: int = 1) -> dict:
    """M nodes -> the floors (ms) of the trainer's uplink: one copy (a relay chain's), a copy
    per server (tensors: M x per_node), and the copies gloo's binomial tree sends from the
    root (world = 1 + M x per_node x workers)."""
    def tree(m: int) -> int:
        return binomial_sends(1 + m * per_node * workers)[0]
    return {m: {"one_copy": floor_ms(nbytes, rate_bits),
                "one_copy_wire": floor_ms(nbytes, rate_bits, WIRE_FACTOR),
                "m_copies": floor_ms(nbytes, rate_bits, m * per_node),
                "tree_copies": tree(m), "tree": floor_ms(nbytes, rate_bits, tree(m))}
            for m in sizes}


# ---- the trainer, inside its namespace ---------------------------------------------------
def say(**reply) -> None:
    print(REPLY + json.dumps(reply), flush=True)


def trainer_main(rank: int) -> int:
    """Reads one JSON command per line on stdin, answers one REPLY line each."""
    import torch

    from lora_sync import LoRASyncClient

    from .fleet_bench import adapter
    from .fleet_server import API_KEY
    torch.set_num_threads(1)
    a = adapter(rank)
    say(bytes=a.nbytes, tensors=len(a.tensors))
    client, grouped = None, False
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "open":
                client = LoRASyncClient(cmd["urls"], api_key=API_KEY, timeout=cmd["timeout_s"],
                                        relays=cmd.get("relays"))
                first = LoRASyncClient(cmd["urls"][:1], api_key=API_KEY,
                                       timeout=cmd["timeout_s"])
                workers = [int(i["workers"]) for i in client.info()]
                t0 = time.perf_counter()
                if cmd["group"]:
                    client.init_group(master_address=cmd["master"], timeout_s=cmd["timeout_s"])
                    grouped = True
                say(workers=workers, init_s=time.perf_counter() - t0)
            elif op == "push":
                one = cmd["transport"] == "one"
                t0 = time.perf_counter()
                results = (first if one else client).push(
                    a, cmd["name"], transport="tensors" if one else cmd["transport"])
                s = time.perf_counter() - t0
                # through a relay each server takes the node's shared copy
                want = {"one": "tensors", "relay": "shared"}.get(cmd["transport"],
                                                                 cmd["transport"])
                bad = [(r.server, repr(r.error)) for r in results
                       if not r.ok or r.transport != want]
                if bad:
                    raise RuntimeError(f"failed pushes: {bad}")
                say(s=s, server_s=[r.seconds for r in results],
                    timings_ms=[r.reply.get("timings_ms", {}) for r in results])
            elif op == "close":
                if grouped:
                    client.destroy_group()
                client.close()
                first.close()
                client, grouped = None, False
                say(closed=True)
            elif op == "quit":
                say(bye=True)
                return 0
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - reported to the controller, which stops
            say(error=f"{type(e).__name__}: {e}"[:4000])
    return 0


# ---- the controller, in the root namespace ----------------------------------------------
class Trainer:
    """The trainer process in its namespace: one command, one reply, each wait bounded."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self._buf = proc, b""

    def read(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(REPLY):
                    reply = json.loads(text[len(REPLY):])
                    if "error" in reply:
                        raise RuntimeError(f"trainer: {reply['error']}")
                    return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from the trainer in {timeout_s:.0f} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the trainer exited ({self.proc.wait(timeout=10)})")
                self._buf += chunk

    def ask(self, wait_s: float, **cmd) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(wait_s)


def counters(net, hosts) -> dict:
    """host -> [bytes the host sent, bytes it received] on its link, read on the bridge-side
    veth end in this namespace (its rx is what the host sent)."""
    out = {}
    for h in hosts:
        base = f"/sys/class/net/{net.link(h)}/statistics/"
        with open(base + "rx_bytes") as f, open(base + "tx_bytes") as g:
            out[h] = [int(f.read()), int(g.read())]
    return out


def wait_ready(log: Path, proc: subprocess.Popen, timeout_s: float,
               mark: str = "fake-engine ready") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and mark in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"server {log.stem} did not start (exit {proc.poll()}):\n{tail}")


def _exit_on_sigterm(*_):
    raise SystemExit(143)  # unwinds through every `finally`: the bed is removed


def run(args) -> dict:
    from tests import netns

    from .fleet_bench import engine_order
    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"no network namespaces here: {why}")
    rate_bits = netns.rate_bits(args.rate)
    n = max(args.sizes)
    servers = [f"srv{i}" for i in range(1, n + 1)]
    hosts = ["trainer", *servers]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    samples: dict = {m: {t: [] for t in args.transports} for m in args.sizes}
    extra: dict = {}
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(netns.HostNet(hosts))
        extra["qdiscs"] = {h: net.shape(h, args.rate) for h in hosts}
        procs, logs, marks = [], [], []
        from .fleet_server import ENV as FLEET_ENV  # the servers' key and body limit
        server_env = {**os.environ, **env, "LORA_SYNC_ALLOWED_TRAINERS": net.subnet,
                      **FLEET_ENV}

        def start(h: str, label: str, argv: list, mark: str) -> None:
            log = out / f"{label}.log"
            logs.append(log)
            marks.append(mark)
            with open(log, "w") as f:
                procs.append(net.popen(h, [sys.executable, "-m", *argv], cwd=REPO,
                                       env=server_env, stdout=f, stderr=subprocess.STDOUT))
        urls, relays = [], {}
        for h in servers:
            for j in range(args.per_node):
                start(h, f"{h}-{j}", ["benchmarks.fleet_server", "--host", net.addr(h),
                                      "--port", str(SERVER_PORT + j), "--max-rank",
                                      str(args.rank)], "fake-engine ready")
                urls.append(f"http://{net.addr(h)}:{SERVER_PORT + j}")
                relays[urls[-1]] = f"http://{net.addr(h)}:{RELAY_PORT}"
            if "relay" in args.transports:  # the node's relay, with the servers' key
                start(h, f"{h}-relay", ["lora_sync.relay", "--host", net.addr(h), "--port",
                                        str(RELAY_PORT)], "lora-sync relay ready")
        t_start = time.monotonic()
        for log, proc, mark in zip(logs, procs, marks):
            wait_ready(log, proc, max(1.0, 240 - (time.monotonic() - t_start)), mark)
        extra["servers_start_s"] = time.monotonic() - t_start
        tlog = open(out / "trainer.log", "w")
        stack.callback(tlog.close)
        proc = net.popen("trainer", [sys.executable, "-m", "benchmarks.multihost_bench",
                                     "--role", "trainer", "--rank", str(args.rank)],
                         cwd=REPO, env={**os.environ, **env}, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=tlog)
        trainer = Trainer(proc)
        first = trainer.read(120)
        nbytes = first["bytes"]
        print(f"bed up: {n} node(s) x {args.per_node} server(s) in "
              f"{extra['servers_start_s']:.1f} s, links at "
              f"{args.rate}; adapter {nbytes / 1e6:.1f} MB ({first['tensors']} tensors)",
              flush=True)
        # a push's bound: the slowest plausible (every copy from the trainer at a tenth of
        # the rate) plus a minute
        push_timeout = 60 + 10 * floor_ms(nbytes, rate_bits, n * args.per_node) / 1e3
        load0 = os.getloadavg()
        for m in args.sizes:
            fleet = urls[:m * args.per_node]
            opened = trainer.ask(180, op="open", urls=fleet, master=net.addr("trainer"),
                                 relays={u: relays[u] for u in fleet},
                                 group="broadcast" in args.transports, timeout_s=push_timeout)
            extra.setdefault("workers", {})[str(m)] = opened["workers"]
            for rnd in range(args.warmup + args.reps):
                for t in engine_order(rnd, args.transports):
                    time.sleep(args.idle)
                    c0 = counters(net, hosts)
                    reply = trainer.ask(push_timeout + 30, op="push", transport=t,
                                        name=f"mh-{t}")
                    got = delta(c0, counters(net, hosts))
                    if rnd >= args.warmup:
                        samples[m][t].append({**reply, "bytes": got})
            trainer.ask(120, op="close")
            print(f"  {m} node(s) done", flush=True)
        load1 = os.getloadavg()
        trainer.ask(30, op="quit")
        proc.wait(timeout=30)
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    workers = max(max(w) for w in extra["workers"].values())
    fl = floors(nbytes, rate_bits, args.sizes, workers, args.per_node)
    # through JSON: the same keys (str) whether read back from results.json or not
    return json.loads(json.dumps({"rate": args.rate, "rate_bits": rate_bits, "rank": args.rank,
            "bytes": nbytes, "per_node": args.per_node,
            "sizes": args.sizes, "reps": args.reps, "warmup": args.warmup,
            "idle_s": args.idle, "transports": list(args.transports), "hosts": hosts,
            "load_before": load0, "load_after": load1, "cpus": os.cpu_count(),
            "floors": {str(m): f for m, f in fl.items()},
            "samples": {str(m): v for m, v in samples.items()}, **extra}))


def summarize(result: dict) -> dict:
    """The curve (transport -> M -> stats, ms) and the copies per link (transport -> M ->
    host -> [sent, received]) of a result."""
    from .fleet_bench import _stats
    sizes = result["sizes"]
    curve, copies = {}, {}
    for t in result["transports"]:
        for m in sizes:
            xs = result["samples"][str(m)][t]
            curve.setdefault(t, {})[m] = _stats([x["s"] * 1e3 for x in xs])
            copies.setdefault(t, {})[m] = link_copies(xs, result["bytes"],
                                                      result["hosts"][:1 + m])
    return {"curve": curve, "copies": copies}


def report(result: dict) -> str:
    from .fleet_bench import per_extra_server, ratios
    sizes = result["sizes"]
    s = summarize(result)
    curve, copies = s["curve"], s["copies"]
    fl = {m: result["floors"][str(m)] for m in sizes}
    per_node = result.get("per_node", 1)
    lines = [f"push cost (ms, median [min-max] of {result['reps']}) against M server nodes of "
             f"{per_node} server(s) each, with {result['rate']} links, rank {result['rank']} "
             f"({result['bytes'] / 1e6:.1f} "
             f"MB); load {result['load_before'][0]:.2f} -> {result['load_after'][0]:.2f} on "
             f"{result['cpus']} cpus",
             "| transport | " + " | ".join(f"M={m}" for m in sizes) +
             " | per extra server | push(M)/push(1) | trainer uplink, copies |",
             "|---|" + "---|" * len(sizes) + "---|---|---|"]
    for t, row in curve.items():
        cells = [f"{row[m]['median']:.0f} [{row[m]['min']:.0f}-{row[m]['max']:.0f}]"
                 for m in sizes]
        ratio = ", ".join(f"{m}: {r:.2f}x" for m, r in ratios(row, sizes).items())
        up = " / ".join(f"{copies[t][m]['trainer'][0]:.2f}" for m in sizes)
        lines.append(f"| {t} | " + " | ".join(cells) +
                     f" | {per_extra_server(row, sizes):.0f} | {ratio} | {up} |")
    lines.append("| floor: bytes / rate, one copy | " + " | ".join(
        f"{fl[m]['one_copy']:.0f}" for m in sizes) + " | | | 1 |")
    lines.append("| floor: one copy with TCP/IP headers (x1.046) | " + " | ".join(
        f"{fl[m]['one_copy_wire']:.0f}" for m in sizes) + " | | | 1 |")
    lines.append("| floor: a copy per server (HTTP) | " + " | ".join(
        f"{fl[m]['m_copies']:.0f}" for m in sizes) + f" | {fl[sizes[0]]['one_copy']:.0f} | | "
        + " / ".join(str(m * per_node) for m in sizes) + " |")
    lines.append("| floor: gloo's binomial tree from the root | " + " | ".join(
        f"{fl[m]['tree']:.0f}" for m in sizes) + " | | | " +
        " / ".join(str(fl[m]['tree_copies']) for m in sizes) + " |")
    lines.append("copies per link (bytes counted on the veths / adapter bytes, one copy reads "
                 "~1.00), sent/received per host:")
    for t in curve:
        for m in sizes:
            c = copies[t][m]
            lines.append(f"  {t:9s} M={m}: " + "  ".join(
                f"{h} {c[h][0]:.2f}/{c[h][1]:.2f}" for h in c))
    for m in sizes:
        world = 1 + sum(result["workers"][str(m)])
        lines.append(f"  gloo binomial tree, world {world}: sends per rank "
                     f"{binomial_sends(world)}")
    lines.extend(relay_goal(result))
    return "\n".join(lines)


RELAY_GOAL = 1.3  # M nodes x K servers through relays, against 1 node x 1 server


def relay_goal(result: dict) -> list[str]:
    """The relay's push to the most nodes over the push to one server (`one`), each round's
    pair from the same round."""
    if not {"relay", "one"} <= set(result["transports"]):
        return []
    m = max(result["sizes"])
    pairs = list(zip(result["samples"][str(m)]["relay"], result["samples"][str(m)]["one"]))
    per_round = sorted(r["s"] / o["s"] for r, o in pairs)
    relay_ms = statistics.median(r["s"] for r, _ in pairs) * 1e3
    one_ms = statistics.median(o["s"] for _, o in pairs) * 1e3
    ratio = relay_ms / one_ms
    return [f"goal relay: {m} nodes x {result.get('per_node', 1)} servers {relay_ms:.0f} ms "
            f"against 1 node x 1 server {one_ms:.0f} ms: {ratio:.2f}x [per round "
            f"{per_round[0]:.2f}-{per_round[-1]:.2f}], goal <= {RELAY_GOAL}x "
            f"({'met' if ratio <= RELAY_GOAL else 'missed'})"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("bench", "trainer"), default="bench",
                   help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4],
                   help="numbers of server nodes")
    p.add_argument("--per-node", type=int, default=1, help="servers on each node")
    p.add_argument("--rate", default="1gbit", help="each link's rate, each way, in tc's bit "
                   "units (1gbit, 100mbit...)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--idle", type=float, default=0.5, help="seconds before each push")
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS),
                   choices=TRANSPORTS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(REPO / "runs" / "multihost"))
    args = p.parse_args(argv)
    if args.role == "trainer":
        return trainer_main(args.rank)
    args.sizes = sorted(set(args.sizes))
    if args.quick:
        args.sizes, args.rank, args.reps, args.warmup = [1, 2], 8, 2, 1
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    t0 = time.time()
    result = run(args)
    result["seconds"] = time.time() - t0
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (out / "table.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
