"""What every transport shares on the trainer side: the server it talks to and the typed
result of one push."""
from __future__ import annotations

from dataclasses import dataclass, field

# The only engine difference the client knows: where the routes live.
ROUTE_PREFIX = {"vllm": "/v1", "sglang": ""}


@dataclass(frozen=True)
class Server:
    url: str                      # e.g. http://127.0.0.1:8000
    engine: str = "vllm"          # vllm | sglang

    def route(self, name: str) -> str:
        return f"{self.url.rstrip('/')}{ROUTE_PREFIX[self.engine]}/{name}"


@dataclass
class PushResult:
    server: str
    name: str                     # registered name, e.g. policy-v3
    version: int
    bytes: int
    seconds: float                # wall time seen by the client
    transport: str = ""
    reply: dict = field(default_factory=dict)

    @classmethod
    def from_reply(cls, server_url: str, reply: dict, seconds: float) -> "PushResult":
        return cls(server_url, reply["name"], reply["version"], reply["bytes"], seconds,
                   reply.get("transport", ""), reply)


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
