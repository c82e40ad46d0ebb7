"""Transport `shared`: one sealed copy of a push for every server on the trainer's host
(lora_sync/transports/shared_copy.py), in process on the FAKE engine (several fake servers
in this process, each with its own service, routes and workers). The attacks: a trainer that
writes after sealing (the kernel refuses), files missing a seal, a file that shrinks or is
not the size declared, paths naming another process's descriptor or something that is not
a memfd, the trainer killed while servers map the file; and a hypothesis over random fleets
with random refusals: each server serves exactly the version it acknowledged, and no
shared file outlives its last reader."""
from __future__ import annotations

import fcntl
import gc
import glob
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import LoRASyncClient, LoRASyncError, http, wire
from lora_sync.transports import shared_copy
from lora_sync.transports.shared_copy import MEMFD_PREFIX, SEALS, memfd_name, write_sealed

from .conftest import REPO
from .engine_fakes import FakeEngineServer, served_text
from .helpers import AUTH, retire_if_held, wait_until

NAME_MARK = f"/memfd:{MEMFD_PREFIX}"
F_SEAL_FUTURE_WRITE = 0x0010  # linux/fcntl.h (Python's fcntl lacks it)


# -- what the host holds --------------------------------------------------------------------
def _own() -> str:
    return str(os.getpid())


def shared_fds(pid: str | None = None) -> list[tuple[str, int]]:
    """(path, inode) of every open descriptor of a shared copy in process `pid` (default:
    this one, where the fake servers and their workers run; other test runs on the host
    make their own)."""
    pid = pid or _own()
    out = []
    for path in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            if os.readlink(path).startswith(NAME_MARK):
                out.append((path, os.stat(path).st_ino))
        except OSError:
            pass  # closed meanwhile, or another user's
    return out


def shared_maps(pid: str | None = None) -> int:
    """How many mappings of a shared copy process `pid` holds (default: this one)."""
    pid = pid or _own()
    n = 0
    for path in glob.glob(f"/proc/{pid}/maps"):
        try:
            with open(path) as f:
                n += sum(MEMFD_PREFIX in line for line in f)
        except OSError:
            pass
    return n


def readers_gone() -> bool:
    gc.collect()  # a worker's mapping goes with its last tensor view
    return not shared_fds() and shared_maps() == 0


def parts_of(adapter, name: str, version=None) -> list:
    return wire.layout(adapter.tensors, adapter.metadata(name, version))


def post_shared(server, body: dict) -> tuple[int, dict]:
    status, reply, _ = http.request("POST", f"{server.url}/v1/{shared_copy.SHARED_ROUTE}",
                                    json_body=body, headers=AUTH)
    return status, reply


def code_of(reply: dict) -> str | None:
    return (reply.get("error") or {}).get("code")


def text(client, model: str, server: int = 0) -> str:
    return client.complete("the quick brown", model, 12, server=server)["text"]


