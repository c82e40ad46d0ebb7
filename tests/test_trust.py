"""Trust boundaries against real servers, on both engines (docs/security.md):

- another local user (uid 65534) can neither steer nor reach the server's files: the old
  predictable staging name, pre-created with links to a root-only file, is never used, and
  the server's own directory is closed to that user;
- a request that names any adapter the server knows (ours, or one loaded through the
  engine's own route) is served by that adapter or refused, never by the base model, in
  every form the engine reads a name."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import time

from lora_sync import http

from .helpers import AUTH, PROMPT, greedy, process_tree
from .test_attacks import shapes
from .test_private_dir import as_nobody, needs_root

SHM = "/dev/shm"


def our_entries(pids) -> list[str]:
    """lora-sync entries in /dev/shm that carry one of the server's process ids."""
    return sorted(n for n in os.listdir(SHM) if n.startswith("lora-sync")
                  and any(f"-{p}" in n for p in pids))


@contextlib.contextmanager
def paths_named_by(pids, log_path):
    """Every path the processes `pids` (all their threads, and what they start) name in a
    file or socket-address syscall while the block runs, traced by strace: the list is
    filled when the block ends. Sees reads and waits, which leave no trace on disk."""
    assert shutil.which("strace"), "strace is needed (scripts/install.sh installs it)"
    cmd = ["strace", "-f", "-qq", "-e", "trace=%file,connect,bind,sendto", "-o",
           str(log_path)] + [a for p in pids for a in ("-p", str(p))]
    tracer = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not all(_traced(p) for p in pids):  # attached to every process first
        assert tracer.poll() is None and time.monotonic() < deadline, "strace did not attach"
        time.sleep(0.05)
    paths: list[str] = []
    try:
        yield paths
    finally:
        tracer.send_signal(signal.SIGINT)  # detaches; the processes go on untraced
        tracer.wait(timeout=30)
        paths += re.findall(r'"(/[^"]*)"', log_path.read_text(errors="replace"))


def _traced(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in f)
    except OSError:
        return True  # gone: nothing left to attach to


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
        with paths_named_by(pids, tmp_path / "strace.log") as named:
            for i, transport in enumerate(["tensors", "shm", "tensors"]):
                client.push(make_adapter(seed=4300 + i), "trust", transport=transport)
            assert greedy(client, "trust")  # served
        after = our_entries(pids)
        assert after == before, "the server made entries outside its private directory"
        private = [n for n in after if f"{SHM}/{n}" not in planted]
        assert len(private) == 1, after
        path = f"{SHM}/{private[0]}"
        # Not one read, write, wait or look at the attacker's names or the victim file; every
        # lora-sync path the server named is inside its own private directory.
        ours = [p for p in named if p.startswith(f"{SHM}/lora-sync")]
        assert ours, "the trace saw none of the server's staging (is strace tracing?)"
        assert [p for p in ours if not p.startswith(path + "/") and p != path] == []
        assert str(victim) not in named
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() \
            and st.st_mode & 0o777 == 0o700
        for script in ('ls "$1"', 'touch "$1/x"', 'ls "$1/notices"'):
            assert as_nobody(script, path).returncode != 0, script
        assert victim.read_bytes() == b"root only"
        for p in planted:  # the attacker's directories, untouched
            assert sorted(os.listdir(p)) == ["f", "notices"]
    finally:
        for path in planted:  # first: a retire that fails must not leave them behind
            as_nobody('rm -rf "$1"', path)
        client.retire("trust")


# Short greedy generations: an adapter's text and the base model's are told apart.
COMPLETION = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0.0}
TOKEN_LIMITS = ("max_tokens", "max_new_tokens", "max_output_tokens")


def short_and_greedy(body):
    """A body of test_attacks.shapes (a long sampled generation, maybe streamed) as a short
    greedy one whose reply comes whole."""
    if isinstance(body, list):
        return [short_and_greedy(v) for v in body]
    if not isinstance(body, dict):
        return body
    out = {k: short_and_greedy(v) for k, v in body.items() if k not in ("ignore_eos", "stream")}
    if any(k in out for k in TOKEN_LIMITS):
        out.update({k: 12 for k in TOKEN_LIMITS if k in out}, temperature=0.0)
    return out


