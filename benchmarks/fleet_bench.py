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
its cost per server beyond the first, and writes runs/fleet/results.json.

`--engine vllm` checks the fake curve against real engines (issue #46: up to 3 real servers
where memory allows):

    flock /tmp/lora-sync-server.lock .venv/bin/python -m benchmarks.fleet_bench --engine vllm \
        --sizes 1 2 3 --reps 5

starts K real vLLM CPU servers (testbed/processes.vllm_server, lora-sync's launcher, bf16,
--enforce-eager) on a model of Qwen2.5-0.5B's shapes (random weights, testbed/tiny_model,
built once in MODELS: so the real servers take the very adapter the fake ones take, same
bytes), next to K fake-engine servers with the same lora-sync settings (fleet_server.ENV).
Each round pushes every transport to both fleets of K, the engines' order alternating per
round, so both curves see the same machine. It prints both curves, each transport's
push(K)/push(1) and per-server cost for both, the server-side phases, and writes
runs/fleet_vllm/results.json. Every server is stopped on the way out (SIGTERM included)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lora_sync import LoRAAdapter, LoRASyncClient
from lora_sync.collective import free_port

from . import limits
from .fleet_server import API_KEY, ENV, qwen_spec

TRANSPORTS = ("tensors", "shm", "shared", "broadcast")
ENGINES = ("fake", "vllm")
GOALS = {"shared": (4, 1.3), "broadcast": (8, 1.3)}  # issue #46: push(K)/push(1) at most
REPO = Path(__file__).resolve().parents[1]
MODELS = Path(tempfile.gettempdir()) / "lora-sync-bench-models"  # as the other benchmarks
# Resident memory one real vLLM CPU server of the Qwen2.5-0.5B-shaped model takes (bf16
# weights 1 GB, KV cache 1 GB, API and engine-core processes: 4.1 GiB once started, on
# vLLM 0.32), with margin for the adapters it then holds; the fleet is refused where
# MemAvailable cannot hold K of them.
REAL_SERVER_BYTES = 5 << 30
# Server-side phases the report shows (per server, from each push's reply timings_ms).
# intake: the body's (broadcast: the collective's) arrival; receive: the worker's copy or
# map; register: the engine's own (vLLM: add_lora).
PHASES = ("server", "intake", "receive", "build", "register")

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


def qwen_model_dir() -> Path:
    """A Llama of Qwen2.5-0.5B's shapes, random weights, bf16 (built once, about 1 GB): the
    model whose LoRA the fake servers accept (fleet_server.qwen_spec)."""
    from testbed.tiny_model import QWEN_05B_SHAPES, build_tiny_model
    return build_tiny_model(MODELS / "qwen05b-shapes-bf16", dtype="bfloat16", **QWEN_05B_SHAPES)


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fits_in_memory(n: int, available: int, per_server: int = REAL_SERVER_BYTES) -> bool:
    return n * per_server <= available


class RealFleet:
    """`n` real vLLM CPU servers with lora-sync (the fake fleet's settings and admin key),
    started one after another (2 cores: a start is CPU-bound whatever the order). Every
    server made is stopped by `close`, also when a later one fails to start."""

    def __init__(self, n: int, max_rank: int, model_dir: Path, start_timeout: float = 900):
        from testbed.processes import vllm_server
        self.servers, self.start_s = [], []
        try:
            for _ in range(n):
                # eager: torch.compile of 24 layers per server would take minutes on 2
                # cores; the forward is not what is measured
                server = vllm_server(model_dir, max_lora_rank=max_rank, max_loras=1,
                                     max_cpu_loras=4, dtype="bfloat16", env=dict(ENV),
                                     extra_args=["--enforce-eager"])
                server.start_timeout = start_timeout
                self.servers.append(server)
                t0 = time.perf_counter()
                server.start()
                self.start_s.append(time.perf_counter() - t0)
                print(f"  vllm server {len(self.servers)}/{n} up in {self.start_s[-1]:.0f} s "
                      f"({server.rss_bytes() / 2**30:.1f} GiB)", flush=True)
        except BaseException:
            self.close()
            raise
        self.urls = [s.url for s in self.servers]

    def rss_bytes(self) -> list[int]:
        return [s.rss_bytes() for s in self.servers]

    def close(self):
        for server in self.servers:
            try:
                server.stop()
            except Exception as e:  # noqa: BLE001 - stop the others all the same
                print(f"stopping {server.url}: {e!r}", file=sys.stderr)


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