def hand_made(parts: list, seals: int, claim: str | None = None, extra: int = 0):
    """A memfd named as a shared copy, holding `parts` (plus `extra` zero bytes), sealed with
    `seals` only: (fd, request body)."""
    import secrets
    claim = claim or secrets.token_hex(32)
    fd = os.memfd_create(memfd_name(claim), os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    data = b"".join(p if isinstance(p, bytes) else
                    p.contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
                    for p in parts)
    os.write(fd, data + b"\0" * extra)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd, {"path": f"/proc/{os.getpid()}/fd/{fd}", "nbytes": len(data) + extra,
                "claim": claim}


@pytest.fixture(scope="module")
def fleet():
    """Four fake servers in this process, shared by the module's tests."""
    servers = [FakeEngineServer().start() for _ in range(4)]
    yield servers
    for s in servers:
        s.stop()
    for s in servers:
        assert not s.bridge.violations, s.bridge.violations


@pytest.fixture(autouse=True)
def drained(fleet):
    """After each test: every name retired on every server, and no shared copy left."""
    yield
    with LoRASyncClient([s.url for s in fleet], api_key=fleet[0].api_key,
                        lease_ahead=False) as c:
        for i, server in enumerate(fleet):
            for entry in c.adapters()[i]["adapters"]:
                try:
                    http.call("POST", server.url + "/v1/retire_lora_adapter",
                              json_body={"lora_name": entry["name"]}, headers=AUTH)
                except LoRASyncError:
                    pass
        wait_until(lambda: all(not a["adapters"] for a in c.adapters()), 15,
                   "every name drained")
    for s in fleet:
        for w in s.bridge.workers:
            w.engine.refuse = None
    wait_until(readers_gone, 15, "no shared copy left open or mapped")


# -- one copy --------------------------------------------------------------------------------
def test_one_sealed_copy_for_every_server(fleet, make_adapter):
    """A push to three servers writes one file: the three servers hold a descriptor each of
    the same inode, the trainer none once the push returned (its resync copy is a
    read-only mapping), and every server serves the pushed weights."""
    servers = fleet[:3]
    a = make_adapter(seed=4601)
    with LoRASyncClient([s.url for s in servers], api_key=servers[0].api_key) as c:
        results = c.push(a, "one", transport="shared")
        assert [r.transport for r in results] == ["shared"] * 3
        held = shared_fds(str(os.getpid()))
        assert len(held) == 3 and len({ino for _, ino in held}) == 1, held
        for i in range(3):
            assert text(c, "one", i) == served_text(a)
        # the client's resync copy: that very file, mapped read-only once for the push
        assert results[0].kept is not None and all(r.kept is results[0].kept for r in results)
        b = make_adapter(seed=4602)
        assert [r.transport for r in c.push(b, "one")] == ["shared"] * 3  # auto, 3 servers
        assert len({ino for _, ino in shared_fds(str(os.getpid()))}) == 2
    with LoRASyncClient(servers[0].url, api_key=servers[0].api_key) as c:
        # one server: auto takes shm (its lease readied ahead), not a copy of the trainer's
        assert c.push(make_adapter(seed=4603), "one")[0].transport == "shm"


# -- the kernel's seals ------------------------------------------------------------------------
def test_a_trainer_cannot_write_after_sealing(fleet, make_adapter):
    """Once sealed, the kernel refuses every way to change the file, through the trainer's
    own descriptor and through a new one: write, pwrite, a writable shared mapping,
    truncate (shrink and grow), fallocate, and removing or adding seals. The servers serve
    the bytes as sealed."""
    a = make_adapter(seed=4611)
    shared = write_sealed(parts_of(a, "sealed", 1))
    try:
        assert fcntl.fcntl(shared.fd, fcntl.F_GET_SEALS) == SEALS
        reopened = os.open(f"/proc/self/fd/{shared.fd}", os.O_RDWR)
        for fd in (shared.fd, reopened):
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"\xff" * 64, 4096)
            with pytest.raises(PermissionError):
                os.write(fd, b"\xff" * 64)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, shared.nbytes, flags=mmap.MAP_SHARED,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, shared.nbytes - 4096)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, shared.nbytes + 4096)
            with pytest.raises(PermissionError):
                os.posix_fallocate(fd, shared.nbytes, 4096)
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        os.close(reopened)
        assert os.fstat(shared.fd).st_size == shared.nbytes
        status, reply = post_shared(fleet[0], shared.request())
        assert status == 200, reply
        status, reply = post_shared(fleet[1], shared.request())
        assert status == 200, reply
    finally:
        shared.close()
    with LoRASyncClient([s.url for s in fleet[:2]], api_key=fleet[0].api_key) as c:
        assert text(c, "sealed", 0) == text(c, "sealed", 1) == served_text(a)


@pytest.mark.parametrize("seals", [0, SEALS & ~fcntl.F_SEAL_WRITE,
                                   SEALS & ~fcntl.F_SEAL_SHRINK, SEALS & ~fcntl.F_SEAL_GROW,
                                   SEALS & ~fcntl.F_SEAL_SEAL,
                                   F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK |
                                   fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL])
