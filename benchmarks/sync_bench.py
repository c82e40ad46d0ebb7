"""Disk vs tensors over HTTP vs shared memory (shm) vs broadcast LoRA sync, against the raw
limits of the same bytes.

    python -m benchmarks.sync_bench             # Qwen2.5-0.5B shapes, ranks 8 16 64 128
    python -m benchmarks.sync_bench --quick     # tiny model, rank 8, 3 repetitions

Each round syncs with every transport in turn (interleaved), so a slow spell of the machine
hits them alike; each transport's ratio to disk is taken per round and reported as its
median and min-max. The result says whether the machine was quiet: its load average before
and after, the CPU time every other process (kernel threads included) used meanwhile, the
time the host took from this VM, and any other inference server beside the benchmark's own.

Writes runs/bench/results.json (every raw sample + machine), results.png and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lora_sync import LoRAAdapter, LoRASyncClient, ModelSpec, http
from lora_sync.engines import ENGINES
from testbed.processes import SGLANG_PYTHON, SGLANG_TEST_PATH, sglang_server, vllm_server
from testbed.tiny_model import QWEN_05B_SHAPES, build_tiny_model

from . import limits

TRANSPORTS = ("disk", "disk_shm", "tensors", "shm", "broadcast")
# Each transport's reference limits (raw transfer of the same bytes, plus registration) and the
# summary key of its multiple; tensors also against the engines' own HTTP stack (uvicorn).
LIMITS = {"tensors": (("http_post", "x_limit"), ("asgi_post", "x_asgi_limit")),
          "shm": (("memcpy", "x_limit"),),
          "broadcast": (("gloo_broadcast", "x_limit"),)}
IDLE_S = 1.2
# Issue #22's goals at the largest rank: each transport's speed-up over the disk route.
GOALS = {"shm": 2.0, "broadcast": 1.5, "tensors": 1.2}
# Issue #55: a goal holds with this margin (a machine slower by the margin must meet it too).
MARGIN = 1.15
# Issue #55's goal for the broadcast: within this multiple of its floor (the raw transfer of
# the same bytes in the same round plus the engine's own time in that push).
FLOOR_GOAL = 1.3


def random_adapter(model_dir: Path, rank: int, dtype=torch.bfloat16, seed: int = 0) -> LoRAAdapter:
    """An all-linear LoRA of the given rank for the model's shapes, random weights."""
    from transformers import AutoConfig
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir), max_rank=rank)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in spec.linear.items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) * 0.01).to(dtype)
        tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(dtype)
    targets = sorted({m.rsplit(".", 1)[-1] for m in spec.linear})
    return LoRAAdapter(tensors, {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
                                 "peft_type": "LORA"})


def save_like_peft(adapter: LoRAAdapter, path: Path) -> None:
    """What PEFT's save_pretrained writes (minus extracting the state dict): the disk
    baseline a trainer pays today."""
    from safetensors.torch import save_file
    save_file(adapter.tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(adapter.config))


def sync_once(client: LoRASyncClient, transport: str, adapter: LoRAAdapter, name: str,
              scratch: Path) -> tuple[str, dict]:
    """One sync; returns (served name, phase seconds incl. 'total')."""
    t0 = time.perf_counter()
    if transport.startswith("disk"):
        root = Path("/dev/shm") if transport == "disk_shm" else scratch
        path = Path(tempfile.mkdtemp(dir=root, prefix="lora-bench-"))
        save_like_peft(adapter, path)
        t1 = time.perf_counter()
        served = f"{name}-{transport}-{int(t1 * 1e6)}"
        client.load_from_disk(str(path), served)
        t2 = time.perf_counter()
        shutil.rmtree(path)
        return served, {"serialise": t1 - t0, "load": t2 - t1, "total": t2 - t0}
    [res] = client.push(adapter, name, transport=transport)
    total = time.perf_counter() - t0
    return res.name, attribute({k: v / 1e3 for k, v in res.reply["timings_ms"].items()},
                               res.seconds, total)


