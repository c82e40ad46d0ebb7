"""One sealed copy for every server on the trainer's host (transport `shared`).

shm gives each server its own lease, so a push to K servers on the trainer's host writes the
adapter K times and the host holds K copies of it. Here the trainer writes the safetensors
file ONCE, into a memfd of its own, and seals it (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL) before any server is told of it. Each server then opens that same file through
`/proc/<trainer pid>/fd/<n>`, checks for itself that it is the copy the request claims (a
memfd whose name carries the digest of the request's one-time claim), sealed with all four
seals and of the declared size, and keeps its own descriptor while the version lives. The
host holds one copy per push, whatever the number of servers; its pages go with the last
descriptor or mapping (docs/protocol.md, "One sealed copy for every same-host server").

Who does what:
  trainer  prepare (once per push, in the first server's thread): memfd, write, seal; send
           (per server): one JSON call naming the file; finish (once, after every server
           answered): closes its descriptor. The client's resync copy is a read-only mapping
           of the same file (no copy).
  API      stage: open the path, check kind, name (the claim), seals and size on the opened
           descriptor (never on the client's word), read the header; the service then runs
           the checks of every push (config, model, checksum in the workers), per server.
  worker   maps the sealed file read-only (or reads it into a reused buffer), as for shm.

A server's verdict is its own: one that refuses closes its descriptor and keeps its
previous versions; the others keep theirs. The client reports each server's result."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field


from .. import http, pages, wire
from ..errors import BadRequest, error_from_json
from ..fields import field as body_field
from ..staging import StagedBody
from .base import ClientConfig, PushResult, Received, Route, SealedCopy, SendContext, Server, \
    ServerContext, Staged, Transport, staged_file
from .device_copy import on_device
from .shm.lease_table import SealedBody
from .shm.memfd import open_pinned, read_header
from .shm.trainer import _pwrite_all, total_bytes, write_mapped
from .shm.worker import map_read_only, receive_sealed

SHARED_ROUTE = "load_lora_adapter_from_shared"
# The memfd's name: this prefix, then sha256 of the claim in hex (`memfd_name`). Linux shows
# it as "/memfd:<name> (deleted)" in /proc/<pid>/fd.
MEMFD_PREFIX = "lora-sync-shared-"
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_SEAL_NAMES = ((fcntl.F_SEAL_WRITE, "F_SEAL_WRITE"), (fcntl.F_SEAL_SHRINK, "F_SEAL_SHRINK"),
               (fcntl.F_SEAL_GROW, "F_SEAL_GROW"), (fcntl.F_SEAL_SEAL, "F_SEAL_SEAL"))
_PATH = re.compile(r"/proc/[1-9][0-9]{0,9}/fd/[0-9]{1,10}")
_CLAIM = re.compile(r"[0-9a-f]{64}")


def claim_digest(claim: str) -> str:
    """sha256 of the claim's 32 bytes, hex: what the file's name carries."""
    return hashlib.sha256(bytes.fromhex(claim)).hexdigest()


def memfd_name(claim: str) -> str:
    return MEMFD_PREFIX + claim_digest(claim)


def missing_seals(seals: int) -> list[str]:
    return [name for bit, name in _SEAL_NAMES if not seals & bit]


# -- the request --------------------------------------------------------------------------
@dataclass(frozen=True)
class SharedRequest:
    """`POST load_lora_adapter_from_shared`: where the sealed file is, its size, and the
    claim whose sha256 its name carries (docs/wire_format.md, 5c)."""
    path: str
    nbytes: int
    claim: str

    @classmethod
    def from_json(cls, body: dict, max_bytes: int) -> "SharedRequest":
        path = body_field(body, "path", str, max_len=64, where="shared copy")
        if not _PATH.fullmatch(path):
            raise BadRequest("path must be /proc/<pid>/fd/<n>: a descriptor of the trainer's "
                             "process", code="bad_request")
        claim = body_field(body, "claim", str, max_len=64, where="shared copy")
        if not _CLAIM.fullmatch(claim):
            raise BadRequest("claim must be 64 lowercase hex digits", code="bad_request")
        return cls(path, body_field(body, "nbytes", int, lo=16, hi=max_bytes,
                                    where="shared copy"), claim)

    def to_json(self) -> dict:
        return {"path": self.path, "nbytes": self.nbytes, "claim": self.claim}


# -- trainer side -------------------------------------------------------------------------
class SharedFile:
    """The push's one sealed copy, as the trainer holds it: its descriptor until `close`
    (the transport's `finish`), and at most one read-only mapping of it, shared by every
    server's result as the client's resync copy (`kept`)."""

    def __init__(self, fd: int, nbytes: int, claim: str, write_s: float):
        self.fd, self.nbytes, self.claim, self.write_s = fd, nbytes, claim, write_s
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        self._lock = threading.Lock()
        self._kept: SealedCopy | None = None
        self.closed = False

    def request(self) -> dict:
        return SharedRequest(self.path, self.nbytes, self.claim).to_json()

    def kept(self) -> SealedCopy | None:
        """None once closed (a server that answered after the push gave up on it)."""
        with self._lock:
            if self._kept is None and not self.closed:
                self._kept = SealedCopy(map_read_only(self.fd))
            return self._kept

    def close(self) -> None:
        """The trainer lets go of its descriptor: the servers hold their own (and the
        client its mapping, while it keeps the copy), so the pages go with the last one."""
        with self._lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)


def write_sealed(chunks: list) -> SharedFile:
    """The safetensors file (`chunks`: header bytes, then tensors) written once into a new
    memfd of this process, then sealed with all four seals. From the seal on, nobody (this
    process included) can write, resize, map it writable or unseal it; no server is told of
    it before. Host memory goes in with `pwritev`; GPU tensors through a mapping, unmapped
    before the seal (a writable mapping would stop it: EBUSY)."""
    nbytes = total_bytes(chunks)

    def fill(fd: int) -> None:
        if any(on_device(c) for c in chunks):
            write_mapped(pages.map_filled(fd, nbytes), chunks)  # unmaps before returning
        else:
            _pwrite_all(fd, chunks)
    return sealed_copy(nbytes, fill)


def sealed_copy(nbytes: int, fill) -> SharedFile:
    """A new shared copy of `nbytes`: `fill(fd)` writes it (by pwrite, or through a mapping
    it unmaps before returning), then it is sealed with all four seals, before any server is
    told of it. A relay fills one with a body as it arrives (lora_sync/relay.py)."""
    t0 = time.perf_counter()
    claim = secrets.token_hex(32)
    fd = os.memfd_create(memfd_name(claim), os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        fill(fd)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise OSError(errno.EPERM, "the shared copy did not take its seals")
    except BaseException:
        os.close(fd)
        raise
    return SharedFile(fd, nbytes, claim, time.perf_counter() - t0)


@dataclass
class SharedClientState:
    """A client's `shared` state: its fleet's URLs, and the servers found unable to reach
    this process's files (another host, PID namespace or user)."""
    fleet: tuple = ()
    reach: dict = field(default_factory=dict)  # server url -> it opened our file

    def reachable(self, url: str) -> bool:
        return self.reach.get(url, True)


# -- server side --------------------------------------------------------------------------
def open_shared(req: SharedRequest) -> int:
    """The file the request names, opened read-only by this process and checked on that
    descriptor: a regular file with no links (a memfd) named for the request's claim, with
    all four seals, of `nbytes`. Returns the descriptor (the caller's); raises 400
    `shared_unreachable` where the path cannot be opened here or is not the claimed copy
    (another host, PID namespace or user; another process's descriptor; the trainer gone),
    400 `bad_shared_file` where it is the claimed copy but not sealed or of another size."""
    def unreachable(why: str) -> BadRequest:
        return BadRequest(f"{req.path} {why}: the shared copy is not reachable from this "
                          "server (another host, PID namespace or user?); push with shm or "
                          "tensors", code="shared_unreachable")
    def claimed(pinned: int, st) -> bool:
        return stat.S_ISREG(st.st_mode) and st.st_nlink == 0 and \
            os.readlink(f"/proc/self/fd/{pinned}") == f"/memfd:{memfd_name(req.claim)} (deleted)"
    try:
        fd = open_pinned(req.path, os.O_RDONLY, claimed)  # what is opened is what was checked
    except OSError as e:
        raise unreachable(f"cannot be opened ({os.strerror(e.errno)})") from None
    if fd is None:
        raise unreachable("is not the shared copy this request claims")
    try:
        st = os.fstat(fd)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise unreachable("is not a memfd") from None
        missing = missing_seals(seals)
        if missing:
            raise BadRequest(f"the shared copy lacks {', '.join(missing)}: it could still "
                             "change; seal it with all four before pushing",
                             code="bad_shared_file")
        if st.st_size != req.nbytes:
            raise BadRequest(f"the shared copy holds {st.st_size} bytes, not the {req.nbytes} "
                             "declared", code="bad_shared_file")
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedCopyTransport(Transport):
    name = "shared"
    push_path = f"/{SHARED_ROUTE}"

    def routes(self):
        return {self.push_path: Route(lambda body, limits: SharedRequest.from_json(
            body, limits.max_body_bytes))}

    # trainer side
    # First where two or more of the fleet's servers may share this host: one copy for them
    # all. With one server, shm (its lease readied ahead) is as cheap and goes first.
    auto_order = -1

    def new_client_state(self, config: ClientConfig) -> SharedClientState:
        return SharedClientState(tuple(s.url for s in config.servers))

    def reaches(self, server: Server, state: SharedClientState) -> bool:
        return state.reachable(server.url) and \
            sum(state.reachable(url) for url in state.fleet) >= 2

    def keeps_copy(self, state) -> bool:
        return True  # the sealed file mapped read-only (else another transport took it)

    def prepare(self, adapter, ctx: SendContext) -> SharedFile:
        """Once per push, before any server hears of it: written and sealed."""
        return write_sealed(wire.layout(adapter.tensors, adapter.metadata(
            ctx.name, ctx.version, ctx.checksum)))

    def send(self, shared: SharedFile, server: Server, ctx: SendContext) -> PushResult | None:
        """One call naming the sealed file. None where the server cannot reach it (it says
        `shared_unreachable`, or has no such route): `auto` then tries the next transport,
        and the state remembers (`reaches`)."""
        state: SharedClientState | None = ctx.state
        t0 = time.perf_counter()
        url = server.route(SHARED_ROUTE)
        status, reply, _ = http.request("POST", url, headers=ctx.headers, timeout=ctx.timeout,
                                        json_body=shared.request(), on_sent=ctx.body_sent)
        if status >= 300:
            err = error_from_json(status, reply)
            # A 404 without our instance id is not lora-sync's: a server without this route
            if err.code == "shared_unreachable" or (status == 404 and
                                                    "instance_id" not in reply):
                if state is not None:
                    state.reach[server.url] = False
                return None
            err.server = http.origin(url)
            raise err
        if state is not None:
            state.reach[server.url] = True
        result = PushResult.from_reply(server.url, reply, time.perf_counter() - t0, ctx.name,
                                       ctx.version)
        # trainer side: `write`, the one write and seal of the push (every server's the same)
        reply.setdefault("timings_ms", {})["write"] = shared.write_s * 1e3
        if ctx.keep:
            result.kept = shared.kept()
        return result

    def finish(self, shared: SharedFile, results: list) -> None:
        shared.close()
        return None

    # server side
    async def stage(self, req: SharedRequest, ctx: ServerContext) -> Staged:
        t0 = time.perf_counter()
        fd = open_shared(req)
        try:
            header = read_header(fd, req.nbytes)
        except BaseException:
            os.close(fd)
            raise
        hold = SealedBody(fd, req.nbytes)  # this server's own descriptor, while it lives
        return staged_file(StagedBody(hold.path, hold.nbytes, header), hold,
                           receive=(time.perf_counter() - t0) * 1e3)

    # worker side
    def receive(self, intake, pool) -> Received:
        """As shm's: the sealed file, mapped or read (`receive_sealed`)."""
        received = receive_sealed(intake.args["path"], pool)
        if received is None:
            raise BadRequest("the shared copy is not sealed", code="bad_shared_file")
        return received
