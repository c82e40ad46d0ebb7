"""verl 0.9.1's own rollout server with lora-sync (vllm_ext/verl.py), in a Ray actor, on vLLM
0.32 CPU: the server half of the verl integration (#53, item 3).

verl's `RolloutReplicaRegistry` gives the replica kind "lora_sync"; its server class is
created as a Ray actor and launched exactly as verl's `vLLMReplica.launch_servers` does
(minus the GPU placement group): verl's own `launch_server` builds the vLLM arguments, the
engine and the app, and lora-sync comes in through vLLM's plugin hooks. Rollouts go through
verl's own `generate` (a Ray call, token ids in, TokenOutput out).

Checked: before the trainer's first push, generate is refused with lora-sync's 404 (never
the base under the adapter's name); pushes by tensors and by broadcast become policy-v1 and
policy-v2, and verl's generate serves PEFT's own greedy tokens for each and says which
version served; verl's HTTP app is guarded as vLLM's is.

Extended (LORA_SYNC_EXTENDED_TESTS=1): a Ray runtime and one more vLLM server cost a minute of
CI on a 2-core machine; test_framework_mount.py covers the mount's mechanism in CI."""
from __future__ import annotations

import pytest

from lora_sync import LoRASyncClient, http
from lora_sync.errors import LoRASyncError
from testbed.processes import VLLM_ENV

from .conftest import API_KEY, REPO, RL_LIB, SERVER_ENV, rl_frameworks
from .helpers import PROMPT
from .peft_oracle import _tokenizer, peft_greedy, peft_model

pytestmark = [pytest.mark.server, pytest.mark.extended]

N = 12


def rollout_configs(model_dir):
    """verl's own config dataclasses for a standalone rollout of the tiny model on CPU."""
    from verl.workers.config import HFModelConfig, RolloutConfig
    model = HFModelConfig(path=str(model_dir), lora_rank=8, lora_alpha=16,
                          target_modules="all-linear")
    rollout = RolloutConfig(name="lora_sync", mode="async", dtype="float32", prompt_length=32,
                            response_length=N, max_model_len=64, max_num_seqs=4,
                            max_num_batched_tokens=256, enforce_eager=True,
                            tensor_model_parallel_size=1, gpu_memory_utilization=0.5,
                            load_format="auto", enable_sleep_mode=False)  # vLLM's CPU build has no sleep mode
    return rollout, model


@pytest.fixture(scope="module")
def verl_server(model_dir):
    """(ray, the server actor, its URL): one LoRASyncHttpServer, launched as verl does."""
    path = f"{REPO}:{RL_LIB}"
    with rl_frameworks(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", path)
        import ray
        from verl.workers.rollout.replica import RolloutMode, RolloutReplicaRegistry

        from vllm_ext.verl import LoRASyncHttpServer, register
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={
            "env_vars": {**VLLM_ENV, **SERVER_ENV, "PYTHONPATH": path}})
        try:
            register()
            rollout, model = rollout_configs(model_dir)
            replica = RolloutReplicaRegistry.get("lora_sync")(
                replica_rank=0, config=rollout, model_config=model, gpus_per_node=1)
            assert replica.server_class.__ray_metadata__.class_name == \
                LoRASyncHttpServer.__name__
            server = replica.server_class.options(max_concurrency=8).remote(
                config=replica.config, model_config=replica.model_config,
                rollout_mode=RolloutMode.STANDALONE, workers=[], replica_rank=0, node_rank=0,
                gpus_per_node=1, nnodes=1, cuda_visible_devices="")
            ray.get(server.launch_server.remote(), timeout=600)
            host, port = ray.get(server.get_server_address.remote())
            yield ray, server, f"http://{host}:{port}"
        finally:
            ray.shutdown()


def rollout(ray, server, model_dir, request_id: str):
    """One rollout through verl's own generate: the prompt's ids in, TokenOutput out."""
    ids = _tokenizer(str(model_dir))(PROMPT)["input_ids"]
    return ray.get(server.generate.remote(ids, {"temperature": 0.0, "max_tokens": N},
                                          request_id), timeout=120)


def test_before_the_first_push_a_rollout_gets_lora_syncs_404_not_the_base(verl_server,
                                                                           model_dir):
    ray, server, _ = verl_server
    from lora_sync.errors import NotFound
    with pytest.raises(Exception) as e:
        rollout(ray, server, model_dir, "before-push")
    cause = e.value.as_instanceof_cause()
    assert isinstance(cause, NotFound) and cause.status == 404 and "policy" in str(cause)


def test_verls_rollouts_serve_each_pushed_version(verl_server, model_dir):
    ray, server, url = verl_server
    with LoRASyncClient(url, engine="vllm", api_key=API_KEY, timeout=300) as client:
        from lora_sync import LoRAAdapter
        for version, (seed, transport) in enumerate([(1201, "tensors"), (1202, "broadcast")],
                                                    start=1):
            model = peft_model(model_dir, seed)
            adapter = LoRAAdapter.from_peft_model(model)
            if transport == "broadcast":
                client.init_group(backend="gloo", master_address="127.0.0.1", timeout_s=120)
                try:
                    results = client.broadcast(adapter, "policy")
                finally:
                    client.destroy_group()
            else:
                results = client.push(adapter, "policy", transport=transport)
            assert [r.version for r in results] == [version]
            out = rollout(ray, server, model_dir, f"after-v{version}")
            assert out.token_ids == peft_greedy(model, model_dir, PROMPT, N)
            assert out.extra_fields["lora_sync_version"] == f"policy-v{version}"


def test_verls_http_app_is_guarded_as_vllms(verl_server):
    _, _, url = verl_server
    status, reply, _ = http.request("POST", f"{url}/v1/load_lora_adapter", json_body={
        "lora_name": "policy-v9", "lora_path": "/tmp"}, timeout=30)
    assert status in (401, 403), reply
    with LoRASyncClient(url, engine="vllm", timeout=60) as keyless:
        with pytest.raises(LoRASyncError) as e:
            keyless.retire("policy")
        assert e.value.status == 401, e.value
