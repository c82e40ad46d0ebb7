"""The server's files in shared places are private: another local user (uid 65534, run with
setpriv) can neither pre-create, replace, link, list nor reach them, and a root where privacy
cannot be had stops the server at start-up; the Prometheus state snapshot is never written
where another user could swap it, and the trainer never opens a lease path that is not a
memfd. In process; the attacker is a real process of another user."""
from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lora_sync import private_dir, wire
from lora_sync.private_dir import NotPrivate
from lora_sync.staging import BodyLimits, StagingArea
from lora_sync.transports.shm.messages import Lease, MEMFD_NAME, PROBE_BYTES
from lora_sync.transports.shm.trainer import open_lease

from .conftest import REPO

NOBODY = 65534


def require(ok: bool, why: str) -> None:
    """Skips where `ok` is false, but fails in CI (env CI set), where a skipped test of
    these boundaries would pass unrun."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{why}, and CI must run the local-user tests")
    pytest.skip(why)


def require_another_user() -> None:
    require(os.geteuid() == 0 and shutil.which("setpriv") is not None,
            "the attacker runs as another uid: needs root and setpriv")


def needs_root(test):
    """Decorator: the test runs only where require_another_user() allows."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        require_another_user()
        return test(*args, **kwargs)
    return run


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
    if "uid" in message:
        require_another_user()  # chown to another uid needs root
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
    dead = f"{2 ** 22 + 1}-{private_dir.pid_namespace()}"  # no such process (pid_max)
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


def test_the_orphan_sweep_leaves_other_pid_namespaces_alone(shared_root):
    """A server in a PID namespace of its own (a container sharing /dev/shm) sees no process
    by the pid of ours: its sweep must not take our live directory for an orphan."""
    require(os.geteuid() == 0 and shutil.which("unshare") is not None,
            "needs root and unshare(1) for a PID namespace of its own")
    ours = private_dir.private_dir(shared_root)
    try:
        sweep = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
             "import sys; from lora_sync import private_dir; "
             "private_dir.remove_orphans(sys.argv[1])", shared_root],
            capture_output=True, text=True, timeout=60, cwd=REPO)
        assert sweep.returncode == 0, sweep.stderr
        assert os.path.isdir(ours), "another namespace's sweep removed a live directory"
    finally:
        private_dir.forget(shared_root)


def test_an_unsafe_root_is_refused_before_the_sweep_touches_it(shared_root):
    """The orphan sweep lists and removes entries of the root: a root others may rename
    entries in stops the server before the sweep acts on what they could have put there."""
    root = os.path.join(shared_root, "root")
    orphan = os.path.join(root, f"{private_dir.PREFIX}{2 ** 22 + 1}-"  # a dead pid
                          f"{private_dir.pid_namespace()}-ours")
    os.makedirs(orphan, 0o700)
    os.chmod(root, 0o777)
    with pytest.raises(NotPrivate, match="sticky"):
        StagingArea(root=root)
    assert os.path.isdir(orphan)


# -- the Prometheus state snapshot (lora_sync/server/metrics.py), in a directory the engine
# names (PROMETHEUS_MULTIPROC_DIR) under a predictable name --------------------------------
def snapshot_with_warnings(directory: str, monkeypatch):
    from lora_sync.server import metrics
    warned = []
    monkeypatch.setattr(metrics.logger, "warning", lambda *a: warned.append(a))
    return metrics._Snapshot(directory), warned


def plant_links(directory: str, victim: str) -> None:
    """Another user's links to `victim` at the snapshot's name and at the name its
    temporary file once had."""
    got = as_nobody('ln -s "$2" "$1/gauge_livesum_lorasync$3.db" && '
                    'ln -s "$2" "$1/gauge_livesum_lorasync$3.tmp"',
                    directory, victim, str(os.getpid()))
    assert got.returncode == 0, got.stderr


