"""The wire format: one safetensors file (header + raw little-endian tensor bytes).

We write and parse the format ourselves so that
  * the client can stream tensor memory straight to the socket (no joined copy), and
  * the server can validate the header before touching the data, then view the tensors
    in place (zero copy) from whatever buffer received them.
The output is byte-compatible with `safetensors.torch.save` / `load`.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import struct
import threading
import warnings
from dataclasses import dataclass, field

import torch

from . import host_copy
from .errors import BadAdapter
from .fields import loads, unique_keys

# safetensors dtype tag <-> torch dtype; LoRA weights are floating point only.
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPE_TAGS = {v: k for k, v in DTYPES.items()}
# A header lists names, dtypes, shapes and offsets: ~130 bytes a tensor (~170 with per-expert
# MoE names), ~50 KB for an all-linear LoRA of a 0.5B model. MAX_TENSORS entries of the
# longest of those fit; entries are counted before the JSON is parsed, so a hostile header
# (many tiny entries) is refused after one scan, and the widest one that is parsed and
# checked entry by entry stays under about a second of a core (benchmarks/large_adapter_bench.py).
MAX_TENSORS = 100_000
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_DIM = 2 ** 40


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str          # safetensors tag: F32 | F16 | BF16
    shape: tuple[int, ...]

    def __hash__(self) -> int:
        # Kept: a push's layout is looked up by the tuple of its specs (check_adapter's kept
        # verdicts), the same spec objects every push of a trainer (the parse is kept too).
        try:
            return self._hash
        except AttributeError:
            h = hash((self.name, self.dtype, self.shape))
            object.__setattr__(self, "_hash", h)
            return h

    @property
    def nbytes(self) -> int:
        try:  # kept, as the hash is: every push's planning asks again
            return self._nbytes
        except AttributeError:
            n = DTYPES[self.dtype].itemsize
            for d in self.shape:
                n *= d
            object.__setattr__(self, "_nbytes", n)
            return n

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSpec":
        return cls.of_torch(name, t.dtype, tuple(t.shape))

    @classmethod
    def of_torch(cls, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> "TensorSpec":
        if dtype not in DTYPE_TAGS:
            raise BadAdapter(f"tensor {name!r} has dtype {dtype}; LoRA weights must be "
                             f"one of {sorted(DTYPES)}", code="bad_dtype")
        return cls(name, DTYPE_TAGS[dtype], shape)

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        name, dtype, shape = (d.get(k) for k in ("name", "dtype", "shape")) \
            if isinstance(d, dict) else (None, None, None)
        if not (isinstance(name, str) and 0 < len(name) <= 512 and isinstance(dtype, str)
                and isinstance(shape, list) and len(shape) <= 8
                and all(type(x) is int for x in shape)):
            raise BadAdapter(f"tensor spec {str(d)[:100]} needs a name (1-512 characters), a "
                             "dtype and a shape (a list of at most 8 integers)",
                             code="bad_metadata")
        if dtype not in DTYPES:
            raise BadAdapter(f"tensor {name!r} has dtype {dtype[:20]!r}; LoRA weights must be "
                             f"one of {sorted(DTYPES)}", code="bad_dtype")
        if any(not 0 <= x <= MAX_DIM for x in shape):
            raise BadAdapter(f"tensor {name!r} has a dimension outside 0..{MAX_DIM}",
                             code="bad_shape")
        return cls(name, dtype, tuple(shape))


@dataclass(frozen=True)
class Header:
    metadata: dict[str, str]
    specs: list[TensorSpec]
    offsets: list[tuple[int, int]]  # byte range of each tensor, relative to data_start
    data_start: int
    # The digest of the entries' text where the parse was kept (_KNOWN_ENTRIES): the views'
    # plan (ViewPlan) is kept under it too.
    layout_key: bytes | None = field(default=None, compare=False)

    @property
    def total_bytes(self) -> int:
        return self.data_start + (self.offsets[-1][1] if self.offsets else 0)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a tensor's memory (bf16 included), copied to the host first
    where it is not there, or not contiguous."""
    if not t.is_cpu or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    # A ctypes array over the tensor's address, which keeps the tensor alive: thousands per
    # push, and torch's own route (view, numpy, memoryview) costs several times as much.
    view = (ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())
    view.tensor = t
    return memoryview(view)


