"""A lora-sync sender written from docs/wire_format.md alone, as a third party would write
one: the standard library for HTTP and the bytes, torch.distributed for the group. It imports
nothing from lora_sync (tests/test_wire_format.py checks that), so a push it makes is evidence
that the document, not the library, says what a server needs.

  sender = MinimalSender("http://host:8000/v1", api_key="...")
  sender.init_group(streams=1)
  status, reply = sender.broadcast("policy", tensors, adapter_config, version=3)
  sender.destroy_group()
  status, reply = sender.push_tensors("policy", tensors, adapter_config, version=4)
  status, reply = sender.push_shm("policy", tensors, adapter_config, version=5)
  [(status, reply), ...] = sender.push_shared("policy", tensors, adapter_config, version=6,
                                              also=[other_sender_on_this_host])

Each section names the part of docs/wire_format.md it follows (§)."""
from __future__ import annotations

import fcntl
import hashlib
import http.client
import json
import os
import secrets
import socket
import stat
import struct
import threading
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

# §1 Protocol version
PROTOCOL_VERSION = 1
PROTOCOL_HEADER = "X-LoRA-Sync-Protocol"

# §3 Tensors: dtype tags and their element sizes (little-endian)
DTYPE_TAGS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2}

# §5c Shared: the memfd's name prefix and its four seals (F_SEAL_WRITE | F_SEAL_SHRINK |
# F_SEAL_GROW | F_SEAL_SEAL)
SHARED_PREFIX = "lora-sync-shared-"
SEALS = 0x0008 | 0x0002 | 0x0004 | 0x0001

# §6 Broadcast: the group and the frames
STORE_PREFIX = "lora-sync"
FRAME_BYTES = 64
MAGIC = b"LSYNC\x01\x00\x00"
HEADER_FRAME = struct.Struct("<8sQQQQQ")
TRAILER = struct.Struct("<8sQQQQ")


# -- §2 HTTP ------------------------------------------------------------------------------
def http_request(method: str, url: str, headers: dict, body: bytes | None = None,
                 timeout: float = 120.0) -> tuple[int, dict, dict]:
    """(status, JSON reply, reply headers)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, u.path, body=body, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        reply = json.loads(raw) if raw else {}
        return resp.status, reply, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


# -- §3 specs, checksum --------------------------------------------------------------------
def spec(name: str, t: torch.Tensor) -> dict:
    return {"name": name, "dtype": DTYPE_TAGS[t.dtype], "shape": list(t.shape)}


def nbytes(s: dict) -> int:
    n = ITEM_SIZE[s["dtype"]]
    for d in s["shape"]:
        n *= d
    return n


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in row-major order, little-endian."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def checksum(tensors: dict) -> str:
    """§3: sha256 over each tensor's name (UTF-8) then its bytes, in the order sent."""
    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(raw_bytes(t))
    return "sha256:" + h.hexdigest()