SERVER_PHASES = ("settle", "receive", "wait", "worker", "handoff", "register")
WORKER_PARTS = ("intake", "checks", "build")
# The engine's own time in a push, what any path pays once the bytes are in: its registration
# (from the API process: the engine's load call) and its build of its LoRA object.
ENGINES_OWN = ("register", "engine_build")
TRAINER_CALLS = ("lease", "write")  # shm's steps before its last call
# Measured and shown, not added: shm's copy into a ready lease runs after its commit went
# out, inside the server's `receive` (which waits for it to seal the lease); full garbage
# collections in the API process (`gc`) and the slowest worker (`worker_gc`) ran inside
# whichever phases they interrupted; `engine_build` is the engine's own code inside `build`;
# a broadcast's `header_wait` (the worker waiting on the trainer's first bytes) and
# `transfer` (the buckets on the wire) are inside `intake`, and `pack` (the trainer's
# packing of the buckets) runs beside them.
WITHIN_PHASES = ("copy", "gc", "worker_gc", "engine_build", "header_wait", "transfer", "pack")


def attribute(timings: dict, calls_s: float, total_s: float) -> dict:
    """A push's wall time as phases that add up to it (seconds). Measured: the server's
    phases and the worker's parts (the reply's timings), the trainer's calls (`calls_s`:
    from its first request to the last reply). Derived, each a named remainder: `client`
    (the trainer's own work around its calls: encoding, threads, the copy it keeps),
    `http` (the last call's round trip beyond the server's own time), `worker_other` and
    `server_other` (the server's time outside its phases: checks of the header, reply)."""
    phases = {k: timings[k] for k in TRAINER_CALLS + WITHIN_PHASES if k in timings}
    phases["client"] = total_s - calls_s
    phases["http"] = calls_s - sum(phases.get(k, 0.0) for k in TRAINER_CALLS) \
        - timings["server"]
    for k in SERVER_PHASES:
        if k == "worker":
            phases.update({p: timings.get(p, 0.0) for p in WORKER_PARTS})
            phases["worker_other"] = timings["worker"] - sum(timings.get(p, 0.0)
                                                             for p in WORKER_PARTS)
        else:
            phases[k] = timings.get(k, 0.0)
    phases["server_other"] = timings["server"] - sum(timings.get(k, 0.0)
                                                     for k in SERVER_PHASES)
    phases["total"] = total_s
    return phases


# The engine's own time per request, summed over its label sets (Prometheus text): what a
# request spent inside the engine, whatever ran around it in the API process.
ENGINE_E2E = {"vllm": "vllm:e2e_request_latency_seconds_sum",
              "sglang": "sglang:e2e_request_latency_seconds_sum"}


def engine_seconds(client) -> float | None:
    """The engine's summed request time so far (None where its metrics do not say)."""
    server = client.servers[0]
    try:
        status, raw, _ = http.exchange("GET", server.url + "/metrics", headers=client.headers,
                                       timeout=10, max_reply_bytes=64 << 20)
    except Exception:  # noqa: BLE001 - a server without metrics: the split is not shown
        return None
    if status != 200:
        return None
    key = ENGINE_E2E[server.engine]
    found = [float(line.rsplit(" ", 1)[1]) for line in raw.decode(errors="replace").splitlines()
             if line.startswith(key)]
    return sum(found) if found else None


def first_completion(client, served: str, transport: str) -> tuple[float, float | None]:
    """The first completion that names the new version (on SGLang a disk-loaded adapter is
    named 'base:<name>' in OpenAI requests): (its wall time, the part spent outside the
    engine: admission, the API process, HTTP; None where the engine's metrics do not say)."""
    if transport.startswith("disk"):
        served = ENGINES[client.servers[0].engine].disk_model(served)
    before = engine_seconds(client)
    t0 = time.perf_counter()
    client.complete("the quick brown", served, max_tokens=1)
    wall = time.perf_counter() - t0
    after = engine_seconds(client) if before is not None else None
    return wall, (wall - (after - before) if after is not None else None)


