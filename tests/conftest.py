"""Session-scoped fixtures: one tiny local model and real servers on 127.0.0.1 (vLLM CPU and
SGLang CPU, one each, shared by the whole session)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
# Test-only: the sgl-kernel stand-in and the pin_memory shim (tests/sgl_kernel_standin).
SGLANG_TEST_PATH = f"{REPO / 'tests' / 'sgl_kernel_standin'}{os.pathsep}{REPO}"
SERVER_ENV = {"LORA_SYNC_MAX_BODY_MB": "4", "LORA_SYNC_API_KEY": API_KEY,
              "LORA_SYNC_KEEP_VERSIONS": "3", "LORA_SYNC_CHECK_FINITE": "1",
              # small bounds so the attack tests reach them quickly
              "LORA_SYNC_MAX_STAGING_MB": "6", "LORA_SYNC_BODY_IDLE_S": "2",
              "LORA_SYNC_LEASE_TTL_S": "3"}


@pytest.fixture(scope="session")
def sglang(model_dir):
    """The shared SGLang CPU server, with the same lora-sync settings as `vllm`."""
    if not SGLANG_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail("no .venv-sglang in CI: scripts/install.sh did not install SGLang")
        pytest.skip("no .venv-sglang: run scripts/install.sh")
    from testbed.processes import sglang_server
    server = sglang_server(model_dir, python=str(SGLANG_PYTHON),
                           env={**SERVER_ENV, "PYTHONPATH": SGLANG_TEST_PATH})
    server.api_key = API_KEY
    with server:
        yield server


@pytest.fixture(params=["vllm", "sglang"])
def server(request):
    """Each test that takes `server` (or `client`) runs against both engines."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def vllm(model_dir):
    """The shared vLLM server: max 2 LoRA slots, 4 cached adapters, 4 MB body limit,
    3 versions kept per name, admin routes behind an API key."""
    server = _vllm(model_dir, max_loras=2, max_cpu_loras=4, env=SERVER_ENV)
    server.api_key = API_KEY
    with server:
        yield server


@pytest.fixture(scope="session")
def vllm_second(model_dir):
    """A second vLLM server, for one group across two servers."""
    with _vllm(model_dir) as server:
        yield server


@pytest.fixture
def client(server):
    from lora_sync import LoRASyncClient
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as c:
        yield c
    assert server.alive(), f"the {server.engine} server died during the test:\n" + server.log_tail()
