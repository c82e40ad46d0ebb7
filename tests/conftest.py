"""Session-scoped fixtures: one tiny local model and real servers on 127.0.0.1 (vLLM CPU and
SGLang CPU, one each, shared by the whole session), plus lora-sync on a FAKE engine in this
process (fake_server, fake_client, make_fake_server: tests/engine_fakes.py).

Every test that needs a real server process is marked `server` at collection (see
pytest_collection_modifyitems): `pytest -m "not server"` runs only the in-process tests."""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from pathlib import Path

import pytest
import torch

# The SGLang venv and its CPU servers' PYTHONPATH (sgl-kernel stand-in), shared with benchmarks.
from testbed.processes import SGLANG_PYTHON, SGLANG_TEST_PATH

torch.set_num_threads(1)  # 2 cores: leave one to the server

PROMPT = "the quick brown"
API_KEY = "test-admin-key"  # the shared server guards its admin routes with this key


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-sync")


@pytest.fixture(scope="session")
def model_dir(workdir):
    from testbed.tiny_model import build_tiny_model
    return build_tiny_model(workdir / "tiny-llama")


@pytest.fixture(scope="session")
def make_adapter(model_dir):
    """make_adapter(seed, rank=8) -> LoRAAdapter with random non-zero weights."""
    from lora_sync import LoRAAdapter
    from testbed.tiny_model import make_lora, randomize_lora
    models = {}

    def make(seed: int, rank: int = 8):
        if rank not in models:
            models[rank] = make_lora(model_dir, rank=rank)
        randomize_lora(models[rank], seed)
        a = LoRAAdapter.from_peft_model(models[rank])
        return LoRAAdapter({k: v.clone() for k, v in a.tensors.items()}, a.config)
    return make


def _vllm(model_dir, **kw):
    pytest.importorskip("vllm")
    from testbed.processes import vllm_server
    return vllm_server(model_dir, **kw)


REPO = Path(__file__).resolve().parents[1]
RL_LIB = REPO / ".venv-rl-lib"  # scripts/install_rl_frameworks.sh


@contextlib.contextmanager
def rl_frameworks(*subdirs: str):
    """verl's and SkyRL's own packages importable while the block runs (they live beside
    .venv, not in it); skips (fails in CI) where they are not installed."""
    if not (RL_LIB / ".complete").exists():
        if os.environ.get("CI"):
            pytest.fail("no .venv-rl-lib in CI: scripts/install.sh did not install it")
        pytest.skip("no .venv-rl-lib: run scripts/install_rl_frameworks.sh")
    paths = [str(RL_LIB), *(str(RL_LIB / d) for d in subdirs)]
    sys.path[:0] = paths
    try:
        yield
    finally:
        for path in paths:
            sys.path.remove(path)
SERVER_ENV = {"LORA_SYNC_MAX_BODY_MB": "4", "LORA_SYNC_API_KEY": API_KEY,
              "LORA_SYNC_KEEP_VERSIONS": "3", "LORA_SYNC_CHECK_FINITE": "1",
              # small bounds so the attack tests reach them quickly
              "LORA_SYNC_MAX_STAGING_MB": "6", "LORA_SYNC_BODY_IDLE_S": "2",
              "LORA_SYNC_LEASE_TTL_S": "3"}


def real_server(engine: str, model_dir, env: dict, extra_args=()):
    """A real server (not started) of `engine` with lora-sync settings `env`, guarded by the
    session's admin key; skips (fails in CI) where that engine is not installed."""
    if engine == "vllm":
        server = _vllm(model_dir, env=env, extra_args=extra_args)
    else:
        if not SGLANG_PYTHON.exists():
            if os.environ.get("CI"):
                pytest.fail("no .venv-sglang in CI: scripts/install.sh did not install SGLang")
            pytest.skip("no .venv-sglang: run scripts/install.sh")
        from testbed.processes import sglang_server
        server = sglang_server(model_dir, python=str(SGLANG_PYTHON), extra_args=extra_args,
                               env={**env, "PYTHONPATH": SGLANG_TEST_PATH})
    server.api_key = API_KEY
    return server


# -- the MoE model's servers: one per engine, shared by the session ---------------------------
# Each runs the tiny Qwen3-MoE with its engine's TEST-ONLY MoE stand-ins (tests/vllm_moe_
# standin; tests/sgl_kernel_standin) for test_moe_serving.py, and with its engine's own
# --api-key (a generation key) beside lora-sync's admin key, for test_attacks.py's key schemes.
GENERATION_KEY = "generation-key"
MOE_ENV = {**SERVER_ENV, "LORA_SYNC_MAX_BODY_MB": "16", "LORA_SYNC_MAX_STAGING_MB": "32"}


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    from testbed.tiny_model import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", arch="qwen3_moe")


