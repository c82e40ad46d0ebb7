"""What an engine's own load route would read from a PEFT directory, read first by lora-sync
so that route gets the verdict every push gets (check_adapter): the config and the tensors'
header, never their data.

Files are opened first (non-blocking, no links followed), then checked on the descriptor
(a regular file, within its bound), then read from that descriptor: a FIFO or a device put in
the directory is never opened for reading."""
from __future__ import annotations

import json
import os
import stat

from . import wire
from .errors import BadAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILES = ("adapter_model.bin", "adapter_model.pt")
MAX_CONFIG_BYTES = 1 << 20


def read(path, data_limit: int | None = None):
    """(the tensors' specs, the config, the tensors) of the PEFT directory `path`; the
    tensors only with a `data_limit` (bytes; a larger file is refused), else None. BadAdapter
    naming what is wrong (`bad_adapter_dir`) when it is not a local directory lora-sync can
    check."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise _bad(f"the adapter path must be a local directory, got {str(path)[:100]!r}")
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise _bad(f"{path[:200]!r} is not a local directory lora-sync can read "
                   f"({os.strerror(e.errno)}); the engine's own load route takes local PEFT "
                   "directories only on a server running lora-sync") from None
    try:
        if not _exists(dir_fd, WEIGHTS_FILE):
            pickled = [f for f in PICKLED_FILES if _exists(dir_fd, f)]
            raise _bad(f"{path[:200]!r} has no {WEIGHTS_FILE}"
                       + (f" ({pickled[0]} is pickle, never loaded)" if pickled else ""))
        config = json.loads(_read(dir_fd, CONFIG_FILE, MAX_CONFIG_BYTES) or b"null")
        if not isinstance(config, dict):
            raise _bad(f"{CONFIG_FILE} must hold a JSON object")
        fd = _open_regular(dir_fd, WEIGHTS_FILE)
        with open(fd, "rb", closefd=True) as f:
            size = os.fstat(f.fileno()).st_size
            if data_limit is not None and size > data_limit:
                raise _bad(f"{WEIGHTS_FILE} is larger than {data_limit} bytes")
            prefix = f.read(8)
            head = prefix + f.read(wire.header_length(prefix) - 8)
            header = wire.parse_header(head, body_len=size)
            if data_limit is None:
                return header.specs, config, None
            body = bytearray(head) + f.read(size - len(head))
        return header.specs, config, wire.view_tensors(body, header)
    except ValueError as e:  # the config's JSON
        raise _bad(f"{CONFIG_FILE} is not valid JSON: {str(e)[:200]}") from None
    finally:
        os.close(dir_fd)


def _bad(message: str) -> BadAdapter:
    return BadAdapter(message, code="bad_adapter_dir")


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


def _open_regular(dir_fd: int, name: str) -> int:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise _bad(f"{name} cannot be opened ({os.strerror(e.errno)}; links are not "
                   "followed)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _bad(f"{name} is not a regular file")
    return fd


def _read(dir_fd: int, name: str, limit: int) -> bytes:
    with open(_open_regular(dir_fd, name), "rb", closefd=True) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _bad(f"{name} is larger than {limit} bytes")
    return data
