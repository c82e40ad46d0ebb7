"""Typed reading of client JSON: every field is checked for type and range, and a bad one is
a 400 that names it (never a TypeError deep inside the server, which would be a 500)."""
from __future__ import annotations

import json
import math

from .errors import BadAdapter, BadRequest

REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
          list: "a list", dict: "a JSON object"}


def field(body: dict, key: str, kind: type, default=REQUIRED, *, lo=None, hi=None,
          max_len: int | None = None, where: str = "request"):
    """`body[key]` as `kind` within [lo, hi] (numbers) or at most `max_len` long (strings,
    lists); `default` when absent or null."""
    value = body.get(key)
    if value is None:
        if default is REQUIRED:
            raise BadRequest(f"{where} field {key!r} is required ({_KINDS[kind]})",
                             code="bad_request")
        return default
    return check(value, kind, f"{where} field {key!r}", lo=lo, hi=hi, max_len=max_len)


def check(value, kind: type, what: str, *, lo=None, hi=None, max_len: int | None = None):
    ok = isinstance(value, kind) and not isinstance(value, bool) if kind in (int, float) \
        else isinstance(value, kind)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value) if abs(value) < 2 ** 1000 else math.inf
    if not ok:
        raise BadRequest(f"{what} must be {_KINDS[kind]}, got {type(value).__name__}",
                         code="bad_request")
    if kind is float and not math.isfinite(value):
        raise BadRequest(f"{what} must be a finite number", code="bad_request")
    if kind in (int, float) and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        shown = value if kind is float or value.bit_length() < 64 else "<huge>"
        raise BadRequest(f"{what} is {shown}, must be between {lo} and {hi}", code="bad_request")
    if max_len is not None and kind in (str, list) and len(value) > max_len:
        raise BadRequest(f"{what} is longer than {max_len}", code="bad_request")
    return value


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def unique_keys(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def loads(text, what: str = "request body", code: str = "bad_request"):
    """JSON as every lora-sync reader takes it: an object that names a key twice is refused
    (parsers disagree on which one counts, so accepting it would pick one silently). Other
    parse errors are left to the caller (ValueError, RecursionError)."""
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except _DuplicateKey as e:
        cls = BadRequest if code == "bad_request" else BadAdapter
        raise cls(f"{what} names the key {e.key[:200]!r} twice; name each key once",
                  code=code) from None
