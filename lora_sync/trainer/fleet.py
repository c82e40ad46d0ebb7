"""What a client remembers about its servers and adapter names, so that a restarted server
or a restarted trainer picks up where it was.

  * each server's instance id (new at every server start): a change means the server lost
    its adapters;
  * each name's newest version, and unless `remember=False` a copy of its adapter (one
    adapter's bytes per name, in host memory) to re-push after a server restart.

A copy, not a reference: PEFT's state dict shares memory with the live parameters, so a
reference would re-push weights newer than the version number it carries. After an shm push
the copy is the sealed lease itself, mapped read-only (its pages are the server's: no bytes
are copied, and they stay while the client keeps them, whatever the server does); after a
broadcast on CPU, the frames it packed (into one of the name's spare buffers)."""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import host_copy, wire
from ..adapter import LoRAAdapter
from ..transports.base import KeptCopy, SealedCopy


@dataclass
class Newest:
    version: int
    adapter: LoRAAdapter | None   # None when the client does not remember adapters
    flat: torch.Tensor | None = None  # the one buffer `adapter`'s tensors view
    # Or, after an shm push: the sealed lease mapped read-only, and the adapter's config
    # (its tensors are viewed only when a resync needs them).
    sealed: Any = None
    config: dict | None = None
    # Or, after a snapshot: `flat` holds the tensors as `layout` (CopyLayout) places them,
    # viewed only when a resync needs them.
    layout: "CopyLayout | None" = None

    @property
    def kept(self) -> bool:
        return self.adapter is not None or self.sealed is not None or self.layout is not None

    def lent(self) -> "Newest":
        """A copy of its own, for a resync (which may outlive the buffer behind `flat`);
        a sealed lease is viewed as it is: nobody can change it."""
        if self.sealed is not None:
            return Newest(self.version, LoRAAdapter(wire.view_mapped(self.sealed)[1],
                                                    dict(self.config)))
        if self.layout is not None:
            return Newest(self.version, LoRAAdapter(self.layout.views(self.flat.clone()),
                                                    dict(self.config)))
        return Newest(self.version, LoRAAdapter.copy_of(
            self.adapter, {k: t.clone() for k, t in self.adapter.tensors.items()}))