def engine_order(rnd: int, engines) -> list[str]:
    """The engines in round `rnd`'s order: rotated each round, so neither fleet always
    pushes right after the other."""
    engines = list(engines)
    i = rnd % len(engines) if engines else 0
    return engines[i:] + engines[:i]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def client_peak_start() -> int:
    """Resets this process's peak RSS to its current RSS (clear_refs 5) and returns that RSS
    in bytes: the baseline a push's peak is measured against."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


def client_peak_over(baseline: int) -> int:
    """Bytes the process's peak RSS rose over `baseline` since client_peak_start."""
    return max(0, _status_kb("VmHWM") * 1024 - baseline)


def bench_rounds(fleets: dict[str, list[str]], a: LoRAAdapter, reps: int, warmup: int,
                 idle_s: float, transports) -> dict[str, dict[str, list[dict]]]:
    """`warmup + reps` rounds; each pushes `a` with every transport in turn, to every fleet
    (engine -> its servers' URLs) in `engine_order`. -> engine -> transport -> samples."""
    out = {e: {t: [] for t in transports} for e in fleets}
    with contextlib.ExitStack() as stack:
        clients = {e: stack.enter_context(LoRASyncClient(urls, api_key=API_KEY, timeout=120))
                   for e, urls in fleets.items()}
        for c in clients.values():
            stack.callback(_retire_all, c, transports)
            if "broadcast" in transports:
                c.init_group(timeout_s=120)
        for rnd in range(warmup + reps):
            for t in transports:
                for e in engine_order(rnd, fleets):
                    time.sleep(idle_s)
                    rss0 = client_peak_start()
                    t0 = time.perf_counter()
                    results = clients[e].push(a, f"fleet-{t}", transport=t)
                    seconds = time.perf_counter() - t0
                    client_peak = client_peak_over(rss0)
                    assert all(r.ok and r.transport == t for r in results), (e, results)
                    if rnd >= warmup:
                        out[e][t].append({"s": seconds, "client_peak": client_peak,
                                          "timings_ms": [
                            r.reply.get("timings_ms", {}) for r in results]})
    return out


def _retire_all(c: LoRASyncClient, transports) -> None:
    for t in transports:
        try:
            c.retire(f"fleet-{t}")
        except Exception:  # noqa: BLE001 - never pushed
            pass


def bench_size(urls: list[str], a: LoRAAdapter, reps: int, warmup: int, idle_s: float,
               transports) -> dict[str, list[dict]]:
    return bench_rounds({"fake": urls}, a, reps, warmup, idle_s, transports)["fake"]


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def curve_of(samples: dict, sizes, transports) -> dict:
    """size -> transport -> samples  =>  transport -> size -> stats (ms)."""
    return {t: {k: _stats([x["s"] * 1e3 for x in samples[k][t]]) for k in sizes}
            for t in transports}


def client_memory_of(samples: dict, sizes, transports) -> dict:
    """transport -> size -> the largest rise of the client's peak RSS over a push (MB)."""
    return {t: {k: max(x.get("client_peak", 0) for x in samples[k][t]) / 2**20
                for k in sizes} for t in transports}


def phases_of(samples: dict, sizes, transports) -> dict:
    """transport -> size -> phase -> median ms over every server of every round."""
    out = {}
    for t in transports:
        for k in sizes:
            per = {}
            for x in samples[k][t]:
                for timings in x["timings_ms"]:
                    for phase in PHASES:
                        if phase in timings:
                            per.setdefault(phase, []).append(timings[phase])
            out.setdefault(t, {})[k] = {p: statistics.median(v) for p, v in per.items()}
    return out


def per_extra_server(row: dict, sizes) -> float:
    k0, kn = sizes[0], sizes[-1]
    return (row[kn]["median"] - row[k0]["median"]) / (kn - k0) if kn > k0 else 0.0


def ratios(row: dict, sizes) -> dict:
    return {k: row[k]["median"] / row[sizes[0]]["median"] for k in sizes[1:]}


