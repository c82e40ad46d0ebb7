"""A fleet that survives restarts: a server killed with SIGKILL and started again gets the
newest versions back, a dead server fails only its own part of a push, a restarted trainer
continues the numbering, and the RL loop rides out a crash mid-run.

test_dead_server_fails_alone_and_gets_the_newest_back: the session's shared vLLM server is
the healthy peer; the server that is killed (SIGKILL), hung (SIGSTOP) and restarted on the
same port is lora-sync on the FAKE engine in a process of its own (tests/fake_server_main.py,
`crashable_fake`): what is checked there (a dead server's part of a push, health, the resync
after a restart, the client's timeout) is lora-sync's client and server code, not the
engine's, and a fake process restarts in about two seconds where vLLM takes most of a minute.
Its text is a digest of the weights its workers hold (engine_fakes.served_text), so "the
restarted server serves v3" is checked on the exact weights.

test_rl_loop_survives_a_server_killed_mid_run keeps a real vLLM server (the session's second
one, `crashable`, killed and restarted): examples/rl_loop.py samples n completions with
token ids and log-probs from its one server and learns from them (the reward must rise), which
the fake engine cannot answer; the loop's rollouts after the crash come from the restarted
engine."""
from __future__ import annotations

import os
import signal
import threading
import time

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from lora_sync import LoRASyncClient, http, private_dir
from lora_sync.errors import NotFound, PushFailed

from .conftest import API_KEY
from .engine_fakes import served_text
from .fake_server_main import REFUSE_PATH, fake_engine_process, violations
from .helpers import greedy, process_tree, retire_if_held, wait_until
from .test_shared_copy import shared_fds, shared_maps


@pytest.fixture
def crashable(vllm_second):
    return vllm_second


@pytest.fixture
def crashable_fake():
    """lora-sync on the fake engine in a process of its own (the real test servers'
    settings), for a test to kill and start again on the same port."""
    server = fake_engine_process().start()
    try:
        yield server
        assert server.alive(), "the fake server died during the test:\n" + server.log_tail()
        assert violations(server.url) == []  # what a real engine would have crashed on
    finally:
        server.stop()


def versions_on(server, name: str) -> list[int]:
    with LoRASyncClient(server.url, api_key=API_KEY) as one:
        [listing] = one.adapters()
    return sorted(v["version"] for a in listing["adapters"] if a["name"] == name
                  for v in a["versions"])