def test_a_file_missing_a_seal_is_refused(fleet, make_adapter, seals):
    """Every seal is required (F_SEAL_FUTURE_WRITE does not stand for F_SEAL_WRITE: a
    mapping made before it could still write): 400 bad_shared_file naming the missing
    ones; the server keeps nothing of it and serves what it served."""
    server = fleet[0]
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        before = make_adapter(seed=4620)
        c.push(before, "seals", transport="tensors")
        fd, body = hand_made(parts_of(make_adapter(seed=4621), "seals"), seals)
        try:
            status, reply = post_shared(server, body)
            assert (status, code_of(reply)) == (400, "bad_shared_file"), reply
            assert "F_SEAL" in reply["error"]["message"]
            assert len(shared_fds()) == 1  # ours: the server closed what it opened
        finally:
            os.close(fd)
        assert text(c, "seals") == served_text(before)


def test_a_file_that_shrinks_or_lies_about_its_size(fleet, make_adapter):
    """A file not sealed against shrinking, shrunk after it was named: refused before any
    byte is read (missing F_SEAL_SHRINK). A sealed file cannot shrink (the kernel says
    no), and one of another size than declared is refused; so is one longer than its
    header says (the tensors must tile the file)."""
    server = fleet[0]
    parts = parts_of(make_adapter(seed=4631), "shrink")
    fd, body = hand_made(parts, SEALS & ~fcntl.F_SEAL_SHRINK)
    try:
        os.ftruncate(fd, body["nbytes"] // 2)  # allowed: it was not sealed against it
        status, reply = post_shared(server, body)
        assert (status, code_of(reply)) == (400, "bad_shared_file"), reply
    finally:
        os.close(fd)
    fd, body = hand_made(parts, SEALS)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, body["nbytes"] // 2)
        for lie in (body["nbytes"] - 8, body["nbytes"] + 8):
            status, reply = post_shared(server, {**body, "nbytes": lie})
            assert (status, code_of(reply)) == (400, "bad_shared_file"), reply
    finally:
        os.close(fd)
    fd, body = hand_made(parts, SEALS, extra=64)
    try:
        status, reply = post_shared(server, body)
        assert status == 400 and code_of(reply) == "bad_safetensors", reply
    finally:
        os.close(fd)
    assert not shared_fds()


TRAINER = r"""
import os, sys, time, fcntl
sys.path.insert(0, sys.argv[1])
from lora_sync import LoRAAdapter, wire
from lora_sync.transports.shared_copy import write_sealed
from testbed.tiny_model import make_lora, randomize_lora
model = make_lora(sys.argv[2], rank=8)
randomize_lora(model, int(sys.argv[3]))
a = LoRAAdapter.from_peft_model(model)
if sys.argv[4] == "file":   # a sealed copy, named to whoever asks, then wait to be killed
    f = write_sealed(wire.layout(a.tensors, a.metadata("victim")))
    print(f.path, f.nbytes, f.claim, flush=True)
else:                       # a whole push to the servers, then wait to be killed
    from lora_sync import LoRASyncClient
    c = LoRASyncClient(sys.argv[5:], api_key="test-admin-key", lease_ahead=False)
    print(",".join(r.transport for r in c.push(a, "killed", transport="shared")), flush=True)
time.sleep(600)
"""


def _trainer(model_dir, seed: int, *args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(REPO), str(model_dir),
                             str(seed), *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = proc.stdout.readline().strip()
    assert line, "the trainer process printed nothing"
    return proc, line


def test_another_process_fd_or_not_a_memfd_is_refused(fleet, model_dir, make_adapter):
    """The server opens the path itself and checks what it opened: another process's
    sealed copy named without its claim (a tenant who learnt the path), a claim that is
    not that file's, a disk file, a pipe, a socket, a descriptor that does not exist, a
    path outside /proc: all refused, nothing kept open."""
    server = fleet[0]
    victim, line = _trainer(model_dir, 4641, "file")
    try:
        path, nbytes, claim = line.split()
        base = {"path": path, "nbytes": int(nbytes), "claim": claim}
        import secrets
        status, reply = post_shared(server, {**base, "claim": secrets.token_hex(32)})
        assert (status, code_of(reply)) == (400, "shared_unreachable"), reply
        # our own copy's claim, pointed at the victim's descriptor
        fd, mine = hand_made(parts_of(make_adapter(seed=4642), "mine"), SEALS)
        try:
            status, reply = post_shared(server, {**mine, "path": path})
            assert (status, code_of(reply)) == (400, "shared_unreachable"), reply
            # and the victim's claim on our descriptor
            status, reply = post_shared(server, {**base, "path": mine["path"]})
            assert (status, code_of(reply)) == (400, "shared_unreachable"), reply
        finally:
            os.close(fd)
    finally:
        victim.kill()
        victim.wait()
    r, w = os.pipe()
    import socket
    sock = socket.socket()
    unlinked = os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR)  # nlink 0, on disk
    os.write(unlinked, b"\0" * 4096)
    with tempfile.NamedTemporaryFile() as disk:
        disk.write(b"\0" * 4096)
        disk.flush()
        for n in (disk.fileno(), unlinked, r, w, sock.fileno(), 999_999):
            status, reply = post_shared(server, {**base, "path": f"/proc/{os.getpid()}/fd/{n}",
                                                 "nbytes": 4096})
            assert (status, code_of(reply)) == (400, "shared_unreachable"), (n, reply)
    for fd in (r, w, unlinked):
        os.close(fd)
    sock.close()
    for path in ("/etc/passwd", f"/proc/{os.getpid()}/fd/../../../etc/passwd",
                 "/proc/self/fd/0"):
        status, reply = post_shared(server, {**base, "path": path})
        assert (status, code_of(reply)) == (400, "bad_request"), reply
    assert not shared_fds()
    # an old server without the route, or one that cannot reach us: auto goes on to the next
    with LoRASyncClient([s.url for s in fleet[:2]], api_key=server.api_key) as c:
        c.states["shared"].reach[fleet[1].url] = False  # as if it had answered unreachable
        assert [r.transport for r in c.push(make_adapter(seed=4643), "next")] == \
            ["shm", "shm"]  # one server left that shares: shm for both


def test_trainer_killed_while_servers_map_the_file(fleet, model_dir):
    """A trainer process pushes to two servers, then is killed (SIGKILL): the servers keep
    serving the version from the file they hold; retired, nothing of it is left open or
    mapped anywhere. A trainer killed before a server opened its file: that server refuses
    (the descriptor is gone), and holds nothing."""
    servers = fleet[:2]
    trainer, line = _trainer(model_dir, 4651, "push", *[s.url for s in servers])
    assert line == "shared,shared"
    assert len({ino for _, ino in shared_fds()}) == 1
    assert shared_fds(str(trainer.pid)) == [] and shared_maps(str(trainer.pid)) >= 1
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert not os.path.exists(f"/proc/{trainer.pid}/fd")
    from lora_sync import LoRAAdapter
    from testbed.tiny_model import make_lora, randomize_lora
    model = make_lora(model_dir, rank=8)
    randomize_lora(model, 4651)
    want = served_text(LoRAAdapter.from_peft_model(model))
    with LoRASyncClient([s.url for s in servers], api_key=servers[0].api_key) as c:
        assert text(c, "killed", 0) == text(c, "killed", 1) == want
        assert len(shared_fds(str(os.getpid()))) == 2  # the servers' own descriptors
    victim, line = _trainer(model_dir, 4652, "file")
    path, nbytes, claim = line.split()
    victim.kill()
    victim.wait()
    status, reply = post_shared(servers[0], {"path": path, "nbytes": int(nbytes),
                                             "claim": claim})
    assert (status, code_of(reply)) == (400, "shared_unreachable"), reply


# -- random fleets ---------------------------------------------------------------------------
def _held_shared(client) -> list[tuple[int, int]]:
    """(server, version) pairs the fleet holds from a shared copy."""
    return [(i, v["version"]) for i, listing in enumerate(client.adapters())
            for entry in listing["adapters"] for v in entry["versions"]
            if v["transport"] == "shared"]


def _host_matches(client) -> bool:
    """This process (every fake server's) holds one descriptor per (server, version) built
    from a shared copy, and one file (inode) per version: all servers share its push's."""
    held = _held_shared(client)
    fds = shared_fds(str(os.getpid()))
    return len(fds) == len(held) and \
        len({ino for _, ino in fds}) == len({v for _, v in held})


# 8 examples (CI time): test_fleet's random fleets add remote servers and kills to these.
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_fleets_serve_what_they_acknowledged(fleet, make_adapter, data):
    """K same-host servers (1-4), 1-4 pushes, each refused by a random subset of them (the
    engine refuses the build). After every push: each server serves exactly the newest
    version it acknowledged (the fake engine's text for those weights), by alias and by
    version, and the host holds one descriptor per server version built from a shared
    copy, every one of that push's file (one inode per push). After the names are
    retired: no shared file is open or mapped in the servers' process."""
    k = data.draw(st.integers(1, 4), "servers")
    servers = fleet[:k]
    pushes = data.draw(st.integers(1, 4), "pushes")
    name = f"fleet{data.draw(st.integers(0, 10**6))}"
    acked: list[int | None] = [None] * k
    adapters = {}
    with LoRASyncClient([s.url for s in servers], api_key=servers[0].api_key,
                        remember=False, lease_ahead=False) as c:
        try:
            for p in range(pushes):
                refuse = data.draw(st.sets(st.integers(0, k - 1)), f"refused at push {p}")
                for i, s in enumerate(servers):
                    for w in s.bridge.workers:
                        w.engine.refuse = (lambda aid, stored: "refused by the test") \
                            if i in refuse else None
                a = make_adapter(seed=4700 + p)
                results = c.push(a, name, transport="shared", on_error="skip")
                for i, r in enumerate(results):
                    assert r.ok == (i not in refuse), r
                    if r.ok:
                        assert r.transport == "shared"
                        acked[i] = r.version
                        adapters[r.version] = a
                    else:
                        assert r.error.code == "engine_refused", r.error
                # one descriptor per server version, one file per push any server holds
                wait_until(lambda: _host_matches(c), 10, "the host holds what the fleet lists")
                for i in range(k):
                    if acked[i] is None:
                        continue
                    want = served_text(adapters[acked[i]])
                    assert text(c, name, i) == want
                    assert text(c, f"{name}-v{acked[i]}", i) == want
        finally:  # a failed example leaves nothing to the next one
            for s in servers:
                for w in s.bridge.workers:
                    w.engine.refuse = None
                retire_if_held(s.url, name)
        wait_until(lambda: not _held_shared(c), 15, "every version drained")
    wait_until(readers_gone, 15, "no shared copy left open or mapped")



def test_a_fifo_swapped_in_by_dup2_is_never_opened(tmp_path):
    """The descriptor a request names is flipped between the claimed memfd and a FIFO by
    dup2, as fast as the test can, while the server opens it (bounded: 300 requests). A
    writer waits in open() on the FIFO, released only if anyone opens it to read: the server
    opens what it checked (an O_PATH pin, then that file), so the FIFO never is. Requests go on
    past 300 until both sides of the flip were seen (a loaded machine switches threads less
    often), bounded by 20,000 requests and 10 s."""
    import threading
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    claim = "ab" * 32
    memfd = os.memfd_create(memfd_name(claim), os.MFD_ALLOW_SEALING)
    pinned_fifo = os.open(fifo, os.O_PATH)
    slot = os.dup(memfd)
    opened, stop = threading.Event(), threading.Event()

    def writer():  # returns once a reader opened the FIFO
        os.close(os.open(fifo, os.O_WRONLY))
        opened.set()

    def flip():
        while not stop.is_set():
            os.dup2(pinned_fifo, slot)
            os.dup2(memfd, slot)
    threads = [threading.Thread(target=writer, daemon=True), threading.Thread(target=flip)]
    for t in threads:
        t.start()
    codes = set()
    try:
        request = shared_copy.SharedRequest(f"/proc/self/fd/{slot}", 0, claim)
        deadline = time.monotonic() + 10
        for i in range(20_000):
            try:
                os.close(shared_copy.open_shared(request))
                codes.add("opened")
            except LoRASyncError as e:
                codes.add(e.code)
            if i >= 300 and (len(codes) > 1 or time.monotonic() > deadline):
                break
    finally:
        stop.set()
        threads[1].join(timeout=10)
        released = opened.is_set()
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # let the writer go
        threads[0].join(timeout=10)
        for fd in (memfd, pinned_fifo, slot):
            os.close(fd)
    assert not released, "the server opened the FIFO"
    # the memfd itself (unsealed) and the FIFO were both seen: the race was run
    assert codes == {"bad_shared_file", "shared_unreachable"}, codes
