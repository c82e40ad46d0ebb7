"""A large adapter: 10,000+ tensors and over 1 GB (issue #44, item 3).

    flock /tmp/lora-sync-server.lock .venv/bin/python -m benchmarks.large_adapter_bench
    .venv/bin/python -m benchmarks.large_adapter_bench --only overhead     # in process, ~1 min
    .venv/bin/python -m benchmarks.large_adapter_bench --quick             # 1,008 tensors, 110 MB

The adapter is an all-linear LoRA (rank 64, bf16) of a dense Llama with many thin layers:
720 layers x 7 projections x (lora_A, lora_B) = 10,080 tensors, 1.11 GB. Each layer has 11
small tensors (8-16 KiB: attention, the MLP's hidden-side halves) and 3 large ones (448 KiB:
the MLP's intermediate-side halves, intermediate size 3584): many small tensors per block
plus a few large ones, as an MoE's per-expert pairs and attention are (lora_sync.moe sends
expert LoRA as 2-D pairs too, so the per-tensor costs are the same).

What it measures, written to runs/large_adapter/ (results.json, table.txt):

1. Per-tensor overhead, in process (`--only overhead`): each step of lora-sync's own code
   that walks the tensor list, at ~1,000 / 10,000 / 100,000 tensors of a small-shaped
   adapter (the bytes barely matter there), in microseconds per tensor: the trainer's
   adapter value (PEFT-key parse, sibling order), the header layout (cold and cached),
   the encode into byte views, the header parse (cold, and again: cached),
   check_adapter, the view of the tensors in place, and the broadcast declaration
   (TensorSpec.from_json, layout digest, bucket plan).
2. The limits on the way: each constant's value against what the 10,080-tensor adapter
   and a 100,000-tensor one need (header bytes per tensor x tensors, ...).
3. A hostile header: 100,000 zero-size tensors (and the largest header the parser takes),
   in process and as a POST to the server: the time to a 4xx, never a 5xx.
4. Pushes to a server (`--engine fake`, the default: tests/engine_fakes.FakeEngineServer in
   a process of its own, lora-sync's real routes, admission, service, transports and worker
   dispatcher, on a fake WorkerEngine that knows this model's linear shapes and whose build
   reads one element per tensor): each transport and the engine's own disk route
   (serialise + load), interleaved per round, against a raw memcpy of the same bytes; the
   same bytes in 10x fewer tensors (`--shapes large few`), and the server's RSS over 50 pushes.
   `--engine vllm` runs the same pushes against a real vLLM CPU server on a model of these
   shapes (a 1.0 B-parameter base: about 2 GB in bf16).

Run it alone on the machine (2 cores: any other server skews it), under the lock the
project's servers share.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lora_sync import LoRAAdapter, LoRASyncClient, ModelSpec, check_adapter, http, wire
from lora_sync import adapter as adapter_module
from lora_sync.adapter import MAX_TARGETS
from lora_sync.trainer.fleet import FleetMemory
from lora_sync.transports.base import PROTOCOL_HEADER, PROTOCOL_VERSION

from benchmarks.sync_bench import ENGINES_OWN  # the engine's registration and its own build

REPO = Path(__file__).resolve().parents[1]
API_KEY = "large-adapter-bench-key"
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
               ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
               ("mlp", "down_proj"))
TENSORS_PER_LAYER = 2 * len(PROJECTIONS)
TRANSPORTS = ("disk", "tensors", "shm", "shared", "broadcast")
GOALS = {"shm_vs_disk": 2.0, "shm_x_limit": 2.0}  # issue #44 item 3, at 10,000+ tensors
# The fake server's settings: room for a 1.1 GB adapter (the defaults, 2048 / 4096 MB, fit it
# too: see `limits_report`), no NaN pass (the default), versions kept as by default.
SERVER_ENV = {"LORA_SYNC_API_KEY": API_KEY, "LORA_SYNC_MAX_BODY_MB": "2048",
              "LORA_SYNC_MAX_STAGING_MB": "4096", "LORA_SYNC_KEEP_VERSIONS": "2",
              "LORA_SYNC_CHECK_FINITE": "0", "LORA_SYNC_LEASE_TTL_S": "60",
              "LORA_SYNC_BODY_IDLE_S": "30"}


# -- the adapter's shapes -------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A dense Llama (head_dim = hidden / heads; 32 by default, vLLM's CPU attention refuses
    16) and an all-linear LoRA of it."""
    layers: int = 720
    hidden: int = 128
    intermediate: int = 3584
    heads: int = 4
    kv_heads: int = 2
    rank: int = 64
    dtype: str = "bfloat16"
    first_layer: int = 0  # where its layers start (the fake engine can serve two shapes)

    def hf_config(self) -> dict:
        """testbed.tiny_model.build_tiny_model's overrides (LlamaConfig fields)."""
        return dict(vocab_size=384, hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, max_position_embeddings=512,
                    tie_word_embeddings=False)

    def linear(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every LoRA-able linear layer, keyed as ModelSpec.from_hf_config keys
        them (a test checks the two agree), without building the model: 7,000 layers on
        the meta device take minutes."""
        kv = self.hidden // self.heads * self.kv_heads
        dims = {"q_proj": (self.hidden, self.hidden), "k_proj": (self.hidden, kv),
                "v_proj": (self.hidden, kv), "o_proj": (self.hidden, self.hidden),
                "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate),
                "down_proj": (self.intermediate, self.hidden)}
        return {f"model.layers.{i}.{block}.{proj}": dims[proj]
                for i in range(self.first_layer, self.first_layer + self.layers)
                for block, proj in PROJECTIONS}

    def spec(self, max_rank: int | None = None) -> ModelSpec:
        return ModelSpec(self.linear(), max_rank or self.rank)

    @property
    def tensors(self) -> int:
        return self.layers * TENSORS_PER_LAYER

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    def tensor_sizes(self) -> list[int]:
        """Bytes of each tensor, in the order `adapter` makes them."""
        return [self.itemsize * self.rank * d for fan_in, fan_out in self.linear().values()
                for d in (fan_in, fan_out)]

    @property
    def nbytes(self) -> int:
        per_layer = sum(self.itemsize * self.rank * (i + o)
                        for i, o in list(self.linear().values())[:len(PROJECTIONS)])
        return per_layer * self.layers

    def size_classes(self) -> dict[int, int]:
        """Tensor bytes -> how many tensors have that size (one layer's, times layers)."""
        out: dict[int, int] = {}
        for n in self.tensor_sizes()[:TENSORS_PER_LAYER]:
            out[n] = out.get(n, 0) + self.layers
        return dict(sorted(out.items()))

    def config(self) -> dict:
        return {"r": self.rank, "lora_alpha": 2 * self.rank, "peft_type": "LORA",
                "target_modules": sorted({p for _, p in PROJECTIONS})}

    def adapter(self, seed: int = 0, fill: bool = True, packed: bool = False) -> LoRAAdapter:
        """An all-linear LoRA of these shapes: one tensor of its own per weight (as PEFT's
        state dict has them), random (`fill`) or zeros; `packed`: views of one buffer, back
        to back, as `trainer.pack_parameters` leaves a trainer's parameters."""
        g = torch.Generator().manual_seed(seed)
        dtype, tensors = getattr(torch, self.dtype), {}
        for module, (fan_in, fan_out) in self.linear().items():
            key = f"base_model.model.{module}"
            for half, shape in (("A", (self.rank, fan_in)), ("B", (fan_out, self.rank))):
                t = torch.empty(shape, dtype=torch.float32 if fill else dtype)
                if fill:
                    t = t.normal_(0.0, 0.01, generator=g).to(dtype)
                else:
                    t.zero_()
                tensors[f"{key}.lora_{half}.weight"] = t
        adapter = LoRAAdapter(tensors, self.config())
        if not packed:
            return adapter
        tensors, start = dict(adapter.tensors), 0  # in the order a push sends them
        flat = torch.empty(sum(t.numel() for t in tensors.values()), dtype=dtype)
        for k, t in tensors.items():
            tensors[k] = flat[start:start + t.numel()].view(t.shape).copy_(t)
            start += t.numel()
        return LoRAAdapter(tensors, adapter.config)


def same_bytes(shape: Shape, layers: int) -> Shape:
    """`shape` with `layers` layers and the intermediate size that keeps its bytes exactly:
    the same adapter size in fewer (larger) tensors."""
    fixed, step = _layer_bytes(shape)
    wide = replace(shape, layers=layers,
                   intermediate=(shape.nbytes // layers - fixed) // step)
    if wide.nbytes != shape.nbytes:
        raise ValueError(f"{shape.layers} layers do not fold into {layers} of equal bytes")
    return wide


def near_bytes(shape: Shape, layers: int, multiple: int = 16) -> Shape:
    """`shape` with `layers` layers and the intermediate size (a multiple of `multiple`, as
    the engines' kernels like it) whose bytes come nearest: more tensors than `same_bytes`
    can fold into, since attention's share of a layer stays."""
    fixed, step = _layer_bytes(shape)
    wide = (shape.nbytes / layers - fixed) / step
    return replace(shape, layers=layers, intermediate=round(wide / multiple) * multiple)


def _layer_bytes(shape: Shape) -> tuple[int, int]:
    """One layer's adapter bytes at intermediate size 0, and what each unit of it adds."""
    fixed = replace(shape, layers=1, intermediate=0).nbytes
    return fixed, replace(shape, layers=1, intermediate=1).nbytes - fixed


LARGE = Shape()
# The same bytes in a tenth of the tensors: 72 layers, an 11x wider MLP (intermediate 39,680).
FEW = same_bytes(LARGE, 72)
# Twice the tensors in the same bytes (+0.3%): 1,440 layers, intermediate 1,584.
MANY = near_bytes(LARGE, 1440)
QUICK = replace(LARGE, layers=72)
# The per-tensor scan: small shapes, so 100,000 tensors are 117 MB.
SCAN = Shape(layers=72, hidden=128, intermediate=256, rank=4)
SCAN_COUNTS = (1_000, 10_000, 100_000)


def scan_shape(tensors: int) -> Shape:
    """SCAN with about `tensors` tensors (never above wire.MAX_TENSORS)."""
    return replace(SCAN, layers=max(1, min(tensors, wire.MAX_TENSORS) // TENSORS_PER_LAYER))


# -- 1. per-tensor overhead, in process ------------------------------------------------------
@contextlib.contextmanager
def header_cap(nbytes: int):
    """wire.MAX_HEADER_BYTES raised for a measurement past it (the default refuses a
    100,000-tensor header: `limits_report`)."""
    old = wire.MAX_HEADER_BYTES
    wire.MAX_HEADER_BYTES = max(old, nbytes)
    try:
        yield
    finally:
        wire.MAX_HEADER_BYTES = old


def _best(fn, reps: int) -> float:
    """The fastest of `reps` runs (seconds): the step's own cost, without the machine's
    hiccups, nor a garbage collection of what other code left (the collector is paused)."""
    times = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return min(times)


def per_tensor_overhead(shape: Shape, reps: int = 3) -> dict:
    """Seconds of each step that walks the tensor list, for one adapter of `shape`."""
    from lora_sync import collective
    adapter = shape.adapter(fill=False)
    tensors, config, spec = adapter.tensors, adapter.config, shape.spec()
    meta = adapter.metadata("large", 1)
    header = wire.layout(tensors, meta)[0]
    data = bytearray(shape.nbytes)
    body_len = len(header) + len(data)
    out = {"tensors": len(tensors), "header_bytes": len(header), "bytes": shape.nbytes}

    def cold_layout():
        wire._entries_json.cache_clear()
        wire.layout(tensors, meta)

    def parse_cold():
        wire._KNOWN_ENTRIES.clear()
        return wire.parse_header(header, body_len)

    with header_cap(len(header)):
        out["adapter"] = _best(lambda: LoRAAdapter(dict(tensors), config), reps)
        out["layout_cold"] = _best(cold_layout, reps)
        out["layout_cached"] = _best(lambda: wire.layout(tensors, meta), reps)
        out["encode"] = _best(lambda: wire.encode(tensors, meta), reps)
        out["parse_cold"] = _best(parse_cold, reps)
        parse_cold()  # the next parse of this header finds its entries, if they were kept
        out["parse_again"] = _best(lambda: wire.parse_header(header, body_len), reps)
        out["parse_cached"] = bool(wire._KNOWN_ENTRIES)
        parsed = wire.parse_header(header, body_len)
        def check_cold():
            adapter_module._VERDICTS.clear()
            check_adapter(parsed.specs, config, spec)
        out["check_cold"] = _best(check_cold, reps)
        # the trainer's next push of the same layout: its verdict is kept
        out["check_again"] = _best(lambda: check_adapter(parsed.specs, config, spec), reps)
        buf = bytearray(header) + data

        def view_cold():
            wire._VIEW_PLANS.clear()
            wire.view_tensors(buf, parsed)
        out["view_cold"] = _best(view_cold, reps)
        view_cold()  # the next push of this layout finds its plan
        out["view"] = _best(lambda: wire.view_tensors(buf, parsed), reps)
        decl = [s.to_json() for s in parsed.specs]

        def declaration():
            specs = [wire.TensorSpec.from_json(s) for s in decl]
            collective.Transfer.plan(specs, 1, layout=collective.layout_digest(specs))
        out["broadcast_decl"] = _best(declaration, reps)
        # a worker's views of a broadcast's frames, its layout known (each push plans the
        # transfer from the same specs)
        transfer = collective.Transfer.plan(parsed.specs, 1)
        frames = collective.frame_buffers(transfer, {})
        collective.unpack_frames(transfer, frames)
        out["broadcast_views"] = _best(lambda: collective.unpack_frames(
            collective.Transfer.plan(parsed.specs, 2, layout=transfer.layout), frames), reps)
        # the trainer's last steps of an HTTP push: the body onto a socket, and the copy
        # it keeps for a resync (its layout and buffers known, as from the second push on)
        chunks = wire.encode(tensors, meta)
        with _Sink() as sink:
            out["send"] = _best(lambda: http._send_body(sink.sock, chunks,
                                                        time.monotonic() + 600), reps)
        memory = FleetMemory()

        def snapshot():
            memory.pushed("large", 1, memory.snapshot("large", adapter))
        snapshot()
        out["snapshot"] = _best(snapshot, reps)
    wire._KNOWN_ENTRIES.clear()
    wire._entries_json.cache_clear()
    return out


class _Sink:
    """A local socket whose other end a thread reads and drops."""

    def __enter__(self) -> "_Sink":
        self.sock, self._peer = socket.socketpair()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        return self

    def _drain(self) -> None:
        buf = bytearray(1 << 20)
        while self._peer.recv_into(buf):
            pass

    def __exit__(self, *exc) -> None:
        self.sock.close()
        self._reader.join(timeout=10)
        self._peer.close()


OVERHEAD_STEPS = ("adapter", "layout_cold", "layout_cached", "encode", "send", "snapshot",
                  "parse_cold", "parse_again", "check_cold", "check_again", "view_cold",
                  "view", "broadcast_decl", "broadcast_views")


def peft_read_overhead(layers: int, reps: int = 3) -> dict:
    """Seconds to read the adapter of a PEFT model (an all-linear rank-8 LoRA of a Llama of
    `layers` thin layers: 14 tensors a layer) through PEFT (`LoRAAdapter._through_peft`: its
    get_peft_model_state_dict walks the whole model) and as a push reads it from the second
    push on (`from_peft_model`, from the parameters recorded at the first)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         vocab_size=256)
    model = get_peft_model(LlamaForCausalLM(config),
                           LoraConfig(target_modules="all-linear", r=8))
    tensors = len(LoRAAdapter.from_peft_model(model).tensors)
    return {"tensors": tensors,
            "through_peft": _best(lambda: LoRAAdapter._through_peft(model, "default"), reps),
            "recorded": _best(lambda: LoRAAdapter.from_peft_model(model), reps)}


def us_per_tensor(row: dict) -> dict:
    """Each step of a `per_tensor_overhead` row in microseconds per tensor."""
    return {k: row[k] * 1e6 / row["tensors"] for k in OVERHEAD_STEPS if k in row}


def overhead_table(rows: list[dict]) -> str:
    head = f"{'tensors':>8} {'header':>9}" + "".join(f" {k:>14}" for k in OVERHEAD_STEPS)
    lines = ["per-tensor overhead in process (us per tensor; best of 3)", head, "-" * len(head)]
    for r in rows:
        us = us_per_tensor(r)
        lines.append(f"{r['tensors']:>8} {r['header_bytes'] / 2 ** 20:8.2f}M" +
                     "".join(f" {us[k]:14.2f}" for k in OVERHEAD_STEPS) +
                     ("" if r.get("parse_cached") else "   (header past the parse cache)"))
    return "\n".join(lines)


# -- 2. the limits ---------------------------------------------------------------------------
def header_bytes_per_tensor(shape: Shape) -> float:
    return (len(wire.layout(shape.adapter(fill=False).tensors, {"lora_name": "x"})[0]) - 8) \
        / shape.tensors


def limits_report(shapes: dict[str, Shape]) -> list[dict]:
    """Each limit a large adapter meets: its value, what each shape needs, fits or not."""
    from lora_sync.server.settings import Settings
    defaults, rows = Settings(), []
    for label, shape in shapes.items():
        hdr = header_bytes_per_tensor(shape) * shape.tensors + 8
        need = {
            "wire.MAX_HEADER_BYTES": (hdr, wire.MAX_HEADER_BYTES),
            "wire.MAX_TENSORS": (shape.tensors, wire.MAX_TENSORS),
            "adapter.MAX_TARGETS (target_modules as full names)":
                (shape.tensors // 2, MAX_TARGETS),
            "LORA_SYNC_MAX_BODY_MB": (hdr + shape.nbytes, defaults.max_body_bytes),
            # a push in flight and the lease the client readies for the next one
            "LORA_SYNC_MAX_STAGING_MB": (2 * (hdr + shape.nbytes), defaults.max_staging_bytes),
            "LORA_SYNC_MAX_REQUEST_MB (broadcast declaration)":
                (shape.tensors * (header_bytes_per_tensor(shape) - 20),
                 defaults.max_request_bytes),
        }
        for limit, (needed, value) in need.items():
            rows.append({"shape": label, "tensors": shape.tensors, "limit": limit,
                         "needs": int(needed), "value": int(value), "fits": needed <= value})
    return rows


def limits_table(rows: list[dict]) -> str:
    lines = ["limits on the way (needs vs value)"]
    for r in rows:
        lines.append(f"  {r['shape']:>10} ({r['tensors']:>6} tensors)  {r['limit']:<52} needs "
                     f"{r['needs']:>13,}  limit {r['value']:>13,}  "
                     f"{'ok' if r['fits'] else 'BLOCKS'}")
    return "\n".join(lines)


# -- 3. hostile headers ----------------------------------------------------------------------
def hostile_header(kind: str, n: int = 100_000, shape: Shape | None = None) -> bytes:
    """A safetensors file with no data: `n` zero-size tensors. `junk`: names that are no
    PEFT key (refused at the first name, after every entry is parsed and checked); `peft`:
    first every tensor name of `shape`'s adapter (default LARGE), 2-D, shape [0, 0], so
    check_adapter walks all of them, then PEFT keys of modules no model has; `widest`: as
    many 5-character names as fit the header cap (refused by count, after the JSON parse)."""
    shape = shape or LARGE
    meta = {"lora_name": "hostile", "adapter_config": json.dumps(shape.config())}
    zero = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    if kind == "widest":
        entry = len(json.dumps({"xxxxx": zero}, separators=(",", ":"))) - 1
        room = wire.MAX_HEADER_BYTES - len(json.dumps({"__metadata__": meta})) - 16
        entries = {f"{i:05x}": zero for i in range(room // entry)}
    elif kind == "junk":
        entries = {f"t{i:06d}": zero for i in range(n)}
    elif kind == "peft":
        zero2 = {**zero, "shape": [0, 0]}
        valid = [f"base_model.model.{m}.lora_{h}.weight"
                 for m in shape.linear() for h in "AB"][:n]
        entries = {name: zero2 for name in valid}
        entries.update({f"x{i:x}.lora_{'AB'[i % 2]}.weight": zero2
                        for i in range(n - len(valid))})
    else:
        raise ValueError(kind)
    raw = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def hostile_in_process(body: bytes, spec: ModelSpec) -> dict:
    """The API process's steps on a hostile body: parse, then check_adapter."""
    from lora_sync.errors import LoRASyncError
    wire._KNOWN_ENTRIES.clear()
    t0 = time.perf_counter()
    outcome = "accepted"
    try:
        h = wire.parse_header(memoryview(body))
        cfg = json.loads(h.metadata["adapter_config"])
        check_adapter(h.specs, cfg, spec)
    except LoRASyncError as e:
        outcome = f"{e.status} {e.code}"
    wire._KNOWN_ENTRIES.clear()
    return {"bytes": len(body), "seconds": time.perf_counter() - t0, "outcome": outcome}


def post_body(url: str, path: str, body: bytes, timeout: float = 120) -> tuple[int, str, float]:
    """(status, error code, seconds) of one raw POST of `body` to a push route."""
    req = urllib.request.Request(url + path, data=body, method="POST", headers={
        "Authorization": f"Bearer {API_KEY}", PROTOCOL_HEADER: str(PROTOCOL_VERSION),
        "Content-Type": "application/octet-stream"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    seconds = time.perf_counter() - t0
    try:
        code = json.loads(raw).get("error", {}).get("code", "")
    except (ValueError, AttributeError):
        code = raw[:80].decode(errors="replace")
    return status, str(code), seconds


# -- 4. pushes to a server ---------------------------------------------------------------------
def serve_fake(shapes: list[Shape], port: int, max_rank: int) -> int:
    """The fake-engine server of this benchmark, in this process, until SIGTERM: lora-sync's
    real routes, admission, service, transports and worker dispatcher (FakeEngineServer) on
    a fake engine that knows `shape`'s linear layers. Its build reads one element per tensor
    (benchmarks/fleet_server._light_build) and so does its disk route's registration, which
    otherwise reads the file as an engine does (LoRAAdapter.from_dir: safetensors load_file)
    and runs check_adapter: hashing 1 GB (the fake's default) would measure sha256."""
    torch.set_num_threads(1)
    from unittest import mock

    from benchmarks.fleet_server import _light_build, light_digest, serve_until_signalled
    from lora_sync.server.settings import Settings
    from tests.engine_fakes import FakeEngineServer
    env = {k: v for k, v in os.environ.items() if k.startswith("LORA_SYNC_")}
    with mock.patch.dict(os.environ, env, clear=True):
        settings = Settings.from_env()
    server = FakeEngineServer(settings, port=port)
    spec = ModelSpec({k: v for shape in shapes for k, v in shape.linear().items()}, max_rank)

    async def model_spec():
        return spec
    bridge = server.bridge
    bridge.model_spec, bridge.max_rank = model_spec, max_rank
    bridge.freezes_heap = True  # a process of its own, standing for an engine's
    for w in bridge.workers:
        w.engine.build = _light_build(w.engine)
        w.engine.freezes_heap = True
    bridge.disk_weights = light_digest
    return serve_until_signalled(server)


class FakeServer:
    """`serve_fake` in a child process (started with SERVER_ENV and `env` on top)."""
    engine = "vllm"  # routes under /v1

    def __init__(self, shapes: list[Shape], max_rank: int, env: dict | None = None):
        from lora_sync.collective import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.large_adapter_bench", "--serve-fake",
             str(self.port), "--fake-shapes", json.dumps([asdict(s) for s in shapes]),
             "--rank", str(max_rank)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, **SERVER_ENV, **(env or {}), "PYTHONPATH": str(REPO),
                 "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.stop()
            raise RuntimeError(f"the fake server did not start: {line!r}")

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


MODELS = Path(tempfile.gettempdir()) / "lora-sync-bench-models"  # as sync_bench keeps them


def start_vllm(shape: Shape):
    """A real vLLM CPU server on a model of `shape` (random weights, built once, kept in
    MODELS: 1.0 B parameters, 2 GB in bf16)."""
    from testbed.processes import vllm_server
    from testbed.tiny_model import build_tiny_model
    model_dir = build_tiny_model(MODELS / f"llama-{shape.layers}x{shape.hidden}x"
                                 f"{shape.intermediate}", dtype=shape.dtype, **shape.hf_config())
    env = {k: v for k, v in SERVER_ENV.items()}
    # eager: torch.compile of 720 layers would take most of an hour on 2 cores; the forward
    # is not what is measured
    server = vllm_server(model_dir, max_lora_rank=shape.rank, max_loras=1, max_cpu_loras=3,
                         dtype=shape.dtype, env=env, extra_args=["--enforce-eager"])
    server.start_timeout = 1800
    return server.start()


def start_sglang(shape: Shape):
    """A real SGLang CPU server on the model `start_vllm` uses, in the model's dtype, with
    room for two of these adapters in its LoRA pool (its default, 8, would hold 9 GB)."""
    from benchmarks.sync_bench import start_server
    from testbed.tiny_model import build_tiny_model
    model_dir = build_tiny_model(MODELS / f"llama-{shape.layers}x{shape.hidden}x"
                                 f"{shape.intermediate}", dtype=shape.dtype, **shape.hf_config())
    return start_server("sglang", model_dir, shape.rank, shape.dtype, env=SERVER_ENV,
                        extra_args=["--max-loras-per-batch", "2"], start_timeout=1800)


STARTS = {"vllm": start_vllm, "sglang": start_sglang}


def push_rounds(client, shape: Shape, adapter: LoRAAdapter, engine: str, reps: int,
                warmup: int, idle_s: float, scratch: Path, transports=TRANSPORTS,
                label: str = "") -> list[dict]:
    """Every transport once per round (interleaved), `warmup` rounds recorded as cold."""
    from benchmarks.sync_bench import sync_once
    samples = []
    for rep in range(-warmup + 1, reps + 1):
        for transport in transports:
            time.sleep(idle_s)
            served, phases = sync_once(client, transport, adapter, f"big{label}", scratch)
            if transport == "disk":
                client.unload_from_disk(served)
            samples.append({"engine": engine, "transport": transport, "rank": shape.tensors,
                            "bytes": adapter.nbytes, "rep": rep, "cold": rep <= 0,
                            "phases": phases, "label": label})
            print(f"  {label or 'large'} round {rep} {transport}: "
                  f"{phases['total'] * 1e3:.0f} ms", flush=True)
    return samples


def memcpy_samples(shape: Shape, nbytes: int, reps: int, engine: str = "raw") -> list[dict]:
    from benchmarks import limits
    return [{"engine": engine, "transport": "memcpy", "rank": shape.tensors, "bytes": nbytes,
             "rep": i + 1, "phases": {"total": t}} for i, t in
            enumerate(limits.memcpy_s(nbytes, reps + 1)[1:])]


def soak(client, server, adapter: LoRAAdapter, pushes: int) -> dict:
    """Server RSS over `pushes` pushes (shm, tensors, broadcast in turn), sampled every 5
    after the first 10 (the retention window full)."""
    from benchmarks.sync_bench import rss_growth
    kinds, rss = ("shm", "tensors", "broadcast"), []
    for i in range(pushes):
        client.push(adapter, "soak", transport=kinds[i % len(kinds)])
        if i >= 9 and (i + 1) % 5 == 0:
            rss.append(server.rss_bytes() / 2 ** 20)
    client.retire("soak")
    return {"pushes": pushes, "rss_mb": rss, "first_mb": rss[0], "last_mb": rss[-1],
            "max_mb": max(rss), "mb_per_100_pushes": rss_growth(rss, pushes)}


def server_overhead(rows: list[dict]) -> list[dict]:
    """The server's phases of each push row in us per tensor and ms per GB."""
    out = []
    for r in rows:
        if r["engine"] == "raw" or r["transport"] == "disk":
            continue
        ph = r["phases_s"]
        out.append({"label": r.get("label", ""), "transport": r["transport"],
                    "tensors": r["rank"], "bytes": r["mb"] * 1e6,
                    **{k: ph.get(k, 0.0) for k in PHASE_KEYS}})
    return out


PHASE_KEYS = ("receive", "intake", "checks", "build", "engine_build", "register",
              "server_other", "client", "total")


def phase_table(rows: list[dict]) -> str:
    lines = ["push phases (median ms, and us per tensor)",
             f"{'transport':10} {'tensors':>7} {'MB':>7}" +
             "".join(f" {k:>17}" for k in PHASE_KEYS)]
    for r in rows:
        cells = "".join(f" {r[k] * 1e3:7.1f} ({r[k] * 1e6 / r['tensors']:6.2f})"
                        for k in PHASE_KEYS)
        lines.append(f"{r['transport']:10} {r['tensors']:>7} {r['bytes'] / 1e6:7.0f}{cells}")
    return "\n".join(lines + per_extra_tensor(rows))


def extra_tensor_cost(fewer: dict, more: dict, extra: int) -> dict:
    """Each phase's difference (seconds) between a push of more tensors and one of fewer, in
    us per extra tensor; `ours`: all of it but the engine's own build and registration."""
    d = {k: (more.get(k, 0.0) - fewer.get(k, 0.0)) * 1e6 / extra for k in PHASE_KEYS}
    d["ours"] = d["total"] - sum(d[k] for k in ENGINES_OWN)
    return d


def per_extra_tensor(rows: list[dict]) -> list[str]:
    """Each transport's cost per tensor: what a push of the same bytes in more tensors costs
    more, over the extra tensors (us), against its fewest-tensor row. `ours`: all of it but
    the engine's own code, its registration and its build of its LoRA object (the bytes
    cost the same in both rows)."""
    lines = []
    for transport in dict.fromkeys(r["transport"] for r in rows):
        mine = sorted((r for r in rows if r["transport"] == transport),
                      key=lambda r: r["tensors"])
        base = mine[0]
        for r in mine[1:]:
            d = extra_tensor_cost(base, r, r["tensors"] - base["tensors"])
            lines.append(f"per extra tensor, {transport} {base['tensors']} -> {r['tensors']}: "
                         f"lora-sync's own {d['ours']:.1f} us (the engine's own: registration "
                         f"{d['register']:.1f}, build {d['engine_build']:.1f}; " +
                         ", ".join(f"{k} {d[k]:.1f}" for k in PHASE_KEYS[:-1]
                                   if k not in ENGINES_OWN) + ")")
    return lines


def goals(rows: list[dict]) -> list[str]:
    """shm >= 2x disk and within 2x of memcpy + the engine's registration, at 10,000+ tensors."""
    lines = []
    for r in rows:
        if r["transport"] != "shm" or r["rank"] < 10_000:
            continue
        ratio = (r.get("speedup_per_round") or {}).get("median", float("nan"))
        lines.append(f"goal shm {r['rank']} tensors ({r['mb']:.0f} MB): >= 2x disk: "
                     f"{ratio:.2f}x ({'met' if ratio >= GOALS['shm_vs_disk'] else 'missed'})")
        if "x_limit" in r:
            lines.append(f"goal shm {r['rank']} tensors: within 2x of memcpy + registration "
                         f"({r['limit_s'] * 1e3:.0f} ms = memcpy "
                         f"{(r['limit_s'] - r['registration_s']) * 1e3:.0f} + engine "
                         f"{r['registration_s'] * 1e3:.0f}): {r['x_limit']:.2f}x "
                         f"({'met' if r['x_limit'] <= GOALS['shm_x_limit'] else 'missed'})")
            # The stricter floor: the engine's own steps alone (its build and registration
            # of this push), without lora-sync's intake that the one above counts in.
            memcpy = r["limit_s"] - r["registration_s"]
            engine = r["phases_s"].get("build", 0.0) + r["phases_s"].get("register", 0.0)
            x = r["median_s"] / (memcpy + engine)
            lines.append(f"goal shm {r['rank']} tensors: within 2x of memcpy + the engine's "
                         f"build and register alone ({(memcpy + engine) * 1e3:.0f} ms): "
                         f"{x:.2f}x ({'met' if x <= GOALS['shm_x_limit'] else 'missed'})")
    return lines


PAIRED_TRANSPORTS = ("shm", "tensors", "shared", "broadcast")
PAIRED_ENV = {"LORA_SYNC_MAX_STAGING_MB": "8192"}  # two names' versions and leases


# The paired measurement is of the cost per tensor: its adapters have the tensor counts of
# LARGE and MANY at a quarter of the bytes (rank 16, 277 MB). At rank 64 one server holds two
# names' versions and leases, and the client their copies, each over a GB: pushes then wait
# on the kernel compacting memory, whatever their tensor count.
PAIRED_RANK = 16


def paired_shapes(shape: Shape = LARGE) -> dict[str, Shape]:
    """`shape` at PAIRED_RANK and its bytes in twice the tensors (as MANY is LARGE's), as the
    layers of one model, the second's after the first's: one fake-engine server takes
    both."""
    shape = replace(shape, rank=PAIRED_RANK)
    many = near_bytes(shape, shape.layers * 2)
    return {"large": shape, "many": replace(many, first_layer=shape.layers)}


def paired_rounds(client, adapters: dict[str, LoRAAdapter], reps: int, warmup: int,
                  idle_s: float, scratch: Path) -> list[dict]:
    """Each transport pushes both adapters to the one server, one after the other (which
    goes first alternates by round): a round's two pushes meet the same server, the same
    load and the same hour. Each is pushed twice and the second counts: the first settles
    what the client and the server keep sized for one adapter (the lease readied ahead,
    the staging file's mapping, a worker's frame buffers), as a trainer's every push after
    its first finds them."""
    from benchmarks.sync_bench import sync_once
    samples = []
    for rep in range(-warmup + 1, reps + 1):
        for transport in PAIRED_TRANSPORTS:
            for label in (list(adapters) if rep % 2 else list(adapters)[::-1]):
                for _settle_first in (True, False):
                    time.sleep(idle_s)
                    _, phases = sync_once(client, transport, adapters[label], label, scratch)
                samples.append({"transport": transport, "label": label, "rep": rep,
                                "tensors": len(adapters[label].tensors), "phases": phases})
            print(f"  paired round {rep} {transport}: " + ", ".join(
                f"{s['label']} {s['phases']['total'] * 1e3:.0f} ms" for s in samples[-2:]),
                flush=True)
    return samples


def paired_per_extra_tensor(samples: list[dict]) -> list[dict]:
    """Per transport, each warm round's difference between the two pushes (more tensors
    less fewer, each phase), over the extra tensors, in us; `ours`: all but the engine's
    own build and registration. Median and [min, max] over the rounds."""
    import statistics
    out = []
    for transport in PAIRED_TRANSPORTS:
        rounds = {}
        for s in samples:
            if s["transport"] == transport and s["rep"] > 0:
                rounds.setdefault(s["rep"], {})[s["tensors"]] = s["phases"]
        per_round = []
        for pushes in rounds.values():
            few, many = min(pushes), max(pushes)
            per_round.append(extra_tensor_cost(pushes[few], pushes[many], many - few))
        if per_round:
            out.append({"transport": transport, "rounds": len(per_round),
                        **{k: statistics.median(r[k] for r in per_round)
                           for k in (*PHASE_KEYS, "ours")},
                        "ours_min": min(r["ours"] for r in per_round),
                        "ours_max": max(r["ours"] for r in per_round)})
    return out


def paired_lines(rows: list[dict], few: int, many: int) -> list[str]:
    return [f"paired, one fake-engine server, {few} -> {many} tensors, per extra tensor (median "
            f"of {r['rounds']} rounds' differences): {r['transport']}: lora-sync's own "
            f"{r['ours']:.2f} us [{r['ours_min']:.2f} to {r['ours_max']:.2f}] (" +
            ", ".join(f"{k} {r[k]:.2f}" for k in PHASE_KEYS[:-1] if k not in ENGINES_OWN) +
            f"; the fake engine's build {r['engine_build']:.2f})" for r in rows]


def bench_paired(args, shape: Shape, out: dict, scratch: Path) -> None:
    """The paired measurement (`--paired`): `shape` and its bytes in twice the tensors to one
    fake-engine server."""
    shapes = paired_shapes(shape)
    adapters = {label: shape.adapter(seed=1 + i, packed=args.packed)
                for i, (label, shape) in enumerate(shapes.items())}
    server = FakeServer(list(shapes.values()), PAIRED_RANK, env=PAIRED_ENV)
    try:
        with LoRASyncClient(server.url, engine=server.engine, api_key=API_KEY,
                            timeout=600) as client:
            client.init_group(timeout_s=300)
            samples = paired_rounds(client, adapters, args.reps, args.warmup, args.idle,
                                    scratch)
            client.destroy_group()
    finally:
        server.stop()
    out["paired_samples"] = samples
    out["paired"] = paired_per_extra_tensor(samples)


def hostile_on_server(url: str, bodies: dict[str, bytes], engine: str) -> list[dict]:
    from lora_sync.engines import ENGINES
    from lora_sync.transports import tensors
    route = ENGINES[engine].route("", tensors.ROUTE)
    out = []
    for kind, body in bodies.items():
        status, code, seconds = post_body(url, route, body)
        out.append({"kind": kind, "bytes": len(body), "status": status, "code": code,
                    "seconds": seconds})
    return out


def bench_server(args, shapes: dict[str, Shape], out: dict, scratch: Path) -> None:
    """Pushes of each shape (by label) to a fake, vLLM or SGLang server of its own (one after
    the other); the first shape's server also gets the RSS soak and the hostile headers.
    Fills `out`."""
    from benchmarks.sync_bench import print_table, summarize
    samples, engine = [], args.engine
    for i, (name, shape) in enumerate(shapes.items()):
        label = "" if name == "large" else name
        print(f"building the adapter: {shape.tensors} tensors, {shape.nbytes / 1e9:.2f} GB",
              flush=True)
        adapter = shape.adapter(seed=1 + i, packed=args.packed)
        server = FakeServer([shape], shape.rank) if engine == "fake" \
            else STARTS[engine](shape)
        try:
            with LoRASyncClient(server.url, engine=server.engine, api_key=API_KEY,
                                timeout=600) as client:
                client.init_group(timeout_s=300)
                # Every shape the same rounds: the per-extra-tensor lines are differences
                # of two shapes' medians.
                samples += push_rounds(client, shape, adapter, engine, args.reps,
                                       args.warmup, args.idle, scratch, label=label)
                if args.soak and i == 0:
                    out["soak"] = soak(client, server, adapter, args.soak)
                    print(f"  RSS over {args.soak} pushes: {out['soak']}", flush=True)
                client.destroy_group()
                if i == 0:
                    bodies = {k: hostile_header(k) for k in ("junk", "peft", "widest")}
                    out["hostile_server"] = hostile_on_server(server.url, bodies,
                                                              server.engine)
        finally:
            server.stop()
        del adapter
        gc.collect()
        samples += memcpy_samples(shape, shape.nbytes, args.reps)
    rows = summarize(samples)
    for r in rows:
        r["label"] = next((s.get("label", "") for s in samples
                           if (s["engine"], s["transport"], s["rank"]) ==
                           (r["engine"], r["transport"], r["rank"])), "")
    out["samples"], out["summary"] = samples, rows
    out["table"] = print_table(rows).replace("rank", "tens")
    out["phases"] = server_overhead(rows)
    out["goals"] = goals(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("overhead", "server"), help="one part only")
    p.add_argument("--engine", choices=("fake", *STARTS), default="fake")
    p.add_argument("--reps", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--packed", action="store_true",
                   help="the trainer's tensors in one buffer (trainer.pack_parameters)")
    p.add_argument("--paired", action="store_true",
                   help="lora-sync's own cost per extra tensor: the same bytes in 10,080 and "
                        "20,160 tensors pushed in turns to one fake-engine server")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--idle", type=float, default=0.5, help="seconds before each push")
    p.add_argument("--soak", type=int, default=50, help="pushes with the RSS sampled (0 or 15-50)")
    p.add_argument("--shapes", nargs="+", choices=("large", "few", "many"),
                   default=["large", "few"],
                   help="large: 10,080 tensors; few: the same bytes in 1,008; many: in 20,160 "
                        "(+0.3%%) (default large few)")
    p.add_argument("--counts", type=int, nargs="+", default=list(SCAN_COUNTS))
    p.add_argument("--quick", action="store_true", help="1,008 tensors (110 MB), 2 rounds")
    p.add_argument("--out", default=str(REPO / "runs" / "large_adapter"))
    p.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--fake-shapes", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=LARGE.rank, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_fake:
        return serve_fake([Shape(**d) for d in json.loads(args.fake_shapes)], args.serve_fake,
                          args.rank)
    args.soak = min(args.soak, 50)
    shape = LARGE
    if args.quick:
        shape, args.reps, args.warmup, args.soak = QUICK, 2, 1, min(args.soak, 15)
        args.counts = [c for c in args.counts if c <= 10_000]
    if args.paired and args.engine != "fake":
        p.error("--paired pushes two shapes to one server: the fake engine's only")
    if 0 < args.soak < 15:  # RSS is sampled every 5 pushes once the first 10 filled the window
        p.error(f"--soak takes 0 (none) or at least 15 pushes, not {args.soak}")
    torch.set_num_threads(1)  # 2 cores: one for the server
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"shape": asdict(shape), "tensors": shape.tensors, "bytes": shape.nbytes,
                    "size_classes": shape.size_classes(), "packed": args.packed,
                    "loadavg_before": os.getloadavg()}
    text = [f"adapter: {shape.tensors} tensors, {shape.nbytes / 1e9:.3f} GB; tensor bytes x "
            f"count: {shape.size_classes()}; the trainer's tensors "
            f"{'packed in one buffer' if args.packed else 'each in memory of its own'}"]
    if args.only in (None, "overhead"):
        rows = []
        for n in args.counts:
            rows.append(per_tensor_overhead(scan_shape(n)))
            print(f"  overhead at {rows[-1]['tensors']} tensors done", flush=True)
        result["overhead"] = rows
        text.append(overhead_table(rows))
        result["peft_read"] = [peft_read_overhead(layers) for layers in (72, 720)]
        text.append("reading a PEFT model's adapter (us per tensor; best of 3): " + "; ".join(
            f"{r['tensors']} tensors: through PEFT {r['through_peft'] * 1e6 / r['tensors']:.1f}"
            f", as a push reads it {r['recorded'] * 1e6 / r['tensors']:.2f}"
            for r in result["peft_read"]))
        result["limits"] = limits_report({"large": shape, "100k": scan_shape(100_000)})
        text.append(limits_table(result["limits"]))
        spec = shape.spec()
        result["hostile_in_process"] = {k: hostile_in_process(hostile_header(k), spec)
                                        for k in ("junk", "peft", "widest")}
        text.append("hostile headers in process (parse + check_adapter): " + "; ".join(
            f"{k}: {v['bytes'] / 2 ** 20:.1f} MiB -> {v['outcome']} in "
            f"{v['seconds'] * 1e3:.0f} ms" for k, v in result["hostile_in_process"].items()))
        print("\n".join(text[1:]), flush=True)
    first_server_block = len(text)
    if args.paired:
        scratch = Path(tempfile.mkdtemp(prefix="lora-large-bench-"))
        try:
            bench_paired(args, shape, result, scratch)
        finally:
            import shutil
            shutil.rmtree(scratch, ignore_errors=True)
        shapes = paired_shapes(shape)
        text.append("\n".join(paired_lines(result["paired"], shapes["large"].tensors,
                                            shapes["many"].tensors)))
        print(text[-1], flush=True)
    elif args.only in (None, "server"):
        scratch = Path(tempfile.mkdtemp(prefix="lora-large-bench-"))
        try:
            shapes = {"large": shape, "few": same_bytes(shape, shape.layers // 10
                                                        if not args.quick else 18),
                      "many": near_bytes(shape, shape.layers * 2)}
            bench_server(args, {k: shapes[k] for k in args.shapes}, result, scratch)
        finally:
            import shutil
            shutil.rmtree(scratch, ignore_errors=True)
        text.append(result["table"])
        text.append(phase_table(result["phases"]))
        text.append("\n".join(result["goals"]))
        if "soak" in result:
            s = result["soak"]
            text.append(f"server RSS over {s['pushes']} pushes: {s['first_mb']:.0f} MB after "
                        f"10, {s['last_mb']:.0f} MB at the end, max {s['max_mb']:.0f} MB "
                        f"({s['mb_per_100_pushes']:+.1f} MB per 100 pushes)")
        text.append("hostile headers on the server (POST load_lora_adapter_from_tensors): " +
                    "; ".join(f"{h['kind']}: {h['status']} {h['code']} in "
                              f"{h['seconds'] * 1e3:.0f} ms" for h in result["hostile_server"]))
    result["loadavg_after"] = os.getloadavg()
    text.append(f"load average {result['loadavg_before'][0]:.2f} before, "
                f"{result['loadavg_after'][0]:.2f} after")
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "table.txt").write_text("\n\n".join(text) + "\n")
    if not args.paired:
        print("\n\n".join(text[first_server_block + 1:]))  # the table was printed already
    return 0


if __name__ == "__main__":
    sys.exit(main())
