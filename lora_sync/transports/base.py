"""The transport plug-in: one class per way of moving an adapter's tensors, with its three
sides (trainer, API process, worker), and the typed values that pass between them.

A push of one version, whatever the transport:
  trainer   client: prepare once -> send to each server (the client fans out) -> finish
  API       routes parse the request -> AdapterService.push: stage (this transport) ->
            check -> install (reserve, workers' intake, activate, publish)
  worker    dispatcher: receive (this transport) -> check -> build

A transport never calls back into its caller: each side gets what it needs as arguments
(`SendContext`, `ServerContext`, the worker's buffer pool) and returns a typed value
(`PushResult`, `Staged`, `Received`). Adding one is a module here and a line in
`transports/__init__.py`; routes, metrics, client and CLI read that table."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from .. import naming
from ..engines import engine as engine_named
from ..errors import BadRequest, LoRASyncError, TooBusy
from ..adapter import META_CHECKSUM, META_CONFIG, META_NAME, META_VERSION, parse_config
from ..http import check_url
from ..messages import IntakeRequest
from ..replies import PushReply
from ..wire import TensorSpec

# -- the protocol's version (docs/wire_format.md, "Protocol version") --------------------
# Every byte a sender sends, on every transport, is what version PROTOCOL_VERSION says. A
# client sends it in the PROTOCOL_HEADER of every POST; the routes refuse another version
# (400 protocol_mismatch, naming both) before anything else happens, a collective call above
# all. Absent, a request is taken as this version (clients older than the header).
PROTOCOL_VERSION = 1
PROTOCOL_HEADER = "X-LoRA-Sync-Protocol"


def with_protocol(headers: dict) -> dict:
    """`headers` plus the protocol version this client speaks."""
    return {**headers, PROTOCOL_HEADER: str(PROTOCOL_VERSION)}


def check_protocol(value: str | None) -> None:
    """The route layer's check of a request's PROTOCOL_HEADER (None: absent, taken as ours)."""
    if value is None:
        return
    text = value.strip()
    if text.isascii() and text.isdigit() and int(text) == PROTOCOL_VERSION:
        return
    said = f"protocol {text}" if text.isascii() and text.isdigit() and len(text) <= 9 \
        else f"{PROTOCOL_HEADER} {text[:20]!r}, not a protocol version"
    raise BadRequest(f"this server speaks lora-sync protocol {PROTOCOL_VERSION}, the request "
                     f"is {said} (docs/wire_format.md)", code="protocol_mismatch")


@dataclass(frozen=True)
class Server:
    url: str                      # e.g. http://127.0.0.1:8000
    engine: str = "vllm"          # vllm | sglang

    def __post_init__(self):
        check_url(self.url)  # ValueError: a bad URL is the caller's, not a server's
        engine_named(self.engine)  # ValueError: not an engine we know

    def route(self, name: str) -> str:
        """The URL of one of lora-sync's routes on this server (the engine says where)."""
        return engine_named(self.engine).route(self.url, name)


@dataclass(frozen=True)
class ClientConfig:
    """What a client tells each transport when it makes that transport's client state."""
    headers: dict
    client_id: str                # a label the client gives itself (never a bound)
    probe_timeout: float          # for small background calls
    lease_ahead: bool = True      # may ready resources for the next push ahead of it
    servers: tuple = ()           # the client's fleet (Server each), in its order


@dataclass(frozen=True)
class SendContext:
    """One push as the client hands it to a transport's trainer side."""
    name: str
    version: int | None
    checksum: bool
    headers: dict
    timeout: float
    client_id: str
    state: Any = None             # this transport's client state (`new_client_state`)
    ahead: bool = True            # may ready what the next push of this name will use
    keep: bool = False            # return the tensors as pushed where that is free
                                  # (`keeps_copy`)
    spare: Any = None             # with `keep`: a buffer of the client's to pack into
    body_sent: Callable[[], None] | None = None  # call once this server's body has left


def send_reaching(transport: "Transport", outgoing, server: Server, ctx: SendContext,
                  hint: str = "use transport='tensors'") -> "PushResult":
    """`transport.send`, where a server it cannot reach from this process (another host or
    PID namespace) is that server's error (`hint`: what to do instead), not a None."""
    result = transport.send(outgoing, server, ctx)
    if result is None:
        raise LoRASyncError(f"{server.url} cannot be reached through {transport.name} from "
                            f"this process (another host or PID namespace); {hint}",
                            code="shm_unreachable", status=400)
    return result


