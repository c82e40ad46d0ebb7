"""The small interface each engine implements so one service drives both: generic calls to
its workers (the ops of worker_extensions/dispatcher.py) plus activate, publish and free."""
from __future__ import annotations

import secrets
from abc import ABC, abstractmethod

from ..adapter import ModelSpec
from ..messages import WorkerReply, raise_refusals
from ..notices import notice_paths, wait_notices


class EngineBridge(ABC):
    """How the shared service reaches one engine. Worker calls act on all of its workers and
    raise LoRASyncError when any worker refuses.

    Identity rule: every registration gets `identity(adapter_id)`, which the engine has never
    seen in any key it caches by (prefix/radix cache, LoRA caches). It joins a secret nonce,
    new at every start, to the adapter id, which never repeats within a start: so retire,
    re-push, restart or a second client never meet blocks computed under other weights, and
    no client can name another registration's cache key."""

    nonce: str = ""
    # True in a server's own process (an engine's API process): its heap is frozen at the
    # first push unless the engine froze it (full_gc). Never where the process is not the
    # server's to freeze (an in-process server of a test, a trainer's).
    freezes_heap: bool = False

    def identity(self, adapter_id: int) -> str:
        if not self.nonce:
            self.nonce = secrets.token_hex(8)
        return f"{self.nonce}-{adapter_id}"

    @abstractmethod
    def engine_names(self) -> set[str]:
        """Every model or adapter name the engine serves that is not lora-sync's."""

    @abstractmethod
    async def model_spec(self) -> ModelSpec:
        """Linear layers and max rank of the served base model."""

    @abstractmethod
    def new_adapter_id(self) -> int:
        """A fresh engine-wide integer id for a new version."""

    @abstractmethod
    async def call_workers(self, op: str, **args) -> list[WorkerReply]:
        """Runs a dispatcher op (keyword arguments only) on every worker; one reply each
        (`messages.check_replies`: the first refusal is raised)."""

    @abstractmethod
    async def worker_count(self) -> int: ...

    async def call_workers_in_background(self, op: str, wait_s: float,
                                         **args) -> list[WorkerReply]:
        """For ops that may take long (a transfer, a rendezvous): the call only starts the
        work, so the engine loop stays free; each worker reports in a notice file, and one
        missing after `wait_s` is a TransferFailed."""
        notices = notice_paths(await self.worker_count())
        await self.call_workers(op, notice_paths=notices, **args)
        return raise_refusals(await wait_notices(notices, wait_s))

    async def worker_status(self) -> list[dict]:
        """One dict per worker: rank, world_size, the adapter ids it holds/caches, groups."""
        return [r.data for r in await self.call_workers("info")]

    @abstractmethod
    async def activate(self, served_name: str, adapter_id: int):
        """Registers the adapter the workers took in with the engine; returns its handle."""

    @abstractmethod
    def publish(self, served_name: str, handle) -> None:
        """Makes requests naming `served_name` (a versioned name) use `handle`."""

    @abstractmethod
    async def unpublish(self, served_name: str) -> None:
        """New requests naming it get a 404."""

    @abstractmethod
    async def in_use(self, adapter_id: int) -> bool:
        """Whether the engine still has a request (queued, running or on its way in) on
        this adapter: it must not be freed before that request ends."""

    @abstractmethod
    async def free(self, adapter_ids: list[int]) -> None:
        """Frees the engine's and the workers' copies."""

    def engine_adapter_id(self, name: str) -> int | None:
        """The id of an adapter the engine loaded itself under `name`, where the engine's
        own unload leaves it cached (then `evict` frees it); None elsewhere."""
        return None

    async def evict(self, adapter_id: int) -> None:
        """Drops an adapter the engine loaded itself from the engine's caches."""
