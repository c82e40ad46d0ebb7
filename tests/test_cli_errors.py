"""The `lora-sync` command against fake servers on 127.0.0.1 (tests/fakes.py; no vLLM or
SGLang): bad input exits 2 with a message, a server's failure is that server's (exit 1,
named), the others still get the command, and nothing ends in a traceback."""
from __future__ import annotations

import json
import os

import pytest
import torch

from lora_sync import LoRAAdapter
from lora_sync.trainer import cli

from .fakes import FakeLoRASync, dead_url

MODULE = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture
def adapter_dir(tmp_path):
    LoRAAdapter({f"{MODULE}.lora_A.weight": torch.randn(2, 8),
                 f"{MODULE}.lora_B.weight": torch.randn(8, 2)},
                {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}).save(tmp_path / "a")
    return str(tmp_path / "a")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("LORA_SYNC_SERVERS", raising=False)
    monkeypatch.delenv("LORA_SYNC_API_KEY", raising=False)


def run(capsys, *argv):
    rc = cli.main(["--timeout", "5", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def test_bad_urls_and_unreadable_adapters_exit_2(capsys, monkeypatch, adapter_dir, tmp_path):
    rc, _, err = run(capsys, "--server", "not a url", "ls")
    assert rc == 2 and "not a server URL" in err and "'not a url'" in err
    monkeypatch.setenv("LORA_SYNC_SERVERS", "http://127.0.0.1:1,ftp://x")
    rc, _, err = run(capsys, "ls")
    assert rc == 2 and "ftp://x" in err and "LORA_SYNC_SERVERS" in err
    with open(os.path.join(adapter_dir, "adapter_model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 16)  # a corrupt header length
    rc, _, err = run(capsys, "--server", dead_url(), "push", adapter_dir, "--name", "p")
    assert rc == 2 and "cannot read the adapter" in err
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        f.write("{not json")
    rc, _, err = run(capsys, "--server", dead_url(), "push", adapter_dir, "--name", "p")
    assert rc == 2 and "cannot read the adapter" in err


@pytest.mark.parametrize("separator", [" ", ",", ", ", "\n"])
def test_lora_sync_servers_takes_commas_and_or_whitespace(capsys, monkeypatch, separator):
    with FakeLoRASync() as a, FakeLoRASync(engine="sglang") as b:
        monkeypatch.setenv("LORA_SYNC_SERVERS", f" {a.url}{separator}{b.url} ")
        rc, out, err = run(capsys, "ls")
    assert rc == 0, err
    assert f"{a.url}  (instance {a.instance_id[:12]}" in out and b.url in out


def test_one_dead_server_does_not_stop_the_push_to_the_others(capsys, adapter_dir):
    dead = dead_url()
    with FakeLoRASync() as a, FakeLoRASync(engine="sglang") as b:
        rc, out, err = run(capsys, "--server", a.url, "--server", dead, "--server", b.url,
                           "push", adapter_dir, "--name", "p")
        assert rc == 1
        assert a.versions == b.versions == {"p": [1]}
        assert f"{a.url}  p-v1  tensors" in out and f"{b.url}  p-v1  tensors" in out
        assert f"{dead}  FAILED  unreachable" in out
        assert err.count("lora-sync: error:") == 1 and dead in err and "unreachable" in err
        # With the engine given, the same: the live servers get the next version.
        rc, out, err = run(capsys, "--engine", "vllm", "--server", a.url, "--server", dead,
                           "push", adapter_dir, "--name", "q")
        assert rc == 1 and a.versions["q"] == [1] and dead in err
        # resync: the fleet's newest to the server lacking it; the dead one is named.
        a.versions["p"].append(2)
        rc, out, err = run(capsys, "--server", a.url, "--server", b.url, "--server", dead,
                           "resync", adapter_dir, "--name", "p")
        assert rc == 1 and b.versions["p"] == [1, 2], (out, err)
        assert f"{a.url}  has p-v2" in out and f"{b.url}  pushed p-v2" in out and dead in err


def test_a_bad_listing_or_a_wrong_key_names_the_server(capsys):
    garbage = {"lora_adapters": lambda req: req.reply(200, {"adapters": "none"}),
               "lora_sync_info": lambda req: req.reply(200, ["not", "an", "object"])}
    with FakeLoRASync(routes=garbage) as bad, FakeLoRASync(api_key="right") as keyed, \
            FakeLoRASync() as good:
        rc, out, err = run(capsys, "--server", bad.url, "--server", good.url, "ls")
        assert rc == 1 and f"bad_reply: {bad.url}" in err and "(no adapters)" in out
        rc, out, err = run(capsys, "--server", bad.url, "info")
        assert rc == 1 and "error: bad_reply: " in err and bad.url in err
        rc, out, err = run(capsys, "--server", good.url, "info")
        assert rc == 0 and json.loads(out)["workers"] == 1
        rc, out, err = run(capsys, "--api-key", "wrong", "--server", keyed.url, "ls")
        assert rc == 1 and "unauthorized" in err and keyed.url in err
        rc, out, err = run(capsys, "--api-key", "right", "--server", keyed.url, "ls")
        assert rc == 0, err


def test_every_server_dead_exits_1_naming_each(capsys, adapter_dir):
    dead = [dead_url(), dead_url()]
    rc, out, err = run(capsys, "--server", dead[0], "--server", dead[1], "push", adapter_dir,
                       "--name", "p")
    assert rc == 1 and all(u in err for u in dead) and err.count("unreachable") == 2
