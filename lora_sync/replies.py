"""Typed reading of server replies on the client. Each reply the client acts on is checked
field by field before anything uses it; a reply that is not the route's message is a
LoRASyncError `bad_reply` naming the server, never a KeyError, a TypeError or garbage taken
for success. (lora_sync.http already bounds each reply's time and size and ensures a JSON
object; this module checks what is in it.) Fields the client does not use pass through."""
from __future__ import annotations

from dataclasses import dataclass

from . import fields, naming
from .errors import BadRequest, LoRASyncError

REQUIRED = fields.REQUIRED


def bad_reply(server: str, message: str) -> LoRASyncError:
    err = LoRASyncError(f"{server}: {message}", code="bad_reply", status=502)
    err.server = server
    return err


def field(body: dict, key: str, kind: type, default=REQUIRED, *, server: str, what: str,
          **bounds):
    """`body[key]` as `kind` (bounds as in lora_sync.fields), or `bad_reply`."""
    try:
        return fields.field(body, key, kind, default, where=f"{what} reply", **bounds)
    except BadRequest as e:
        raise bad_reply(server, e.message) from None


def check(value, kind: type, what: str, *, server: str, **bounds):
    try:
        return fields.check(value, kind, what, **bounds)
    except BadRequest as e:
        raise bad_reply(server, e.message) from None


def version_of(value, what: str, *, server: str) -> int:
    return check(value, int, what, server=server, lo=1, hi=naming.MAX_VERSION)


def instance_of(body: dict, *, server: str, what: str) -> str:
    return field(body, "instance_id", str, "", server=server, what=what, max_len=64)


# -- pushes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PushReply:
    """A version registered: `<lora_name>-v<version>`, the one the client sent."""
    name: str
    version: int
    bytes: int
    transport: str
    instance_id: str
    timings_ms: dict

    @classmethod
    def from_json(cls, server: str, body: dict, name: str | None = None,
                  version: int | None = None) -> "PushReply":
        what = "push"
        served = field(body, "name", str, server=server, what=what, max_len=300)
        got = version_of(body.get("version"), f"{what} reply field 'version'", server=server)
        lora_name, in_name = naming.split_versioned(served)
        if in_name != got:
            raise bad_reply(server, f"the push reply names {served[:200]!r} for version {got}")
        if (name is not None and lora_name != name) or (version is not None and got != version):
            raise bad_reply(server, f"the push reply names {served[:200]!r}; the client pushed "
                            f"{naming.versioned(name or lora_name, version or got)!r}")
        timings = field(body, "timings_ms", dict, {}, server=server, what=what)
        for k, v in timings.items():
            check(v, float, f"{what} reply timings_ms[{str(k)[:40]!r}]", server=server)
        return cls(served, got,
                   field(body, "bytes", int, server=server, what=what, lo=0),
                   field(body, "transport", str, "", server=server, what=what, max_len=32),
                   instance_of(body, server=server, what=what), timings)


# -- listings ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ListedVersion:
    version: int
    served_name: str
    inflight: int


@dataclass(frozen=True)
class ListedName:
    name: str
    alias_target: str | None
    versions: tuple[ListedVersion, ...]
    draining: tuple[str, ...]


@dataclass(frozen=True)
class Listing:
    """GET lora_adapters. `raw` is the reply as the server sent it (checked)."""
    instance_id: str
    keep_versions: int | None
    adapters: tuple[ListedName, ...]
    raw: dict

    @classmethod
    def from_json(cls, server: str, body: dict) -> "Listing":
        what = "lora_adapters"
        names = []
        for i, entry in enumerate(field(body, "adapters", list, server=server, what=what)):
            where = f"lora_adapters reply adapters[{i}]"
            entry = check(entry, dict, where, server=server)
            name = field(entry, "name", str, server=server, what=where, max_len=300)
            versions = []
            for j, v in enumerate(field(entry, "versions", list, [], server=server,
                                        what=where)):
                vwhere = f"{where} versions[{j}]"
                v = check(v, dict, vwhere, server=server)
                number = version_of(v.get("version"), f"{vwhere} field 'version'",
                                    server=server)
                versions.append(ListedVersion(
                    number,
                    field(v, "served_name", str, naming.versioned(name, number), server=server,
                          what=vwhere, max_len=300),
                    field(v, "inflight", int, 0, server=server, what=vwhere, lo=0)))
            draining = field(entry, "draining", list, [], server=server, what=where)
            for k, d in enumerate(draining):
                check(d, str, f"{where} draining[{k}]", server=server, max_len=300)
            names.append(ListedName(
                name, field(entry, "alias_target", str, None, server=server, what=where,
                            max_len=300),
                tuple(versions), tuple(draining)))
        return cls(instance_of(body, server=server, what=what),
                   field(body, "keep_versions", int, None, server=server, what=what, lo=0),
                   tuple(names), body)

    def versions_by_name(self) -> dict[str, set[int]]:
        """Versions per name the server still holds: servable, and draining (a new version
        must be numbered above those too)."""
        out: dict[str, set[int]] = {}
        for entry in self.adapters:
            held = out.setdefault(entry.name, set())
            held.update(v.version for v in entry.versions)
            for served in entry.draining:
                base, version = naming.split_versioned(served)
                if base == entry.name and version is not None:
                    held.add(version)
        return out


# -- info -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Info:
    """GET lora_sync_info: what a trainer needs before it broadcasts."""
    instance_id: str
    workers: int
    max_lora_rank: int
    linear_modules: dict  # module name -> (in_features, out_features)
    raw: dict

    @classmethod
    def from_json(cls, server: str, body: dict) -> "Info":
        what = "lora_sync_info"
        modules = {}
        for k, v in field(body, "linear_modules", dict, server=server, what=what).items():
            where = f"lora_sync_info reply linear_modules[{str(k)[:80]!r}]"
            check(v, list, where, server=server)
            if len(v) != 2:
                raise bad_reply(server, f"{where} must be [in_features, out_features]")
            modules[k] = tuple(check(n, int, where, server=server, lo=1, hi=1 << 40)
                               for n in v)
        return cls(instance_of(body, server=server, what=what),
                   field(body, "workers", int, server=server, what=what, lo=1, hi=1 << 20),
                   field(body, "max_lora_rank", int, server=server, what=what, lo=1,
                         hi=1 << 20),
                   modules, body)


def served_version(server: str, headers: dict) -> int | None:
    """The X-LoRA-Version header of a generation reply (None: the base model served it)."""
    raw = {k.lower(): v for k, v in headers.items()}.get("x-lora-version")
    if not raw:
        return None
    try:
        return naming.parse_version(raw)
    except BadRequest as e:
        raise bad_reply(server, f"X-LoRA-Version: {e.message}") from None


def completion_text(server: str, body: dict) -> str:
    """The first choice's text of an OpenAI /v1/completions reply."""
    what = "completion reply field 'choices'"
    choices = field(body, "choices", list, server=server, what="completion")
    if not choices:
        raise bad_reply(server, f"{what} is empty")
    first = check(choices[0], dict, f"{what}[0]", server=server)
    return field(first, "text", str, server=server, what="completion choices[0]")
