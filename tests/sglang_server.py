"""Start and stop a real SGLang server on CPU for lora-sync's tests (no pytest dependency).

The server runs from ``.venv-sglang`` (created by ``scripts/install_sglang.sh``) with SGLang's
CPU engine. Two test-only shims are put on its PYTHONPATH (they reach SGLang's spawned
scheduler/detokenizer processes too, which inherit the environment):

* ``tests/sgl_kernel_standin/sgl_kernel`` -- pure-torch TEST STAND-IN for the few native
  sgl-kernel CPU ops a tiny dense Llama needs (PyPI's sgl-kernel is CUDA-only);
* ``tests/sgl_kernel_standin/sitecustomize.py`` -- makes SGLang's hard-coded
  ``pin_memory=True`` in its LoRA code a no-op on machines without an accelerator.

The repository root is on PYTHONPATH as well, so a server-side lora-sync plugin can be imported
without installing the package.

    from tests.sglang_server import start_sglang_server, stop
    srv = start_sglang_server("/tmp/tiny", 31000)
    try:
        requests.post(srv.url + "/generate", json={...})
    finally:
        stop(srv)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
STANDIN_DIR = REPO_ROOT / "tests" / "sgl_kernel_standin"
DEFAULT_SGLANG_PYTHON = REPO_ROOT / ".venv-sglang" / "bin" / "python"

# Flags every test server gets. --max-total-tokens keeps the KV cache small (the default memory
# fraction would reserve ~15 GB); torch_native is the LoRA backend that runs on CPU;
# --sleep-on-idle stops the idle scheduler from busy-polling a whole core.
BASE_ARGS = (
    "--sleep-on-idle",
    "--device", "cpu",
    "--enable-lora",
    "--max-lora-rank", "64",
    "--lora-target-modules", "all",
    "--lora-backend", "torch_native",
    "--max-total-tokens", "8192",
)


@dataclass
class SGLangServer:
    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path
    args: list = field(default_factory=list)
    started_in_s: Optional[float] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<cannot read {self.log_path}: {e}>"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None


def sglang_python() -> Path:
    return Path(os.environ.get("LORA_SYNC_SGLANG_PYTHON", DEFAULT_SGLANG_PYTHON))


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_sglang_server(model_dir, port: int, extra_args: Sequence[str] = (),
                        env: Optional[Mapping[str, str]] = None, *, host: str = "127.0.0.1",
                        timeout: float = 180.0, log_path=None,
                        python=None) -> SGLangServer:
    """Launches ``python -m sglang.launch_server`` and waits until ``GET /health`` is 200.

    `env` entries are added to (and override) the inherited environment. Raises RuntimeError
    with the tail of the server log if the server exits or is not healthy within `timeout`
    seconds (the server is stopped first)."""
    python = Path(python) if python else sglang_python()
    if not python.exists():
        raise RuntimeError(f"{python} not found: run scripts/install_sglang.sh first")
    if not _port_is_free(host, port):
        raise RuntimeError(f"port {host}:{port} is already in use")

    log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"sglang-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)

    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it, --device cpu tries to import vllm
    pythonpath = [str(STANDIN_DIR), str(REPO_ROOT)]
    if child_env.get("PYTHONPATH"):
        pythonpath.append(child_env["PYTHONPATH"])
    child_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    child_env.setdefault("PYTHONUNBUFFERED", "1")

    args = [str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir),
            "--host", host, "--port", str(port), *BASE_ARGS, *extra_args]
    log_file = open(log_path, "wb")
    t0 = time.monotonic()
    try:
        # A new session: stop() signals the whole process group (launcher, scheduler,
        # detokenizer), so nothing is left behind even if the launcher dies first.
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env, cwd=str(log_path.parent),
                                start_new_session=True)
    finally:
        log_file.close()  # the child keeps its own descriptor
    server = SGLangServer(proc=proc, host=host, port=port, log_path=log_path, args=args)

    deadline = t0 + timeout
    while True:
        if not server.alive():
            tail = server.log_tail()
            stop(server)
            raise RuntimeError(f"SGLang server exited with code {proc.returncode} during "
                               f"startup; log {log_path}:\n{tail}")
        if _health_ok(server.url):
            server.started_in_s = time.monotonic() - t0
            return server
        if time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"SGLang server not healthy after {timeout:.0f}s; "
                               f"log {log_path}:\n{server.log_tail()}")
        time.sleep(1.0)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop(handle: SGLangServer, timeout: float = 20.0) -> Optional[int]:
    """SIGTERM to the server's process group, then SIGKILL after `timeout` seconds.
    Returns the launcher's exit code. Safe to call twice."""
    proc = handle.proc
    pgid = proc.pid  # start_new_session=True: the launcher leads its own group
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()
        if proc.returncode is not None and not _group_alive(pgid):
            return proc.returncode
        time.sleep(0.2)
    _signal_group(pgid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    t_end = time.monotonic() + 5
    while _group_alive(pgid) and time.monotonic() < t_end:
        time.sleep(0.1)
    return proc.returncode


if __name__ == "__main__":  # manual smoke test: python tests/sglang_server.py MODEL_DIR [PORT]
    srv = start_sglang_server(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 31000)
    print(f"up at {srv.url} in {srv.started_in_s:.1f}s (log {srv.log_path}); Ctrl-C stops it")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        print("exit code", stop(srv))
