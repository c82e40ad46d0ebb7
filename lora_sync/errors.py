"""The error vocabulary shared by both engines' routes and the client: one enum of codes
(docs/protocol.md lists them), and one exception class per kind of failure."""
from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Every code a reply may carry. A code not listed here is a bug (refused at raise)."""
    # 400: the request itself
    BAD_REQUEST = "bad_request"
    BAD_ADAPTER = "bad_adapter"
    BAD_CONFIG = "bad_config"
    BAD_SAFETENSORS = "bad_safetensors"
    BAD_METADATA = "bad_metadata"
    MISSING_METADATA = "missing_metadata"
    BAD_NAME = "bad_name"
    BAD_VERSION = "bad_version"
    BAD_SHAPE = "bad_shape"
    BAD_DTYPE = "bad_dtype"
    RANK_TOO_LARGE = "rank_too_large"
    UNKNOWN_MODULE = "unknown_module"
    UNKNOWN_TENSOR = "unknown_tensor"
    MISSING_TENSOR = "missing_tensor"
    DUPLICATE_MODULE = "duplicate_module"
    UNSUPPORTED_MODULE = "unsupported_module"
    EMPTY_ADAPTER = "empty_adapter"
    EMPTY_BODY = "empty_body"
    NON_FINITE = "non_finite"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    ENGINE_REFUSED = "engine_refused"
    NO_GROUP = "no_group"
    BAD_LEASE = "bad_lease"
    SHM_UNREACHABLE = "shm_unreachable"
    # transport `shared`: the named file cannot be opened here, or is not the copy claimed
    SHARED_UNREACHABLE = "shared_unreachable"
    BAD_SHARED_FILE = "bad_shared_file"  # the claimed copy, but not sealed or not its size
    CLIENT_DISCONNECTED = "client_disconnected"
    TRANSFER_MISMATCH = "transfer_mismatch"  # a broadcast that is not what was declared
    LAYOUT_UNKNOWN = "layout_unknown"  # a broadcast naming a layout its group does not hold
    PROTOCOL_MISMATCH = "protocol_mismatch"  # a request of another protocol version
    # the engine's own load route: the path is not a local PEFT directory lora-sync can check
    BAD_ADAPTER_DIR = "bad_adapter_dir"
    # a route that would not hand the engine the adapter the request names (server/applied.py)
    ROUTE_IGNORES_ADAPTER = "route_ignores_adapter"
    # 401 / 403: access
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    ADMIN_CLOSED = "admin_closed"
    RESERVED_NAME = "reserved_name"
    TRAINER_NOT_ALLOWED = "trainer_not_allowed"
    BAD_TOKEN = "bad_token"
    # 404 / 408 / 409 / 413 / 415 / 429
    NOT_FOUND = "not_found"
    VERSION_RETIRED = "version_retired"
    MODEL_NOT_FOUND = "model_not_found"  # a model name neither the engine nor we serve
    UNKNOWN_LEASE = "unknown_lease"
    BODY_TIMEOUT = "body_timeout"
    VERSION_CONFLICT = "version_conflict"
    GROUP_EXISTS = "group_exists"
    NAME_TAKEN = "name_taken"  # the engine already serves that name (or a case variant)
    # the served model's LoRA forward cannot run on this engine build: every push refused
    MODEL_UNSUPPORTED = "model_unsupported"
    LEASE_MAPPED = "lease_mapped"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    BAD_CONTENT_TYPE = "bad_content_type"
    TOO_BUSY = "too_busy"
    STAGING_FULL = "staging_full"
    TOO_MANY_NAMES = "too_many_names"
    TOO_MANY_GROUPS = "too_many_groups"
    TOO_MANY_LEASES = "too_many_leases"
    # a tenant's own quotas (docs/operations.md, "Shared servers"), beside the totals above
    QUOTA_NAMES = "quota_names"
    QUOTA_STAGING = "quota_staging"
    QUOTA_LEASES = "quota_leases"
    QUOTA_GROUPS = "quota_groups"
    QUOTA_PUSHES = "quota_pushes"
    CONFLICT = "conflict"  # a 409 without a more precise code (a foreign reply)
    # 5xx: the server or the path to it
    INTERNAL_ERROR = "internal_error"
    WORKER_FAILED = "worker_failed"
    TRANSFER_FAILED = "transfer_failed"
    UNREACHABLE = "unreachable"
    HTTP_ERROR = "http_error"  # a reply without our error shape (a proxy, the engine)
    PUSH_FAILED = "push_failed"  # client side: some servers did not take a version
    BAD_REPLY = "bad_reply"      # client side: a reply that is not the route's typed message


class LoRASyncError(Exception):
    """An error with an HTTP status and a stable machine-readable code (an ErrorCode)."""

    status = 500
    code = "internal_error"
    server: str | None = None  # client side: the server it came from (set by lora_sync.http)

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = ErrorCode(code).value  # an unlisted code fails here, loudly
        if status:
            self.status = status

    def __str__(self) -> str:
        if self.server and self.server not in self.message:
            return f"{self.server}: {self.message}"
        return self.message

    def to_json(self) -> dict:
        err = {"code": self.code, "message": self.message, "status": self.status}
        return {"error": {**err, "server": self.server} if self.server else err}


class BadAdapter(LoRASyncError):
    """The request describes an adapter the server cannot serve (400)."""
    status, code = 400, "bad_adapter"


class BadRequest(LoRASyncError):
    """The request itself is malformed, whatever the adapter: a field's type or range, its
    JSON, a name or version, a lease or group it names (400)."""
    status, code = 400, "bad_request"


class ClientDisconnected(LoRASyncError):
    """The client went away before its body was complete (400, for the log: nobody reads
    the reply)."""
    status, code = 400, "client_disconnected"


class PayloadTooLarge(LoRASyncError):
    status, code = 413, "payload_too_large"


class VersionConflict(LoRASyncError):
    """A version lower than or equal to one already loaded (409)."""
    status, code = 409, "version_conflict"


class NotFound(LoRASyncError):
    status, code = 404, "not_found"


class Unauthorized(LoRASyncError):
    status, code = 401, "unauthorized"


class Forbidden(LoRASyncError):
    """Authenticated or not, this is never allowed here (admin routes closed, a trainer
    address outside the allowed list, an engine route acting on our names)."""
    status, code = 403, "forbidden"


class Conflict(LoRASyncError):
    """The request clashes with the server's state (409); the code says how: a group of that
    name exists, a name the engine serves, a lease still mapped, a model whose LoRA forward
    cannot run on this engine build (`model_unsupported`: every push, until it can)."""
    status, code = 409, "conflict"


class TooBusy(LoRASyncError):
    """A bounded resource is full (staging bytes, names, pending groups): retry later."""
    status, code = 429, "too_busy"


class TimedOut(LoRASyncError):
    """The client sent its body too slowly or stopped sending it."""
    status, code = 408, "body_timeout"


class TransferFailed(LoRASyncError):
    """A collective transfer timed out or a peer vanished (502: the server is fine)."""
    status, code = 502, "transfer_failed"


class PushFailed(LoRASyncError):
    """Client side: a push failed on some servers. `results` has one PushResult per server,
    `.error` set on those that failed; the servers that took the version keep it."""
    status, code = 502, "push_failed"

    def __init__(self, results: list):
        self.results = results
        failed = [r for r in results if r.error is not None]
        lines = "; ".join(f"{r.server}: {r.error.code}: {r.error.message[:300]}" for r in failed)
        super().__init__(f"{len(failed)} of {len(results)} server(s) failed: {lines}")


# Codes whose exception class is not the one their status alone would give.
_CLASS_OF_CODE = {"version_conflict": VersionConflict, "group_exists": Conflict,
                  "name_taken": Conflict, "model_unsupported": Conflict,
                  "lease_mapped": Conflict, "body_timeout": TimedOut,
                  "transfer_failed": TransferFailed,
                  "client_disconnected": ClientDisconnected,
                  **{code: BadRequest for code in (
                      "bad_request", "bad_version", "bad_name", "bad_lease", "no_group",
                      "shared_unreachable", "bad_shared_file",
                      "protocol_mismatch",
                      "transfer_mismatch", "layout_unknown", "bad_content_type")}}
_CLASS_OF_STATUS = {cls.status: cls for cls in (BadAdapter, Unauthorized, Forbidden, NotFound,
                                                TimedOut, Conflict, PayloadTooLarge, TooBusy,
                                                TransferFailed)}


def error_from_json(status: int, body) -> LoRASyncError:
    """Rebuilds the error a server replied with (client side): by its code first, then by
    the HTTP status. Any body shape gives an error (foreign replies: a proxy's, an engine's)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not err:
        err = body
    msg, code, server = (err.get("message"), err.get("code"), err.get("server")) \
        if isinstance(err, dict) else (err, None, None)
    if not isinstance(msg, str) or not msg:
        msg = str(body)
    msg = msg[:2000]  # foreign errors may echo the body
    if not isinstance(code, str) or code not in ErrorCode._value2member_map_:
        code = None  # not ours (an engine's or a proxy's reply)
    status = status if isinstance(status, int) and not isinstance(status, bool) else 500
    cls = _CLASS_OF_CODE.get(code) or _CLASS_OF_STATUS.get(status)
    e = cls(msg, code=code, status=status) if cls is not None else \
        LoRASyncError(msg, code=code or "http_error", status=status)
    if isinstance(server, str) and len(server) <= 300:
        e.server = server  # shared between a sharded trainer's ranks; lora_sync.http
    return e                # sets the true one on every reply it reads