def byte_views(tensors) -> list[memoryview]:
    """Zero-copy byte views of the tensors' memory, in order, tensors with no bytes left
    out: one per run of host tensors that lie back to back (`host_copy.host_runs`; a packed
    adapter, `trainer.pack_parameters`, is one view, one buffer to send or write), else one
    per tensor."""
    tensors = list(tensors)
    runs = host_copy.host_runs(tensors)
    if runs is None:
        return [as_bytes(t) for t in tensors if t.numel()]
    return [_span(start, n, tensors) for start, n in runs]


def _span(start: int, nbytes: int, tensors: list) -> memoryview:
    """`nbytes` of host memory from address `start`, viewed while `tensors` (which lie
    there) live."""
    view = (ctypes.c_ubyte * nbytes).from_address(start)
    view.tensors = tensors
    return memoryview(view)


def layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list:
    """The safetensors file as [header bytes, tensor, tensor, ...]: each tensor's bytes
    follow in order (the same-host transport copies them, from any device, into place)."""
    meta = json.dumps({"__metadata__": {k: str(v) for k, v in metadata.items()}},
                      separators=(",", ":"))
    raw = (meta[:-1] + _entries_json(tuple((name, t.dtype, tuple(t.shape))
                                           for name, t in tensors.items()))).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    return [struct.pack("<Q", len(raw)) + raw, *tensors.values()]


@functools.lru_cache(maxsize=4)
def _entries_json(shapes: tuple) -> str:
    """The header's text after `__metadata__`: the same every step of a trainer (hundreds
    of entries at rank 64, too many to write again each push)."""
    header, offset = {}, 0
    for name, dtype, shape in shapes:
        spec = TensorSpec.of_torch(name, dtype, shape)
        header[name] = {"dtype": spec.dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":"))
    return "," + text[1:] if header else "}"  # what follows the metadata's "}"


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list:
    """Returns the safetensors file as a list of chunks: header bytes, then byte views of
    the tensors (`byte_views`: no copy of tensor memory). `b"".join(chunks)` is the
    complete file."""
    header, *parts = layout(tensors, metadata)
    return [header, *byte_views(parts)]


def encode_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    return b"".join(encode(tensors, metadata))


def header_length(prefix: bytes | memoryview) -> int:
    """Size of the whole header (8-byte length + JSON) given the first 8 bytes."""
    if len(prefix) < 8:
        raise BadAdapter("body is not a safetensors file: shorter than 8 bytes",
                         code="bad_safetensors")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n == 0 or n > MAX_HEADER_BYTES:
        raise BadAdapter(f"body is not a safetensors file: header length {n} is invalid",
                         code="bad_safetensors")
    return 8 + n




def parse_header(buf: bytes | memoryview, body_len: int | None = None) -> Header:
    """Parses and checks a safetensors header. `buf` must hold at least the header;
    `body_len` (default len(buf)) is the full body size the data offsets must match."""
    hlen = header_length(buf)
    if len(buf) < hlen:
        raise BadAdapter(f"body is not a safetensors file: header claims {hlen - 8} bytes "
                         f"but only {len(buf) - 8} were sent", code="bad_safetensors")
    text = bytes(buf[8:hlen])
    if text.count(b'"data_offsets"') > MAX_TENSORS:  # before any parse: one scan
        raise BadAdapter(f"safetensors header lists more than {MAX_TENSORS} tensors",
                         code="bad_safetensors")
    split = _split_metadata(text)
    key = _known_key(split[1]) if split is not None else None
    known = _KNOWN_ENTRIES.get(key) if key is not None else None
    if known is not None:
        meta, (specs, offsets, pos) = split[0], known
    else:
        meta, specs, offsets, pos = _parse_whole(text)
        if key is not None:
            _remember(key, (specs, offsets, pos))
    body_len = len(buf) if body_len is None else body_len
    if hlen + pos != body_len:
        raise BadAdapter(f"body has {body_len - hlen} data bytes but the header describes "
                         f"{pos} (truncated or padded body)", code="bad_safetensors")
    return Header(meta, list(specs), list(offsets), hlen, key)


