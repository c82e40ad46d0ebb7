"""Checksum verification of a staged body (client sends `checksum` in the metadata)."""
from __future__ import annotations

from ..adapter import tensors_checksum
from ..errors import BadAdapter
from ..staging import open_staged


def verify_staged(path: str, expected: str) -> None:
    _, tensors = open_staged(path)
    actual = tensors_checksum(tensors)
    if actual != expected:
        raise BadAdapter(f"checksum mismatch: body hashes to {actual}, metadata says "
                         f"{expected}", code="checksum_mismatch")
