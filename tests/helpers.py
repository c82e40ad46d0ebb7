"""Small helpers shared by the server test suites."""
from __future__ import annotations

import glob
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

from lora_sync import http, wire
from lora_sync.engines import ENGINES

from .conftest import API_KEY, REPO

AUTH = {"Authorization": f"Bearer {API_KEY}"}

PROMPT = "the quick brown"


def tiny_peft_model(seed: int = 0, **lora_config):
    """A PEFT model over the tiny Llama built in memory (no model directory), all-linear
    rank 8 unless `lora_config` says otherwise, its LoRA weights random and non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from testbed.tiny_model import TINY_CONFIG
    torch.manual_seed(seed)
    config = LoraConfig(**{"target_modules": "all-linear", "r": 8, "lora_dropout": 0.0,
                           **lora_config})
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)), config)
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def smaps_kb(address: int, field: str) -> int:
    """A field of /proc/self/smaps (Rss, ShmemPmdMapped, ...) for the mapping holding
    `address`, in kB."""
    with open("/proc/self/smaps") as f:
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read()):
            lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
            if lo <= address < hi:
                return int(re.search(rf"^{field}:\s+(\d+) kB", block, re.M).group(1))
    raise AssertionError("the mapping is not in smaps")


def staging_dir_of(server) -> str:
    """A real server's private staging directory (lora_sync/private_dir.py: its API
    process's pid, then a random part)."""
    import glob
    found = glob.glob(f"/dev/shm/lora-sync-staging-{server.proc.pid}-*")
    assert len(found) == 1, found
    return found[0]


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.01)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from every thread's children (a server's workers, a server
    run under a wrapper such as unshare)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for children in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                with open(children) as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                pass  # gone meanwhile
    return out


def retire_if_held(url: str, name: str) -> None:
    """Retires `name` on the (vLLM-routed) server at `url`, where it holds any version."""
    from lora_sync.errors import NotFound
    try:
        http.call("POST", url + "/v1/retire_lora_adapter", json_body={"lora_name": name},
                  headers=AUTH)
    except NotFound:
        pass  # it holds no version


def versions_of(client, name: str) -> list[int]:
    """The servable (not retired) versions the server lists for `name`."""
    return [v["version"] for a in client.adapters()[0]["adapters"] if a["name"] == name
            for v in a["versions"] if not v["retired"]]


def greedy(client, model: str, prompt: str = PROMPT, n: int = 12) -> str:
    return client.complete(prompt, model, n)["text"]


def push_by(client, adapter, name: str, transport: str):
    """One push of `adapter` as `name` by `transport` (a broadcast: in a group of its own,
    destroyed after it); returns the server's PushResult."""
    if transport != "broadcast":
        [res] = client.push(adapter, name, transport=transport)
        return res
    client.init_group(group_name="one-push", timeout_s=60)
    try:
        [res] = client.broadcast(adapter, name)
    finally:
        client.destroy_group()
    return res


def disk_model(client, name: str) -> str:
    """How a request names an adapter loaded by the engine's own disk route (SGLang's
    OpenAI routes take 'base:<adapter>'; ours take the plain name on both engines)."""
    return ENGINES[client.servers[0].engine].disk_model(name)


def post_body(server_route: str, body, content_type="application/octet-stream", headers=None):
    """Raw POST of arbitrary bytes; returns (status, reply JSON)."""
    chunks = body if isinstance(body, list) else [body]
    headers = {**AUTH, **(headers or {})}
    status, reply, _ = http.request("POST", server_route, chunks=chunks,
                                    headers={"Content-Type": content_type, **headers})
    return status, reply


def body_of(adapter, name="bad", version=None, tensors=None, config=None, meta=None):
    """A safetensors body built from `adapter` with parts replaced."""
    m = adapter.metadata(name, version)
    if config is not None:
        m["adapter_config"] = config if isinstance(config, str) else json.dumps(config)
    if meta is not None:
        m = meta
    return wire.encode_bytes(adapter.tensors if tensors is None else tensors, m)


