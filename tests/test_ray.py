"""Servers as Ray actors on two Ray nodes, the trainer as a Ray actor (#53, item 6): the way
verl and SkyRL run them. Ray's own multi-node on one machine (ray.cluster_utils.Cluster: a
head and a second raylet, each with a resource naming it); each node hosts one vLLM server
built inside its actor as a framework builds it (testbed.framework_server, lora-sync
mounted through vllm_ext.mount).

Checked: a push by tensors and one by broadcast, from the trainer actor, reach both servers,
each serving PEFT's own greedy tokens; a server actor killed and restarted by Ray
(max_restarts) comes back empty, and the trainer's resync gives it its versions back.

Extended (LORA_SYNC_EXTENDED_TESTS=1): a Ray cluster and two more vLLM servers are minutes
of CI on a 2-core machine; test_framework_mount.py covers the mount in CI."""
from __future__ import annotations

import asyncio
import os
import threading
import time
import urllib.request

import pytest

from testbed.processes import VLLM_ENV, free_port, vllm_args

from .conftest import API_KEY, REPO, RL_LIB, SERVER_ENV, rl_frameworks
from .helpers import PROMPT
from .peft_oracle import peft_greedy, peft_model

pytestmark = [pytest.mark.server, pytest.mark.extended]

N = 12


class ServerActor:
    """One vLLM server with lora-sync, built in the actor's own process (as verl's
    vLLMHttpServer is) and served on a thread of it. Ray restarts the actor after a crash:
    __init__ runs again and the server comes back on the same port."""

    def __init__(self, model_dir: str, port: int):
        from testbed.framework_server import serve
        self.url = f"http://127.0.0.1:{port}"
        argv = vllm_args(model_dir, port)
        threading.Thread(target=lambda: asyncio.run(serve(argv)), daemon=True).start()

    def ready(self, timeout_s: float = 300.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.url} did not serve within {timeout_s} s")

    def pid(self) -> int:
        return os.getpid()


class TrainerActor:
    """The trainer's side in a Ray actor: one LoRASyncClient for every server."""

    def __init__(self, urls: list[str], model_dir: str):
        from lora_sync import LoRASyncClient
        self.client = LoRASyncClient(urls, api_key=API_KEY, timeout=300)
        self.model_dir = model_dir

    def push(self, seed: int, name: str, transport: str) -> list[int]:
        from lora_sync import LoRAAdapter
        adapter = LoRAAdapter.from_peft_model(peft_model(self.model_dir, seed))
        if transport == "broadcast":
            self.client.init_group(backend="gloo", master_address="127.0.0.1", timeout_s=120)
            try:
                return [r.version for r in self.client.broadcast(adapter, name)]
            finally:
                self.client.destroy_group()
        return [r.version for r in self.client.push(adapter, name, transport=transport)]

    def resync(self) -> list[dict]:
        return self.client.resync()

    def newest(self, name: str) -> list:
        return self.client.newest_versions(name)

    def greedy(self, name: str) -> list[list[int]]:
        return [list(self.client.complete(PROMPT, name, N, return_token_ids=True, server=s)
                     ["raw"]["choices"][0]["token_ids"]) for s in range(len(self.client.servers))]


@pytest.fixture(scope="module")
def cluster(model_dir):
    """Two Ray nodes; a server actor on each; the trainer actor beside them."""
    path = f"{REPO}:{RL_LIB}"  # Ray's own processes (raylets, agents, workers) too
    with rl_frameworks(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", path)
        import ray
        from ray.cluster_utils import Cluster
        env = {**VLLM_ENV, **SERVER_ENV, "PYTHONPATH": path}
        nodes = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False})
        nodes.add_node(num_cpus=2, resources={"node_b": 1})
        ray.init(address=nodes.address, runtime_env={"env_vars": env})
        try:
            server_cls = ray.remote(max_restarts=1, max_task_retries=0)(ServerActor)
            servers = [server_cls.options(resources={node: 1}).remote(str(model_dir),
                                                                        free_port())
                       for node in ("node_a", "node_b")]
            urls = ray.get([s.ready.remote() for s in servers], timeout=600)
            trainer = ray.remote(TrainerActor).remote(urls, str(model_dir))
            yield ray, servers, trainer
        finally:
            ray.shutdown()
            nodes.shutdown()


def wait_restarted(ray, actor, before_pid: int, timeout_s: float = 600.0) -> int:
    """Until the actor answers from a new process (Ray restarted it) and its server serves;
    returns the new pid. ray.kill returns before the old process is gone, so a call may still
    reach it, and calls made while Ray restarts it fail (ActorUnavailableError): both are made
    again, within `timeout_s`."""
    from ray.exceptions import ActorUnavailableError
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = ray.get(actor.pid.remote(), timeout=max(deadline - time.monotonic(), 1))
            if pid != before_pid:
                ray.get(actor.ready.remote(), timeout=max(deadline - time.monotonic(), 1))
                return pid
        except ActorUnavailableError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the actor did not come back within {timeout_s} s")
        time.sleep(1.0)


@pytest.mark.parametrize("transport", ["tensors", "broadcast"])
def test_a_push_from_the_trainer_actor_reaches_every_server_actor(cluster, model_dir,
                                                                  transport):
    ray, servers, trainer = cluster
    seed = 1001 if transport == "tensors" else 1002
    name = f"ray-{transport}"
    assert ray.get(trainer.push.remote(seed, name, transport)) == [1, 1]
    want = peft_greedy(peft_model(model_dir, seed), model_dir, PROMPT, N)
    assert ray.get(trainer.greedy.remote(name)) == [want, want]


def test_a_server_actor_ray_restarts_gets_its_versions_back(cluster, model_dir):
    ray, servers, trainer = cluster
    ray.get(trainer.push.remote(1011, "ray-restart", "tensors"))
    before = ray.get(servers[1].pid.remote())
    ray.kill(servers[1], no_restart=False)  # a crash: Ray restarts the actor
    wait_restarted(ray, servers[1], before)  # answers from a new process (or times out)
    assert ray.get(trainer.newest.remote("ray-restart")) == [1, None]  # it lost them
    ray.get(trainer.resync.remote())
    assert ray.get(trainer.newest.remote("ray-restart")) == [1, 1]
    want = peft_greedy(peft_model(model_dir, 1011), model_dir, PROMPT, N)
    assert ray.get(trainer.greedy.remote("ray-restart")) == [want, want]