def test_dead_server_fails_alone_and_gets_the_newest_back(vllm, crashable_fake, make_adapter):
    crashable = crashable_fake
    client = LoRASyncClient([vllm.url, crashable.url], api_key=API_KEY, timeout=30)
    with client:
        [a1, a2, a3, b1] = [make_adapter(seed) for seed in (501, 502, 503, 504)]
        assert [r.version for r in client.push(a1, "fleet")] == [1, 1]
        before = client.health()
        assert all(h["ok"] for h in before)

        crashable.kill()  # SIGKILL, every process of the server
        health = client.health(timeout=3)
        assert [h["ok"] for h in health] == [True, False]
        assert health[1]["error"].startswith("unreachable")

        # skip: the healthy server takes the version, the dead one is reported.
        skipped = client.push(a2, "fleet", on_error="skip")
        assert skipped[0].ok and skipped[0].version == 2
        assert not skipped[1].ok and skipped[1].error.code == "unreachable"
        # raise (the default): the error names the dead server; the other keeps v3.
        with pytest.raises(PushFailed) as failed:
            client.push(a3, "fleet")
        assert crashable.url in str(failed.value) and vllm.url not in str(failed.value)
        assert failed.value.results[0].ok and failed.value.results[0].version == 3
        assert versions_on(vllm, "fleet")[-1] == 3

        crashable.start()  # same port, a new instance with no adapters
        health = client.health()
        assert health[1]["ok"] and health[1]["restarted"]
        assert health[1]["instance_id"] != before[1]["instance_id"]

        # The next push (of another name) first gives the restarted server the newest
        # version of every name it lost, under its version number.
        results = client.push(b1, "fleet-b")
        assert [r.version for r in results] == [1, 1]
        assert versions_on(crashable, "fleet") == [3]
        # Both serve v3 under the alias: the healthy vLLM its own v3, the restarted (fake)
        # server exactly a3's weights (its text is their digest).
        with LoRASyncClient(vllm.url, api_key=API_KEY) as real, \
                LoRASyncClient(crashable.url, api_key=API_KEY) as fake:
            assert greedy(real, "fleet") == greedy(real, "fleet-v3")
            assert greedy(fake, "fleet") == greedy(fake, "fleet-v3") == served_text(a3)
        assert client.resync() == [{"server": s.url, "pushed": [], "error": None}
                                   for s in (vllm, crashable)]  # nothing left to give back

    # A hung server (SIGSTOP) holds a push no longer than the client's timeout.
    with LoRASyncClient([vllm.url, crashable.url], api_key=API_KEY, timeout=5) as hung:
        os.killpg(crashable.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            results = hung.push(make_adapter(506), "fleet-hung", version=1, on_error="skip")
            elapsed = time.monotonic() - t0
        finally:
            os.killpg(crashable.proc.pid, signal.SIGCONT)
        assert results[0].ok and results[1].error.code == "unreachable", results
        assert elapsed < 5 + 3, elapsed

    # A restarted trainer (a fresh client) continues the numbering from the servers.
    with LoRASyncClient([vllm.url, crashable.url], api_key=API_KEY) as fresh:
        assert [r.version for r in fresh.push(make_adapter(505), "fleet")] == [4, 4]


@pytest.mark.extended  # CI time: the dead-server test above covers the client's resync
def test_rl_loop_survives_a_server_killed_mid_run(crashable, model_dir, workdir):
    """SIGKILL after step 3's push; the server comes back on its own while the loop waits.
    The next step's rollouts come from the version the trainer last pushed."""
    from examples.rl_loop import LoopConfig, run, summary
    kill_after = 3
    restart = []

    def on_step(step):
        if step == kill_after:
            crashable.kill()
            restart.append(threading.Thread(target=crashable.start))
            restart[0].start()

    cfg = LoopConfig(steps=14, transport="auto", name="rl-crash", model_dir=str(model_dir),
                     server_url=crashable.url, api_key=API_KEY, progress=False,
                     out_dir=str(workdir / "rl-crash"), server_wait_s=240)
    log = run(cfg, on_step=on_step)
    restart[0].join(timeout=300)
    steps = log["steps"]
    events = [e for s in steps for e in s["restarts"]]
    assert len(events) == 1, events
    after = steps[kill_after + 1]
    assert after["restarts"], "the step after the kill did not see the restart"
    pushed_before = steps[kill_after]["pushed_version"]
    assert after["restarts"][0]["resynced"] == [f"rl-crash-v{pushed_before}"]
    assert after["rollout_version"] == pushed_before  # the newest, with its number
    assert after["pushed_version"] == pushed_before + 1
    first, last = summary(log, k=3)
    print(f"\nreward {first:.3f} -> {last:.3f}; server down {events[0]['down_s']:.0f} s")
    assert last > first + 0.3


# -- random fleets: same-host and remote servers, refusals and kills mid-push ---------------
@pytest.fixture(scope="module")
def mixed_fleet():
    """Three fake-engine servers on this host and two 'remote' ones, each in a PID namespace
    of its own (fake_server_main.OWN_PID_NAMESPACE): they cannot open the trainer's
    /proc/<pid>/fd, nor it theirs, as from another host or container. Processes of their
    own, so a test can SIGKILL one and start it again."""
    servers = [fake_engine_process() for _ in range(3)] + \
        [fake_engine_process(own_pid_namespace=True) for _ in range(2)]
    shm_before = set(os.listdir("/dev/shm"))
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.start(), servers))
        yield servers[:3], servers[3:]
        for s in servers:
            assert violations(s.url) == [], s.url  # what a real engine would have crashed on
    finally:
        for s in servers:
            s.stop()
        # What the killed namespace servers left: no later server of theirs sweeps it (a
        # sweep keeps to its own PID namespace), and those namespaces are gone now.
        ours = private_dir.pid_namespace()
        for name in set(os.listdir("/dev/shm")) - shm_before:
            if name.startswith(private_dir.PREFIX) and f"-{ours}-" not in name:
                shutil.rmtree(f"/dev/shm/{name}", ignore_errors=True)


