"""The shm transport's routes and typed messages (docs/protocol.md,
"Same-host transport (shm): lease, write, commit")."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import ClassVar


from ... import replies
from ...errors import BadRequest
from ...fields import field



LEASE_ROUTE = "lora_sync_lease"
CANCEL_ROUTE = "lora_sync_lease_cancel"
RENEW_ROUTE = "lora_sync_lease_renew"
COMMIT_ROUTE = "load_lora_adapter_from_lease"
PROBE_BYTES = 16
_LEASE_ID = re.compile(r"[0-9a-f]{32}")
# What the trainer accepts in a grant: it opens `path` read-write, so only a descriptor of a
# process (never a file system path), and only a memfd of the server's lease table.
_TOKEN = re.compile(r"[0-9a-f]{16,128}")
_PROBE = re.compile(r"[0-9a-f]{%d}" % (2 * PROBE_BYTES))
_LEASE_PATH = re.compile(r"/proc/[1-9][0-9]{0,9}/fd/[0-9]{1,10}")
MEMFD_NAME = "lora-sync-lease"


# -- typed messages ---------------------------------------------------------------------
@dataclass(frozen=True)
class LeaseRequest:
    # What the request holds for its client (Access.tenant_call counts it on the tenant).
    opens: ClassVar[str] = "lease"
    nbytes: int
    # Who asks, as the client names itself: a label, never a bound (a client could mint
    # any number of ids); bounds rest on the server's totals (docs/security.md).
    client: str
    # For a push to come (transports/ready_lease.py), not this one: granted once the
    # versions being retired have given their memory back (`ShmTransport.grant`).
    ahead: bool = False

    @classmethod
    def from_json(cls, body: dict, max_bytes: int) -> "LeaseRequest":
        return cls(field(body, "nbytes", int, lo=PROBE_BYTES, hi=max_bytes, where="lease"),
                   field(body, "client", str, "anonymous", max_len=64, where="lease"),
                   field(body, "ahead", bool, False, where="lease"))


@dataclass(frozen=True)
class Lease:
    """The grant: where to write (`path`), what must be there before (`probe`), and the
    one-time `token` that commits it. Only this reply ever carries them."""
    lease_id: str
    token: str
    path: str
    probe: str
    nbytes: int
    expires_s: float

    def to_json(self) -> dict:
        return asdict(self)

    def ticket(self) -> dict:
        """What commits, cancels or renews it."""
        return {"lease_id": self.lease_id, "token": self.token}

    @classmethod
    def from_json(cls, d: dict, server: str = "the server",
                  nbytes: int | None = None) -> "Lease":
        """The grant as the trainer reads it: every field checked (`nbytes`, when given, must
        be the size asked for), and `path` a /proc/<pid>/fd/<n> name; else `bad_reply`."""
        def text(key: str, pattern: re.Pattern) -> str:
            value = replies.field(d, key, str, server=server, what="lease", max_len=128)
            if not pattern.fullmatch(value):
                raise replies.bad_reply(server, f"lease reply field {key!r} is malformed")
            return value
        size = replies.field(d, "nbytes", int, server=server, what="lease", lo=PROBE_BYTES)
        if nbytes is not None and size != nbytes:
            raise replies.bad_reply(server, f"the lease holds {size} bytes, not the {nbytes} "
                                    "asked for")
        return cls(text("lease_id", _LEASE_ID), text("token", _TOKEN), text("path", _LEASE_PATH),
                   text("probe", _PROBE), size,
                   replies.field(d, "expires_s", float, server=server, what="lease", lo=0))


@dataclass(frozen=True)
class CommitRequest:
    lease_id: str
    token: str

    @classmethod
    def from_json(cls, body: dict) -> "CommitRequest":
        lease_id = field(body, "lease_id", str, max_len=64, where="lease commit")
        if not _LEASE_ID.fullmatch(lease_id):
            raise BadRequest("lease_id must be the 32 hex digits the lease reply gave",
                             code="bad_request")
        return cls(lease_id, field(body, "token", str, max_len=128, where="lease commit"))
