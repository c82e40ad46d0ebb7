"""The server's files in shared places are private: another local user (uid 65534, run with
setpriv) can neither pre-create, replace, link, list nor reach them, and a root where privacy
cannot be had stops the server at start-up. In process; the attacker is a real process of
another user."""
from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile

import pytest
import torch

from lora_sync import private_dir, wire
from lora_sync.private_dir import NotPrivate
from lora_sync.staging import BodyLimits, StagingArea

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="the attacker runs as another uid: needs root and setpriv")


def as_nobody(script: str, *args: str) -> subprocess.CompletedProcess:
    """Runs a shell script as uid/gid 65534, without root's groups."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "sh", "-c", script, "sh", *args],
                          capture_output=True, text=True, timeout=30)


@pytest.fixture
def shared_root():
    """A directory like /dev/shm: everyone may write, sticky."""
    root = tempfile.mkdtemp(prefix="ls-shared-")
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def body(seed: int = 0) -> bytes:
    t = {"x.lora_A.weight": torch.full((4, 8), float(seed))}
    return b"".join(bytes(c) for c in wire.encode(t, {"format": "pt"}))


async def chunks_of(data: bytes):
    yield data


def receive(area: StagingArea, data: bytes):
    limits = BodyLimits(max_body=1 << 20, max_inflight=1 << 22)
    return asyncio.run(area.receive_body(chunks_of(data), limits, len(data)))


def owned_private(path: str) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700


@needs_root
def test_predictable_names_planted_by_another_user_are_never_used(shared_root):
    """The old name (`lora-sync-staging-<pid>`) and guesses of the new one, pre-created by
    another user with links to a root-only file, are left alone: the area makes its own."""
    victim = os.path.join(shared_root, "victim")
    with open(victim, "wb") as f:
        f.write(b"root only")
    os.chmod(victim, 0o600)
    pid = os.getpid()
    planted = as_nobody('cd "$1" && mkdir -m 777 lora-sync-staging-$2 && '
                        'ln -s "$3" lora-sync-staging-$2/f && ln -s "$1" lora-sync-staging-$2-aaaa'
                        ' && ln -s "$3" lora-sync-staging-$2-bbbb', shared_root, str(pid), victim)
    assert planted.returncode == 0, planted.stderr
    area = StagingArea(spare=2, root=shared_root, map_kept=False)
    try:
        assert owned_private(area.dir)
        assert os.path.basename(area.dir) not in (f"lora-sync-staging-{pid}",)
        for seed in range(3):
            staged = receive(area, body(seed))
            assert os.path.dirname(staged.path) == area.dir
            area.recycle(staged.path)
        with open(victim, "rb") as f:
            assert f.read() == b"root only"
        assert os.listdir(os.path.join(shared_root, f"lora-sync-staging-{pid}")) == ["f"]
    finally:
        area.close()
    assert not os.path.exists(area.dir)


@needs_root
def test_another_user_can_neither_list_nor_enter_nor_swap_staged_files(shared_root):
    area = StagingArea(spare=2, root=shared_root, map_kept=False)
    try:
        staged = receive(area, body(1))
        area.recycle(staged.path)  # kept for the next body: the file a swap would target
        for script in ('ls "$1"', 'touch "$1/x"', 'ln -sf /etc/shadow "$2"', 'rm -f "$2"',
                       'mv "$1" "$1.moved"', 'cat "$2"'):
            got = as_nobody(script, area.dir, staged.path)
            assert got.returncode != 0, script
        assert os.path.isfile(staged.path) and not os.path.islink(staged.path)
        assert receive(area, body(2)).path == staged.path  # reused, still ours
    finally:
        area.close()


@pytest.mark.parametrize("setup, message", [
    (lambda d: os.chmod(d, 0o777), "sticky"),
    (lambda d: os.chown(d, NOBODY, NOBODY), "belongs to uid"),
    (lambda d: (os.rmdir(d), os.symlink("/tmp", d)), "not a directory"),
    (lambda d: os.rmdir(d), "cannot be used"),
])
def test_a_root_where_privacy_cannot_be_had_stops_the_server(shared_root, setup, message):
    root = os.path.join(shared_root, "root")
    os.mkdir(root)
    if "uid" in message and os.geteuid() != 0:
        pytest.skip("chown needs root")
    setup(root)
    with pytest.raises(NotPrivate, match=message):
        StagingArea(root=root)


def test_a_private_directory_changed_under_us_is_refused(shared_root):
    path = private_dir.private_dir(shared_root)
    try:
        os.chmod(path, 0o755)
        with pytest.raises(NotPrivate, match="mode 0700"):
            private_dir.private_dir(shared_root)
    finally:
        private_dir.forget(shared_root)


@needs_root
def test_the_orphan_sweep_touches_only_this_users_directories(shared_root):
    """Dead-pid names: ours is swept; another user's directory and a link are left alone."""
    dead = 2 ** 22 + 1  # above pid_max's default: no such process
    ours = os.path.join(shared_root, f"lora-sync-staging-{dead}-ours")
    os.mkdir(ours, 0o700)
    got = as_nobody('mkdir "$1/lora-sync-staging-$2-theirs" && '
                    'ln -s "$3" "$1/lora-sync-staging-$2-link"', shared_root, str(dead), ours)
    assert got.returncode == 0, got.stderr
    keep = os.path.join(ours, "inside")
    open(keep, "w").close()
    os.chown(ours, NOBODY, NOBODY)  # now another user's: must survive
    private_dir.remove_orphans(shared_root)
    assert os.path.exists(keep)
    assert os.path.isdir(os.path.join(shared_root, f"lora-sync-staging-{dead}-theirs"))
    os.chown(ours, 0, 0)
    private_dir.remove_orphans(shared_root)
    assert not os.path.exists(ours)
    assert os.path.islink(os.path.join(shared_root, f"lora-sync-staging-{dead}-link"))