def _exit_on_sigterm(*_):
    raise SystemExit(143)  # unwinds through every `finally`: the servers are stopped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, default="fake",
                   help="vllm: K real vLLM CPU servers beside K fake ones, same adapter")
    p.add_argument("--sizes", type=int, nargs="+",
                   help="fleet sizes (default 1 2 4 8; with --engine vllm, 1 2 3)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--idle", type=float, default=0.6, help="seconds before each push")
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS))
    p.add_argument("--model-dir", help="--engine vllm: a model of Qwen2.5-0.5B's linear "
                   "shapes (default: built once in " + str(MODELS) + ")")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", help="default runs/fleet, or runs/fleet_vllm with --engine vllm")
    args = p.parse_args(argv)
    real = args.engine != "fake"
    args.sizes = sorted(set(args.sizes or ([1, 2, 3] if real else [1, 2, 4, 8])))
    if args.quick:
        args.sizes, args.rank, args.reps, args.warmup = [1, 2], 8, 3, 1
    args.out = args.out or str(REPO / "runs" / ("fleet_vllm" if real else "fleet"))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(1)
    a = adapter(args.rank)
    nbytes = a.nbytes
    t_start = time.time()
    n = max(args.sizes)
    extra = {}
    if real:
        model_dir = Path(args.model_dir) if args.model_dir else qwen_model_dir()
        available = mem_available()
        if not fits_in_memory(n, available):
            p.error(f"{n} vLLM servers need about {n * REAL_SERVER_BYTES / 2**30:.0f} GiB; "
                    f"{available / 2**30:.1f} GiB available")
        extra = {"engine": args.engine, "model": str(model_dir),
                 "mem_available_before": available}
    samples = {}
    with contextlib.ExitStack() as stack:
        fleet = Fleet(n, args.rank)
        stack.callback(fleet.close)
        fleets = {"fake": fleet.urls}
        if real:
            print(f"starting {n} vLLM server(s) on {model_dir}", flush=True)
            real_fleet = RealFleet(n, args.rank, model_dir)
            stack.callback(real_fleet.close)
            fleets[args.engine] = real_fleet.urls
            extra["start_s"] = real_fleet.start_s
            extra["rss_bytes"] = real_fleet.rss_bytes()
        load0 = os.getloadavg()  # after the starts: what the rounds begin on
        for k in args.sizes:
            got = bench_rounds({e: urls[:k] for e, urls in fleets.items()}, a, args.reps,
                               args.warmup, args.idle, args.transports)
            for e, by_t in got.items():
                samples.setdefault(e, {})[k] = by_t
            print(f"  {k} server(s) done", flush=True)
        if real:
            extra["rss_bytes_after"] = real_fleet.rss_bytes()
    floors = {"memcpy": _stats([s * 1e3 for s in limits.memcpy_s(nbytes, args.reps)])}
    for k in args.sizes:
        floors[f"gloo_{k}"] = _stats([s * 1e3 for s in gloo_floor_s(k, nbytes, args.reps,
                                                                      args.idle)])
    load1 = os.getloadavg()
    curves = {e: curve_of(by_k, args.sizes, args.transports) for e, by_k in samples.items()}
    result = {"rank": args.rank, "bytes": nbytes, "sizes": args.sizes, "reps": args.reps,
              "warmup": args.warmup, "idle_s": args.idle, "curve": curves["fake"],
              "client_peak_mb": {e: client_memory_of(by_k, args.sizes, args.transports)
                                 for e, by_k in samples.items()},
              "floors": floors, "load_before": load0, "load_after": load1,
              "cpus": os.cpu_count(), "seconds": time.time() - t_start, **extra}
    if real:
        result["curves"] = curves
        result["phases"] = {e: phases_of(by_k, args.sizes, args.transports)
                            for e, by_k in samples.items()}
        result["samples"] = {e: {str(k): v for k, v in by_k.items()}
                             for e, by_k in samples.items()}
    else:
        result["samples"] = {str(k): v for k, v in samples["fake"].items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (out / "table.txt").write_text(text + "\n")
    print(text)
    return 0


def _cells(row: dict, sizes) -> list[str]:
    return [f"{row[k]['median']:.1f} [{row[k]['min']:.1f}-{row[k]['max']:.1f}]" for k in sizes]


def _ratio_text(row: dict, sizes) -> str:
    return ", ".join(f"{k}: {r:.2f}x" for k, r in ratios(row, sizes).items())


def _floor_lines(result: dict) -> list[str]:
    fl, sizes = result["floors"], result["sizes"]
    return [f"| floor: memcpy | {fl['memcpy']['median']:.1f} (one copy, any K) |",
            "| floor: raw gloo broadcast | " + " | ".join(
                f"{fl[f'gloo_{k}']['median']:.1f}" for k in sizes) + " |"]


def _client_memory_lines(result: dict) -> list[str]:
    """The trainer's own memory per push: the most its peak RSS rose over one push, per K
    (flat in K when the client holds one copy of the adapter whatever the fleet)."""
    lines = []
    for e, by_t in result.get("client_peak_mb", {}).items():
        lines.append(f"client peak RSS rise per push, {e} servers (MB, max over rounds; K = "
                     + " / ".join(map(str, result["sizes"])) + "):")
        for t, by_k in by_t.items():
            lines.append(f"  {t:9s} " + " / ".join(f"{by_k[k]:.1f}" for k in result["sizes"]))
    return lines


def _header(result: dict) -> str:
    return (f"push cost (ms, median [min-max] of {result['reps']}) against servers, rank "
            f"{result['rank']} ({result['bytes'] / 1e6:.1f} MB); load "
            f"{result['load_before'][0]:.2f} -> {result['load_after'][0]:.2f} on "
            f"{result['cpus']} cpus")


def report(result: dict) -> str:
    if "curves" in result:
        return report_compare(result)
    sizes, curve = result["sizes"], result["curve"]
    lines = [_header(result),
             "| transport | " + " | ".join(f"{k}" for k in sizes) +
             " | per extra server | push(K)/push(1) |",
             "|---|" + "---|" * len(sizes) + "---|---|"]
    k0 = sizes[0]
    for t, row in curve.items():
        lines.append(f"| {t} | " + " | ".join(_cells(row, sizes)) +
                     f" | {per_extra_server(row, sizes):.1f} | {_ratio_text(row, sizes)} |")
    lines += _floor_lines(result)
    lines += _client_memory_lines(result)
    for t, (k, goal) in GOALS.items():
        if t in curve and k in curve[t] and k0 in curve[t]:
            r = curve[t][k]["median"] / curve[t][k0]["median"]
            lines.append(f"goal {t}: push({k})/push({k0}) = {r:.2f} (goal <= {goal}): "
                         f"{'met' if r <= goal else 'missed'}")
    return "\n".join(lines)


def report_compare(result: dict) -> str:
    """Both curves, row by row (fake, then real, per transport), then what the fake curve
    predicts of the real one: ratio and per-server cost side by side, and the server-side
    phases that make the difference."""
    sizes, curves = result["sizes"], result["curves"]
    engines = list(curves)
    real = [e for e in engines if e != "fake"]
    lines = [_header(result) + f"; fake-engine vs {', '.join(real)} servers, same adapter",
             "| transport | engine | " + " | ".join(f"{k}" for k in sizes) +
             " | per extra server | push(K)/push(1) |",
             "|---|---|" + "---|" * len(sizes) + "---|---|"]
    transports = list(curves["fake"])
    for t in transports:
        for e in engines:
            row = curves[e][t]
            lines.append(f"| {t} | {e} | " + " | ".join(_cells(row, sizes)) +
                         f" | {per_extra_server(row, sizes):.1f} | {_ratio_text(row, sizes)} |")
    lines += _floor_lines(result)
    lines += _client_memory_lines(result)
    kn = sizes[-1]
    for e in real:
        lines.append(f"fake vs {e}: push({kn})/push({sizes[0]}) and per extra server (ms); "
                     f"{e} - fake at K={sizes[0]} (the engine's fixed cost)")
        for t in transports:
            f, r = curves["fake"][t], curves[e][t]
            lines.append(
                f"  {t:9s} ratio {ratios(f, sizes).get(kn, 1.0):.2f}x vs "
                f"{ratios(r, sizes).get(kn, 1.0):.2f}x; per server "
                f"{per_extra_server(f, sizes):+.1f} vs {per_extra_server(r, sizes):+.1f}; "
                f"fixed {r[sizes[0]]['median'] - f[sizes[0]]['median']:+.1f}")
    phases = result.get("phases")
    if phases:
        ends = [sizes[0], kn] if kn != sizes[0] else [kn]
        lines.append("server-side phases (median ms per server, K=" +
                     " / K=".join(map(str, ends)) + "): " + ", ".join(PHASES))
        for t in transports:
            for e in engines:
                cells = ["/".join(f"{phases[e][t][k].get(ph, float('nan')):.1f}"
                                  for k in ends) for ph in PHASES]
                lines.append(f"  {t:9s} {e:5s} " + "  ".join(cells))
    if "rss_bytes" in result:
        lines.append("real servers: started in " + ", ".join(
            f"{x:.0f}" for x in result.get("start_s", [])) + " s; RSS " + ", ".join(
            f"{b / 2**30:.1f}" for b in result["rss_bytes"]) + " GiB each")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
