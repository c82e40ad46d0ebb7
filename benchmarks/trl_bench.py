"""TRL's own adapter sync (disk + pause) against lora-sync's, in one run on one vLLM server.

    python -m benchmarks.trl_bench                 # 16 steps each, about 80 s on 2 cores
    python -m benchmarks.trl_bench --steps 8       # quicker

One vLLM CPU server (our launcher, the tiny local model) with what TRL 1.16's adapter sync
needs switched on: VLLM_ALLOW_RUNTIME_LORA_UPDATING (its /v1/load_lora_adapter and unload)
and VLLM_SERVER_DEV_MODE (its /server_info probe, /pause and /resume). The same short
AsyncGRPO training (same seed, data, LoRA, steps) then runs twice, one after the other:

  trl        TRL's own trl.experimental.async_grpo.AsyncGRPOTrainer: each sync pauses vLLM,
             saves the adapter under <output_dir>/.vllm_lora/, loads it by path, resumes;
  lora-sync  lora_sync.integrations.trl.AsyncGRPOTrainer: each sync pushes the adapter from
             memory (shm on this host), no pause, nothing on disk.

Both trainers, their rollout workers and their syncs talk to the server through one
recording proxy (a separate process; every request's path, model, start, end and status).
It also makes TRL's own sync possible on a lora-sync server, which reserves every
`<name>-v<N>` name for its own versions and refuses them on vLLM's load route: for the trl
run only, the proxy renames TRL's `trl-policy-v<N>` to `trl-policy-disk-<N>` in load, unload
and completion requests (a name, nothing else), and adds the server's admin key to the load
and unload routes (TRL's client sends none).

Measured per run:
  * sync: wall time of each `_sync_weight` call in the trainer (the cold sync at train begin
    apart), median and min-max;
  * step: TRL's own `perf/step_s` (optimizer step end to the next, sync included), median;
  * paused: the server is paused from TRL's /pause request to its /resume reply (both seen by
    the proxy); every rollout request whose [start, end] overlaps such a window was held by
    it (in flight when the pause came, frozen by vLLM's pause mode "keep"; or sent while
    paused, queued): counted, with the request-seconds spent held. A lora-sync run sends no
    /pause (checked); requests that ran across one of its syncs are counted too, as "ran
    through", with their latency beside the run's median;
  * failed: rollout requests the server answered with an error (or that broke off);
  * bytes: per sync, what the sync moved (trl: the adapter directory it wrote and vLLM read
    back; lora-sync: the bytes pushed), total written under <output_dir>/.vllm_lora and the
    most it held at once;
  * reward: TRL's logged reward of the first and last steps, and the mean of the last 4.
    Each rollout request draws its own random sampling seed in TRL's worker, so the two runs
    see different samples: rewards are comparable in trend, not equal.

Writes runs/trl_bench/results.json (every request, sync and step) and table.md, and prints
the table. Run it under `flock /tmp/lora-sync-server.lock` beside other server users.
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from lora_sync.engines import ENGINES

KINDS = ("trl", "lora-sync")
ADMIN_KEY = "trl-bench-admin-key"
LORA_NAME = "trl-policy"  # TRL's adapter name (`_lora_name`), and lora-sync's default for it
NATIVE_ROUTES = (ENGINES["vllm"].native_load, ENGINES["vllm"].native_unload)  # TRL: vLLM
COMPLETIONS = "/v1/completions"
_VERSIONED = re.compile(r"(?P<name>.+)-v(?P<version>[0-9]+)")


# -- the recording proxy (its own process: its threads never compete with the trainer's) ---
def disk_name(name):
    """TRL's `trl-policy-v3` as the trl run loads it: `trl-policy-disk-3` (lora-sync
    reserves every `-v<N>` name for its own versions)."""
    m = _VERSIONED.fullmatch(name) if isinstance(name, str) else None
    return f"{m['name']}-disk-{m['version']}" if m else name


def _proxy_main(upstream: str, rename: bool, api_key: str | None, conn) -> None:
    up = urlsplit(upstream)
    events: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _upstream(self, fresh=False):
            if fresh or getattr(self, "_conn", None) is None:
                self._conn = http.client.HTTPConnection(up.hostname, up.port, timeout=600)
            return self._conn

        def _forward(self):
            t0 = time.time()
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.split("?")[0]
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("host", "connection", "content-length")}
            model = None
            if path == COMPLETIONS or path in NATIVE_ROUTES:
                try:
                    request = json.loads(body)
                except ValueError:
                    request = None
                if isinstance(request, dict):
                    field = "model" if path == COMPLETIONS else "lora_name"
                    model = request.get(field)
                    if rename and isinstance(model, str):
                        request[field] = disk_name(model)
                        body = json.dumps(request).encode()
            if api_key and path in NATIVE_ROUTES and "authorization" not in \
                    {k.lower() for k in headers}:
                headers["Authorization"] = f"Bearer {api_key}"
            status, data, reply_headers = 599, b"", []
            for attempt in range(2):  # a kept-alive upstream connection may have closed
                try:
                    c = self._upstream(fresh=attempt > 0)
                    c.request(self.command, self.path, body=body or None, headers=headers)
                    reply = c.getresponse()
                    status, data, reply_headers = reply.status, reply.read(), reply.getheaders()
                    break
                except (OSError, http.client.HTTPException):
                    self._conn = None
            sent = True
            try:
                self.send_response(status)
                for k, v in reply_headers:
                    if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                         "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                sent = False  # the client stopped waiting (a rollout worker shutting down)
            events.append({"method": self.command, "path": path, "model": model,
                           "t0": t0, "t1": time.time(), "status": status, "sent": sent})

        do_GET = do_POST = do_DELETE = _forward

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    conn.send(httpd.server_address[1])
    conn.recv()  # stop
    httpd.shutdown()
    conn.send(list(events))


class RecordingProxy:
    """Forwards everything to `upstream` from a child process; `stop()` returns its events."""

    def __init__(self, upstream: str, rename: bool = False, api_key: str | None = None):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_proxy_main, args=(upstream, rename, api_key, child),
                                 daemon=True)
        self._proc.start()
        self.url = f"http://127.0.0.1:{self._conn.recv()}"

    def stop(self) -> list[dict]:
        self._conn.send("stop")
        events = self._conn.recv()
        self._proc.join(10)
        return events


# -- the summary (pure functions: tests/test_trl.py checks them) ----------------------------
def _median(xs):
    return statistics.median(xs) if xs else None


def pause_windows(events: list[dict]) -> list[tuple[float, float]]:
    """(start of /pause, end of the next /resume) for every pause the proxy saw."""
    windows, start = [], None
    for e in sorted(events, key=lambda e: e["t0"]):
        if e["path"] == "/pause":
            start = e["t0"] if start is None else start
        elif e["path"] == "/resume" and start is not None:
            windows.append((start, e["t1"]))
            start = None
    return windows


def overlapping(requests: list[dict], windows: list[tuple[float, float]]) -> dict:
    """The requests whose [t0, t1] overlaps a window: how many, of those how many were in
    flight when a window opened and how many were sent inside one (the rest), and the
    request-seconds spent inside windows (for pauses: the time requests were held)."""
    hit, in_flight, arrived, inside = [], 0, 0, 0.0
    for r in requests:
        spans = [(a, b) for a, b in windows if r["t0"] < b and r["t1"] > a]
        if not spans:
            continue
        hit.append(r)
        was_running = any(r["t0"] < a for a, _ in spans)
        in_flight += was_running
        arrived += not was_running
        inside += sum(min(r["t1"], b) - max(r["t0"], a) for a, b in spans)
    return {"requests": len(hit), "in_flight_at_start": in_flight,
            "sent_inside": arrived, "request_s_inside": inside,
            "latency_median_s": _median([r["t1"] - r["t0"] for r in hit])}


def summarize_run(kind: str, syncs: list[dict], events: list[dict], log_history: list[dict],
                  disk: dict) -> dict:
    """One row of the table from a run's syncs (trainer side), proxy events and TRL's log."""
    rollouts = [e for e in events if e["path"] == COMPLETIONS]
    windows = pause_windows(events)
    sync_windows = [(s["t0"], s["t1"]) for s in syncs]
    steady = [s["seconds"] for s in syncs[1:]] or [s["seconds"] for s in syncs]
    steps = [h["perf/step_s"] for h in log_history if "perf/step_s" in h]
    waits = [h["perf/rollout_wait_s"] for h in log_history if "perf/rollout_wait_s" in h]
    rewards = [h["reward"] for h in log_history if "reward" in h]
    per_sync = [s["bytes"] for s in syncs]
    return {
        "kind": kind, "syncs": len(syncs),
        "sync_cold_s": syncs[0]["seconds"] if syncs else None,
        "sync_median_s": _median(steady), "sync_min_s": min(steady, default=None),
        "sync_max_s": max(steady, default=None),
        "step_median_s": _median(steps), "rollout_wait_median_s": _median(waits),
        "pauses": len(windows),
        "paused_total_s": sum(b - a for a, b in windows),
        "paused_median_s": _median([b - a for a, b in windows]),
        "held": overlapping(rollouts, windows),
        "through_syncs": overlapping(rollouts, sync_windows),
        "rollout_requests": len(rollouts),
        "rollout_latency_median_s": _median([r["t1"] - r["t0"] for r in rollouts]),
        "failed_requests": sum(r["status"] != 200 for r in rollouts),
        "bytes_per_sync": _median(per_sync),
        "bytes_moved_total": sum(per_sync),
        "disk_written_bytes": disk["written"], "disk_peak_bytes": disk["peak"],
        "disk_left_bytes": disk["left"],
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_last4_mean": statistics.fmean(rewards[-4:]) if rewards else None,
    }


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.0f} ms"


HOW = {"trl": "written to disk, read back by vLLM", "lora-sync": "pushed from memory"}


def table(rows: list[dict]) -> str:
    """Markdown table, one column per run."""
    def cell(r, what):
        h, t = r["held"], r["through_syncs"]
        return {
            "sync wall time, median [min-max]":
                f"{_ms(r['sync_median_s'])} [{_ms(r['sync_min_s'])}-{_ms(r['sync_max_s'])}]",
            "first (cold) sync": _ms(r["sync_cold_s"]),
            "trainer step time, median": _ms(r["step_median_s"]),
            "server paused (syncs x median, total)":
                f"{r['pauses']} x {_ms(r['paused_median_s'])}, "
                f"{r['paused_total_s'] * 1e3:.0f} ms" if r["pauses"] else "never",
            "rollout requests paused (in flight / sent while paused)":
                f"{h['requests']} ({h['in_flight_at_start']} / {h['sent_inside']}), "
                f"{h['request_s_inside']:.1f} request-s held" if r["pauses"] else "0",
            "requests running through a sync (latency median)":
                f"{t['requests']} ({_ms(t['latency_median_s'])})",
            "rollout requests, latency median": f"{r['rollout_requests']}, "
                                                f"{_ms(r['rollout_latency_median_s'])}",
            "failed rollout requests": str(r["failed_requests"]),
            "bytes per sync": f"{r['bytes_per_sync'] / 1e3:.0f} kB ({HOW[r['kind']]})",
            "disk: written / most held / left": f"{r['disk_written_bytes'] / 1e6:.2f} MB / "
                                                f"{r['disk_peak_bytes'] / 1e6:.2f} MB / "
                                                f"{r['disk_left_bytes'] / 1e6:.2f} MB",
            "reward first -> last (mean of last 4)":
                f"{r['reward_first']:.2f} -> {r['reward_last']:.2f} ({r['reward_last4_mean']:.2f})",
        }[what]
    whats = ["sync wall time, median [min-max]", "first (cold) sync",
             "trainer step time, median", "server paused (syncs x median, total)",
             "rollout requests paused (in flight / sent while paused)",
             "requests running through a sync (latency median)",
             "rollout requests, latency median", "failed rollout requests", "bytes per sync",
             "disk: written / most held / left", "reward first -> last (mean of last 4)"]
    names = {"trl": "TRL 1.16 own adapter sync (disk + pause)",
             "lora-sync": "lora-sync integration"}
    lines = ["| | " + " | ".join(names[r["kind"]] for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    lines += [f"| {w} | " + " | ".join(cell(r, w) for r in rows) + " |" for w in whats]
    return "\n".join(lines)


# -- the runs -------------------------------------------------------------------------------
def _tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (TRL renames and removes them as this walks)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def bench_class(base):
    """`base` (either trainer) timing each weight sync, and what it moved and left on disk."""
    class Bench(base):
        def _sync_weight(self):
            t0, p0 = time.time(), time.perf_counter()
            super()._sync_weight()
            seconds, t1 = time.perf_counter() - p0, time.time()
            lora_dir = Path(self.args.output_dir) / ".vllm_lora"
            pushes = getattr(self, "lora_sync_pushes", None)
            moved = pushes[-1][0].bytes if pushes else _tree_bytes(
                lora_dir / f"{LORA_NAME}-v{self.model_version}")
            self.bench_syncs.append({"t0": t0, "t1": t1, "seconds": seconds,
                                     "version": self.model_version, "bytes": moved,
                                     "transport": pushes[-1][0].transport if pushes else "disk",
                                     "disk_bytes": _tree_bytes(lora_dir)})
    return Bench


class StepPrinter:
    def __new__(cls, kind: str, steps: int):
        from transformers import TrainerCallback

        class _Printer(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    print(f"  [{kind}] step {state.global_step}/{steps}: reward "
                          f"{logs['reward']:.2f}, step {logs.get('perf/step_s', 0):.2f} s, "
                          f"sync {logs.get('perf/weight_sync_s', 0) * 1e3:.0f} ms", flush=True)
        return _Printer()


class MergedFallback(RuntimeError):
    """TRL's probe of the server chose merged full weights (NCCL) over its adapter sync."""