def bad_bodies(adapter, max_rank: int):
    """(case, body, content type) for every bad input of the tensor route."""
    t = adapter.tensors
    a_key = next(k for k in t if "lora_A" in k)
    good = body_of(adapter)
    big_r = max_rank * 2
    big_rank = {k: (torch.randn(big_r, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], big_r))
                for k, v in t.items()}
    return [
        ("not safetensors", b"hello, this is not a safetensors file", None),
        ("empty body", b"", None),
        ("truncated", good[:-100], None),
        ("header claims more bytes", good[:8] + b"\xff" * 4 + good[12:], None),
        ("missing lora_name", body_of(adapter, meta={"adapter_config": json.dumps(adapter.config)}), None),
        ("missing adapter_config", body_of(adapter, meta={"lora_name": "bad"}), None),
        ("adapter_config not JSON", body_of(adapter, config="{not json"), None),
        ("adapter_config without r", body_of(adapter, config={"lora_alpha": 8, "target_modules": ["q_proj"]}), None),
        ("rank above max", body_of(adapter, tensors=big_rank, config={**adapter.config, "r": big_r}), None),
        ("unknown module", body_of(adapter, tensors={**t, a_key.replace("layers.0", "layers.7"): t[a_key],
                                                     a_key.replace("layers.0", "layers.7").replace("lora_A", "lora_B"): t[a_key.replace("lora_A", "lora_B")]}), None),
        ("shape does not fit", body_of(adapter, tensors={**t, a_key: torch.randn(t[a_key].shape[0], 7)}), None),
        ("missing B half", body_of(adapter, tensors={k: v for k, v in t.items() if k != a_key.replace("lora_A", "lora_B")}), None),
        ("int tensors", body_of(adapter, tensors={k: v.to(torch.int32) for k, v in t.items()}) if False else
            _raw_safetensors({k: v.to(torch.int32) for k, v in t.items()}, adapter), None),
        ("pickle payload", pickle.dumps({"tensors": t}), None),
        ("float64 tensors", _raw_safetensors({k: v.double() for k, v in t.items()}, adapter), None),
        ("NaN values", body_of(adapter, tensors={**t, a_key: torch.full_like(t[a_key], float("nan"))}), None),
        ("Inf values", body_of(adapter, tensors={**t, a_key: torch.full_like(t[a_key], float("inf"))}), None),
        ("extra unknown tensor", body_of(adapter, tensors={**t, "base_model.model.model.extra.weight": torch.ones(2)}), None),
        ("lm_head LoRA of another vocabulary", body_of(adapter, tensors={
            **t, "base_model.model.lm_head.lora_A.weight": torch.ones(8, 128),
            "base_model.model.lm_head.lora_B.weight": torch.ones(383, 8)}), None),
        ("modules_to_save", body_of(adapter, config={**adapter.config, "modules_to_save": ["lm_head"]}), None),
        ("regex target_modules", body_of(adapter, config={**adapter.config, "target_modules": ".*proj"}), None),
        ("unknown target module", body_of(adapter, config={**adapter.config, "target_modules": ["nope_proj"]}), None),
        ("pickle as JSON route", json.dumps({"serialized_named_tensors": ["gASV"]}).encode(), "application/json"),
        ("upstream SGLang pickle payload", _upstream_json(pickle.dumps(dict(t))), "application/json"),
        ("ForkingPickler payload", _upstream_json(_forking_pickle(t)), "application/json"),
        ("ForkingPickler raw body", _forking_pickle(t), None),
        ("duplicate tensor names", _duplicate_key_body(adapter), None),
        ("bad name", body_of(adapter, name="a/b"), None),
        ("name with version suffix", body_of(adapter, name="pol-v2"), None),
    ]


def _raw_safetensors(tensors, adapter):
    from safetensors.torch import save
    return save(tensors, metadata=adapter.metadata("bad"))


def _upstream_json(payload: bytes) -> bytes:
    """SGLang's upstream JSON form of the tensor route (pickled tensors, base64)."""
    import base64
    return json.dumps({"lora_name": "bad", "config_dict": {"r": 8},
                       "serialized_named_tensors": [base64.b64encode(payload).decode()]}).encode()


def _forking_pickle(tensors) -> bytes:
    """Tensors pickled by torch's multiprocessing reducer: shared-memory handles that point
    into this process (upstream SGLang crashes on these)."""
    import io
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing  # noqa: F401  (registers the tensor reducers)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(dict(tensors))
    return buf.getvalue()


def _duplicate_key_body(adapter) -> bytes:
    """A header that names the first tensor twice (JSON keeps the last; the data no longer
    tiles)."""
    body = body_of(adapter)
    n = int.from_bytes(body[:8], "little")
    header = json.loads(body[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    raw = json.dumps(header)[:-1] + f', "{first}": ' + json.dumps(header[first]) + "}"
    raw = raw.encode() + b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + body[8 + n:]


def torchrun(script, *args, nproc: int = 2, timeout: float = 240, env=None):
    """Runs `script` under torchrun on CPU (its own session, killed whole on a timeout);
    returns (exit code, output)."""
    from lora_sync.collective import free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"torchrun timed out after {timeout:g} s:\n{log[-6000:]}")
    return proc.returncode, log


class Background:
    """An HTTP request on its own thread, bounded in time; remembers how it ended."""

    def __init__(self, method, url, body=None, headers=None, timeout=240):
        self.result: dict = {}

        def run():
            try:
                status, reply, hdrs = http.request(method, url, json_body=body,
                                                   headers=headers, timeout=timeout)
                self.result.update(status=status, reply=reply, headers=hdrs)
            except Exception as e:  # reported by the test
                self.result.update(error=repr(e))
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout=300) -> dict:
        self.thread.join(timeout)
        return self.result


def blackhole():
    """A listener that accepts connections and never answers: (port, close)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held, stop = [], threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                pass
    threading.Thread(target=accept, daemon=True).start()
    return sock.getsockname()[1], lambda: (stop.set(), [c.close() for c in held], sock.close())


def try_to_take_a_group(load_url: str, destroy_url: str, adapter) -> None:
    """Another client naming the group "default" with no token or a made-up one: it can
    neither load on it nor destroy it (400/403)."""
    body = {"lora_name": "stolen", "adapter_config": adapter.config, "group_name": "default",
            "tensors": [s.to_json() for s in adapter.specs()], "transfer_id": 5}
    for token in (None, "x" * 32):
        status, reply, _ = http.request("POST", load_url, headers=AUTH,
                                        json_body={**body, "group_token": token})
        assert status in (400, 403) and reply["error"]["code"] in ("bad_request", "bad_token"), \
            reply
        status, reply, _ = http.request("POST", destroy_url, headers=AUTH,
                                        json_body={"group_name": "default", "group_token": token})
        assert status in (400, 403), reply

