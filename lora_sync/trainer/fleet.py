"""What a client remembers about its servers and adapter names, so that a restarted server
or a restarted trainer picks up where it was.

  * each server's instance id (new at every server start): a change means the server lost
    its adapters;
  * each name's newest version, and unless `remember=False` a copy of its adapter (one
    adapter's bytes per name, in host memory) to re-push after a server restart.

A copy, not a reference: PEFT's state dict shares memory with the live parameters, so a
reference would re-push weights newer than the version number it carries."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..adapter import LoRAAdapter


@dataclass
class Newest:
    version: int
    adapter: LoRAAdapter | None   # None when the client does not remember adapters


@dataclass
class FleetMemory:
    remember: bool = True
    newest: dict[str, Newest] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)  # server url -> instance id
    stale: set[str] = field(default_factory=set)             # servers to resync first

    def next_version(self, name: str, held_by_servers) -> int:
        """The version the next push of `name` gets. A fresh client (a restarted trainer)
        continues from the newest version any server holds; `held_by_servers(name)` lists
        each server's newest (None where it has none or cannot be reached)."""
        if name in self.newest:
            return self.newest[name].version + 1
        return max([v for v in held_by_servers(name) if v] or [0]) + 1

    def pushed(self, name: str, version: int, adapter: LoRAAdapter) -> None:
        kept = None
        if self.remember:
            kept = LoRAAdapter({k: t.detach().clone() for k, t in adapter.tensors.items()},
                               dict(adapter.config))
        self.newest[name] = Newest(version, kept)

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