def train(kind: str, model_dir: str, url: str, out_dir: Path, steps: int, seed: int,
          api_key: str | None) -> tuple[list[dict], list[dict], dict]:
    """One AsyncGRPO training against `url`; returns (syncs, log history, disk use)."""
    import torch
    from transformers.trainer_callback import PrinterCallback
    from trl.experimental.async_grpo import AsyncGRPOTrainer as TRLAsyncGRPOTrainer

    from examples.trl_async_grpo import trainer_arguments
    from lora_sync.integrations.trl import AsyncGRPOTrainer as LoRASyncAsyncGRPOTrainer
    from testbed import trl_cpu
    if not torch.cuda.is_available():
        trl_cpu.patch()
    shutil.rmtree(out_dir, ignore_errors=True)
    # The example's settings, the same for both runs.
    kwargs = trainer_arguments(model_dir, url, steps, str(out_dir), seed)
    if kind == "trl":
        trainer = bench_class(TRLAsyncGRPOTrainer)(**kwargs)
        if not trainer._lora_sync:  # TRL fell back to merged weights (its warning says why)
            raise MergedFallback("TRL 1.16 picked its merged-weight sync, not its adapter sync "
                                 "(with --data-parallel-size > 1 it always does)")
    else:
        trainer = bench_class(LoRASyncAsyncGRPOTrainer)(**kwargs, lora_sync_api_key=api_key)
    trainer.bench_syncs = []
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepPrinter(kind, steps))
    peak = 0

    def watch_disk():  # the most .vllm_lora held at once (TRL removes old versions itself)
        nonlocal peak
        while not done.wait(0.05):
            peak = max(peak, _tree_bytes(out_dir / ".vllm_lora"))
    done = threading.Event()
    watcher = threading.Thread(target=watch_disk, daemon=True)
    watcher.start()
    try:
        trainer.train()
    finally:
        done.set()
        watcher.join()
        if getattr(trainer, "lora_sync_client", None) is not None:
            trainer.lora_sync_client.close()
    left = _tree_bytes(out_dir / ".vllm_lora")
    peak = max([peak, left, *(s["disk_bytes"] for s in trainer.bench_syncs)])
    written = sum(s["bytes"] for s in trainer.bench_syncs) if kind == "trl" else left
    return trainer.bench_syncs, trainer.state.log_history, {"written": written, "peak": peak,
                                                             "left": left}