@dataclass(frozen=True)
class CopyLayout:
    """Where a snapshot puts each tensor in its buffer: back to back, each at a multiple of
    8 bytes (every dtype's view is legal there)."""
    names: list[str]
    kinds: list[tuple]        # (dtype, shape) of each tensor
    starts: list[int]         # each tensor's first byte in the buffer
    nbytes: int               # the buffer's bytes in use
    plan: Any                 # the views' wire.ViewPlan, or None: cut tensor by tensor

    @classmethod
    def of(cls, adapter: LoRAAdapter, kinds: list[tuple]) -> "CopyLayout":
        sizes = [t.nbytes for t in adapter.tensors.values()]
        starts = [0, *itertools.accumulate(-(-n // 8) * 8 for n in sizes)]
        names = list(adapter.tensors)
        plan = wire.plan_tensor_views(names, kinds, [(b, b + n) for b, n in zip(starts, sizes)])
        return cls(names, kinds, starts[:-1], starts[-1], plan)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.plan is not None:
            return self.plan.views(flat, 0)
        return {name: flat[b:b + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for name, (dtype, shape), b in zip(self.names, self.kinds, self.starts)}


def newest_of(kept: KeptCopy, adapter: LoRAAdapter) -> Newest:
    """The client's record of what a push of `adapter` kept (PushResult.kept), its version
    set later."""
    if isinstance(kept, SealedCopy):
        return Newest(0, None, sealed=kept.view, config=dict(adapter.config))
    return Newest(0, LoRAAdapter.copy_of(adapter, kept.tensors), kept.flat)


@dataclass
class FleetMemory:
    remember: bool = True
    newest: dict[str, Newest] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)  # server url -> instance id
    stale: set[str] = field(default_factory=set)             # servers to resync first
    # A name's copies before its newest, reused by its next snapshots: writing memory already
    # touched costs a fraction of fresh pages. Nobody else reads them (see `newest_copies`).
    # Two at most: the pair a snapshot transport alternates between. After an shm push (no
    # copy: the newest is the sealed lease) both are spares; dropping one there, to take a
    # fresh one at the next snapshot, made that push pay for fresh pages again.
    _spares: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    _layouts: dict[str, CopyLayout] = field(default_factory=dict)  # of each name's copies
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def next_version(self, name: str, held_by_servers) -> int:
        """The version the next push of `name` gets. A fresh client (a restarted trainer)
        continues from the newest version any server holds; `held_by_servers(name)` lists
        each server's newest (None where it has none or cannot be reached)."""
        if name in self.newest:
            return self.newest[name].version + 1
        return max([v for v in held_by_servers(name) if v] or [0]) + 1

    def snapshot(self, name: str, adapter: LoRAAdapter) -> Newest | None:
        """The adapter's bytes as pushed, in host memory (one buffer, the name's spare when it
        fits), or None unless `remember`. The client makes it while the servers take the
        push in, off the push's critical path."""
        if not self.remember:
            return None
        layout = self._layout(name, adapter)
        with self._lock:
            spares = self._spares.get(name, [])
            flat = next((f for f in spares if _fits(f, layout.nbytes)), None)
            if flat is not None:
                spares.remove(flat)
            elif spares:  # another size: the adapter changed shape
                spares.pop(0)
        if flat is None:
            flat = torch.empty(copy_capacity(layout.nbytes), dtype=torch.uint8)
        # beside the servers' intake: no torch thread team. Host tensors go in by address,
        # with no view made (thousands per push); the views are made if a resync wants them.
        sources = adapter.tensors.values()
        if not host_copy.copy_to(flat.data_ptr(), layout.starts, sources):
            views = layout.views(flat)
            host_copy.copy_each([(views[k], t) for k, t in adapter.tensors.items()])
        return Newest(0, None, flat, config=dict(adapter.config), layout=layout)

    def _layout(self, name: str, adapter: LoRAAdapter) -> CopyLayout:
        """The name's copies' CopyLayout, kept while its tensors stay the same (a trainer's
        every step)."""
        kinds = [(t.dtype, t.shape) for t in adapter.tensors.values()]
        with self._lock:
            kept = self._layouts.get(name)
        if kept is not None and kept.kinds == kinds and kept.names == list(adapter.tensors):
            return kept
        layout = CopyLayout.of(adapter, kinds)
        with self._lock:
            self._layouts[name] = layout
        return layout

    def spare(self, name: str) -> torch.Tensor | None:
        """A spare buffer of `name` for a transport to pack the push into (broadcast): it
        stays a spare unless the push becomes the newest (`pushed`)."""
        with self._lock:
            return next(iter(self._spares.get(name, [])), None)

    def pushed(self, name: str, version: int, kept: Newest | None) -> None:
        """`kept`: the push's `snapshot` (or its sealed lease, or the transport's packed
        copy). The copy it replaces becomes one of the name's spares."""
        with self._lock:
            old = self.newest.get(name)
            self.newest[name] = replace(kept, version=version) if kept is not None \
                else Newest(version, None)
            flat = self.newest[name].flat
            if flat is not None and name in self._spares:  # packed into a spare
                self._spares[name] = [f for f in self._spares[name] if f is not flat]
            if old is not None and old.flat is not None and old.flat is not flat:
                self._keep_spare(name, old.flat)

    def unused(self, name: str, kept: Newest | None) -> None:
        """A snapshot no server took: its buffer is the name's spare again (unless an
        earlier try of the same push made it the newest)."""
        with self._lock:
            newest = self.newest.get(name)
            if kept is not None and kept.flat is not None and \
                    (newest is None or newest.flat is not kept.flat):
                self._keep_spare(name, kept.flat)

    def _keep_spare(self, name: str, flat: torch.Tensor) -> None:
        spares = self._spares.setdefault(name, [])
        if all(f is not flat for f in spares):
            spares[:] = [flat] + spares[:1]

    def forget(self, name: str) -> None:
        with self._lock:
            self.newest.pop(name, None)
            self._spares.pop(name, None)
            self._layouts.pop(name, None)

    def newest_copies(self, wanted) -> list[tuple[str, Newest]]:
        """(name, Newest) of each remembered adapter `wanted(name, version)` says to send,
        as copies of their own: the buffers behind `newest` become spares, and a resync may
        outlive that."""
        with self._lock:
            return [(name, n.lent()) for name, n in self.newest.items()
                    if n.kept and wanted(name, n.version)]

    def saw(self, server_url: str, instance_id: str | None) -> bool:
        """Records the instance a server replied from; True when it changed (a restart),
        and the server is then marked for a resync."""
        if not instance_id:
            return False
        before = self.instances.get(server_url)
        self.instances[server_url] = instance_id
        if before is not None and before != instance_id:
            self.stale.add(server_url)
            return True
        return False


def copy_capacity(nbytes: int) -> int:
    """The size of a copy buffer for an adapter of `nbytes`: room for it however a transport
    lays it out, so one buffer serves every transport of a name in turn (a broadcast's frames
    add under 128 bytes per bucket, and buckets of 4 KiB or more hold it in 1/32 more)."""
    return nbytes + nbytes // 32 + 4096


def _fits(flat: torch.Tensor, nbytes: int) -> bool:
    """A spare serves a copy of `nbytes` if it has room, but not if it is much larger (held
    for an adapter of another shape)."""
    return nbytes <= flat.numel() <= copy_capacity(nbytes) + (1 << 20)