@pytest.fixture
def victim(shared_root):
    path = os.path.join(shared_root, "victim")
    with open(path, "wb") as f:
        f.write(b"root only")
    os.chmod(path, 0o600)
    return path


@needs_root
@pytest.mark.parametrize("hostile", ["world-writable, not sticky", "another user's"])
def test_the_metrics_snapshot_is_not_written_where_another_user_can_swap_it(
        shared_root, victim, monkeypatch, hostile):
    directory = os.path.join(shared_root, "multiproc")
    if hostile == "another user's":
        assert as_nobody('mkdir -m 755 "$1"', directory).returncode == 0
    else:
        os.mkdir(directory)
        os.chmod(directory, 0o777)
    plant_links(directory, victim)
    snapshot, warned = snapshot_with_warnings(directory, monkeypatch)
    for _ in range(3):
        snapshot.write()
    assert len(warned) == 1 and "PROMETHEUS_MULTIPROC_DIR" in warned[0][-1].args[0], warned
    assert not any(os.lstat(e.path).st_uid == os.geteuid() for e in os.scandir(directory)), \
        "the snapshot was written"
    with open(victim, "rb") as f:
        assert f.read() == b"root only"


@needs_root
def test_the_metrics_snapshot_in_a_sticky_shared_directory_is_a_file_of_ours(
        shared_root, victim, monkeypatch):
    """Where others may write but not rename our entries (sticky), the snapshot is written,
    into a file made here: never through another user's link at either name."""
    from prometheus_client.mmap_dict import MmapedDict
    plant_links(shared_root, victim)
    snapshot, warned = snapshot_with_warnings(shared_root, monkeypatch)
    snapshot.write()
    snapshot.write()
    assert not warned
    st = os.lstat(snapshot.path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
    MmapedDict(snapshot.path, read_mode=True).close()  # the collector's format
    with open(victim, "rb") as f:
        assert f.read() == b"root only"
    ours = [e.name for e in os.scandir(shared_root) if e.name.startswith("lorasync")]
    assert not ours, f"temporary files left behind: {ours}"
    snapshot.remove()
    assert not os.path.lexists(snapshot.path)


# -- the trainer's side of shm (lora_sync/transports/shm/trainer.py): a lease path names a
# descriptor of the server's process, whatever that process put there ------------------------
IN_OPEN, IN_NONBLOCK = 0x20, os.O_NONBLOCK


def opens_of(path: str):
    """Starts counting opens of `path`'s file (inotify); returns a function that says whether
    any came since."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(IN_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, path.encode(), IN_OPEN) >= 0, \
        os.strerror(ctypes.get_errno())

    def opened() -> bool:
        try:
            return bool(os.read(fd, 4096))
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
    return opened


def lease_at(fd: int, nbytes: int, probe: bytes) -> Lease:
    return Lease("0" * 32, "0" * 64, f"/proc/{os.getpid()}/fd/{fd}", probe.hex(), nbytes, 3.0)


@pytest.mark.parametrize("kind", ["fifo", "file on disk"])
def test_the_trainer_never_opens_a_lease_path_that_is_not_a_memfd(tmp_path, kind):
    """A FIFO or a named file at the lease's descriptor is refused before it is opened (an
    open may have effects, or block), and a real lease memfd is still opened."""
    probe = os.urandom(PROBE_BYTES)
    path = str(tmp_path / "planted")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.write(probe + bytes(4096 - PROBE_BYTES))
    held = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # as the server's process holds it
    try:
        opened = opens_of(path)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(open_lease, lease_at(held, 4096, probe)).result(timeout=10) \
                is None
        assert not opened(), f"the trainer opened a {kind}"
    finally:
        os.close(held)
    memfd = os.memfd_create(MEMFD_NAME)
    try:
        os.write(memfd, probe + bytes(4096 - PROBE_BYTES))
        fd = open_lease(lease_at(memfd, 4096, probe))
        assert fd is not None
        os.close(fd)
    finally:
        os.close(memfd)
