"""lora-sync on the FAKE engine (tests/engine_fakes.py) as a server process of its own.

    python -m tests.fake_server_main --host ADDR --port PORT [--workers N]   (from the repo root)

A FakeEngineServer (lora-sync's real routes, admission, AdapterService, transports and worker
dispatcher; a fake WorkerEngine that does the real gloo receive of a broadcast; a fake
/v1/completions whose text is derived from the weights the workers hold, see
engine_fakes.served_text) bound to ADDR:PORT. Settings: the real test servers' (conftest's
SERVER_ENV), with every LORA_SYNC_* variable of this process's environment on top (e.g.
LORA_SYNC_ALLOWED_TRAINERS for a trainer on another host). It prints "fake-engine ready URL"
once it serves, and serves until SIGTERM/SIGINT (a clean stop, exit status 0) or SIGKILL
(a crash, as the tests that kill servers want: it starts again in about two seconds, where
a vLLM CPU server takes most of a minute).

GET /fake/violations answers what a real engine would have crashed or misbehaved on
(FakeBridge.violations; tests assert it stays empty), as the in-process fixtures check.

`fake_engine_process(...)` builds the testbed.processes.ServerProcess that runs this module, the
same surface as a real test server (url, proc, start, stop, kill, alive, log_tail)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from .conftest import API_KEY, REPO, SERVER_ENV

VIOLATIONS_PATH = "/fake/violations"
REFUSE_PATH = "/fake/refuse"  # POST {"refuse": bool}: the engine refuses every build, or none
# A PID namespace of its own (and its own /proc): neither this server nor a trainer outside
# can open the other's /proc/<pid>/fd, as between hosts or containers. --kill-child: the
# server dies with unshare; unshare ignores SIGTERM, so a stop signals the process group.
OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


def fake_engine_process(port: int | None = None, env: dict | None = None, workers: int = 1,
                host: str = "127.0.0.1", own_pid_namespace: bool = False):
    """A not yet started ServerProcess running this module (SERVER_ENV, then `env`)."""
    from lora_sync.collective import free_port
    from testbed.processes import ServerProcess
    port = port or free_port()
    cmd = [*(OWN_PID_NAMESPACE if own_pid_namespace else []),
           sys.executable, "-m", "tests.fake_server_main", "--host", host, "--port", str(port),
           "--workers", str(workers)]
    server = ServerProcess(cmd, port, {**SERVER_ENV, **(env or {}), "PYTHONPATH": str(REPO),
                                       "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                           log_path=f"/tmp/lora-sync-fake-{port}.log", engine="vllm",
                           start_timeout=60, stop_group=own_pid_namespace)
    server.url = f"http://{host}:{port}"
    server.api_key = API_KEY
    return server


def violations(url: str, timeout: float = 10) -> list[str]:
    """FakeBridge.violations of the fake server process at `url`."""
    import json
    import urllib.request
    with urllib.request.urlopen(url + VIOLATIONS_PATH, timeout=timeout) as r:
        return json.loads(r.read())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from .engine_fakes import FakeEngineServer, settings_like_test_servers, tiny_model_spec
    settings = settings_like_test_servers(
        env={k: v for k, v in os.environ.items() if k.startswith("LORA_SYNC_")})
    server = FakeEngineServer(settings, workers=args.workers, host=args.host, port=args.port)
    tiny_model_spec()  # what a real server knows before it serves: the first push waits less

    @server.app.get(VIOLATIONS_PATH)
    async def fake_violations():
        return list(server.bridge.violations)

    @server.app.post(REFUSE_PATH)
    async def fake_refuse(body: dict):
        refuse = (lambda aid, stored: "refused by the test") if body.get("refuse") else None
        for w in server.bridge.workers:
            w.engine.refuse = refuse
        return {"refuse": refuse is not None}

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"fake-engine ready {server.url} (pid {os.getpid()}, {args.workers} worker(s))",
          flush=True)
    while not stop.wait(1.0):
        if not server._thread.is_alive():  # uvicorn gave up on its own
            print("fake-engine: the server thread ended\n" + server.log_tail(), flush=True)
            return 1
    server.stop()
    if server.bridge.violations:
        print(f"fake-engine violations: {server.bridge.violations}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: that joins the worker threads, and one may still wait in a collective a
    # cut link left hanging; the server has stopped, nothing else is left to finish.
    os._exit(code)