@pytest.fixture(scope="session")
def moe_vllm(request):
    with _shared("moe_vllm", request) as server:
        yield server


@pytest.fixture(scope="session")
def moe_sglang(request):
    with _shared("moe_sglang", request) as server:
        yield server


@pytest.fixture(scope="session")
def sglang(request):
    """The shared SGLang CPU server, with the same lora-sync settings as `vllm`."""
    with _shared("sglang", request) as server:
        yield server


@pytest.fixture(params=["vllm", "sglang"])
def server(request):
    """Each test that takes `server` (or `client`) runs against both engines."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def vllm(request):
    """The shared vLLM server: max 2 LoRA slots, 4 cached adapters, 4 MB body limit,
    3 versions kept per name, admin routes behind an API key."""
    with _shared("vllm", request) as server:
        yield server


@pytest.fixture(scope="session")
def framework_vllm(request):
    """A vLLM server built the way verl builds its own, lora-sync mounted through the public
    API (testbed/framework_server.py), with the session's settings."""
    with _shared("framework_vllm", request) as server:
        yield server


def _keyed(server):
    server.api_key = API_KEY
    return server


# The servers the session shares: name -> (the model directory's fixture, maker).
SHARED_SERVERS = {
    "vllm": ("model_dir", lambda d: _keyed(_vllm(d, max_loras=2, max_cpu_loras=4,
                                                 env=SERVER_ENV))),
    "sglang": ("model_dir", lambda d: real_server("sglang", d, SERVER_ENV)),
    "framework_vllm": ("model_dir", lambda d: _keyed(_vllm(
        d, env=SERVER_ENV, launcher="testbed.framework_server"))),
    "moe_vllm": ("moe_dir", lambda d: real_server(
        "vllm", d, {**MOE_ENV, "PYTHONPATH": str(REPO / "tests" / "vllm_moe_standin")},
        ("--api-key", GENERATION_KEY))),
    "moe_sglang": ("moe_dir", lambda d: real_server("sglang", d, MOE_ENV,
                                                    ("--api-key", GENERATION_KEY))),
}
PRESTARTED: dict = {}  # launched by prestart_shared_servers, not yet taken by their fixture


def _shared(name: str, request):
    """A shared server (not yet serving: `with` waits for it), prestarted or made now."""
    if name in PRESTARTED:
        return PRESTARTED.pop(name)
    directory, make = SHARED_SERVERS[name]
    return make(request.getfixturevalue(directory))


@pytest.fixture(scope="session", autouse=True)
def prestart_shared_servers(request):
    """CI time: the shared servers this run's tests name boot all at once, before the first
    test (so no test runs beside a boot); their fixtures then take them. One that fails to
    boot here is booted again by its fixture, which reports why. Stops what was launched
    and never taken."""
    wanted = set()
    for item in request.session.items:
        if item.get_closest_marker("skip") is None:
            wanted |= shared_servers_of(item)
    for name in sorted(wanted):
        directory, make = SHARED_SERVERS[name]
        try:
            PRESTARTED[name] = make(request.getfixturevalue(directory)).launch()
        except (pytest.skip.Exception, pytest.fail.Exception):
            continue  # its fixture skips (or fails in CI) as it says
    for server in list(PRESTARTED.values()):
        try:
            server.start()
        except (RuntimeError, TimeoutError):
            pass
    yield
    while PRESTARTED:
        PRESTARTED.popitem()[1].stop()


@pytest.fixture(scope="session")
def vllm_second(model_dir):
    """A second vLLM server with the session's settings: one group across two servers, and
    the fleet's server that test_fleet.py kills and starts again."""
    server = _vllm(model_dir, env=SERVER_ENV)
    server.api_key = API_KEY
    with server:
        yield server


@pytest.fixture
def client(server):
    from lora_sync import LoRASyncClient
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as c:
        yield c
    assert server.alive(), f"the {server.engine} server died during the test:\n" + server.log_tail()


# -- in-process servers on a FAKE engine (tests/engine_fakes.py) ---------------------------
@pytest.fixture(scope="session")
def fake_server():
    """lora-sync's whole server stack in this process, on a fake engine (no model, no text
    generation: see tests/engine_fakes.py), with the real test servers' settings."""
    from .engine_fakes import FakeEngineServer
    with FakeEngineServer() as server:
        yield server


@pytest.fixture(scope="session")
def fake_client(fake_server):
    from lora_sync import LoRASyncClient
    with LoRASyncClient(fake_server.url, engine=fake_server.engine,
                        api_key=fake_server.api_key) as c:
        yield c


