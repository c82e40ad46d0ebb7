"""Trust boundaries against real servers, on both engines (docs/security.md):

- another local user (uid 65534) can neither steer nor reach the server's files: the old
  predictable staging name, pre-created with links to a root-only file, is never used, and
  the server's own directory is closed to that user;
- a request that names any adapter the server knows (ours, or one loaded through the
  engine's own route) is served by that adapter or refused, never by the base model, in
  every form the engine reads a name."""
from __future__ import annotations

import json
import os
import stat

import pytest

from lora_sync import http

from .helpers import AUTH, PROMPT, greedy
from .test_private_dir import as_nobody, needs_root

SHM = "/dev/shm"


def process_tree(pid: int) -> set[int]:
    pids, todo = set(), [pid]
    while todo:
        p = todo.pop()
        pids.add(p)
        try:
            todo += [int(k) for k in open(f"/proc/{p}/task/{p}/children").read().split()]
        except OSError:
            pass
    return pids


def our_entries(pids: set[int]) -> list[str]:
    """lora-sync entries in /dev/shm that carry one of the server's process ids."""
    return sorted(n for n in os.listdir(SHM) if n.startswith("lora-sync")
                  and any(f"-{p}" in n for p in pids))


@needs_root
def test_another_local_user_can_neither_steer_nor_reach_the_servers_files(
        server, client, make_adapter, tmp_path):
    pids = process_tree(server.proc.pid)
    victim = tmp_path / "victim"
    victim.write_bytes(b"root only")
    os.chmod(victim, 0o600)
    os.chmod(tmp_path, 0o755)
    # The names the server used before: `lora-sync-staging-<pid>` of each of its processes.
    planted = [f"{SHM}/lora-sync-staging-{p}" for p in pids]
    for path in planted:
        got = as_nobody('mkdir -m 777 "$1" && ln -s "$2" "$1/notices" && ln -s "$2" "$1/f"',
                        path, str(victim))
        assert got.returncode == 0, got.stderr
    try:
        before = our_entries(pids)
        for i, transport in enumerate(["tensors", "shm", "tensors"]):
            client.push(make_adapter(seed=4300 + i), "trust", transport=transport)
        assert greedy(client, "trust")  # served
        after = our_entries(pids)
        assert after == before, "the server made entries outside its private directory"
        private = [n for n in after if f"{SHM}/{n}" not in planted]
        assert len(private) == 1, after
        path = f"{SHM}/{private[0]}"
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() \
            and st.st_mode & 0o777 == 0o700
        for script in ('ls "$1"', 'touch "$1/x"', 'ls "$1/notices"'):
            assert as_nobody(script, path).returncode != 0, script
        assert victim.read_bytes() == b"root only"
        for p in planted:  # the attacker's directories, untouched
            assert sorted(os.listdir(p)) == ["f", "notices"]
    finally:
        client.retire("trust")
        for path in planted:
            as_nobody('rm -rf "$1"', path)


def native_forms(engine: str, name: str, served_model: str) -> list[tuple[str, str, dict]]:
    """(label, path, body) of every way the engine reads an adapter name in a request."""
    base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
    forms = [("model bare", "/v1/completions", {**base, "model": name})]
    if engine == "sglang":
        forms += [
            ("model base:name", "/v1/completions", {**base, "model": f"base:{name}"}),
            ("model <served>:name", "/v1/completions",
             {**base, "model": f"{served_model}:{name}"}),
            ("lora_path", "/v1/completions", {**base, "model": served_model, "lora_path": name}),
            ("/generate lora_path", "/generate",
             {"text": PROMPT, "lora_path": name,
              "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}),
            ("/generate lora_path list", "/generate",
             {"text": [PROMPT], "lora_path": [name],
              "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}),
        ]
    return forms


def post(url: str, body: dict) -> tuple[int, object]:
    """(status, parsed reply): /generate answers a list for a list of prompts."""
    status, raw, _ = http.exchange("POST", url, json_body=body, headers=AUTH)
    return status, json.loads(raw)


def text_of(reply) -> str:
    if isinstance(reply, list):
        reply = reply[0]
    return reply["text"] if "text" in reply else reply["choices"][0]["text"]


def test_no_adapter_name_falls_through_to_the_base_model(server, client, make_adapter,
                                                          tmp_path):
    """An adapter loaded through the engine's own disk route, named in every form the
    engine accepts: its own text or a 4xx, never the base model's."""
    name = "native-trust"
    make_adapter(seed=4310).save(tmp_path / name)
    client.load_from_disk(str(tmp_path / name), name)
    try:
        models = http.call("GET", f"{server.url}/v1/models", headers=AUTH)[0]["data"]
        served_model = next(m["id"] for m in models if m.get("parent") is None
                            and m["id"] != name and not m["id"].startswith("native"))
        reference = {"model": f"base:{name}"} if server.engine == "sglang" else {"model": name}
        forms = native_forms(server.engine, name, served_model)
        served_forms = 0
        for label, path, body in forms:
            status, reply = post(f"{server.url}{path}", body)
            assert status == 200 or 400 <= status < 500, (label, status, reply)
            if status != 200:
                continue
            # The same route without the adapter, and with it named the way known to work.
            plain = {k: v for k, v in body.items() if k != "lora_path"}
            if path == "/v1/completions":
                plain["model"] = served_model
            base_text = text_of(post(f"{server.url}{path}", plain)[1])
            assert text_of(reply) != base_text, f"{label}: served by the base model"
            if path == "/v1/completions":
                want = text_of(post(f"{server.url}{path}", {**plain, **reference})[1])
                assert text_of(reply) == want, f"{label}: not the adapter's text"
            served_forms += 1
        assert served_forms, "no form served the adapter at all"
        assert server.alive()
    finally:
        client.unload_from_disk(name)