def warm_up(server_url: str, model_dir: str, api_key: str, scratch: Path) -> None:
    """Both sync paths and LoRA generation once, so neither run pays the server's first
    LoRA request (and the first disk load) alone."""
    from lora_sync import LoRAAdapter, LoRASyncClient
    from testbed.tiny_model import make_lora
    peft_model = make_lora(model_dir, rank=8)
    peft_model.save_pretrained(scratch / "warm")
    with LoRASyncClient(server_url, api_key=api_key) as client:
        client.load_from_disk(str(scratch / "warm"), "warmup-disk")
        client.complete("the quick brown", "warmup-disk", max_tokens=8)
        client.unload_from_disk("warmup-disk")
        client.push(LoRAAdapter.from_peft_model(peft_model), "warmup")
        client.complete("the quick brown", "warmup", max_tokens=8)
        client.retire("warmup")


def clean_server(server_url: str, api_key: str, kind: str) -> None:
    """What a run left loaded: TRL's last disk versions, lora-sync's name."""
    from lora_sync import LoRASyncClient
    with LoRASyncClient(server_url, api_key=api_key) as client:
        if kind == "lora-sync":
            client.retire(LORA_NAME)
            return
        models = json.loads(urllib_get(f"{server_url}/v1/models"))["data"]
        for m in models:
            if m["id"].startswith(f"{LORA_NAME}-disk-"):
                client.unload_from_disk(m["id"])


