"""Push cost against the number of servers, per transport (issue #46).

    python -m benchmarks.fleet_bench                      # 1 2 4 8 servers, rank 64, 7 rounds
    python -m benchmarks.fleet_bench --sizes 1 2 4 8 16 --reps 5
    python -m benchmarks.fleet_bench --quick              # 1 2 servers, rank 8, 3 rounds

Every server is a fake-engine server in a process of its own on 127.0.0.1
(benchmarks/fleet_server.py: lora-sync's real routes, service and worker dispatcher, a
fake engine knowing Qwen2.5-0.5B's shapes). The largest fleet is started once; a fleet of K
is its first K servers. For each K, each round pushes the same adapter (rank 64, bf16,
about 70 MB) once with every transport in turn (interleaved, after an idle pause, as a
trainer's step leaves one), each transport under its own name:

  tensors    the body over HTTP to each server
  shm        a lease per server, readied ahead (K writes, K copies on the host)
  shared     one sealed memfd of the trainer's, mapped by every server (1 write, 1 copy)
  broadcast  one gloo group of the trainer and every server's worker

and the raw floors of the same bytes: a memcpy, and a gloo broadcast to K peer processes.
It prints the curve (median [min-max] ms per K), each transport's ratio push(K)/push(1) and
its cost per server beyond the first, and writes runs/fleet/results.json."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lora_sync import LoRAAdapter, LoRASyncClient
from lora_sync.collective import free_port

from . import limits
from .fleet_server import API_KEY, qwen_spec

TRANSPORTS = ("tensors", "shm", "shared", "broadcast")
GOALS = {"shared": (4, 1.3), "broadcast": (8, 1.3)}  # issue #46: push(K)/push(1) at most
REPO = Path(__file__).resolve().parents[1]

_GLOO_PEERS = r"""
import sys, torch
from lora_sync import collective
port, rank, world, n, reps = (int(x) for x in sys.argv[1:6])
g = collective.create_group("127.0.0.1", port, rank, world, "gloo", 120)
buf = torch.zeros(n, dtype=torch.uint8)
for _ in range(reps):
    for w in [g.start_broadcast(b, 0) for b in buf.split(collective.DEFAULT_BUCKET_BYTES)]:
        w.wait()
"""


def adapter(rank: int, dtype=torch.bfloat16, seed: int = 0) -> LoRAAdapter:
    """An all-linear LoRA of Qwen2.5-0.5B's shapes (benchmarks/sync_bench.random_adapter)."""
    spec = qwen_spec(rank)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in spec.linear.items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) * .01).to(dtype)
        tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * .01).to(dtype)
    targets = sorted({m.rsplit(".", 1)[-1] for m in spec.linear})
    return LoRAAdapter(tensors, {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
                                 "peft_type": "LORA"})