def start_server(engine: str, model_dir: Path, max_rank: int, dtype: str, env=None,
                 extra_args=(), start_timeout: float | None = None):
    if engine == "sglang":
        # SGLang on CPU needs the sgl-kernel stand-in, as the tests' servers do.
        server = sglang_server(model_dir, max_lora_rank=max_rank,
                               extra_args=["--dtype", dtype, *extra_args],
                               python=str(SGLANG_PYTHON),
                               env={**(env or {}), "PYTHONPATH": SGLANG_TEST_PATH})
    elif engine == "vllm":
        # vLLM's own unload route leaves a disk adapter in the worker's cache (vllm#54839);
        # lora-sync evicts it after the unload (Registry.evict_when_idle), off every
        # push's path. The small cache bounds what a run leaves cached all the same: while
        # disk adapters pile up the disk route slows down (docs/benchmarks.md, "Method").
        server = vllm_server(model_dir, max_lora_rank=max_rank, dtype=dtype, max_cpu_loras=8,
                             env=env, extra_args=extra_args)
    else:
        raise ValueError(f"unknown engine {engine!r}")
    server.start_timeout = start_timeout or server.start_timeout
    return server.start()


def bench_engine(client, model_dir, ranks, reps, dtype, scratch, bar) -> list[dict]:
    """Every transport, `reps` times per rank, against one server, after `warmup` rounds.

    The first pushes of a name fill the server's retention window with fresh memory; from
    then on each push reuses what a retired version freed. Warm-up rounds (one per version
    kept) are recorded as "cold" samples and reported apart from the steady state."""
    engine, samples = client.servers[0].engine, []
    warmup = int(client.info()[0]["keep_versions"])
    client.init_group()
    with limits.GlooPeer() as peer:
        for rank in ranks:
            adapter = random_adapter(model_dir, rank, getattr(torch, dtype))
            for rep in range(-warmup + 1, reps + 1):
                for transport in TRANSPORTS:
                    served, phases = sync_once(client, transport, adapter, f"r{rank}", scratch)
                    first, outside = first_completion(client, served, transport)
                    if transport.startswith("disk"):  # as a trainer would: drop the old version
                        client.unload_from_disk(served)
                    # After a request, vLLM's worker and engine loops busy-poll for about a
                    # second and, on two cores, slow whatever runs next: start each sync from
                    # an idle server.
                    time.sleep(IDLE_S)
                    sample = {"engine": engine, "transport": transport, "rank": rank,
                              "bytes": adapter.nbytes, "rep": rep, "cold": rep <= 0,
                              "phases": phases, "first_completion_s": first,
                              "first_outside_s": outside}
                    if transport == "broadcast":
                        # The raw transfer of the same bytes in the same round, from the same
                        # trainer: the floor at this push's moment (the machine's speed moves
                        # between runs by more than the goal's margin).
                        sample["raw_transfer_s"] = peer.broadcast_s(adapter.nbytes)
                        time.sleep(IDLE_S)
                    samples.append(sample)
                    if bar:
                        bar.update()
    client.destroy_group()
    return samples


def soak(client, server, model_dir, rank: int, pushes: int, dtype: str, bar=None) -> dict:
    """Server memory over `pushes` pushes of one rank (shm, tensors and broadcast in turn):
    the RSS of the server's processes every 10 pushes, after a first 10 that fill the
    retention window. Flat means no push leaks what a retired version held."""
    adapter = random_adapter(model_dir, rank, getattr(torch, dtype), seed=7)
    kinds = ("shm", "tensors", "broadcast")
    client.init_group()
    rss = []
    for i in range(pushes):
        client.push(adapter, f"soak{rank}", transport=kinds[i % len(kinds)])
        if i >= 9 and (i + 1) % 10 == 0:
            rss.append(server.rss_bytes() / 2 ** 20)
        if bar:
            bar.update()
    client.destroy_group()
    client.retire(f"soak{rank}")
    return {"engine": client.servers[0].engine, "rank": rank, "pushes": pushes,
            "rss_mb_every_10": rss, "first_mb": rss[0], "last_mb": rss[-1], "max_mb": max(rss),
            "mb_per_100_pushes": rss_growth(rss, pushes)}


def rss_growth(rss: list[float], pushes: int) -> float:
    """MB per 100 pushes by which the top of the RSS rose from the first half of the samples
    to the second. Between two samples the retention window holds one adapter more or less
    (70 MB at rank 64), so the samples sit on two levels; a leak lifts the top, while which
    level a sample catches (what a median or the first and last samples follow) does not."""
    half = len(rss) // 2
    if not half:
        return 0.0
    return (max(rss[half:]) - max(rss[:half])) / (pushes / 2) * 100


