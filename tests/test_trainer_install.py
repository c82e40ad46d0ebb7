"""The trainer side installs anywhere: `pip install lora-sync` (no extra) brings the client,
the CLI and the transports' senders with torch and safetensors, and nothing of vLLM, SGLang,
FastAPI or uvicorn. A fresh venv with only that (torch from the local wheel folder) pushes
to the session's real vLLM server by tensors and by broadcast, and the two serve the same
tokens. Extended set: building the venv installs torch (a few hundred MB), which CI's time
budget leaves out; the import check runs in CI in process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import REPO

SERVER_SIDE = ("fastapi", "starlette", "uvicorn", "vllm", "sglang")


def test_the_trainer_side_imports_nothing_of_a_server():
    """In a fresh interpreter: the package, the client, the CLI and the sharded push."""
    code = ("import sys, lora_sync, lora_sync.trainer.cli, lora_sync.trainer.sharded, "
            "lora_sync.transports.broadcast, lora_sync.integrations.transformers; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({SERVER_SIDE!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


PUSH = textwrap.dedent('''
    import json, sys, torch
    from lora_sync import LoRAAdapter, LoRASyncClient
    url, key = sys.argv[1], sys.argv[2]
    with LoRASyncClient(url, engine="vllm", api_key=key) as c:
        info = c.info()[0]
        g = torch.Generator().manual_seed(7)
        tensors = {}
        for m, (fan_in, fan_out) in sorted(info["linear_modules"].items())[:6]:
            tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(4, fan_in, generator=g)
            tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(fan_out, 4, generator=g) * .5
        adapter = LoRAAdapter(tensors, {"r": 4, "lora_alpha": 8})
        out = {}
        [r] = c.push(adapter, "fresh-venv-tensors", transport="tensors")
        out["tensors"] = c.complete("the quick brown", r.name, 8)["text"]
        c.init_group(group_name="fresh-venv", timeout_s=60)
        try:
            [r] = c.broadcast(adapter, "fresh-venv-broadcast")
        finally:
            c.destroy_group()
        out["broadcast"] = c.complete("the quick brown", r.name, 8)["text"]
        out["base"] = c.complete("the quick brown", "base", 8)["text"]
        for name in ("fresh-venv-tensors", "fresh-venv-broadcast"):
            c.retire(name)
    print(json.dumps(out))
''')


@pytest.mark.extended  # CI time: the venv installs torch
def test_a_fresh_venv_with_only_the_trainer_side_pushes(vllm, tmp_path):
    venv = tmp_path / "trainer"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    env = {**os.environ, "PIP_FIND_LINKS": os.environ.get("PIP_FIND_LINKS", "/opt/wheels")}
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "torch==2.13.0", str(REPO)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert pip.returncode == 0, pip.stderr[-3000:]
    check = subprocess.run([py, "-c", "import importlib.util as u; print([m for m in "
                            f"{SERVER_SIDE!r} if u.find_spec(m)])"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert check.stdout.strip() == "[]", check.stdout + check.stderr
    script = tmp_path / "push.py"
    script.write_text(PUSH)
    run = subprocess.run([py, str(script), vllm.url, vllm.api_key], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["tensors"] == out["broadcast"] != out["base"], out
