"""The JSON requests of the group and broadcast routes, read into typed values: every field
is checked for type and range here, so a bad one is a 400 that names it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .. import naming
from ..adapter import META_CONFIG
from ..collective import DEFAULT_BUCKET_BYTES
from ..errors import BadAdapter
from ..fields import field
from ..wire import MAX_TENSORS, TensorSpec

MAX_WORLD_SIZE = 4096
MAX_GROUP_TIMEOUT_S = 3600.0
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


def parse_config(raw: str | None) -> dict:
    """PEFT's adapter_config.json text, as sent in the metadata or the broadcast request."""
    if raw is None:
        raise BadAdapter(f"safetensors __metadata__ has no {META_CONFIG!r} (the JSON text of "
                         "PEFT's adapter_config.json)", code="missing_metadata")
    try:
        cfg = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise BadAdapter(f"{META_CONFIG} is not valid JSON: {str(e)[:200]}",
                         code="bad_config") from e
    if not isinstance(cfg, dict):
        raise BadAdapter(f"{META_CONFIG} must be a JSON object", code="bad_config")
    return cfg


def group_name_of(body: dict) -> str:
    return naming.check_name(field(body, "group_name", str, "default", max_len=128),
                             "group_name")


@dataclass(frozen=True)
class InitGroupRequest:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    group_name: str
    timeout_s: float

    @classmethod
    def from_json(cls, body: dict) -> "InitGroupRequest":
        where = "init_lora_update_group"
        backend = field(body, "backend", str, "gloo", max_len=8, where=where)
        if backend not in ("gloo", "nccl"):
            raise BadAdapter(f"backend must be 'gloo' or 'nccl', got {backend!r}",
                             code="bad_request")
        return cls(
            master_address=field(body, "master_address", str, max_len=253, where=where),
            master_port=field(body, "master_port", int, lo=1, hi=65535, where=where),
            rank_offset=field(body, "rank_offset", int, lo=1, hi=MAX_WORLD_SIZE, where=where),
            world_size=field(body, "world_size", int, lo=2, hi=MAX_WORLD_SIZE, where=where),
            backend=backend, group_name=group_name_of(body),
            timeout_s=field(body, "timeout_s", float, 120.0, lo=0.1, hi=MAX_GROUP_TIMEOUT_S,
                            where=where))


@dataclass(frozen=True)
class DistributedLoadRequest:
    lora_name: str
    version: int | None
    config: dict
    specs: list[TensorSpec]
    group_name: str
    bucket_bytes: int
    checksum: str | None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @classmethod
    def from_json(cls, body: dict) -> "DistributedLoadRequest":
        where = "load_lora_adapter_from_distributed"
        raw_specs = field(body, "tensors", list, max_len=MAX_TENSORS, where=where)
        specs = [TensorSpec.from_json(s) for s in raw_specs]
        if len({s.name for s in specs}) != len(specs):
            raise BadAdapter("'tensors' lists a name twice", code="bad_metadata")
        config = body.get("adapter_config")
        if isinstance(config, str):
            config = parse_config(config)
        elif config is not None and not isinstance(config, dict):
            raise BadAdapter("adapter_config must be a JSON object or its JSON text",
                             code="bad_config")
        checksum = field(body, "checksum", str, None, max_len=80, where=where)
        if checksum is not None and not _CHECKSUM.fullmatch(checksum):
            raise BadAdapter("checksum must be 'sha256:' and 64 lowercase hex digits",
                             code="bad_request")
        return cls(
            lora_name=naming.check_name(body.get("lora_name")),
            version=naming.parse_version(body.get("version")),
            config=config if config is not None else {}, specs=specs,
            group_name=group_name_of(body),
            bucket_bytes=field(body, "bucket_bytes", int, DEFAULT_BUCKET_BYTES, lo=1 << 12,
                               hi=1 << 30, where=where),
            checksum=checksum)
