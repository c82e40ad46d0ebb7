"""The `lora-sync` command end to end against the real servers (both engines): push, ls, info,
resync, and bad input that exits non-zero with a clear message. The commands run in this
process (`cli.main`); one run through `python -m` proves the entry point."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lora_sync.trainer import cli

from .conftest import API_KEY, REPO


def lora_sync(capsys, monkeypatch, server, *args, key=API_KEY):
    monkeypatch.setenv("LORA_SYNC_API_KEY", key)
    rc = cli.main(["--server", server.url, *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def adapter_dir(make_adapter, tmp_path):
    make_adapter(601).save(tmp_path / "adapter")
    return str(tmp_path / "adapter")


def test_cli_push_ls_info_resync(capsys, monkeypatch, server, adapter_dir):
    def run(*args):
        return lora_sync(capsys, monkeypatch, server, *args)
    rc, out, err = run("push", adapter_dir, "--name", "cli")
    assert rc == 0, err
    assert "cli-v1" in out
    rc, out, err = run("push", adapter_dir, "--name", "cli", "--transport", "tensors")
    assert rc == 0 and "cli-v2" in out and "tensors" in out, (out, err)

    rc, out, err = run("ls")
    assert rc == 0, err
    assert "cli -> cli-v2: cli-v1 (0 in flight), cli-v2 (0 in flight)" in out

    rc, out, err = run("info")
    assert rc == 0, err
    info = json.loads(out)
    assert info["engine"] == server.engine and len(info["instance_id"]) == 32

    rc, out, err = run("resync", adapter_dir, "--name", "cli")
    assert rc == 0 and f"{server.url}  has cli-v2" in out, (out, err)


def test_cli_bad_input_exits_non_zero_with_a_clear_message(capsys, monkeypatch, vllm,
                                                            adapter_dir, tmp_path):
    def run(*args, key=API_KEY):
        return lora_sync(capsys, monkeypatch, vllm, *args, key=key)
    rc, out, err = run("push", str(tmp_path / "nowhere"), "--name", "cli-bad")
    assert rc == 2 and "not a PEFT adapter directory" in err
    rc, out, err = run("push", adapter_dir, "--name", "bad name!")
    assert rc == 1 and "bad_name" in err and vllm.url in err
    rc, out, err = run("ls", key="wrong-key")
    assert rc == 1 and "unauthorized" in err
    rc, out, err = run("resync", adapter_dir, "--name", "cli-never-pushed")
    assert rc == 2 and "use push" in err
    proc = subprocess.run([sys.executable, "-m", "lora_sync.trainer.cli", "push"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "required" in proc.stderr  # argparse usage error
