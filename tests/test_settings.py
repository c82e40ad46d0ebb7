"""Every operator setting lives in one table (lora_sync/server/settings.py): read once at
start-up, typed and range-checked, its defaults the Settings dataclass's, and each one
documented in docs/operations.md."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from lora_sync.server.settings import SETTINGS, Settings

REPO = Path(__file__).resolve().parents[1]


def test_the_tables_defaults_are_the_dataclasss():
    declared = {f.name: f.default for f in dataclasses.fields(Settings)}
    for s in SETTINGS:
        default = s.default if s.default is None or s.kind in (str, bool, tuple) \
            else s.kind(s.default * s.scale)
        assert declared[s.field] == default, s.env


def test_an_empty_environment_gives_the_defaults():
    with mock.patch.dict(os.environ, {s.env: "" for s in SETTINGS}):
        assert Settings.from_env() == Settings()


@pytest.mark.parametrize("env, value", [
    ("LORA_SYNC_KEEP_VERSIONS", "0"), ("LORA_SYNC_KEEP_VERSIONS", "2.5"),
    ("LORA_SYNC_MAX_BODY_MB", "nan"), ("LORA_SYNC_MAX_BODY_MB", "-1"),
    ("LORA_SYNC_MAX_LEASES", "1e9"), ("LORA_SYNC_MAX_GROUPS", "0"),
    ("LORA_SYNC_LEASE_TTL_S", "inf"), ("LORA_SYNC_CHECK_FINITE", "yes"),
    ("LORA_SYNC_SOCKET_BODY", "2"), ("LORA_SYNC_ALLOWED_TRAINERS", "10.0.0.0/8,nowhere"),
])
def test_a_value_out_of_range_stops_the_server_naming_the_variable(env, value):
    with mock.patch.dict(os.environ, {env: value}), pytest.raises(RuntimeError, match=env):
        Settings.from_env()


def test_values_are_read_in_the_fields_units():
    env = {"LORA_SYNC_MAX_BODY_MB": "4", "LORA_SYNC_MAX_LEASES": "3",
           "LORA_SYNC_CHECK_FINITE": "1", "LORA_SYNC_ALLOWED_TRAINERS": "10.1.0.0/16, ::1"}
    with mock.patch.dict(os.environ, env):
        s = Settings.from_env()
    assert (s.max_body_bytes, s.max_leases, s.check_finite, s.allowed_trainers) == \
        (4 << 20, 3, True, ("10.1.0.0/16", "::1"))


def test_every_setting_is_documented_and_every_documented_one_exists():
    """Each setting has one row of the settings table (a mention in prose is not enough),
    and the doc names no variable that lora-sync does not read."""
    doc = (REPO / "docs" / "operations.md").read_text()
    table = re.search(r"^## Settings\n(.*?)(?=^#|^Also read:)", doc, re.M | re.S)
    assert table, "docs/operations.md has no '## Settings' section"
    rows = re.findall(r"^\| `(LORA_SYNC_[A-Z_]+)` \|", table.group(1), re.M)
    assert sorted(rows) == sorted(s.env for s in SETTINGS), (
        "settings table rows vs Settings: "
        f"missing {sorted({s.env for s in SETTINGS} - set(rows))}, rows {sorted(rows)}")
    documented = set(re.findall(r"`(LORA_SYNC_[A-Z_]+)`", doc))
    known = {s.env for s in SETTINGS} | {"LORA_SYNC_ALLOW_UNTESTED_ENGINE", "LORA_SYNC_SERVERS",
                                         "LORA_SYNC_FULL_GC"}
    assert documented <= known, documented - known


def test_no_module_reads_the_environment_at_import():
    """Importing every server-side module with a poisoned environment changes nothing:
    nothing is read before Settings.from_env."""
    code = ("import lora_sync.server.service, lora_sync.staging, lora_sync.notices, "
            "worker_extensions.receiver, worker_extensions.dispatcher, lora_sync.server.settings"
            " as s; import lora_sync.staging as st; print(st.SHM_DIR)")
    env = {**os.environ, **{x.env: "poison" for x in SETTINGS}}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "/dev/shm"