def bench_limits(model_dir, ranks, reps, dtype) -> list[dict]:
    """Raw memcpy / loopback HTTP POST (plain and through uvicorn + FastAPI) / gloo broadcast
    of the same bytes, each transfer from an idle pause as the pushes are."""
    samples = []
    for rank in ranks:
        nbytes = random_adapter(model_dir, rank, getattr(torch, dtype)).nbytes
        row = {"engine": "raw", "rank": rank, "bytes": nbytes}
        for t in limits.gloo_broadcast_s([nbytes] * (reps + 1), IDLE_S)[1:]:
            samples.append({**row, "transport": "gloo_broadcast", "phases": {"total": t}})
        for transport, asgi in (("http_post", False), ("asgi_post", True)):
            with limits.HttpSink(asgi) as sink:
                sink.post_s(nbytes)
                for _ in range(reps):
                    time.sleep(IDLE_S)
                    samples.append({**row, "transport": transport,
                                    "phases": {"total": sink.post_s(nbytes)}})
        for t in limits.memcpy_s(nbytes, reps):
            samples.append({**row, "transport": "memcpy", "phases": {"total": t}})
    return samples


def run(model_dir: Path, ranks: list[int], reps: int, servers: list, out: Path, dtype: str,
        progress: bool = True, api_key: str | None = None, soak_pushes: int = 0) -> dict:
    """`servers`: engine names to start ("vllm", "sglang") or running (engine, url) pairs.
    `soak_pushes`: pushes at the largest rank with the server's RSS sampled (servers the
    benchmark starts only: it reads their processes)."""
    torch.set_num_threads(1)  # with two threads on two cores the trainer stalls randomly
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(servers) * (len(ranks) * (reps + 2) * len(TRANSPORTS)
                                          + soak_pushes),
                   desc="sync benchmark", unit="sync")
    samples, memory = [], []
    cpu_before, own, others = cpu_snapshot(), {os.getpid()}, set()
    try:
        for entry in servers:
            started = None
            if isinstance(entry, str):
                started = start_server(entry, model_dir, max(ranks), dtype)
                entry = (entry, started.url)
                own |= _process_tree(started.proc.pid)
            else:
                own |= _listening_pids(entry[1])
            others |= set(other_servers(own))
            try:
                with LoRASyncClient(entry[1], engine=entry[0], api_key=api_key) as client:
                    samples += bench_engine(client, model_dir, ranks, reps, dtype, scratch, bar)
                    if soak_pushes and started is not None:
                        memory.append(soak(client, started, model_dir, max(ranks),
                                           soak_pushes, dtype, bar))
            finally:
                if started is not None:
                    started.stop()
        samples += bench_limits(model_dir, ranks, reps, dtype)
    finally:
        if bar:
            bar.close()
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"machine": machine(), "model": str(model_dir), "dtype": dtype, "ranks": ranks,
              "reps": reps, "quiet": quiet_report(cpu_before, cpu_snapshot(), sorted(others)),
              "samples": samples, "summary": summarize(samples), "memory": memory}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "results.png")
    return result


def _process_tree(root: int) -> set[int]:
    """`root` and every process below it (a server and the helpers it spawned)."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def _listening_pids(url: str) -> set[int]:
    """The processes of a server the caller started (given by URL; it is the benchmark's
    own): those with its port on their command line, and their children."""
    port = url.rsplit(":", 1)[-1].split("/")[0]
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if f"\0{port}\0" in cmd or cmd.endswith(f"\0{port}"):
            pids |= _process_tree(int(pid))
    return pids


def machine() -> dict:
    import vllm
    from lora_sync.server.pins import SUPPORTED
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "vllm": vllm.__version__, "sglang": " or ".join(SUPPORTED["SGLang"]),
            "shmem_thp": _thp_setting(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _thp_setting() -> str:
    """Transparent huge pages for shared memory ([advise] lets shm leases use 2 MiB pages)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return next(w.strip("[]") for w in f.read().split() if w.startswith("["))
    except (OSError, StopIteration):
        return "unknown"


SERVER_MARKERS = ("vllm_ext.serve", "sglang_ext.launch_server", "sglang.launch_server",
                  "vllm.entrypoints", "vllm serve")