@pytest.fixture
def make_fake_server():
    """make_fake_server(workers=1, engine_keys=(), **settings) -> a started FakeEngineServer
    of this test's own (stopped after it), e.g. make_fake_server(max_names=3)."""
    from .engine_fakes import FakeEngineServer
    started = []

    def make(**kw):
        server = FakeEngineServer(**kw).start()
        started.append(server)
        return server
    yield make
    for server in started:
        server.stop()
    for server in started:  # what a real engine would have crashed on (engine_fakes.py)
        assert not server.bridge.violations, server.bridge.violations


# -- which tests need a real server: marker `server` (pytest -m "not server" skips them) ---
# Fixtures that are, or start, real vLLM/SGLang servers.
REAL_SERVER_FIXTURES = {"vllm", "sglang", "moe_vllm", "moe_sglang", "framework_vllm",
                        "server", "client",
                        "vllm_second", "vllm_tp2",
                        "dp_server", "crashable"}
# Modules whose tests start servers, torchrun jobs or network namespaces in their bodies.
REAL_SERVER_MODULES = {"test_benchmark", "test_cli", "test_data_parallel", "test_fleet",
                       "test_multihost", "test_netns", "test_rl_loop", "test_sharded",
                       "test_sharded_push"}
# A test or fixture whose source calls one of these starts a server (or torchrun) itself;
# fake_engine_process (tests/fake_server_main.py): lora-sync on the fake engine, but in a
# process of its own, which `-m "not server"` (in-process tests only) leaves out too.
SERVER_CALLS = re.compile(
    r"(?<!\w)(vllm_server|sglang_server|_vllm|real_server|torchrun|HostNet|fake_engine_process)\(")


@functools.lru_cache(maxsize=None)
def _source(fn) -> str:
    import inspect
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _source_has(fn, text: str) -> bool:
    return text in _source(fn)


def _starts_servers(fn) -> bool:
    return SERVER_CALLS.search(_source(fn)) is not None


def _needs_real_server(item) -> bool:
    module = getattr(item, "module", None)
    if module is not None and module.__name__.rsplit(".", 1)[-1] in REAL_SERVER_MODULES:
        return True
    names = set(getattr(item, "fixturenames", ()))
    if names & REAL_SERVER_FIXTURES:
        return True
    fn = getattr(item, "function", None)
    if _starts_servers(fn):
        return True
    # A test that takes a server by name (request.getfixturevalue(param)).
    params = getattr(getattr(item, "callspec", None), "params", {})
    if {str(v) for v in params.values()} & REAL_SERVER_FIXTURES \
            and _source_has(fn, "getfixturevalue("):
        return True
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(_starts_servers(d.func) for name in names for d in defs.get(name, ()))


def shared_servers_of(item) -> set:
    """The shared servers (SHARED_SERVERS) a test takes."""
    names = set(getattr(item, "fixturenames", ()))
    wanted = names & set(SHARED_SERVERS)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if names & {"server", "client"}:
        param = params.get("server")
        wanted |= {param} if param in SHARED_SERVERS else {"vllm", "sglang"}
    if _source_has(getattr(item, "function", None), "getfixturevalue("):  # taken by name
        wanted |= {str(v) for v in params.values()} & set(SHARED_SERVERS)
    return wanted


# CI time: the real-server tests run as two pytest processes at once (scripts/test.sh), each
# booting only the shared servers its own tests take: a test mostly waits on its server, so two
# streams keep both cores busy. Tests that start servers of their own go with SGLang's, which
# are lighter, so the two streams take about as long.
SERVER_GROUPS = ("vllm", "sglang")


def server_group(item) -> str:
    """`sglang`: the tests of SGLang's shared servers alone, and those that take no shared
    server; `vllm`: every other real-server test."""
    return "sglang" if shared_servers_of(item) <= {"sglang", "moe_sglang"} else "vllm"


def pytest_collection_modifyitems(config, items):
    extended = os.environ.get("LORA_SYNC_EXTENDED_TESTS") == "1"
    for item in items:
        if _needs_real_server(item):
            item.add_marker(pytest.mark.server)
        if item.get_closest_marker("extended") and not extended:
            item.add_marker(pytest.mark.skip(
                reason="extended real-server test: LORA_SYNC_EXTENDED_TESTS=1 runs it"))
    group = os.environ.get("LORA_SYNC_SERVER_GROUP")
    if group:
        if group not in SERVER_GROUPS:
            raise pytest.UsageError(f"LORA_SYNC_SERVER_GROUP must be one of "
                                    f"{sorted(SERVER_GROUPS)}, not {group!r}")
        keep, other = [], []
        for item in items:
            ours = item.get_closest_marker("server") is None or server_group(item) == group
            (keep if ours else other).append(item)
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = keep