# A trainer pushes the same tensors every step, only `__metadata__` (name, version) changes:
# the checked entries of the last few headers are kept, keyed by the SHA-256 of the header's
# text after its metadata (the text itself is not held). Checking every entry is a visible
# part of a push's intake (in the API process and in each worker), and grows with the
# tensor count: a 10,000-tensor header is over a megabyte of JSON.
_META_PREFIX = '{"__metadata__":'
_KNOWN_ENTRIES: dict[bytes, tuple] = {}
_KNOWN_MAX = 4
_KNOWN_LOCK = threading.Lock()  # headers are parsed on the event loop's threads
_DECODER = json.JSONDecoder(object_pairs_hook=unique_keys)


def _split_metadata(text: bytes) -> tuple[dict, str] | None:
    """(checked metadata, the text after it) for a header that starts `{"__metadata__":`, as
    `layout` writes it; None for any other (parsed whole)."""
    try:
        doc = text.decode("utf-8")
        if not doc.startswith(_META_PREFIX):
            return None
        meta, end = _DECODER.raw_decode(doc, len(_META_PREFIX))
    except Exception:  # noqa: BLE001 - parsed whole, which names the problem
        return None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return None
    return meta, doc[end:]


def _known_key(rest: str) -> bytes:
    return hashlib.sha256(rest.encode("utf-8")).digest()


def _remember(key: bytes, entries: tuple) -> None:
    with _KNOWN_LOCK:
        if len(_KNOWN_ENTRIES) >= _KNOWN_MAX:
            del _KNOWN_ENTRIES[next(iter(_KNOWN_ENTRIES))]  # the oldest
        _KNOWN_ENTRIES[key] = entries


def _parse_whole(text: bytes) -> tuple[dict, list, list, int]:
    """(metadata, specs, offsets, data bytes) of a header's JSON text, every entry checked."""
    try:
        raw = loads(text.decode("utf-8"), "safetensors header", code="bad_safetensors")
    except BadAdapter:
        raise
    except Exception as e:  # not UTF-8, not JSON, or nested too deeply (RecursionError)
        raw = e
    if not isinstance(raw, dict):
        raise BadAdapter("body is not a safetensors file: header is not a JSON object",
                         code="bad_safetensors")
    if len(raw) > MAX_TENSORS + 1:
        raise BadAdapter(f"safetensors header lists {len(raw)} entries, more than "
                         f"{MAX_TENSORS} tensors", code="bad_safetensors")
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadAdapter("safetensors __metadata__ must map strings to strings",
                         code="bad_metadata")
    entries = []
    for name, info in raw.items():
        if not isinstance(info, dict):
            raise BadAdapter(f"tensor {name!r}: header entry is not an object",
                             code="bad_safetensors")
        spec = TensorSpec.from_json({"name": name, "dtype": info.get("dtype"),
                                     "shape": info.get("shape")})
        offsets = info.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(x) is int for x in offsets)):
            raise BadAdapter(f"tensor {name[:200]!r}: header entry needs data_offsets "
                             "[begin, end]", code="bad_safetensors")
        begin, end = offsets
        if end - begin != spec.nbytes or begin < 0:
            raise BadAdapter(f"tensor {name!r}: data_offsets {begin}..{end} do not match "
                             f"{spec.dtype}{list(spec.shape)} ({spec.nbytes} bytes)",
                             code="bad_safetensors")
        entries.append((begin, end, spec))
    entries.sort(key=lambda e: e[0])
    pos = 0
    for begin, end, spec in entries:  # tensors must tile the data area exactly
        if begin != pos:
            raise BadAdapter(f"tensor {spec.name!r}: data is not contiguous (gap or overlap "
                             f"at byte {begin})", code="bad_safetensors")
        pos = end
    return meta, [e[2] for e in entries], [(e[0], e[1]) for e in entries], pos


