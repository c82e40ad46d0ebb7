"""Versioned adapter names: every push is `<name>-v<N>`; `<name>` aliases the newest."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import BadAdapter, VersionConflict

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSIONED = re.compile(r"^(?P<name>.+)-v(?P<version>\d+)$")


def versioned(name: str, version: int) -> str:
    return f"{name}-v{version}"


def split_versioned(served: str) -> tuple[str, int | None]:
    """'policy-v3' -> ('policy', 3); 'policy' -> ('policy', None)."""
    m = _VERSIONED.match(served)
    return (m["name"], int(m["version"])) if m else (served, None)


def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadAdapter(f"lora_name {name!r} must be 1-128 characters of letters, digits, "
                         "'.', '_' or '-'", code="bad_name")
    if _VERSIONED.match(name):
        raise BadAdapter(f"lora_name {name!r} must not end in -v<N>: the server appends the "
                         "version itself", code="bad_name")
    return name


def parse_version(raw) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        v = int(str(raw), 10)
    except ValueError:
        raise BadAdapter(f"version {raw!r} is not a decimal integer", code="bad_version")
    if v <= 0:
        raise BadAdapter(f"version {v} must be >= 1", code="bad_version")
    return v


@dataclass
class VersionBook:
    """Which versions of each adapter name exist. Pure bookkeeping; the engine glue
    calls `reserve` before loading and `commit` once every worker has the version."""
    versions: dict[str, list[int]] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)

    def latest(self, name: str) -> int | None:
        vs = self.versions.get(name)
        return vs[-1] if vs else None

    def reserve(self, name: str, requested: int | None) -> int:
        """The version a push will get; refuses one not above the newest (or in flight)."""
        floor = max(self.latest(name) or 0, self.reserved.get(name, 0))
        version = floor + 1 if requested is None else requested
        if version <= floor:
            raise VersionConflict(f"{name}: version {version} is not above the newest "
                                  f"version {floor}", code="version_conflict")
        self.reserved[name] = version
        return version

    def release(self, name: str, version: int) -> None:
        """Forget a reservation whose load failed."""
        if self.reserved.get(name) == version:
            del self.reserved[name]

    def commit(self, name: str, version: int, keep: int | None = None) -> list[int]:
        """Marks `version` servable; returns versions that fall out of a `keep` window."""
        self.release(name, version)
        vs = self.versions.setdefault(name, [])
        vs.append(version)
        vs.sort()
        if keep is None or len(vs) <= keep:
            return []
        retired, self.versions[name] = vs[:-keep], vs[-keep:]
        return retired
