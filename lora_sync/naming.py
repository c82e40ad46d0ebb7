"""Versioned adapter names: every push is `<name>-v<N>`; `<name>` aliases the newest."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import BadRequest, VersionConflict

# ASCII only and matched whole (`fullmatch`): `$` would accept a trailing newline, which then
# breaks the X-LoRA-Name reply header of every request on that name.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VERSIONED = re.compile(r"(?P<name>.+)-v(?P<version>[0-9]{1,19})")
_DIGITS = re.compile(r"[0-9]{1,19}")
MAX_VERSION = 2 ** 63 - 1  # what every engine-side integer can hold


def versioned(name: str, version: int) -> str:
    return f"{name}-v{version}"


def split_versioned(served: str) -> tuple[str, int | None]:
    """'policy-v3' -> ('policy', 3); 'policy' -> ('policy', None)."""
    m = _VERSIONED.fullmatch(served)
    return (m["name"], int(m["version"])) if m else (served, None)


def check_name(name, what: str = "lora_name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(f"{what} {_short(name)} must be 1-128 ASCII letters, digits, "
                         "'.', '_' or '-', starting with a letter or digit", code="bad_name")
    if _VERSIONED.fullmatch(name):
        raise BadRequest(f"{what} {name!r} must not end in -v<N>: the server appends the "
                         "version itself", code="bad_name")
    return name


def parse_version(raw) -> int | None:
    """A version from a header string or a JSON number: ASCII digits only, 1 <= v < 2**63."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise BadRequest(f"version {_short(raw)} must be a decimal integer", code="bad_version")
    if isinstance(raw, str):
        if not _DIGITS.fullmatch(raw):
            raise BadRequest(f"version {_short(raw)} must be 1-19 ASCII digits",
                             code="bad_version")
        raw = int(raw)
    if not 1 <= raw <= MAX_VERSION:
        raise BadRequest(f"version {_short(raw)} must be between 1 and {MAX_VERSION}",
                         code="bad_version")
    return raw


def _short(value, limit: int = 80) -> str:
    """repr() of client input, cut short: error messages must not echo a huge value."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "<huge int>"
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class VersionBook:
    """Which versions of each adapter name exist. Pure bookkeeping; the engine glue
    calls `reserve` before loading and `commit` once every worker has the version."""
    versions: dict[str, list[int]] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    # Newest version of a retired name whose versions may still drain: a new push of the
    # name must not reuse one of their served names.
    floors: dict[str, int] = field(default_factory=dict)
    # Where a rolled-back alias points (a retained version), and the names whose alias is
    # pinned there: a push moves an unpinned alias to its new version, never a pinned one.
    targets: dict[str, int] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)

    def latest(self, name: str) -> int | None:
        vs = self.versions.get(name)
        return vs[-1] if vs else None

    def alias(self, name: str) -> int | None:
        """The version `name` itself resolves to: where it was pointed, else the newest."""
        target = self.targets.get(name)
        return target if target is not None else self.latest(name)

    def point(self, name: str, version: int | None, pin: bool = False) -> int:
        """Points the alias at a retained `version` (None: back to the newest, unpinned);
        `pin` keeps it there across pushes. Returns the version it now resolves to."""
        if version is None:
            self.targets.pop(name, None)
            self.pinned.discard(name)
        else:
            if version not in self.versions.get(name, ()):
                raise KeyError(version)
            self.targets[name] = version
            if pin:
                self.pinned.add(name)
            else:
                self.pinned.discard(name)
        return self.alias(name)

    def names(self) -> set[str]:
        """Every name that is servable or has a push in flight."""
        return {n for n, vs in self.versions.items() if vs} | set(self.reserved)

    def reserve(self, name: str, requested: int | None) -> int:
        """The version a push will get; refuses one not above the newest (or in flight)."""
        floor = max(self.latest(name) or 0, self.reserved.get(name, 0),
                    self.floors.get(name, 0))
        version = floor + 1 if requested is None else requested
        if version <= floor or version > MAX_VERSION:
            raise VersionConflict(f"{name}: version {version} is not above the newest "
                                  f"version {floor}", code="version_conflict")
        self.reserved[name] = version
        return version

    def unreserve(self, name: str, version: int) -> None:
        """Forget a reservation whose load failed."""
        if self.reserved.get(name) == version:
            del self.reserved[name]

    def commit(self, name: str, version: int, keep: int | None = None) -> list[int]:
        """Marks `version` servable; returns versions that fall out of a `keep` window. The
        alias moves to it unless pinned; a pinned target stays, outside the window."""
        self.unreserve(name, version)
        vs = self.versions.setdefault(name, [])
        vs.append(version)
        vs.sort()
        if name not in self.pinned:
            self.targets.pop(name, None)
        if keep is None or len(vs) <= keep:
            return []
        held = self.targets.get(name)
        retired = [v for v in vs[:-keep] if v != held]
        self.versions[name] = [v for v in vs if v not in retired]
        return retired

    def forget(self, name: str) -> list[int]:
        """Takes every version of `name` out of service (the alias goes with them)."""
        versions = self.versions.pop(name, [])
        self.targets.pop(name, None)
        self.pinned.discard(name)
        if versions:
            self.floors[name] = max(versions[-1], self.floors.get(name, 0))
        return versions
