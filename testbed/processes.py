"""Start and stop inference servers as child processes (demo, tests, benchmarks).

Always binds 127.0.0.1 unless told otherwise, waits for /health, and stops the whole process
group (vLLM and SGLang both spawn helpers) on exit. Each server gets a private TMPDIR for the
IPC socket and rendezvous files its processes create (SGLang never removes them, a stopped vLLM
leaves them behind); it is removed when the server stops, with any /dev/shm file that appeared
while it ran and that no process holds any more (SGLang leaves a semaphore and a load file)."""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lora_sync.collective import free_port
from lora_sync.engines import ENGINES

INDUCTOR_CACHE = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")

SHM = "/dev/shm"

REPO = Path(__file__).resolve().parents[1]
# The checkout's SGLang environment (scripts/install_sglang.sh), and the PYTHONPATH its CPU
# servers need: the sgl-kernel stand-in and pin_memory shim (PyPI ships CUDA kernels only;
# tests/sgl_kernel_standin, docs/engines.md), then the checkout. Shared by tests and benchmarks.
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
SGLANG_TEST_PATH = f"{REPO / 'tests' / 'sgl_kernel_standin'}{os.pathsep}{REPO}"


def remove_unheld(directory: str, names: set[str], min_age_s: float = 30.0) -> None:
    """Unlinks the named files in `directory` that no live process has open or mapped and
    that are older than `min_age_s` (a server starting beside this one may have created a
    file its child has not opened yet: seen as a SemLock FileNotFoundError at start-up).
    Semaphores (`sem.*`) are never removed: a process maps them under a temporary name, so
    whether one is held cannot be told from /proc."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            held.update(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
            held.update(line.split(None, 5)[-1].strip() for line in open(f"/proc/{pid}/maps")
                        if directory in line)
        except OSError:
            continue  # gone, or not ours to read
    for name in names:
        path = os.path.join(directory, name)
        try:
            young = time.time() - os.stat(path).st_mtime < min_age_s
        except OSError:
            continue
        if path not in held and not young and not name.startswith("sem."):
            try:
                os.unlink(path)
            except OSError:
                pass


class ServerProcess:
    def __init__(self, cmd: list[str], port: int, env: dict | None = None,
                 log_path: str | os.PathLike | None = None, engine: str = "vllm",
                 start_timeout: float = 300.0, stop_group: bool = False):
        self.cmd, self.port, self.engine = cmd, port, engine
        # stop() sends SIGTERM to the whole process group, not to `cmd` alone: for a server
        # run under a wrapper that does not pass it on (unshare --fork ignores it).
        self.stop_group = stop_group
        self.private_tmp = None
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path or f"/tmp/lora-sync-{engine}-{port}.log")
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def launch(self) -> "ServerProcess":
        """Starts the server's process without waiting for it to serve (`start` waits), so
        several can boot at once. A running process is kept; a server that was stopped or
        killed starts again."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self._log = open(self.log_path, "wb")
        self.shm_before = set(os.listdir(SHM))
        self.private_tmp = tempfile.mkdtemp(prefix=f"lora-sync-{self.engine}-{self.port}-")
        # torch.compile's cache stays where it was: shared, so later starts reuse it.
        env = {"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE, **self.env, "TMPDIR": self.private_tmp}
        # Own process group (stopped as one), but the caller's session: a new session is a
        # new scheduler autogroup, and a busy server then starved the caller's threads for
        # whole seconds (a trainer step stalled 1.5 s; 20 ms in the same session).
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, process_group=0)
        return self

    def start(self) -> "ServerProcess":
        """Launches the server (unless `launch` did) and waits until it serves."""
        self.launch()
        deadline = time.time() + self.start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            if self.healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.engine} server not healthy after {self.start_timeout}s:\n"
                           + self.log_tail())

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except Exception:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.healthy()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its children."""
        if self.proc is None:
            return 0
        total, pids = 0, [self.proc.pid]
        while pids:
            pid = pids.pop()
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
                pids += [int(k) for k in kids]
            except OSError:
                pass
        return total

    def kill(self) -> None:
        """A crash: SIGKILL to the whole server (every process) at once, then clean up."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the server alone, so it shuts its helpers down and cleans up after
        them; then SIGKILL to whatever is left of the process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if self.stop_group:
                os.killpg(self.proc.pid, signal.SIGTERM)
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._log.close()
        if self.private_tmp:
            shutil.rmtree(self.private_tmp, ignore_errors=True)
            self.private_tmp = None
            remove_unheld(SHM, set(os.listdir(SHM)) - self.shm_before)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def vllm_server(model_dir, port: int | None = None, *, max_lora_rank: int = 64,
                max_loras: int = 2, max_cpu_loras: int = 4, extra_args=(), env=None,
                dtype: str = "float32", python: str = sys.executable,
                launcher: str = ENGINES["vllm"].launcher) -> ServerProcess:
    """A vLLM CPU server with lora-sync, through our launcher (or `launcher`, a module
    that takes vLLM's arguments: testbed.framework_server builds it as a framework does)."""
    port = port or free_port()
    cmd = [python, "-m", launcher, *vllm_args(model_dir, port, max_lora_rank=max_lora_rank,
                                              max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                                              dtype=dtype), *extra_args]
    return ServerProcess(cmd, port, {**VLLM_ENV, **(env or {})}, engine="vllm")


# The engine's own disk route: the baseline tests and the benchmark compare against.
VLLM_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def vllm_args(model_dir, port: int, *, max_lora_rank: int = 64, max_loras: int = 2,
              max_cpu_loras: int = 4, dtype: str = "float32") -> list[str]:
    """The vLLM arguments of a test server (a launcher's, or testbed.framework_server's)."""
    return ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", "512", "--max-lora-rank", str(max_lora_rank),
            "--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras),
            "--max-num-seqs", "8", "--served-model-name", "base"]


def sglang_server(model_dir, port: int | None = None, *, max_lora_rank: int = 64,
                  extra_args=(), env=None, python: str = sys.executable) -> ServerProcess:
    """An SGLang CPU server with lora-sync, through our launcher. CPU needs the CPU engine,
    the torch_native LoRA backend, a small KV cache and --sleep-on-idle (an idle scheduler
    otherwise busy-polls a whole core). --enable-metrics: SGLang serves /metrics (with
    lora-sync's metrics) only then."""
    port = port or free_port()
    cmd = [python, "-m", ENGINES["sglang"].launcher, "--model-path", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
           "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--lora-target-modules",
           "all", "--lora-backend", "torch_native", "--max-total-tokens", "8192",
           "--sleep-on-idle", "--served-model-name", "base", "--enable-metrics", *extra_args]
    base_env = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return ServerProcess(cmd, port, {**base_env, **(env or {})}, engine="sglang")