class Unavailable(TooBusy):
    """This transport cannot take this push on this server now, for want of room (the
    server's code says which): `auto` sends it with its next choice."""


class KeptCopy:
    """What a push left the client of the tensors as pushed (`PushResult.kept`), so the
    client remembers them for a resync without a copy of its own (trainer.fleet.newest_of):
    a PackedCopy or a SealedCopy."""


@dataclass
class PushResult:
    server: str
    name: str | None              # registered name, e.g. policy-v3 (None if it failed)
    version: int
    bytes: int
    seconds: float                # wall time seen by the client
    transport: str = ""
    reply: dict = field(default_factory=dict)
    instance_id: str = ""         # the server instance that took it
    error: Exception | None = None  # a LoRASyncError when this server failed
    # With SendContext.keep: shm, the file as pushed, the sealed lease mapped read-only;
    # broadcast, its PackedCopy.
    kept: Any = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def from_reply(cls, server_url: str, reply: dict, seconds: float, name: str | None = None,
                   version: int | None = None) -> "PushResult":
        """A server's push reply, checked field by field (and, given `name` and `version`,
        against what was pushed); anything else raises LoRASyncError `bad_reply`."""
        r = PushReply.from_json(server_url, reply, name, version)
        return cls(server_url, r.name, r.version, r.bytes, seconds, r.transport, reply,
                   r.instance_id)

    def to_json(self) -> dict:
        """For handing the result to the other ranks of a sharded trainer (no pickle)."""
        err = self.error
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__
                   if k not in ("error", "kept")},
                "error": err.to_json()["error"] if err is not None else None}

    @classmethod
    def from_json(cls, d: dict) -> "PushResult":
        from ..errors import error_from_json
        err = d.get("error")
        return cls(**{**d, "error": error_from_json(err["status"], {"error": err})
                      if err else None})

    @classmethod
    def failed(cls, server_url: str, version: int, error: Exception,
               seconds: float) -> "PushResult":
        return cls(server_url, None, version, 0, seconds, error=error)


@dataclass(frozen=True)
class PackedCopy(KeptCopy):
    """The adapter as a transport packed it anyway, in host memory (broadcast's frames):
    the client keeps it as the pushed copy instead of making a second one."""
    tensors: dict                 # name -> a view into `flat`
    flat: Any                     # the one buffer (a torch.uint8 tensor) they view


@dataclass(frozen=True)
class SealedCopy(KeptCopy):
    """The file as the server holds it, mapped read-only (a sealed shm lease): nobody can
    change it, so the client views its tensors only when a resync needs them."""
    view: Any