def native_forms(engine: str, name: str, served_model: str) -> list[tuple]:
    """(label, method, path, body, headers) of every way the engine reads an adapter name in
    a request: the model forms on the OpenAI routes here, and the review's other routes and
    places (test_attacks.shapes)."""
    forms = [("model bare", "POST", "/v1/completions", {**COMPLETION, "model": name}, None),
             ("chat model bare", "POST", "/v1/chat/completions", {**CHAT, "model": name}, None)]
    if engine == "sglang":
        forms += [
            ("model base:name", "POST", "/v1/completions",
             {**COMPLETION, "model": f"base:{name}"}, None),
            ("model <served>:name", "POST", "/v1/completions",
             {**COMPLETION, "model": f"{served_model}:{name}"}, None),
            ("chat model base:name", "POST", "/v1/chat/completions",
             {**CHAT, "model": f"base:{name}"}, None),
            ("chat lora_path", "POST", "/v1/chat/completions",
             {**CHAT, "model": served_model, "lora_path": name}, None),
            ("/generate lora_path", "POST", "/generate",
             {"text": PROMPT, "lora_path": name,
              "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}, None),
            ("/invocations model bare", "POST", "/invocations", {**CHAT, "model": name}, None),
            ("/invocations SageMaker header", "POST", "/invocations",
             {**CHAT, "model": served_model}, {"X-Amzn-SageMaker-Adapter-Identifier": name}),
        ]
    return forms + [(label, method, url, short_and_greedy(body), headers)
                    for label, method, url, body, headers in shapes(engine, name, "")]


def without_adapter(body, served_model: str):
    """The same request on the base model: no lora_path anywhere, `model` the served one."""
    if isinstance(body, list):
        return [without_adapter(v, served_model) for v in body]
    if not isinstance(body, dict):
        return body
    out = {k: without_adapter(v, served_model) for k, v in body.items() if k != "lora_path"}
    if "model" in out:
        out["model"] = served_model
    return out


def send(method: str, url: str, body: dict, headers: dict | None = None) -> tuple[int, object]:
    """(status, parsed reply)."""
    status, raw, _ = http.exchange(method, url, json_body=body, headers={**AUTH, **(headers or {})})
    return status, json.loads(raw)


def text_of(reply) -> str:
    """The generated text of any of these routes' replies: OpenAI completions and chat,
    Anthropic messages, Responses, SGLang's /generate (a list for a list) and Vertex's."""
    if isinstance(reply, list):
        return text_of(reply[0])
    for key in ("text", "content"):
        if isinstance(reply.get(key), str):
            return reply[key]
    for key in ("choices", "predictions", "output", "content"):
        if isinstance(reply.get(key), list) and reply[key]:
            return text_of(reply[key][0])
    if isinstance(reply.get("message"), dict):
        return text_of(reply["message"])
    raise AssertionError(f"no generated text in {str(reply)[:300]}")


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
        reference = f"base:{name}" if server.engine == "sglang" else name
        served, refused, wrong = [], [], []  # every form is tried: the failures all show
        for label, method, path, body, headers in native_forms(server.engine, name,
                                                               served_model):
            url = f"{server.url}{path}"
            status, reply = send(method, url, body, headers)
            assert status == 200 or 400 <= status < 500, (label, status, reply)
            if status != 200:
                refused.append(label)
                continue
            # The same route without the adapter, and with it named the way known to work.
            plain = without_adapter(body, served_model)
            if text_of(reply) == text_of(send(method, url, plain)[1]):
                wrong.append(f"{label}: served by the base model")
            elif "model" in body and text_of(reply) != text_of(
                    send(method, url, {**plain, "model": reference})[1]):
                wrong.append(f"{label}: not the adapter's text")
            else:
                served.append(label)
        print(f"{server.engine}: served {served}; refused {refused}")
        assert not wrong, wrong
        assert served, "no form served the adapter at all"
        assert server.alive()
    finally:
        client.unload_from_disk(name)
