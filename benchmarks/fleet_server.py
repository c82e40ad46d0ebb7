"""One fake-engine server of the fleet benchmark, in a process of its own:

    python -m benchmarks.fleet_server --port PORT [--max-rank 64] [--full-build]

lora-sync's real routes, admission, AdapterService, transports and worker dispatcher
(tests/engine_fakes.FakeEngineServer) on a fake engine that knows Qwen2.5-0.5B's linear
shapes (so a rank-64 adapter, 70 MB in bf16, is accepted as on a real server), with
limits fit for it. It prints "fake-engine ready URL" once it serves, and serves until
SIGTERM/SIGINT.

The fake engine's build hashes every byte of the adapter (sha256, about 0.1 s for 70 MB on
this VM): on a 2-core host, K servers hashing at once measure the cores, not the transport,
whereas K real servers on K GPUs each build on their own device. So by default the build
here reads one element of each tensor (the worker still receives, maps and checks the whole
file as it would for a real engine); `--full-build` keeps the fake's hashing."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

API_KEY = "fleet-bench-key"
ENV = {"LORA_SYNC_API_KEY": API_KEY, "LORA_SYNC_MAX_BODY_MB": "256",
       "LORA_SYNC_MAX_STAGING_MB": "1024", "LORA_SYNC_KEEP_VERSIONS": "2",
       "LORA_SYNC_CHECK_FINITE": "0", "LORA_SYNC_LEASE_TTL_S": "30",
       "LORA_SYNC_BODY_IDLE_S": "10"}


def qwen_spec(max_rank: int):
    from transformers import LlamaConfig

    from lora_sync import ModelSpec
    from testbed.tiny_model import QWEN_05B_SHAPES
    return ModelSpec.from_hf_config(LlamaConfig(**QWEN_05B_SHAPES), max_rank)


def light_digest(tensors: dict, config=None) -> str:
    """A digest of an adapter that reads one element per tensor instead of hashing all."""
    return str(hash(tuple(sorted((k, float(t.reshape(-1)[0]) if t.numel() else 0.0)
                                 for k, t in tensors.items()))))


def _light_build(engine):
    """The fake engine's build, by light_digest. It stands for an engine's own build, so it
    is reported as one (`engine_build`): a benchmark's per-tensor cost of lora-sync's own
    code must not count the fake's read of every tensor."""
    def build(adapter_id, stored, take_buffer):
        t0 = time.perf_counter()
        engine.built[adapter_id] = digest = light_digest(stored.tensors)
        stored.engine_build_ms = (time.perf_counter() - t0) * 1e3
        return digest
    return build


def serve_until_signalled(server) -> int:
    """Starts `server`, says so on stdout ("fake-engine ready URL"), serves until SIGTERM or
    SIGINT, stops it."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"fake-engine ready {server.url} (pid {os.getpid()})", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-rank", type=int, default=64)
    p.add_argument("--full-build", action="store_true")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    from tests.engine_fakes import FakeEngineServer, settings_like_test_servers
    settings = settings_like_test_servers(env=ENV)
    server = FakeEngineServer(settings, host=args.host, port=args.port)
    spec = qwen_spec(args.max_rank)

    async def model_spec():
        return spec
    server.bridge.model_spec = model_spec
    server.bridge.max_rank = args.max_rank
    if not args.full_build:
        for w in server.bridge.workers:
            w.engine.build = _light_build(w.engine)
    return serve_until_signalled(server)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
