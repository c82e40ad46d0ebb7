"""Same-host transport (one module per job: messages, lease_table, memfd, trainer,
transport, worker): the trainer writes the safetensors file straight into memory the server
leased to it, then commits. Only two small JSON calls cross the socket.

The lease is a Linux memfd owned by the server's API process. The trainer reaches it through
`/proc/<server pid>/fd/<n>` (so only a process on the same host and in the same PID namespace
can), checks a random probe the server wrote into it, writes the file into it and commits
with a one-time token. At commit the server seals the memfd (F_SEAL_WRITE, SHRINK, GROW):
from then on nobody, the trainer included, can change the bytes the served version is built
from. The trainer commits while its unmap still runs; the seal waits for it, and a writable
mapping still held after SEAL_WAIT_S gets a 409 instead. The server never takes a
path from the client: a commit names a lease id it granted."""

from .lease_table import LeaseTable, SealedBody
from .memfd import _SEALS, is_sealed, new_lease, read_header, seal_and_read_header, seal_wait_s
from .messages import (CANCEL_ROUTE, COMMIT_ROUTE, LEASE_ROUTE, MEMFD_NAME, PROBE_BYTES,
                       RENEW_ROUTE, CommitRequest, Lease, LeaseRequest)
from .trainer import (LeaseRefused, map_lease, open_lease, reopen_read_only, total_bytes,
                      write_lease, write_mapped, write_then_unmap)
from .ready_lease import ReadyLeases
from .transport import ShmClientState, ShmTransport
from .worker import map_read_only, map_sealed, read_sealed, view_sealed

__all__ = ["LeaseTable", "SealedBody", "is_sealed", "new_lease", "read_header",
           "seal_and_read_header", "seal_wait_s", "CANCEL_ROUTE", "COMMIT_ROUTE", "LEASE_ROUTE",
           "MEMFD_NAME", "PROBE_BYTES", "RENEW_ROUTE", "CommitRequest", "Lease", "LeaseRequest",
           "LeaseRefused", "map_lease", "open_lease", "reopen_read_only", "total_bytes",
           "write_lease", "write_mapped", "write_then_unmap", "ReadyLeases", "ShmClientState",
           "ShmTransport", "map_read_only",
           "map_sealed", "read_sealed", "view_sealed", "_SEALS"]