def shared_files_held(servers, trainer_before: int = 0) -> list[int]:
    """The processes of `servers` that hold a shared copy open or mapped, and this one (the
    trainer) if it holds more than `trainer_before` (other tests' clients in this process
    may keep theirs)."""
    held = [p for s in servers for p in process_tree(s.proc.pid)
            if shared_fds(str(p)) or shared_maps(str(p))]
    return held + ([os.getpid()] if _trainer_holds() > trainer_before else [])


def _trainer_holds() -> int:
    return len(shared_fds()) + shared_maps()


def _text_or_none(server, model: str) -> str | None:
    """The fake engine's text for `model` on `server`, or None where the name is unknown
    there (404): never the base model's."""
    with LoRASyncClient(server.url, api_key=API_KEY) as one:
        try:
            return one.complete("the quick brown", model, 12)["text"]
        except NotFound:
            return None


# No shrinking: each example starts servers again; a failure prints its draws as they were.
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.generate))
@given(st.data())
def test_random_fleets_with_remote_servers_refusals_and_kills(mixed_fleet, make_adapter, data):
    """K same-host servers (0-3) and M remote ones (0-2), 1-3 pushes by `auto`; at each push
    a random subset refuses (the engine refuses the build), and at one push of the example
    one random server may be killed (SIGKILL) while the push is under way, then started
    again (empty). After every
    push each server serves exactly the newest version it acknowledged (the fake engine's
    text is a digest of the weights), by alias and by version, and a server that holds no
    version answers 404, never the base model; `auto` took the shared copy on the same-host
    servers when two or more can map it, shm for one alone, and HTTP for the remote ones.
    Once the name is retired, no process on the host holds a shared copy."""
    local, remote = mixed_fleet
    k = data.draw(st.integers(0, 3), "same-host servers")
    m = data.draw(st.integers(0 if k else 1, 2), "remote servers")
    servers = local[:k] + remote[:m]
    name = f"mixed{data.draw(st.integers(0, 10**6))}"
    trainer_before = _trainer_holds()
    acked: list[int | None] = [None] * len(servers)
    adapters = {}
    with LoRASyncClient([s.url for s in servers], api_key=API_KEY, remember=False,
                        lease_ahead=False, timeout=20) as c:
        try:
            pushes = data.draw(st.integers(1, 3), "pushes")
            # At most one kill per example (a restart is most of an example's time).
            kill_at = data.draw(st.none() | st.integers(0, pushes - 1), "push with a kill")
            for p in range(pushes):
                refuse = data.draw(st.sets(st.integers(0, len(servers) - 1)), f"refuse {p}")
                for i, s in enumerate(servers):
                    http.call("POST", s.url + REFUSE_PATH, json_body={"refuse": i in refuse})
                victim = data.draw(st.integers(0, len(servers) - 1), "victim") \
                    if p == kill_at else None
                delay = data.draw(st.floats(0, 0.05), "kill delay") if p == kill_at else 0
                killer = threading.Timer(delay, servers[victim].kill) if victim is not None \
                    else None
                a = make_adapter(seed=4800 + p)
                if killer:
                    killer.start()
                results = c.push(a, name, on_error="skip")
                if killer:
                    killer.join()
                    servers[victim].start()  # same port, a new instance holding nothing
                    acked[victim] = None
                for i, r in enumerate(results):
                    if i == victim:
                        continue  # acknowledged or not, that instance is gone
                    assert r.ok == (i not in refuse), r
                    if not r.ok:
                        assert r.error.code == "engine_refused", r.error
                        continue
                    # Remote: HTTP (neither memory transport reaches another PID
                    # namespace). Same host: the one sealed copy once two servers can map
                    # it; with one, shm (or the shared copy while a remote one still
                    # counted as reachable, before its first refusal).
                    want = {"tensors"} if i >= k else {"shared"} if k >= 2 else \
                        {"shared", "shm"}
                    assert r.transport in want, (i, r.transport, want)
                    acked[i] = r.version
                    adapters[r.version] = a
                for i, s in enumerate(servers):
                    want = served_text(adapters[acked[i]]) if acked[i] is not None else None
                    assert _text_or_none(s, name) == want, (i, acked)
                    if acked[i] is not None:
                        assert _text_or_none(s, f"{name}-v{acked[i]}") == want
        finally:
            for s in servers:
                http.call("POST", s.url + REFUSE_PATH, json_body={"refuse": False})
                retire_if_held(s.url, name)
    wait_until(lambda: not shared_files_held(servers, trainer_before), 20,
               "no shared copy left open or mapped")
