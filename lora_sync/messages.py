"""The typed messages between the API process and the engine's workers. They cross the
engine's own RPC (in-host IPC) as plain dicts: `to_json` on one side, `from_json` on the
other."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .errors import LoRASyncError


@dataclass(frozen=True)
class IntakeRequest:
    """Take a new adapter in: `transport` names the transport whose worker side receives
    it; `args` are that transport's own (a staged file's path, a broadcast's plan)."""
    transport: str
    adapter_id: int
    config: dict
    checksum: str | None = None
    args: dict = field(default_factory=dict)
    check_finite: bool = False  # the operator's LORA_SYNC_CHECK_FINITE (Settings)

    def to_json(self) -> dict:
        return {"transport": self.transport, "adapter_id": self.adapter_id,
                "config": self.config, "checksum": self.checksum, "args": self.args,
                "check_finite": self.check_finite}

    @classmethod
    def from_json(cls, d: dict) -> "IntakeRequest":
        return cls(str(d["transport"]), int(d["adapter_id"]), dict(d["config"]),
                   d.get("checksum"), dict(d.get("args") or {}), bool(d.get("check_finite")))


@dataclass(frozen=True)
class WorkerReply:
    """One worker's outcome of one op: `data` on success, or the error it raised."""
    ok: bool
    ms: float = 0.0
    data: dict = field(default_factory=dict)
    status: int = 200
    code: str | None = None
    message: str = ""

    @classmethod
    def run(cls, fn, *args, **kwargs) -> "WorkerReply":
        """Runs a worker step and captures its outcome (exceptions do not travel well
        through the engines' RPC): a LoRASyncError keeps its status and code; anything else
        is a bug of ours or the engine's, a 500 `worker_failed`."""
        t0 = time.perf_counter()
        try:
            data = fn(*args, **kwargs) or {}
            return cls(True, (time.perf_counter() - t0) * 1e3, data)
        except LoRASyncError as e:
            return cls.failed(e)
        except Exception as e:
            return cls(False, status=500, code="worker_failed",
                       message=f"worker failed: {type(e).__name__}: {str(e)[:1000]}")

    @classmethod
    def failed(cls, error: LoRASyncError) -> "WorkerReply":
        return cls(False, status=error.status, code=error.code, message=error.message)

    def raise_error(self) -> None:
        if not self.ok:
            raise LoRASyncError(self.message or "worker failed", code=self.code,
                                status=self.status)

    def to_json(self) -> dict:
        if self.ok:
            return {**self.data, "ok": True, "ms": self.ms}
        return {"ok": False, "status": self.status, "code": self.code, "message": self.message}

    @classmethod
    def from_json(cls, d) -> "WorkerReply":
        if not isinstance(d, dict) or not d.get("ok"):
            d = d if isinstance(d, dict) else {}
            return cls(False, status=int(d.get("status", 500)),
                       code=d.get("code") or "worker_failed",
                       message=str(d.get("message", "worker failed")))
        data = {k: v for k, v in d.items() if k not in ("ok", "ms")}
        return cls(True, float(d.get("ms", 0.0)), data)


def check_replies(raw: list) -> list[WorkerReply]:
    """The workers' replies as the engine's RPC carried them, typed and checked."""
    return raise_refusals([WorkerReply.from_json(r) for r in raw])


def raise_refusals(replies: list[WorkerReply]) -> list[WorkerReply]:
    """`replies`, once none is a refusal; else the first refusal as its LoRASyncError."""
    for r in replies:
        r.raise_error()
    return replies
