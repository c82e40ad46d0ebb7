"""The error vocabulary shared by both engines' routes and the client."""
from __future__ import annotations


class LoRASyncError(Exception):
    """An error with an HTTP status and a stable machine-readable code."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        if status:
            self.status = status

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "status": self.status}}


class BadAdapter(LoRASyncError):
    """The request describes an adapter the server cannot serve (400)."""
    status, code = 400, "bad_adapter"


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


class TooBusy(LoRASyncError):
    """A bounded resource is full (staging bytes, names, pending groups): retry later."""
    status, code = 429, "too_busy"


class TimedOut(LoRASyncError):
    """The client sent its body too slowly or stopped sending it."""
    status, code = 408, "body_timeout"


class TransferFailed(LoRASyncError):
    """A collective transfer timed out or a peer vanished (502: the server is fine)."""
    status, code = 502, "transfer_failed"


def error_from_json(status: int, body: dict) -> LoRASyncError:
    """Rebuilds the error a server replied with (client side)."""
    err = (body or {}).get("error") or body or {}
    msg = err.get("message") if isinstance(err, dict) else str(err)
    msg = msg[:2000] if isinstance(msg, str) else msg  # foreign errors may echo the body
    code = err.get("code") if isinstance(err, dict) else None
    for cls in (BadAdapter, PayloadTooLarge, VersionConflict, NotFound, Unauthorized,
                Forbidden, TooBusy, TimedOut, TransferFailed):
        if cls.status == status:
            return cls(msg or str(body), code=code)
    return LoRASyncError(msg or str(body), code=code or "http_error", status=status)
