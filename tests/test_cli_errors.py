"""The `lora-sync` command against lora-sync's real server stack on the fake engine
(tests/engine_fakes.py; no vLLM or SGLang), some of it answering garbage (canned replies):
bad input exits 2 with a message, a server's failure is that server's (exit 1, named), the
others still get the command, and nothing ends in a traceback."""
from __future__ import annotations

import json
import os

import pytest

from lora_sync.trainer import cli

from .engine_fakes import FakeEngineServer
from .fakes import dead_url


@pytest.fixture
def adapter_dir(tmp_path, make_adapter):
    make_adapter(1, rank=2).save(tmp_path / "a")
    return str(tmp_path / "a")


def fake(engine: str = "vllm", api_key: str | None = None, **kw) -> FakeEngineServer:
    """lora-sync on the fake engine, its routes where `engine` has them, keyed or not."""
    return FakeEngineServer(engine=engine, api_key=api_key, **kw)


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
    with fake() as a, fake("sglang") as b:
        monkeypatch.setenv("LORA_SYNC_SERVERS", f" {a.url}{separator}{b.url} ")
        rc, out, err = run(capsys, "ls")
    assert rc == 0, err
    assert f"{a.url}  (instance {a.instance_id[:12]}" in out and b.url in out


def test_one_dead_server_does_not_stop_the_push_to_the_others(capsys, adapter_dir):
    dead = dead_url()
    with fake() as a, fake("sglang") as b:
        rc, out, err = run(capsys, "--server", a.url, "--server", dead, "--server", b.url,
                           "push", adapter_dir, "--name", "p")
        assert rc == 1
        assert a.served() == b.served() == {"p": [1]}
        assert f"{a.url}  p-v1  " in out and f"{b.url}  p-v1  " in out  # the transport `auto` took
        assert f"{dead}  FAILED  unreachable" in out
        assert err.count("lora-sync: error:") == 1 and dead in err and "unreachable" in err
        # With the engine given, the same: the live servers get the next version.
        rc, out, err = run(capsys, "--engine", "vllm", "--server", a.url, "--server", dead,
                           "push", adapter_dir, "--name", "q")
        assert rc == 1 and a.served()["q"] == [1] and dead in err
        # resync: the fleet's newest to the server lacking it; the dead one is named.
        rc, out, err = run(capsys, "--server", a.url, "push", adapter_dir, "--name", "p")
        assert rc == 0 and a.served()["p"] == [1, 2], err
        rc, out, err = run(capsys, "--server", a.url, "--server", b.url, "--server", dead,
                           "resync", adapter_dir, "--name", "p")
        assert rc == 1 and b.served()["p"] == [1, 2], (out, err)
        assert f"{a.url}  has p-v2" in out and f"{b.url}  pushed p-v2" in out and dead in err


def test_a_bad_listing_or_a_wrong_key_names_the_server(capsys):
    garbage = {"lora_adapters": (200, {"adapters": "none"}),
               "lora_sync_info": (200, ["not", "an", "object"])}
    with fake(canned=garbage) as bad, fake(api_key="right") as keyed, fake() as good:
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
