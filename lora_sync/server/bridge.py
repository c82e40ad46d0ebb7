"""The small interface each engine implements so one service drives both."""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..adapter import ModelSpec


class EngineBridge(ABC):
    """How the shared service reaches one engine. Every method acts on all of its workers
    and raises LoRASyncError when any worker refuses."""

    @abstractmethod
    async def model_spec(self) -> ModelSpec:
        """Linear layers and max rank of the served base model."""

    @abstractmethod
    def new_adapter_id(self) -> int:
        """A fresh engine-wide integer id for a new version."""

    @abstractmethod
    async def take_staged(self, adapter_id: int, path: str, config: dict,
                             checksum: str | None) -> list[dict]:
        """Every worker takes the adapter from a staged shared-memory body (verifying
        `checksum` if given); returns one reply per worker (its own time in 'ms')."""

    @abstractmethod
    async def receive(self, adapter_id: int, group_name: str, specs: list[dict], config: dict,
                      bucket_bytes: int, checksum: str | None, timeout_s: float) -> list[dict]:
        """Every worker receives the adapter by broadcast in `group_name`."""

    @abstractmethod
    async def activate(self, served_name: str, adapter_id: int):
        """Registers the staged adapter with the engine; returns the engine's handle."""

    @abstractmethod
    def publish(self, names: list[str], handle) -> None:
        """Makes requests naming any of `names` (versioned names only) use `handle`."""

    @abstractmethod
    async def unpublish(self, names: list[str]) -> None:
        """New requests naming these get a 404."""

    @abstractmethod
    async def in_use(self, adapter_id: int, served_name: str) -> bool:
        """Whether the engine still has a request (queued, running or on its way in) on
        this adapter: it must not be freed before that request ends."""

    @abstractmethod
    async def free(self, adapter_ids: list[int]) -> None:
        """Frees the engine's and the workers' copies."""

    @abstractmethod
    async def init_group(self, group_name: str, host: str, port: int, rank_offset: int,
                         world_size: int, backend: str, timeout_s: float) -> None:
        """Every worker joins the trainer's group, off the engine's step loop; a worker not
        done within `timeout_s` is a TransferFailed (and its late group is discarded)."""

    @abstractmethod
    async def destroy_group(self, group_name: str) -> None: ...

    @abstractmethod
    async def worker_status(self) -> list[dict]:
        """One dict per worker: rank, world_size and the adapter ids it holds/caches."""