def other_servers(own_pids: set[int]) -> list[str]:
    """Command lines of inference servers running beside the benchmark (and not its own):
    any of them makes the timings noisy."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in own_pids:
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(m in cmd for m in SERVER_MARKERS):
            found.append(cmd.strip()[:200])
    return found


def cpu_snapshot() -> dict:
    """What the machine's CPU time went to so far: each process's (parent, CPU seconds of
    its own: a reaped child's time would land on whoever reaps it, init for orphans), and
    the time the host took from this VM (`steal`)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        procs[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    with open("/proc/stat") as f:
        steal = int(f.readline().split()[8]) / tick
    return {"procs": procs, "steal_s": steal, "at": time.monotonic(),
            "loadavg": os.getloadavg()}


def others_cpu_s(start: dict, end: dict, me: int) -> float:
    """CPU seconds that processes other than this one and its descendants (the servers it
    started, the raw limits' peers) used between two snapshots, kernel threads included."""
    procs = end["procs"]
    ours = {me}
    for pid in sorted(procs):  # a child's pid may be below its parent's: walk up each chain
        chain, p = [], pid
        while p in procs and p not in ours and p > 1 and p not in chain:
            chain.append(p)
            p = procs[p][0]
        if p in ours:
            ours.update(chain)
    return sum(cpu - start["procs"].get(pid, (0, 0.0))[1]
               for pid, (_, cpu) in procs.items() if pid not in ours)


def quiet_report(start: dict, end: dict, others: list[str]) -> dict:
    """Quiet: no other inference server, a low load when the run began, and the rest of the
    machine (kernel threads included) used under 5% of a core meanwhile. The load average
    at the end includes the benchmark's own servers and pushes: reported, not judged."""
    wall = max(end["at"] - start["at"], 1e-9)
    other_cores = others_cpu_s(start, end, os.getpid()) / wall
    steal_cores = (end["steal_s"] - start["steal_s"]) / wall
    return {"loadavg_before": list(start["loadavg"]), "loadavg_after": list(end["loadavg"]),
            "other_servers": others, "other_processes_cores": other_cores,
            "steal_cores": steal_cores,
            "quiet": not others and start["loadavg"][0] < 0.5 * (os.cpu_count() or 1)
            and other_cores < 0.05}


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(samples: list[dict]) -> list[dict]:
    """One row per (engine, transport, rank): median/min/max, MB/s, ratios."""
    rows = []
    keys = sorted({(s["engine"], s["transport"], s["rank"]) for s in samples},
                  key=lambda k: (k[2], k[0], k[1]))
    med = {}
    for key in keys:
        every = [s for s in samples if (s["engine"], s["transport"], s["rank"]) == key]
        group = [s for s in every if not s.get("cold")]
        totals = [s["phases"]["total"] for s in group]
        # A phase one push skipped (shm's copy when its lease was written ahead) counts 0.
        names = dict.fromkeys(p for s in group for p in s["phases"])
        phases = {p: _median([s["phases"].get(p, 0.0) for s in group]) for p in names}
        med[key] = phases
        rows.append({"engine": key[0], "transport": key[1], "rank": key[2],
                     "mb": group[0]["bytes"] / 1e6, "median_s": _median(totals),
                     "min_s": min(totals), "max_s": max(totals),
                     "mb_per_s": group[0]["bytes"] / 1e6 / _median(totals),
                     "phases_s": phases,
                     # The median phases' sum against the median wall time (1.0: all of it).
                     "attributed": sum(v for k, v in phases.items()
                                       if k not in ("total", *WITHIN_PHASES))
                     / _median(totals),
                     "cold_s": _median([s["phases"]["total"] for s in every if s.get("cold")]),
                     "first_completion_s": _median([s.get("first_completion_s") for s in group
                                                    if s.get("first_completion_s")])})
    disk_by_round = {(s["engine"], s["rank"], s["rep"]): s["phases"]["total"] for s in samples
                     if s["transport"] == "disk" and not s.get("cold")}
    disk_first = {(s["engine"], s["rank"], s["rep"]): s["first_completion_s"] for s in samples
                  if s["transport"] == "disk" and not s.get("cold")
                  and s.get("first_completion_s")}
    disk_outside = {(s["engine"], s["rank"], s["rep"]): s["first_outside_s"] for s in samples
                    if s["transport"] == "disk" and not s.get("cold")
                    and s.get("first_outside_s") is not None}
    for row in rows:
        rank, engine = row["rank"], row["engine"]
        warm = [s for s in samples if (s["engine"], s["transport"], s["rank"]) ==
                (engine, row["transport"], rank) and not s.get("cold")]
        # Per round: this transport against the disk sync of the same round.
        ratios = [disk_by_round[(engine, rank, s["rep"])] / s["phases"]["total"]
                  for s in warm if (engine, rank, s.get("rep")) in disk_by_round]
        if ratios:
            row["speedup_per_round"] = {"median": _median(ratios), "min": min(ratios),
                                        "max": max(ratios), "rounds": len(ratios)}
        disk = med.get((engine, "disk", rank), {}).get("total")
        tens = med.get((engine, "tensors", rank), {})
        registration = sum(tens.get(k, 0) for k in ENGINES_OWN)
        if row["engine"] != "raw" and disk:
            row["speedup_over_disk"] = disk / row["median_s"]
        for raw, key in LIMITS.get(row["transport"], ()):
            if ("raw", raw, rank) in med:
                limit = med[("raw", raw, rank)]["total"] + registration
                row[key] = row["median_s"] / limit
                if key == "x_limit":
                    row["limit_s"], row["registration_s"] = limit, registration
        later = [s["first_completion_s"] - disk_first[(engine, rank, s["rep"])]
                 for s in warm if s.get("first_completion_s")
                 and (engine, rank, s.get("rep")) in disk_first]
        if later and row["transport"] in GOALS:
            # Paired per round: the first completion on the version this transport synced
            # minus the one after that round's disk load. "No slower" is met while it is
            # slower in at most half the rounds (so the paired median is not above zero).
            slower = sum(d > 0 for d in later)
            row["first_vs_disk_s"] = {"median": _median(later), "min": min(later),
                                      "max": max(later), "rounds": len(later),
                                      "slower": slower, "met": 2 * slower <= len(later)}
            # The same pairs, outside the engine only: what lora-sync's side adds to the
            # request (the rest is the engine's own compute, which varies round to round).
            outside = [s["first_outside_s"] - disk_outside[(engine, rank, s["rep"])]
                       for s in warm if s.get("first_outside_s") is not None
                       and (engine, rank, s.get("rep")) in disk_outside]
            if outside:
                row["first_vs_disk_s"]["outside_engine"] = {
                    "median": _median(outside), "min": min(outside), "max": max(outside)}
        paired = [(s["phases"]["total"], s["raw_transfer_s"],
                   sum(s["phases"].get(k, 0.0) for k in ENGINES_OWN))
                  for s in warm if s.get("raw_transfer_s")]
        if paired:
            # Per round: the push against its floor at that moment, the raw transfer of the
            # same round plus the engine's own time in this very push.
            ratios = [total / (raw + engine_s) for total, raw, engine_s in paired]
            row["x_floor_per_round"] = {"median": _median(ratios), "min": min(ratios),
                                        "max": max(ratios), "rounds": len(ratios),
                                        "raw_s": _median([p[1] for p in paired]),
                                        "registration_s": _median([p[2] for p in paired]),
                                        "met": _median(ratios) <= FLOOR_GOAL}
        goal = GOALS.get(row["transport"])
        if goal and disk and "speedup_per_round" in row:
            # The floor is the raw transfer plus the engine's own work: a goal whose time
            # budget is below it cannot be met on this machine, whatever lora-sync does.
            row["goal"] = {"ratio": goal, "budget_s": disk / goal,
                           "margin_budget_s": disk / (goal * MARGIN),
                           "met": row["speedup_per_round"]["median"] >= goal,
                           "floor_s": row.get("limit_s"),
                           "floor_within_budget": row.get("limit_s", math.inf) <= disk / goal}
    return rows


def goals_report(rows: list[dict]) -> str:
    """Each goal at the largest rank: met or not, its time budget against the floor."""
    largest = max((r["rank"] for r in rows), default=0)
    lines = []
    for r in rows:
        g = r.get("goal")
        if r["rank"] != largest or g is None:
            continue
        floor = (f"floor {g['floor_s'] * 1e3:.1f} ms = raw transfer "
                 f"{(g['floor_s'] - r['registration_s']) * 1e3:.1f} + engine "
                 f"{r['registration_s'] * 1e3:.1f}, "
                 f"{'within' if g['floor_within_budget'] else 'ABOVE'} the budget "
                 f"({'within' if g['floor_s'] <= g['margin_budget_s'] else 'ABOVE'} the "
                 f"{(MARGIN - 1) * 100:.0f}% margin's {g['margin_budget_s'] * 1e3:.1f} ms)"
                 if g["floor_s"] else "floor not measured")
        lines.append(f"goal {r['engine']} {r['transport']} rank {r['rank']}: "
                     f"{g['ratio']:.1f}x disk needs <= {g['budget_s'] * 1e3:.1f} ms; median "
                     f"{r['median_s'] * 1e3:.1f} ms ({r['speedup_per_round']['median']:.2f}x, "
                     f"{'met' if g['met'] else 'missed'}); {floor}")
        per_round = r.get("x_floor_per_round")
        if per_round:
            lines.append(f"goal {r['engine']} {r['transport']} rank {r['rank']}: within "
                         f"{FLOOR_GOAL:.1f}x its floor; paired per round "
                         f"{per_round['median']:.2f}x [{per_round['min']:.2f}-"
                         f"{per_round['max']:.2f}] ({'met' if per_round['met'] else 'missed'}), "
                         f"the same rounds' raw transfer {per_round['raw_s'] * 1e3:.1f} ms + "
                         f"engine {per_round['registration_s'] * 1e3:.1f}")
        first = r.get("first_vs_disk_s")
        if first:
            lines.append(f"goal {r['engine']} {r['transport']} rank {r['rank']}: first "
                         f"completion no slower than after disk; paired per round "
                         f"{first['median'] * 1e3:+.1f} ms [{first['min'] * 1e3:+.1f} to "
                         f"{first['max'] * 1e3:+.1f}], slower in {first['slower']} of "
                         f"{first['rounds']} ({'met' if first['met'] else 'missed'})"
                         + (f"; outside the engine {first['outside_engine']['median'] * 1e3:+.1f}"
                            f" ms [{first['outside_engine']['min'] * 1e3:+.1f} to "
                            f"{first['outside_engine']['max'] * 1e3:+.1f}]"
                            if "outside_engine" in first else ""))
    text = "\n".join(lines)
    print(text)
    return text


def _cell(value, spec: str, unit: str, scale: float = 1.0) -> str:
    """One table cell; '-' where a row has no such number (raw limits, missing runs)."""
    if value is None or math.isnan(value):
        return "-".rjust(len(format(0.0, spec)) + len(unit))
    return f"{value * scale:{spec}}{unit}"


def _spread(per_round: dict | None) -> str:
    """The per-round ratio's min-max, beside its median."""
    if not per_round:
        return " " * 12
    return f" [{per_round['min']:.2f}-{per_round['max']:.2f}]"


def print_table(rows: list[dict]) -> str:
    head = (f"{'engine':7} {'transport':15} {'rank':>4} {'MB':>7} {'median':>8} {'min':>8} "
            f"{'max':>8} {'MB/s':>7} {'vs disk [per-round min-max]':>27} {'x limit':>7} "
            f"{'cold':>8} {'1st compl':>9} {'attrib':>6}"
            "  phases (median ms)")
    lines = [head, "-" * len(head)]
    for r in rows:
        ph = ", ".join(f"{k} {v*1e3:.1f}" for k, v in r["phases_s"].items() if k != "total")
        lines.append(
            f"{r['engine']:7} {r['transport']:15} {r['rank']:>4} {r['mb']:7.1f} "
            f"{r['median_s']*1e3:7.1f}ms {r['min_s']*1e3:6.1f}ms {r['max_s']*1e3:6.1f}ms "
            f"{r['mb_per_s']:7.0f} "
            f"{_cell((r.get('speedup_per_round') or {}).get('median'), '6.2f', 'x')}"
            f"{_spread(r.get('speedup_per_round'))} "
            f"{_cell(r.get('x_limit'), '6.2f', 'x')} {_cell(r['cold_s'], '6.1f', 'ms', 1e3)} "
            f"{_cell(r['first_completion_s'], '7.0f', 'ms', 1e3)} "
            f"{_cell(r.get('attributed') if r['engine'] != 'raw' else None, '5.0f', '%', 100)}"
            f"  {ph}")
    text = "\n".join(lines)
    print(text)
    return text


def plot(result: dict, path: Path) -> None:
    """One panel per engine: each transport's median (solid) and its limit (dotted, same
    colour) against the adapter size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["summary"]
    engines = sorted({r["engine"] for r in rows} - {"raw"})
    fig, axes = plt.subplots(1, max(1, len(engines)), figsize=(6 * max(1, len(engines)), 4.2),
                             sharey=True, squeeze=False)
    colors = dict(zip(TRANSPORTS, ("tab:purple", "tab:brown", "tab:blue", "tab:green",
                                   "tab:red")))
    for ax, engine in zip(axes[0], engines):
        for transport in TRANSPORTS:
            mine = sorted((r for r in rows if (r["engine"], r["transport"]) == (engine, transport)),
                          key=lambda r: r["mb"])
            if not mine:
                continue
            ax.plot([r["mb"] for r in mine], [r["median_s"] * 1e3 for r in mine], "-o",
                    color=colors[transport], label=transport)
            limited = [r for r in mine if "limit_s" in r]
            if limited:
                ax.plot([r["mb"] for r in limited], [r["limit_s"] * 1e3 for r in limited], ":",
                        color=colors[transport], label=f"{transport} limit")
        ax.set(xlabel="adapter size (MB)", title=engine, xscale="log", yscale="log")
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("sync latency (ms, median)")
    fig.suptitle("LoRA sync latency vs adapter size (dotted: the transport's limit)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, rank 8, 3 repetitions")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64, 128])
    p.add_argument("--reps", type=int, default=10, help="interleaved rounds (default 10)")
    p.add_argument("--engines", nargs="+", default=["vllm", "sglang"],
                   help="servers to start, one after the other")
    p.add_argument("--server-url", help="an already running lora-sync server instead")
    p.add_argument("--server-engine", default="vllm", help="the engine of --server-url")
    p.add_argument("--model-dir", help="the model that server runs")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--soak", type=int, default=200,
                   help="pushes at the largest rank with the server's RSS sampled (default "
                        "200; 0: none)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args()
    scratch = Path(tempfile.gettempdir()) / "lora-sync-bench-models"
    if a.quick:
        ranks, reps, dtype = [8], 3, "float32"
        model_dir = Path(a.model_dir) if a.model_dir else build_tiny_model(scratch / "tiny")
    else:
        ranks, reps, dtype = a.ranks, a.reps, "bfloat16"
        model_dir = Path(a.model_dir) if a.model_dir else build_tiny_model(
            scratch / "qwen05b-shapes", dtype="bfloat16", **QWEN_05B_SHAPES)
    servers = [(a.server_engine, a.server_url)] if a.server_url else a.engines
    soak_pushes = min(a.soak, 30) if a.quick else a.soak
    result = run(model_dir, ranks, reps, servers, Path(a.out), dtype, a.progress,
                 soak_pushes=soak_pushes)
    text = print_table(result["summary"]) + "\n" + goals_report(result["summary"])
    for m in result["memory"]:
        line = (f"{m['engine']} server RSS over {m['pushes']} pushes at rank {m['rank']}: "
                f"{m['first_mb']:.0f} MB after 10, {m['last_mb']:.0f} MB at the end, max "
                f"{m['max_mb']:.0f} MB ({m['mb_per_100_pushes']:+.1f} MB per 100 pushes)")
        print(line)
        text += "\n" + line
    q = result["quiet"]
    note = (f"shmem huge pages: {result['machine']['shmem_thp']}; "
            f"machine {'quiet' if q['quiet'] else 'NOT quiet'}: load average "
            f"{q['loadavg_before'][0]:.2f} before, {q['loadavg_after'][0]:.2f} after (its own "
            f"load included); other processes used {q['other_processes_cores']:.3f} cores, "
            f"the host took {q['steal_cores']:.3f}; "
            f"{len(q['other_servers'])} other inference server(s) running")
    print(note)
    (Path(a.out) / "table.txt").write_text(text + "\n" + note + "\n")
    print(f"\nraw samples: {a.out}/results.json  plot: {a.out}/results.png")


if __name__ == "__main__":
    main()