def urllib_get(url: str) -> bytes:
    import urllib.request
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def run(model_dir: Path, steps: int, seed: int, order: list[str], out: Path,
        data_parallel: int = 1) -> dict:
    import torch

    from testbed.processes import vllm_server

    from .sync_bench import _process_tree, machine, other_servers, quiet_report
    torch.set_num_threads(1)  # two cores: one for the trainer, one for the server
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="trl-bench-"))
    load_before = os.getloadavg()
    env = {"VLLM_SERVER_DEV_MODE": "1",            # TRL's /server_info, /pause, /resume
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # TRL's /v1/load_lora_adapter
           "LORA_SYNC_API_KEY": ADMIN_KEY}
    # TRL wants max_loras >= max_staleness + 2 (3 here); lora-sync keeps 2 versions.
    extra = ["--data-parallel-size", str(data_parallel)] if data_parallel > 1 else []
    server = vllm_server(model_dir, max_loras=4, max_cpu_loras=8, env=env, extra_args=extra)
    runs, notes, t_start = [], [], time.time()
    print("starting the vLLM CPU server (about a minute)...", flush=True)
    with server:
        others = other_servers(_process_tree(server.proc.pid) | {os.getpid()})
        warm_up(server.url, str(model_dir), ADMIN_KEY, scratch)
        for kind in order:
            print(f"{kind}: {steps} AsyncGRPO steps", flush=True)
            proxy = RecordingProxy(server.url, rename=kind == "trl", api_key=ADMIN_KEY)
            t0 = time.perf_counter()
            try:
                syncs, history, disk = train(kind, str(model_dir), proxy.url,
                                             out / f"{kind}-output", steps, seed, ADMIN_KEY)
            except MergedFallback as e:
                print(f"{kind}: not run: {e}", flush=True)
                notes.append(f"{kind}: not run: {e}")
                continue
            finally:
                events = proxy.stop()
            wall = time.perf_counter() - t0
            clean_server(server.url, ADMIN_KEY, kind)
            row = summarize_run(kind, syncs, events, history, disk)
            row["train_wall_s"] = wall
            if kind == "lora-sync":
                assert row["pauses"] == 0, "lora-sync paused the server"
            runs.append({"kind": kind, "summary": row, "syncs": syncs, "events": events,
                         "log_history": history})
            shutil.rmtree(out / f"{kind}-output", ignore_errors=True)
        server_alive = server.alive()
    shutil.rmtree(scratch, ignore_errors=True)
    result = {"machine": machine(), "model": str(model_dir), "steps": steps, "seed": seed,
              "order": order, "data_parallel_size": data_parallel, "notes": notes,
              "server_alive_at_end": server_alive,
              "wall_s": time.time() - t_start,
              "quiet": quiet_report(load_before, os.getloadavg(), others),
              "summary": [r["summary"] for r in runs], "runs": runs}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per run (16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", nargs="+", default=list(KINDS), choices=KINDS,
                   help="runs, one after the other (default: trl lora-sync)")
    p.add_argument("--model-dir", help="a model (default: build the tiny model)")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="the server's vLLM replicas (TRL's own sync then falls back to merged "
                        "weights and is not run)")
    p.add_argument("--out", default="runs/trl_bench")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing comes from the Hub
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from testbed.tiny_model import build_tiny_model
    model_dir = Path(a.model_dir) if a.model_dir else build_tiny_model(
        Path(tempfile.gettempdir()) / "lora-sync-bench-models" / "tiny")
    result = run(model_dir, a.steps, a.seed, a.order, Path(a.out), a.data_parallel_size)
    text = table(result["summary"])
    q, m = result["quiet"], result["machine"]
    note = (f"{a.steps} steps per run, seed {a.seed}, order {' then '.join(a.order)}, "
            f"{a.data_parallel_size} vLLM replica(s); {m['cores']} cores, torch {m['torch']}, "
            f"vLLM {m['vllm']}; load average {q['loadavg_before'][0]:.2f} before (after: "
            f"{q['loadavg_after'][0]:.2f}, the benchmark's own load included); "
            f"{len(q['other_servers'])} other inference server(s) running; "
            f"{result['wall_s']:.0f} s in all")
    note += "".join(f"\n{n}" for n in result["notes"])
    print("\n" + text + "\n" + note)
    (Path(a.out) / "table.md").write_text(text + "\n\n" + note + "\n")
    print(f"\nevery request, sync and step: {a.out}/results.json")


if __name__ == "__main__":
    main()