def view_tensors(buf, header: Header, data_only: bool = False) -> dict[str, torch.Tensor]:
    """Tensors viewing `buf` in place (zero copy), all in one storage: tensors that lie back
    to back can then be viewed as one (`join_adjacent`). `buf` must be writable (bytearray,
    mmap) and outlive the tensors. `data_only`: `buf` holds the data area alone."""
    base = 0 if data_only else header.data_start
    whole = torch.frombuffer(buf, dtype=torch.uint8) if header.total_bytes > header.data_start \
        else None
    plan = _view_plan(header) if whole is not None else None
    if plan is not None:
        return plan.views(whole, base)
    return _views_by_run(buf, whole, base, header.specs, header.offsets)


def _views_by_run(buf, whole, base: int, specs: list, offsets: list) -> dict[str, torch.Tensor]:
    """A run of tensors of one dtype is cut from one typed view by one `split` (336 views at
    rank 64: under half the time of three view calls each)."""
    out = {}
    i = 0
    while i < len(specs):
        j = i + 1
        while j < len(specs) and specs[j].dtype == specs[i].dtype:
            j += 1
        dtype = DTYPES[specs[i].dtype]
        begin, end = offsets[i][0], offsets[j - 1][1]
        if whole is None or begin == end:  # nothing but empty tensors
            run = torch.empty(0, dtype=dtype)
        elif (base + begin) % dtype.itemsize == 0:
            run = whole[base + begin:base + end].view(dtype)
        else:  # misaligned after tensors of another dtype: a storage of their own
            run = torch.frombuffer(buf, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                   offset=base + begin)
        pieces = run.split([(e - b) // dtype.itemsize for b, e in offsets[i:j]])
        for spec, piece in zip(specs[i:j], pieces):
            out[spec.name] = piece.view(spec.shape)
        i = j
    return out


# A LoRA of L layers lists the same tensors layer after layer: its views are cut position by
# position of that period, each one strided view of every repeat split by one `unbind`, so a
# push makes a few torch calls per position instead of two per tensor (a 10,000-tensor
# adapter: docs/benchmarks.md, "A large adapter"). Kept per layout, as the parse is.
MAX_PERIOD = 4096  # an MoE layer's tensors (attention, then every expert's) repeat per layer
_VIEW_PLANS: dict[bytes, "ViewPlan | None"] = {}


@dataclass(frozen=True)
class Column:
    """One position of the period: `count` tensors of one dtype and shape, `step` bytes
    apart, the first at byte `first` of the data area."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    first: int
    step: int
    count: int


@dataclass(frozen=True)
class ViewPlan:
    names: tuple[str, ...]  # in the data area's order
    columns: tuple[Column, ...]
    data_bytes: int

    def views(self, whole: torch.Tensor, base: int) -> dict[str, torch.Tensor]:
        period, typed, out = len(self.columns), {}, [None] * len(self.names)
        for k, c in enumerate(self.columns):
            size = c.dtype.itemsize
            flat = typed.get(c.dtype)
            if flat is None:
                flat = typed[c.dtype] = whole[base:base + self.data_bytes // size * size] \
                    .view(c.dtype)
            strides = [1] * len(c.shape)
            for d in range(len(c.shape) - 2, -1, -1):
                strides[d] = strides[d + 1] * c.shape[d + 1]
            out[k::period] = flat.as_strided((c.count, *c.shape), (c.step // size, *strides),
                                             flat.storage_offset() + c.first // size).unbind(0)
        return dict(zip(self.names, out))


def _view_plan(header: Header) -> ViewPlan | None:
    """The header's plan, kept per layout; None where its tensors do not repeat with a
    period (or lie misaligned for their dtype): they are cut run by run."""
    key = header.layout_key
    if key is None:
        return None
    with _KNOWN_LOCK:
        if key in _VIEW_PLANS:
            return _VIEW_PLANS[key]
    plan = plan_views(header.specs, header.offsets)
    with _KNOWN_LOCK:
        if len(_VIEW_PLANS) >= _KNOWN_MAX:
            del _VIEW_PLANS[next(iter(_VIEW_PLANS))]
        _VIEW_PLANS[key] = plan
    return plan


def plan_views(specs: list[TensorSpec], offsets: list[tuple[int, int]]) -> ViewPlan | None:
    """`plan_tensor_views` for tensors described by specs."""
    return plan_tensor_views([s.name for s in specs], [(DTYPES[s.dtype], s.shape) for s in specs],
                             offsets)


def plan_tensor_views(names: list[str], kinds: list[tuple[torch.dtype, tuple]],
                      offsets: list[tuple[int, int]]) -> ViewPlan | None:
    """The shortest period (at most MAX_PERIOD tensors, at least two repeats) whose every
    position holds one (dtype, shape) of `kinds` at a fixed byte step, aligned for that
    dtype; None where there is none. Linear in the tensor count whatever the layout (a
    hostile one included): the period of (kind, gap to the next tensor) is found at once."""
    n = len(names)
    if n < 4:
        return None
    gaps = [(kinds[i], offsets[i + 1][0] - offsets[i][0]) for i in range(n - 1)]
    period = _smallest_period(gaps)
    step = offsets[period][0] - offsets[0][0]
    if period > min(MAX_PERIOD, n // 2) or kinds[n - 1] != kinds[n - 1 - period] \
            or step <= 0:
        return None
    columns = []
    for k in range(period):
        dtype, shape = kinds[k]
        if offsets[k][0] % dtype.itemsize or step % dtype.itemsize:
            return None
        columns.append(Column(dtype, tuple(shape), offsets[k][0], step,
                              len(range(k, n, period))))
    return ViewPlan(tuple(names), tuple(columns), offsets[-1][1])


def _smallest_period(seq: list) -> int:
    """The least p with seq[i] == seq[i + p] wherever both exist (Knuth-Morris-Pratt)."""
    fail, k = [0] * len(seq), 0
    for i in range(1, len(seq)):
        while k and seq[i] != seq[k]:
            k = fail[k - 1]
        if seq[i] == seq[k]:
            k += 1
        fail[i] = k
    return len(seq) - fail[-1]


def view_mapped(mapped) -> tuple[Header, dict[str, torch.Tensor]]:
    """The header of a safetensors file mapped read-only (`pages.map_read_only`), checked,
    and tensors viewing the mapping."""
    header = parse_header(bytes(mapped[:header_length(bytes(mapped[:8]))]), len(mapped))
    with warnings.catch_warnings():  # torch warns that the memory is not writable: intended
        warnings.simplefilter("ignore", UserWarning)
        return header, view_tensors(mapped, header)


def join_adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """`torch.cat(parts)` without a copy: a view spanning them, when they lie back to back
    in one storage (same dtype, the same sizes past the first dimension); else None."""
    first = parts[0]
    if first.dim() == 0:
        return None
    end = first.storage_offset()
    for t in parts:
        if t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:] \
                or not t.is_contiguous() or t.storage_offset() != end \
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += t.numel()
    shape = (sum(t.shape[0] for t in parts), *first.shape[1:])
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return first.as_strided(shape, strides, first.storage_offset())


def decode(buf) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Parses and views a complete safetensors body: (metadata, tensors)."""
    header = parse_header(memoryview(buf))
    return header.metadata, view_tensors(buf, header)