# -- server side (API process) ----------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """One HTTP route a transport adds: `parse(body, limits)` makes the typed request from
    the JSON object (`stream=True`: the request is the `RawBody` itself); `handler(request,
    ctx)` answers it, or, when None, the request is a push (`Transport.stage`, then the
    service's install)."""
    parse: Callable[[Any, Any], Any] | None = None
    handler: Callable | None = None
    stream: bool = False


@dataclass(frozen=True)
class RawBody:
    chunks: object                # async iterator of bytes
    content_length: int | None


@dataclass
class ServerContext:
    """What a transport's server side may use: the operator's limits, its own state between
    requests, and the capabilities the service lends it (none of them the service itself)."""
    limits: Any                   # server.service.Settings, read only
    state: Any                    # what `Transport.new_state` made
    staging: Any                  # staging.StagingArea: where bodies land
    workers: Any                  # server.service.Workers: ops on every worker
    receive_body: Callable        # async (RawBody) -> staging.StagedBody, budget shared
    retired_freed: Callable       # async (hasten: bool) -> None: retired versions' memory
                                  # given back (hasten: now, as a push does), time-bounded


@dataclass
class Staged:
    """A push as far as the API process takes it before the workers: what it claims to
    be (checked by the service against the model), the transport's own intake arguments,
    and what the new version must keep alive (`hold.close()` when it goes, or at once if the
    push fails)."""
    name: str
    version: int | None
    config: dict
    specs: list[TensorSpec]
    nbytes: int                   # tensor bytes
    checksum: str | None
    intake_args: dict
    hold: Any = None
    background_s: float | None = None  # workers take it in on a thread, within this
    timings_ms: dict = field(default_factory=dict)
    on_failure: Callable | None = None  # (LoRASyncError) -> None, after a failed install
    on_success: Callable | None = None  # () -> None, once the version is installed

    def intake(self, transport: str, adapter_id: int, config: dict,
               check_finite: bool) -> IntakeRequest:
        return IntakeRequest(transport, adapter_id, config, self.checksum, self.intake_args,
                             check_finite)

    def release(self) -> None:
        if self.hold is not None:
            self.hold.close()


def staged_file(body, hold, **timings_ms) -> Staged:
    """A safetensors file staged in server memory (an HTTP body, a sealed shm lease): the
    push's fields come from its metadata. `hold` goes back if they are bad."""
    try:
        meta = body.header.metadata
        return Staged(naming.check_name(meta.get(META_NAME)),
                      naming.parse_version(meta.get(META_VERSION)),
                      parse_config(meta.get(META_CONFIG)), body.header.specs,
                      body.nbytes - body.header.data_start, meta.get(META_CHECKSUM),
                      {"path": body.path}, hold, timings_ms=timings_ms)
    except BaseException:
        hold.close()
        raise


# -- worker side ------------------------------------------------------------------------
@dataclass
class Received:
    """What a transport's worker side hands the dispatcher: the tensors, their bytes, and
    the buffers they view (which become the spares of the next intake)."""
    tensors: dict
    nbytes: int
    buffers: list = field(default_factory=list)
    # the tensors view memory this worker must not write (a sealed lease, a staged body)
    read_only: bool = False
    timings_ms: dict = field(default_factory=dict)  # parts of the intake, for the reply


# -- the plug-in ------------------------------------------------------------------------
class Transport(ABC):
    name: ClassVar[str]
    push_path: ClassVar[str]               # the route whose reply ends a push
    start_path: ClassVar[str | None] = None  # a push's first step, if it has one
    # False: one collective send reaches every server at once (all or nothing).
    per_server: ClassVar[bool] = True

    @abstractmethod
    def routes(self) -> dict[str, Route]:
        """Path (without the engine's prefix) -> Route."""

    # trainer side
    # Where `auto` tries this transport on a server: lower first; None, never (a transport
    # that is not per server, or needs set-up the caller asks for).
    auto_order: ClassVar[int | None] = None

    def new_client_state(self, config: ClientConfig) -> Any:
        """What this transport keeps between pushes in one client (SendContext.state)."""
        return None

    def close_client_state(self, state) -> None:
        """The client closes: let go of what the state holds."""

    def after_push(self, state) -> None:
        """Each push of the client ended (whatever transport it took)."""

    def reaches(self, server: Server, state) -> bool:
        """Whether `auto` should try this transport on `server` (as far as the client
        knows: a send may still find it cannot)."""
        return True

    def keeps_copy(self, state) -> bool:
        """Whether a push with `SendContext.keep` leaves the client the tensors as pushed
        (`PushResult.kept`), so it need not copy them itself."""
        return False

    def prepare(self, adapter, ctx: SendContext):
        """Once per push, before any server: what `send` sends (default: the adapter).
        Under `auto` too: in the first server's thread this transport takes, the others
        waiting for it; `finish` then runs once, after every server."""
        return adapter

    @abstractmethod
    def send(self, outgoing, server: Server, ctx: SendContext) -> "PushResult | None":
        """Pushes to one server; None when this transport cannot reach it from here."""

    def finish(self, outgoing, results: list) -> "PackedCopy | None":
        """Once per push, after every server answered (or failed); returns the push's own
        copy of the tensors where it made one for the client (`SendContext.keep`)."""
        return None

    def send_timeout(self, ctx: SendContext) -> float | None:
        """Seconds one push may take, when the client's own timeout is not the bound."""
        return None

    # server side
    def new_state(self, limits) -> Any:
        """What this transport keeps between requests in one API process."""
        return None

    def held_bytes(self, state) -> int:
        """Server memory `state` holds for pushes not yet made (one budget with uploads)."""
        return 0

    def leases(self, state) -> dict:
        """The leases `state` holds open for pushes to come (lease id -> its staged body,
        with `nbytes`): the tenants' ledger counts them against their owners."""
        return {}

    def groups(self, state) -> list[str]:
        """The update groups `state` knows by name: the tenants' ledger counts them."""
        return []

    def info(self, state) -> dict:
        """What lora_sync_info says about `state`."""
        return {}

    @abstractmethod
    async def stage(self, request, ctx: ServerContext) -> Staged:
        """Takes a push request as far as the API process goes."""

    # worker side
    @abstractmethod
    def receive(self, intake: IntakeRequest, pool) -> Received:
        """Takes the tensors in on one worker; `pool` lends buffers and update groups
        (worker_extensions/receiver.py WorkerState)."""
