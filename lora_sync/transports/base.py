"""What every transport shares on the trainer side: the server it talks to and the typed
result of one push."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..http import check_url
from ..replies import PushReply

# The only engine difference the client knows: where the routes live.
ROUTE_PREFIX = {"vllm": "/v1", "sglang": ""}


@dataclass(frozen=True)
class Server:
    url: str                      # e.g. http://127.0.0.1:8000
    engine: str = "vllm"          # vllm | sglang

    def __post_init__(self):
        check_url(self.url)  # ValueError: a bad URL is the caller's, not a server's
        if self.engine not in ROUTE_PREFIX:
            raise ValueError(f"engine must be one of {tuple(ROUTE_PREFIX)}, "
                             f"not {self.engine!r}")

    def route(self, name: str) -> str:
        return f"{self.url.rstrip('/')}{ROUTE_PREFIX[self.engine]}/{name}"


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
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__ if k != "error"},
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


# -- server side ------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """One HTTP route a transport adds to the server: `handler(service, body)` gets the JSON
    object (body="json") or a `RawBody` of the streamed request (body="stream")."""
    handler: object
    body: str = "json"


@dataclass(frozen=True)
class RawBody:
    chunks: object                # async iterator of bytes
    content_length: int | None


# -- worker side ------------------------------------------------------------------------
@dataclass
class Received:
    """What a transport's worker intake hands the dispatcher: the tensors, their bytes, and
    the buffers they view (which become the spares of the next intake)."""
    tensors: dict
    nbytes: int
    buffers: list = field(default_factory=list)