# -- §4 the safetensors file (tensors and shm) ---------------------------------------------
def safetensors_file(tensors: dict, metadata: dict) -> bytes:
    header, offset = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        n = nbytes(spec(name, t))
        header[name] = {"dtype": DTYPE_TAGS[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(raw_bytes(t) for t in tensors.values())


def metadata(name: str, config: dict, version: int | None, with_checksum: bool,
             tensors: dict) -> dict:
    meta = {"lora_name": name, "adapter_config": json.dumps(config)}
    if version is not None:
        meta["version"] = str(version)
    if with_checksum:
        meta["checksum"] = checksum(tensors)
    return meta


def adapter_file(name: str, tensors: dict, config: dict, version: int | None,
                 with_checksum: bool) -> bytes:
    """The file of §4 that tensors, shm and shared all carry."""
    return safetensors_file(tensors, metadata(name, config, version, with_checksum, tensors))


# -- §5c the sealed memfd ------------------------------------------------------------------
def sealed_memfd(body: bytes) -> tuple[int, str]:
    """A new memfd of this process, named for a new claim, holding exactly `body`, sealed
    with all four seals before any server hears of it: (its descriptor, the claim in hex)."""
    claim = secrets.token_bytes(32)
    fd = os.memfd_create(SHARED_PREFIX + hashlib.sha256(claim).hexdigest(),
                         os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        view = memoryview(body)
        while view:  # at offset 0, the whole file (a write may take part of it)
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, claim.hex()


# -- §6.4 layout digest, §6.5 bucket plan, §6.6 frames ------------------------------------
def layout_digest(specs: list[dict]) -> int:
    text = json.dumps([[s["name"], s["dtype"], s["shape"]] for s in specs]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def plan_buckets(specs: list[dict], bucket_bytes: int) -> list[list[dict]]:
    by_dtype: dict[str, list[dict]] = {}
    for s in specs:
        by_dtype.setdefault(s["dtype"], []).append(s)
    buckets = []
    for group in by_dtype.values():
        cur, size = [], 0
        for s in group:
            if cur and size + nbytes(s) > bucket_bytes:
                buckets.append(cur)
                cur, size = [], 0
            cur.append(s)
            size += nbytes(s)
        if cur:
            buckets.append(cur)
    return buckets


def header_frame(transfer_id: int, buckets: list, bucket_bytes: int, layout: int) -> bytes:
    payload = sum(nbytes(s) for b in buckets for s in b)
    return HEADER_FRAME.pack(MAGIC, transfer_id, payload, len(buckets), bucket_bytes,
                             layout).ljust(FRAME_BYTES, b"\0")


def bucket_frame(index: int, bucket: list[dict], tensors: dict, transfer_id: int,
                 layout: int) -> bytes:
    payload = b"".join(raw_bytes(tensors[s["name"]]) for s in bucket)
    padded = payload.ljust(-(-len(payload) // FRAME_BYTES) * FRAME_BYTES, b"\0")
    trailer = TRAILER.pack(MAGIC, transfer_id, index, len(payload), layout)
    return padded + trailer.ljust(FRAME_BYTES, b"\0")


def as_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


# -- the sender ----------------------------------------------------------------------------
class MinimalSender:
    def __init__(self, base_url: str, api_key: str | None = None,
                 protocol: int | None = PROTOCOL_VERSION, timeout: float = 60.0):
        """`base_url`: the server's URL with the engine's prefix (`/v1` on vLLM, nothing on
        SGLang). `protocol`: what this sender says it speaks (None: no header)."""
        self.base = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if protocol is not None:
            self.headers[PROTOCOL_HEADER] = str(protocol)
        self.timeout = timeout
        self.pg = self.store = None
        self.group_name = self.token = None
        self.declared = None  # the layout the server holds for our group
        self.broken = False

    def post(self, route: str, body: dict) -> tuple[int, dict, dict]:
        return http_request("POST", f"{self.base}/{route}",
                            {**self.headers, "Content-Type": "application/json"},
                            json.dumps(body).encode(), self.timeout)

    def info(self) -> dict:
        return http_request("GET", f"{self.base}/lora_sync_info", self.headers)[1]

    # §5 tensors ------------------------------------------------------------------------
    def push_tensors(self, name: str, tensors: dict, config: dict, version: int | None = None,
                     with_checksum: bool = False) -> tuple[int, dict]:
        body = adapter_file(name, tensors, config, version, with_checksum)
        status, reply, _ = http_request(
            "POST", f"{self.base}/load_lora_adapter_from_tensors",
            {**self.headers, "Content-Type": "application/octet-stream"}, body, self.timeout)
        return status, reply

    # §5b shm ---------------------------------------------------------------------------
    def push_shm(self, name: str, tensors: dict, config: dict, version: int | None = None,
                 with_checksum: bool = False) -> tuple[int, dict]:
        body = adapter_file(name, tensors, config, version, with_checksum)
        status, lease, _ = self.post("lora_sync_lease", {"nbytes": len(body),
                                                         "client": "minimal-sender"})
        if status != 200:
            return status, lease
        ticket = {"lease_id": lease["lease_id"], "token": lease["token"]}
        fd = os.open(lease["path"], os.O_RDWR)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            st = os.fstat(fd)
            if not (target.startswith("/memfd:lora-sync-lease") and stat.S_ISREG(st.st_mode)
                    and st.st_size == lease["nbytes"] == len(body)
                    and os.pread(fd, 16, 0) == bytes.fromhex(lease["probe"])):
                self.post("lora_sync_lease_cancel", ticket)
                raise RuntimeError("not this server's lease")
            os.pwrite(fd, body[8:], 8)  # everything but the length first ...
            os.pwrite(fd, body[:8], 0)  # ... the header's length last
        finally:
            os.close(fd)
        status, reply, _ = self.post("load_lora_adapter_from_lease", ticket)
        return status, reply

    # §5c shared ------------------------------------------------------------------------
    def push_shared(self, name: str, tensors: dict, config: dict, version: int | None = None,
                    with_checksum: bool = False, also: tuple = ()) -> list[tuple[int, dict]]:
        """One sealed file, named to this server, then to each sender in `also` (servers on
        this host), with the same path and claim: one (status, reply) per server. The
        descriptor is closed once every server answered (each keeps its own)."""
        body = adapter_file(name, tensors, config, version, with_checksum)
        fd, claim = sealed_memfd(body)
        request = {"path": f"/proc/{os.getpid()}/fd/{fd}", "nbytes": len(body),
                   "claim": claim}
        try:
            return [s.post("load_lora_adapter_from_shared", request)[:2]
                    for s in (self, *also)]
        finally:
            os.close(fd)

    # §6 broadcast ----------------------------------------------------------------------
    def init_group(self, master_address: str = "127.0.0.1", master_port: int | None = None,
                   group_name: str = "default", streams: int = 1,
                   timeout_s: float = 30.0) -> tuple[int, dict]:
        """§6.1-6.2: POST init_lora_update_group while this process, rank 0, hosts the store
        and joins the gloo group with `streams` devices."""
        if master_port is None:
            with socket.socket() as s:
                s.bind((master_address, 0))
                master_port = s.getsockname()[1]
        workers = int(self.info()["workers"])
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": 1, "world_size": 1 + workers, "backend": "gloo",
                "group_name": group_name, "timeout_s": timeout_s, "streams": streams}
        answer: dict = {}

        def post():
            answer["reply"] = self.post("init_lora_update_group", body)
        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, 1 + workers, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        if streams == 1:
            pg = dist.ProcessGroupGloo(prefixed, 0, 1 + workers, timeout)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_default_device()
                             for _ in range(streams)]
            opts._threads = streams
            pg = dist.ProcessGroupGloo(prefixed, 0, 1 + workers, opts)
        poster.join(timeout_s + 30)
        status, reply, _ = answer["reply"]
        if status == 200:
            self.pg, self.store = pg, store
            self.group_name, self.token = group_name, reply["group_token"]
            self.declared, self.broken = None, False
        return status, reply

    def broadcast(self, name: str, tensors: dict, config: dict, version: int | None = None,
                  bucket_bytes: int = 8 << 20, with_checksum: bool = False
                  ) -> tuple[int, dict]:
        """§6.3-6.8: POST load_lora_adapter_from_distributed, and while it is in flight one
        broadcast(src=0) of the header frame, then one per bucket frame, in plan order."""
        specs = [spec(k, t) for k, t in tensors.items()]
        layout = layout_digest(specs)
        buckets = plan_buckets(specs, bucket_bytes)
        transfer_id = secrets.randbelow(2 ** 63 - 1) + 1
        body = {"lora_name": name, "adapter_config": config, "layout": layout,
                "group_name": self.group_name, "group_token": self.token,
                "bucket_bytes": bucket_bytes, "transfer_id": transfer_id}
        if version is not None:
            body["version"] = version
        if with_checksum:
            body["checksum"] = checksum(tensors)
        if self.declared != layout:
            body["tensors"] = specs
        answer: dict = {}

        def post():
            answer["reply"] = self.post("load_lora_adapter_from_distributed", body)
        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        frames = [as_tensor(header_frame(transfer_id, buckets, bucket_bytes, layout))]
        frames += [as_tensor(bucket_frame(i, b, tensors, transfer_id, layout))
                   for i, b in enumerate(buckets)]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        works = [self.pg.broadcast([f], opts) for f in frames]
        poster.join(self.timeout + 30)
        status, reply, _ = answer["reply"]
        if status != 200:  # §6.8: the group is out of step now; only a new one will do
            self.declared = None
            self.broken = True  # destroy_group, then init_group again
            return status, reply
        for w in works:
            w.wait()
        self.declared = layout
        return status, reply

    def destroy_group(self) -> tuple[int, dict]:
        """§6.9: the server's side first (its workers leaving end any broadcast still
        queued here), then ours."""
        status, reply, _ = self.post("destroy_lora_update_group",
                                     {"group_name": self.group_name, "group_token": self.token})
        if self.pg is not None:
            self.pg.shutdown()
        self.pg = self.store = None
        return status, reply