class Fleet:
    """`n` fleet_server processes, started at once."""

    def __init__(self, n: int, max_rank: int):
        self.procs, self.urls = [], []
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        for _ in range(n):
            port = free_port()
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.fleet_server", "--port", str(port),
                 "--max-rank", str(max_rank)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True))
            self.urls.append(f"http://127.0.0.1:{port}")
        for proc in self.procs:
            line = proc.stdout.readline()
            if "ready" not in line:
                self.close()
                raise RuntimeError(f"a fleet server did not start: {line!r}")

    def close(self):
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def gloo_floor_s(peers: int, nbytes: int, reps: int, idle_s: float) -> list[float]:
    """A raw gloo broadcast of `nbytes` (in the transport's buckets) to `peers` processes."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_PEERS, str(port), str(r),
                               str(peers + 1), str(nbytes), str(reps)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO),
                                   "OMP_NUM_THREADS": "1"})
             for r in range(1, peers + 1)]
    try:
        from lora_sync import collective
        g = collective.create_group("127.0.0.1", port, 0, peers + 1, "gloo", 120)
        buf, out = torch.ones(nbytes, dtype=torch.uint8), []
        for _ in range(reps):
            time.sleep(idle_s)
            t0 = time.perf_counter()
            for w in [g.start_broadcast(b, 0) for b in buf.split(collective.DEFAULT_BUCKET_BYTES)]:
                w.wait()
            out.append(time.perf_counter() - t0)
        return out
    finally:
        for p in procs:
            p.wait(timeout=120)


def bench_size(urls: list[str], a: LoRAAdapter, reps: int, warmup: int, idle_s: float,
               transports) -> dict[str, list[dict]]:
    out = {t: [] for t in transports}
    with LoRASyncClient(urls, api_key=API_KEY, timeout=120) as c:
        if "broadcast" in transports:
            c.init_group(timeout_s=120)
        try:
            for rnd in range(warmup + reps):
                for t in transports:
                    time.sleep(idle_s)
                    t0 = time.perf_counter()
                    results = c.push(a, f"fleet-{t}", transport=t)
                    seconds = time.perf_counter() - t0
                    assert all(r.ok and r.transport == t for r in results), results
                    if rnd >= warmup:
                        out[t].append({"s": seconds, "timings_ms": [r.reply.get("timings_ms", {})
                                                                     for r in results]})
        finally:
            for t in transports:
                try:
                    c.retire(f"fleet-{t}")
                except Exception:  # noqa: BLE001 - never pushed
                    pass
    return out


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--idle", type=float, default=0.6, help="seconds before each push")
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(REPO / "runs" / "fleet"))
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.rank, args.reps, args.warmup = [1, 2], 8, 3, 1
    torch.set_num_threads(1)
    a = adapter(args.rank)
    nbytes = a.nbytes
    load0 = os.getloadavg()
    t_start = time.time()
    fleet = Fleet(max(args.sizes), args.rank)
    samples = {}
    try:
        for k in args.sizes:
            samples[k] = bench_size(fleet.urls[:k], a, args.reps, args.warmup, args.idle,
                                    args.transports)
            print(f"  {k} server(s) done", flush=True)
    finally:
        fleet.close()
    floors = {"memcpy": _stats([s * 1e3 for s in limits.memcpy_s(nbytes, args.reps)])}
    for k in args.sizes:
        floors[f"gloo_{k}"] = _stats([s * 1e3 for s in gloo_floor_s(k, nbytes, args.reps,
                                                                      args.idle)])
    load1 = os.getloadavg()
    curve = {t: {k: _stats([s["s"] * 1e3 for s in samples[k][t]]) for k in args.sizes}
             for t in args.transports}
    result = {"rank": args.rank, "bytes": nbytes, "sizes": args.sizes, "reps": args.reps,
              "idle_s": args.idle, "curve": curve, "floors": floors,
              "load_before": load0, "load_after": load1, "cpus": os.cpu_count(),
              "seconds": time.time() - t_start, "samples": {
                  str(k): v for k, v in samples.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0


def report(result: dict) -> str:
    sizes, curve = result["sizes"], result["curve"]
    lines = [f"push cost (ms, median [min-max] of {result['reps']}) against servers, rank "
             f"{result['rank']} ({result['bytes'] / 1e6:.1f} MB); load "
             f"{result['load_before'][0]:.2f} -> {result['load_after'][0]:.2f} on "
             f"{result['cpus']} cpus",
             "| transport | " + " | ".join(f"{k}" for k in sizes) +
             " | per extra server | push(K)/push(1) |",
             "|---|" + "---|" * len(sizes) + "---|---|"]
    k0 = sizes[0]
    for t, row in curve.items():
        cells = [f"{row[k]['median']:.1f} [{row[k]['min']:.1f}-{row[k]['max']:.1f}]"
                 for k in sizes]
        kn = sizes[-1]
        per = (row[kn]["median"] - row[k0]["median"]) / (kn - k0) if kn > k0 else 0.0
        ratios = ", ".join(f"{k}: {row[k]['median'] / row[k0]['median']:.2f}x"
                           for k in sizes[1:])
        lines.append(f"| {t} | " + " | ".join(cells) + f" | {per:.1f} | {ratios} |")
    fl = result["floors"]
    lines.append(f"| floor: memcpy | {fl['memcpy']['median']:.1f} (one copy, any K) |")
    lines.append("| floor: raw gloo broadcast | " + " | ".join(
        f"{fl[f'gloo_{k}']['median']:.1f}" for k in sizes) + " |")
    for t, (k, goal) in GOALS.items():
        if t in curve and k in curve[t] and k0 in curve[t]:
            r = curve[t][k]["median"] / curve[t][k0]["median"]
            lines.append(f"goal {t}: push({k})/push({k0}) = {r:.2f} (goal <= {goal}): "
                         f"{'met' if r <= goal else 'missed'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
