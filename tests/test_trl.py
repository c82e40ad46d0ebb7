"""The training-framework integrations: TRL's AsyncGRPOTrainer with lora-sync
(lora_sync/integrations/trl.py) and LoRASyncCallback for transformers.Trainer
(lora_sync/integrations/transformers.py).

In-process (no server): what the TRL trainer refuses, and its version numbering and pushes
against lora-sync on the fake engine (tests/engine_fakes.py), and its hooks for a server
that goes down. Real vLLM server: a short AsyncGRPO run whose rollouts are served by exactly
the versions the trainer pushed; one whose server is SIGKILLed, restarted and ridden out,
then killed for good (ServerDown); and the callback's pushes against the same adapters
loaded from disk by the engine."""
from __future__ import annotations

import functools
import http.client
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here comes from the Hub (TRL's
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # trainers send telemetry)
pytest.importorskip("trl")
pytest.importorskip("peft")

from peft import LoraConfig  # noqa: E402

from lora_sync import LoRASyncClient  # noqa: E402
from lora_sync.errors import LoRASyncError  # noqa: E402

from .helpers import PROMPT, disk_model  # noqa: E402

PROMPTS = ["the quick brown", "hello world,", "one two three", "a small model",
           "lora adapters are", "how are you"]
# The tiny tokenizer's chat template matches none TRL knows, and TRL's rollout worker parses
# each completion with the tokenizer's response template: plain text after the prompt (which
# the template ends with a space), up to </s>.
PLAIN_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor_pattern": r" $",
                  "fields": {"content": {"close_pattern": r"</s>\s*", "content": "text"}}}


def lora(**kw) -> LoraConfig:
    return LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": "all-linear",
                         "lora_dropout": 0.0, **kw})


def token_reward(completions, completion_ids, targets=frozenset(), **kwargs):
    """Fraction of a completion's tokens in `targets` (module level: TRL's rollout worker is a
    spawned process and unpickles its reward functions)."""
    return [sum(t in targets for t in ids) / max(len(ids), 1) for ids in completion_ids]


def tokenizer(model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.response_template = PLAIN_TEMPLATE
    return tok


def trainer_for(model_dir, out_dir, servers, api_key=None, peft_config=None, **kw):
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from lora_sync.integrations import trl_cpu
    from lora_sync.integrations.trl import AsyncGRPOTrainer
    trl_cpu.patch()  # TRL's AsyncGRPOTrainer needs CUDA otherwise
    config = {"output_dir": str(out_dir), "max_steps": 4, "per_device_train_batch_size": 8,
              "num_generations": 4, "max_completion_length": 8, "learning_rate": 3e-2,
              "bf16": False, "gradient_checkpointing": False, "report_to": "none",
              "logging_steps": 1, "save_strategy": "no", "max_staleness": 1,
              "token_budget": -1, "seed": 0, "disable_tqdm": True,
              "vllm_server_base_url": servers[0] if servers else "http://127.0.0.1:9",
              **kw.pop("config", {})}
    tok = tokenizer(model_dir)
    targets = frozenset(i for i in range(len(tok)) if "e" in tok.decode([i]))
    return AsyncGRPOTrainer(
        model=str(model_dir), reward_funcs=functools.partial(token_reward, targets=targets),
        args=AsyncGRPOConfig(**config),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}]
                                                    for p in PROMPTS]}),
        processing_class=tok, peft_config=peft_config or lora(),
        lora_sync_servers=servers, lora_sync_api_key=api_key, **kw)


# -- in-process: what is refused ------------------------------------------------------------
UNREACHABLE = ["http://127.0.0.1:9"]  # the refusals come before any server is asked


@pytest.mark.parametrize("peft_config,why", [
    (lora(use_dora=True), "DoRA"),
    (lora(modules_to_save=["norm"]), "modules_to_save"),
    (lora(bias="lora_only"), "bias='lora_only'"),
    (lora(bias="all"), "bias='all'"),
])
def test_refuses_what_trls_adapter_sync_refuses(model_dir, tmp_path, peft_config, why):
    with pytest.raises(ValueError) as e:
        trainer_for(model_dir, tmp_path, UNREACHABLE, peft_config=peft_config)
    assert "lora-sync cannot sync this adapter" in str(e.value) and why in str(e.value)
    assert not (tmp_path / ".vllm_lora").exists()


def test_refuses_what_lora_sync_servers_would(model_dir):
    """TRL's check lets through what a server refuses (a rank above its slots; per-module
    ranks where the engine reads none): given the servers' lora_sync_info, check_servable
    runs each server's own check_adapter, and accepts what every server accepts."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from lora_sync.adapter import Coverage, ModelSpec
    from lora_sync.integrations.trl import check_servable
    from vllm_ext.bridge import COVERAGE

    def info(max_rank, coverage=COVERAGE):
        return ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir), max_rank,
                                        coverage).info()
    sglang_like = Coverage("SGLang", config_features=frozenset())
    per_module = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                lora(rank_pattern={"q_proj": 4}))
    assert check_servable(per_module, [info(16)]).rank_pattern == {"q_proj": 4}
    with pytest.raises(ValueError, match="does not read rank_pattern"):
        check_servable(per_module, [info(16), info(16, sglang_like)])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora(r=16))
    assert check_servable(model, [info(16)]).r == 16
    with pytest.raises(ValueError, match="max LoRA rank 8"):
        check_servable(model, [info(8)])


def test_refuses_without_lora_or_with_another_weight_sync(model_dir, tmp_path):
    from lora_sync.integrations.trl import AsyncGRPOTrainer
    with pytest.raises(ValueError, match="peft_config"):
        AsyncGRPOTrainer(str(model_dir), token_reward)
    with pytest.raises(ValueError, match="weight_transfer"):
        AsyncGRPOTrainer(str(model_dir), token_reward, peft_config=lora(),
                         weight_transfer=object())
    with pytest.raises(ValueError, match="lora_sync_transport"):
        AsyncGRPOTrainer(str(model_dir), token_reward, peft_config=lora(),
                         lora_sync_transport="shm")


def test_refuses_an_untested_trl(monkeypatch, model_dir):
    import trl

    from lora_sync.integrations.trl import AsyncGRPOTrainer
    monkeypatch.setattr(trl, "__version__", "9.9.9")
    monkeypatch.delenv("LORA_SYNC_ALLOW_UNTESTED_ENGINE", raising=False)
    with pytest.raises(RuntimeError, match="TRL 1.16.0"):
        AsyncGRPOTrainer(str(model_dir), token_reward, peft_config=lora())


def test_cpu_tree_attention_matches_plain_attention(model_dir):
    """lora_sync.integrations.trl_cpu's stand-in for TRL's FA3 tree attention: two samples
    sharing a prefix, packed as TRL packs them, get the logits each gets alone with plain
    attention."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import async_grpo_trainer
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow

    from lora_sync.integrations import trl_cpu
    trl_cpu.patch()
    async_grpo_trainer.register_tree_attention()
    samples = [[5, 6, 7, 8, 9], [5, 6, 7, 11]]
    row = TreeRow()
    for i, ids in enumerate(samples):
        row.add({"input_ids": torch.tensor(ids), "completion_mask": torch.ones(len(ids)),
                 "old_log_probs": torch.zeros(len(ids)), "advantage": 0.0, "group_id": 0})
    packed = row.pack()
    assert packed["input_ids"].tolist() == [5, 6, 7, 8, 9, 7, 11]  # [5, 6] is shared
    tree = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=TREE_ATTENTION)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        logits = tree(input_ids=packed["input_ids"][None],
                      position_ids=packed["position_ids"][None],
                      tree_kv_index=packed["tree_kv_index"],
                      tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                      tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
                      tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
                      tree_max_seqlen_k=int(packed["tree_max_seqlens"][1])).logits[0]
        for ids, where in zip(samples, ([0, 1, 2, 3, 4], [0, 1, 5, 6])):
            alone = plain(input_ids=torch.tensor([ids])).logits[0]
            torch.testing.assert_close(logits[where], alone, atol=1e-5, rtol=1e-5)


# -- in-process: versions and pushes on the fake engine ------------------------------------
def served_text(model):
    from lora_sync import LoRAAdapter

    from . import engine_fakes
    return engine_fakes.served_text(LoRAAdapter.from_peft_model(model))


def held(client, name):
    return sorted(v["version"] for a in client.adapters()[0]["adapters"] if a["name"] == name
                  for v in a["versions"] if not v["retired"])


def test_syncs_push_trl_model_versions(model_dir, tmp_path, make_fake_server):
    """Each sync is TRL's model_version + 1, pushed from memory (nothing under .vllm_lora),
    and is what the rollout worker requests; a restarted trainer, resumed or not, continues
    above what the server holds."""
    server = make_fake_server()
    client = LoRASyncClient(server.url, api_key=server.api_key)
    trainer = trainer_for(model_dir, tmp_path / "a", [server.url], server.api_key,
                          lora_sync_name="grpo")
    assert trainer._lora_name == "grpo"  # the rollout worker requests grpo-v<N>
    for n in (1, 2, 3):
        with torch.no_grad():  # a training step between syncs
            next(p for p in trainer.model.parameters() if p.requires_grad).add_(0.01)
        trainer._sync_weight()
        assert trainer.model_version == n == trainer.rollout_worker.model_version
        assert client.complete(PROMPT, f"grpo-v{n}")["text"] == served_text(trainer.model)
    assert held(client, "grpo") == [1, 2, 3]
    assert [r.transport for [r] in trainer.lora_sync_pushes] == ["shm"] * 3  # same host
    assert not (tmp_path / "a" / ".vllm_lora").exists()

    restarted = trainer_for(model_dir, tmp_path / "b", [server.url], server.api_key,
                            lora_sync_name="grpo", lora_sync_transport="broadcast")
    restarted._sync_weight()  # a fresh trainer (model_version 0): above the server's 3
    assert restarted.model_version == 4 == restarted.rollout_worker.model_version
    [r] = restarted.lora_sync_pushes[0]
    assert r.name == "grpo-v4" and r.transport == "broadcast"
    assert client.complete(PROMPT, "grpo")["version"] == 4

    resumed = trainer_for(model_dir, tmp_path / "c", [server.url], server.api_key,
                          lora_sync_name="grpo")
    resumed.model_version = 9  # what TRL reads from a checkpoint's rollout_state.json
    resumed._sync_weight()
    assert resumed.model_version == 10 and held(client, "grpo")[-1] == 10
    for t in (trainer, restarted, resumed):
        t.lora_sync_client.close()
    client.close()


def test_a_killed_server_is_ridden_out_then_stops_training(model_dir, tmp_path,
                                                           make_fake_server):
    """The trainer's hooks for a server that goes down (fake engine behind a proxy, so a new
    server can take the dead one's URL): while training, a sync that reaches no server waits
    for it; the one that takes its place is restored by the watch (the versions the dead one
    held, under their numbers) and the sync then pushes. Down past the bound: ServerDown, raised where
    TRL waits for rollouts (the worker's check_health) and by the next sync. Outside train()
    a sync fails at once, as before."""
    from lora_sync.integrations.server_watch import ServerWatch
    from lora_sync.integrations.trl import ServerDown
    first = make_fake_server()

    def wait_for(what, timeout=20.0):  # every wait here is bounded
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.02)

    with RecordingProxy(first.url) as proxy:
        trainer = trainer_for(model_dir, tmp_path, [proxy.url], first.api_key,
                              lora_sync_name="crash", lora_sync_timeout=10)
        client = trainer.lora_sync_client
        for _ in range(2):
            trainer._sync_weight()
        assert trainer.model_version == 2 and trainer.lora_sync_restore_versions == 3
        # what train() sets up (a thread on rank 0), here by hand
        watch = trainer.lora_sync_watch = ServerWatch(client, bound=30, interval=0.05,
                                                      restore=trainer.lora_sync_restore).start()
        trainer.lora_sync_watching = True
        try:
            first.stop()
            wait_for(lambda: proxy.url in watch.down_since)
            replacement = {}

            def restart():  # a new instance, holding nothing, at the same URL
                time.sleep(0.5)
                replacement["server"] = make_fake_server()
                proxy.upstream = replacement["server"].url
            threading.Thread(target=restart, daemon=True).start()
            t0 = time.monotonic()
            trainer._sync_weight()  # no server: waits for it, then pushes
            assert time.monotonic() - t0 >= 0.5
            assert trainer.model_version == 3 == trainer.rollout_worker.model_version
            [back] = watch.events
            assert back["server"] == proxy.url and back["restarted"]
            # what the server held before (TRL's worker retries requests naming either)
            assert back["resynced"] == ["crash-v1", "crash-v2"]
            assert held(client, "crash") == [1, 2, 3]
            assert client.complete(PROMPT, "crash-v3")["text"] == served_text(trainer.model)
            assert [v for v, _ in trainer.lora_sync_kept] == [1, 2, 3]

            proxy.upstream = "http://127.0.0.1:9"  # down for good
            watch.bound = 0.3
            wait_for(lambda: watch.failure is not None)
            for stops in (lambda: trainer.rollout_worker.check_health(1e12),
                          trainer._sync_weight):
                with pytest.raises(ServerDown) as e:
                    stops()
                assert e.value.server == proxy.url and proxy.url in str(e.value)
                assert "lora_sync_restart_timeout=0.3" in str(e.value)
            wait_for(lambda: not watch.running)
        finally:
            watch.stop()
            trainer.lora_sync_watching = False
        # outside train(): the push's own error, at once
        t0 = time.monotonic()
        with pytest.raises(LoRASyncError) as e:
            trainer._sync_weight()
        assert not isinstance(e.value, ServerDown)  # (through the proxy: its 502)
        assert time.monotonic() - t0 < 5
        client.close()  # (the fake servers are stopped by their fixture)


def test_sglang_rollouts_disable_top_k_the_sglang_way(model_dir, tmp_path, make_fake_server):
    """TRL disables top-k with 0, which SGLang refuses (400); the worker sends args.top_k."""
    from lora_sync import Server
    server = make_fake_server()
    trainer = trainer_for(model_dir, tmp_path, [Server(server.url, "vllm")], server.api_key,
                          lora_sync_engine="sglang", config={"vllm_server_base_url": server.url})
    assert trainer.args.top_k == -1
    trainer.lora_sync_client.close()


def test_callback_pushes_every_n_steps(model_dir, tmp_path, make_fake_server):
    from transformers import Trainer

    from lora_sync.integrations.transformers import LoRASyncCallback
    server = make_fake_server()
    seen = {}
    sync = LoRASyncCallback(server.url, "hf", every_n_steps=2, api_key=server.api_key,
                            step_versions=True)
    trainer = Trainer(model=peft_model(model_dir), args=hf_args(tmp_path, max_steps=5),
                      train_dataset=lm_dataset(model_dir),
                      callbacks=[sync, Probe(lambda step, model: seen.update(
                          {step: (served_text(model), sync.client.complete(PROMPT, "hf"))}))])
    trainer.train()
    assert [(p["step"], p["served"]) for p in sync.pushes] == [(2, "hf-v2"), (4, "hf-v4"),
                                                               (5, "hf-v5")]  # + train end
    for step in (2, 4):  # right after the push, the alias serves that step's weights
        text, reply = seen[step]
        assert reply["text"] == text and reply["version"] == step
    assert seen[2][0] != seen[4][0]
    with pytest.raises(ValueError, match="every_n_steps"):
        LoRASyncCallback(server.url, "hf", every_n_steps=0)


# -- transformers.Trainer helpers -----------------------------------------------------------
def peft_model(model_dir):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora())


def lm_dataset(model_dir):
    tok = tokenizer(model_dir)
    ids = [tok(p + " the end")["input_ids"][:8] for p in PROMPTS]
    ids = [x + [tok.eos_token_id] * (8 - len(x)) for x in ids]
    return [{"input_ids": torch.tensor(x), "labels": torch.tensor(x)} for x in ids]


def hf_args(out_dir, **kw):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=3,
                             learning_rate=5e-2, report_to="none", save_strategy="no",
                             use_cpu=True, disable_tqdm=True, logging_strategy="no", **kw)


class Probe:
    """A callback after LoRASyncCallback: `fn(step, model)` at every step it pushed."""

    def __new__(cls, fn):
        from transformers import TrainerCallback

        class _Probe(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                if state.global_step % 2 == 0:
                    fn(state.global_step, model)
        return _Probe()


# -- real vLLM server -----------------------------------------------------------------------
class RecordingProxy:
    """Forwards HTTP to `upstream` and records every /v1/completions request's model with the
    reply's status, X-LoRA-Version and model: what TRL's rollout worker asked and got."""

    def __init__(self, upstream: str):
        self.upstream = upstream  # may be changed while it runs
        self.calls: list[dict] = []
        calls, proxy = self.calls, self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                up = urlsplit(proxy.upstream)
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=120)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection")}
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                except OSError as e:  # the upstream is down: a gateway's 502
                    conn.close()
                    if self.path.startswith("/v1/completions"):
                        calls.append({"model": json.loads(body).get("model"), "status": 502,
                                      "version": None, "served": None, "error": str(e),
                                      "t": time.monotonic()})
                    data = json.dumps({"error": {"message": str(e)}}).encode()
                    self.send_response(502)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if self.path.startswith("/v1/completions"):
                    calls.append({"model": json.loads(body).get("model"),
                                  "status": reply.status, "t": time.monotonic(),
                                  "version": reply.getheader("X-LoRA-Version"),
                                  "served": json.loads(data).get("model")
                                  if reply.status == 200 else None,
                                  "error": None if reply.status == 200 else data[:300]})
                self.send_response(reply.status)
                for k, v in reply.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                         "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the rollout worker stopped waiting (it is being shut down)
                conn.close()

            do_GET = do_POST = _forward

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class RecordingQueue:
    """Stands in for the trainer's rollout queue: records each sample the trainer takes."""

    def __init__(self, queue):
        self.queue, self.taken = queue, []

    def get(self, *args, **kwargs):
        sample = self.queue.get(*args, **kwargs)
        self.taken.append(sample)
        return sample

    def __getattr__(self, name):
        return getattr(self.queue, name)


GRPO_STEPS = 8


# A failed rollout worker leaves TRL's stop() waiting for ever (a dead child never wakes the
# stop event's condition): the timeout bounds that, about 30 s is the normal run.
@pytest.mark.timeout(180)
def test_async_grpo_trains_through_lora_sync(vllm, model_dir, tmp_path):
    """TRL's AsyncGRPOTrainer, changed by its import only, against the real vLLM server: every
    completion its rollout worker requested was served by exactly the version it named, one
    the trainer pushed, or, when the worker lagged the whole retention window behind, refused
    as retired (never served by another version); every sample trained on came from such a version; nothing on disk;
    the last version serves the trainer's final weights (log-probs agree). The reward is
    printed, not asserted: 8 steps are too few for it to rise reliably (see test_rl_loop)."""
    from examples.rl_loop import logprob_mismatch, token_logprobs
    from peft import set_peft_model_state_dict

    from lora_sync import LoRAAdapter
    name = "trl-grpo"
    with RecordingProxy(vllm.url) as proxy:
        trainer = trainer_for(model_dir, tmp_path, [vllm.url], vllm.api_key,
                              lora_sync_name=name,
                              config={"vllm_server_base_url": proxy.url,
                                      "max_steps": GRPO_STEPS,
                                      "per_device_train_batch_size": 32, "num_generations": 8})
        queue = trainer.rollout_queue = RecordingQueue(trainer.rollout_queue)
        client = trainer.lora_sync_client
        keep = int(client.info()[0]["keep_versions"])
        try:
            trainer.train()
            final = client.completions(model=f"{name}-v{trainer.model_version}", prompt=PROMPT,
                                       max_tokens=8, temperature=0.0, logprobs=1,
                                       return_token_ids=True)
        finally:
            client.retire(name)
            client.close()
    pushed = [r.version for [r] in trainer.lora_sync_pushes]
    # the initial policy, then one version per step
    assert pushed == list(range(pushed[0], pushed[0] + GRPO_STEPS + 1))
    assert trainer.model_version == pushed[-1] == final["served_version"]
    served = [c for c in proxy.calls if c["status"] == 200]
    for c in proxy.calls:
        if c["status"] != 200:  # a version out of the window by the end: refused as retired
            assert c["status"] == 404 and b"version_retired" in c["error"], c
            assert int(c["model"].rsplit("-v", 1)[1]) <= pushed[-1] - keep, (c, pushed)
    for c in served:  # served by exactly the version the worker named
        assert c["served"] == c["model"] == f"{name}-v{c['version']}", c
    requested = {int(c["version"]) for c in served}
    assert requested <= set(pushed) and len(requested) > 2
    taken = {s.model_version for s in queue.taken}
    assert taken <= requested, (taken, requested)
    assert not (tmp_path / ".vllm_lora").exists()
    # The newest version is the trainer's final adapter: the server's log-probs of its greedy
    # completion are the trainer's own (a fresh model with the trainer's LoRA weights).
    policy = peft_model(model_dir)
    set_peft_model_state_dict(policy, LoRAAdapter.from_peft_model(trainer.model).tensors)
    choice = final["choices"][0]
    with torch.no_grad():
        mine = token_logprobs(policy, [(choice["prompt_token_ids"], choice["token_ids"])])
    mismatch = logprob_mismatch(mine, [choice["logprobs"]["token_logprobs"]])
    rewards = [s.metrics["reward"] for s in queue.taken]
    third = len(rewards) // 3
    first, last = (sum(r) / len(r) for r in (rewards[:third], rewards[-third:]))
    print(f"\nTRL AsyncGRPO via lora-sync: {GRPO_STEPS} steps, {len(rewards)} samples, reward "
          f"first third {first:.3f} -> last third {last:.3f}; versions requested "
          f"{sorted(requested)}; final version's log-prob mismatch {mismatch:.1e}")
    assert mismatch < 1e-3


class AfterSync:
    """A callback added after construction, so after TRL's sync: `fn(step)` at every step's
    end, once that step's version is pushed."""

    def __new__(cls, fn):
        from transformers import TrainerCallback

        class _AfterSync(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                fn(state.global_step)
        return _AfterSync()


RESTART_BOUND_S = 150  # the ride-out bound while the server restarts (a start takes ~40 s)
DOWN_BOUND_S = 10      # the bound once it is killed for good
KILL_STEP, KILL_AGAIN_STEP = 2, 5


# Two kills and one server start: about 2 minutes; a trainer that hangs on the dead server
# (the bug: TRL's worker retries for about 8 minutes) runs into the timeout.
@pytest.mark.extended  # CI time: test_a_killed_server_is_ridden_out_then_stops_training
@pytest.mark.timeout(420)  # checks the same hooks in process
def test_async_grpo_rides_out_a_killed_server_then_stops_on_one_that_stays_down(model_dir,
                                                                                 tmp_path):
    """A vLLM server SIGKILLed mid-training and started again: the trainer resyncs it (it
    holds the newest version again, the one TRL's rollout worker names), rollouts are served
    by exactly the versions they name, and training goes on. Killed again and left down:
    train() raises ServerDown naming the server, after the bound and soon after it."""
    from testbed.processes import vllm_server

    from lora_sync.integrations.trl import ServerDown

    from .conftest import API_KEY, SERVER_ENV
    name = "trl-crash"
    server = vllm_server(model_dir, env=SERVER_ENV)  # its own: killed twice here
    server.start_timeout = 150
    marks: dict = {}

    def restart():
        try:
            server.start()
        except (RuntimeError, TimeoutError) as e:
            marks["restart_error"] = str(e)[-3000:]
            return
        marks.update(up=time.monotonic(), restart_error=None, held_after_restart=0)
        deadline = time.monotonic() + 30  # the watch checks every second
        while time.monotonic() < deadline and marks["held_after_restart"] < marks["named"]:
            marks["held_after_restart"] = probe.newest_versions(name)[0] or 0
            time.sleep(0.2)
    restarted = threading.Thread(target=restart, daemon=True)

    def crash(step):
        if step == KILL_STEP:
            marks["named"] = trainer.model_version  # what the rollout worker requests
            server.kill()  # SIGKILL to every process of the server
            marks["killed"] = time.monotonic()
            restarted.start()  # same port, a new instance that holds no adapter
        elif step == KILL_AGAIN_STEP:
            restarted.join(timeout=1)
            marks["pushed_before_2nd_kill"] = trainer.model_version
            trainer.lora_sync_watch.bound = DOWN_BOUND_S
            server.kill()
            marks["killed_again"] = time.monotonic()

    try:
        with server, RecordingProxy(server.url) as proxy, \
                LoRASyncClient(server.url, api_key=API_KEY, timeout=10) as probe:
            trainer = trainer_for(model_dir, tmp_path, [server.url], API_KEY, lora_sync_name=name,
                                  lora_sync_restart_timeout=RESTART_BOUND_S,
                                  lora_sync_health_interval=1.0,
                                  config={"vllm_server_base_url": proxy.url, "max_steps": 12})
            trainer.add_callback(AfterSync(crash))
            try:
                with pytest.raises(ServerDown) as raised:
                    trainer.train()
                stopped = time.monotonic()
            finally:
                trainer.lora_sync_client.close()
                if restarted.ident is not None:  # started: a start is bounded by its timeout
                    restarted.join(timeout=server.start_timeout + 10)
            assert marks.get("restart_error", "never ran") is None, marks["restart_error"]
    finally:
        server.stop()

    # Stopped by the second kill, with the clear error, after the bound and soon after it.
    assert trainer.state.global_step == KILL_AGAIN_STEP
    err = raised.value
    assert err.server == server.url and server.url in str(err) and "unreachable" in str(err)
    assert "lora_sync_restart_timeout" in str(err) and "Restart the server" in str(err)
    took = stopped - marks["killed_again"]
    assert DOWN_BOUND_S <= took < DOWN_BOUND_S + 40, took
    # Rode out the restart: every step pushed its version, one after another, all on the
    # restarted server after the first kill, which the watch saw come back.
    pushed = [r.version for [r] in trainer.lora_sync_pushes]
    assert pushed == list(range(pushed[0], pushed[0] + KILL_AGAIN_STEP + 1)), pushed
    assert all(r.ok for [r] in trainer.lora_sync_pushes)
    assert pushed[-1] == marks["pushed_before_2nd_kill"] > marks["named"]
    # The watch saw the restart and gave the server back what it held: the version the
    # worker named and those before it in the servers' window (TRL's worker retries each
    # request with the version it named then).
    events = [e for e in trainer.lora_sync_watch.events if e["server"] == server.url]
    [back] = [e for e in events if e["restarted"]]
    keep = trainer.lora_sync_restore_versions
    assert back["resynced"] == [f"{name}-v{v}" for v in range(
        max(pushed[0], marks["named"] - keep + 1), marks["named"] + 1)], (back, marks)
    print(f"\nrestart: down {back['down_s']:.0f} s, resynced {back['resynced']}; ServerDown "
          f"{took:.0f} s after the second kill; versions pushed {pushed}")
    # The restarted server held the version the worker named (or a newer one) once it was
    # back: rollouts after the restart were served, each by exactly the version it named.
    assert marks["held_after_restart"] >= marks["named"], marks
    after = [c for c in proxy.calls if marks["up"] < c["t"] < marks["killed_again"]]
    served = [c for c in after if c["status"] == 200]
    assert served, after[-5:]
    for c in served:
        assert c["served"] == c["model"] == f"{name}-v{c['version']}", c
    assert {int(c["version"]) for c in served} <= set(pushed)
    for c in proxy.calls:  # nothing but 200s, 502s (server down) and 404s (not there yet)
        assert c["status"] in (200, 404, 502), c


@pytest.mark.timeout(180)
def test_callback_pushes_what_disk_serves(vllm, model_dir, tmp_path):
    """After step N the server's greedy output for the name equals the adapter saved at step N
    and loaded by the engine from disk."""
    from transformers import Trainer

    from lora_sync.integrations.transformers import LoRASyncCallback
    name, seen = "hf-cb", {}
    sync = LoRASyncCallback(vllm.url, name, every_n_steps=2, api_key=vllm.api_key)
    client = sync.client

    def probe(step, model):
        model.save_pretrained(tmp_path / f"step-{step}")
        reply = client.complete(PROMPT, name, 12, logprobs=1)
        seen[step] = (reply["text"], reply["version"], logprobs(reply))

    trainer = Trainer(model=peft_model(model_dir), args=hf_args(tmp_path / "out", max_steps=4),
                      train_dataset=lm_dataset(model_dir), callbacks=[sync, Probe(probe)])
    try:
        trainer.train()
        assert [p["step"] for p in sync.pushes] == [2, 4]
        base = logprobs(client.complete(PROMPT, "base", 12, logprobs=1))
        for step, (text, version, lps) in seen.items():
            assert version == sync.pushes[step // 2 - 1]["version"]
            served = f"{name}-disk{step}"
            client.load_from_disk(str(tmp_path / f"step-{step}"), served)
            try:
                reply = client.complete(PROMPT, disk_model(client, served), 12, logprobs=1)
            finally:
                client.unload_from_disk(served)
            assert text == reply["text"]
            assert max(abs(a - b) for a, b in zip(lps, logprobs(reply))) < 1e-4
            assert max(abs(a - b) for a, b in zip(lps, base)) > 1e-3  # a trained adapter
        assert seen[2][0] != seen[4][0] or seen[2][2] != seen[4][2]
    finally:
        client.retire(name)
        client.close()


def logprobs(reply) -> list[float]:
    return reply["raw"]["choices"][0]["logprobs"]["token_logprobs"]


# -- benchmarks/trl_bench.py's summary (no server) ------------------------------------------
def test_trl_bench_counts_what_a_pause_held():
    """A request in flight when /pause came and one sent while paused are held (with the
    time each spent inside the pause); one before and one after are not. TRL's names are
    renamed for the server, lora-sync's own are not touched by a run that does not rename."""
    from benchmarks.trl_bench import disk_name, summarize_run, table
    assert disk_name("trl-policy-v12") == "trl-policy-disk-12" and disk_name("base") == "base"

    def ev(path, t0, t1, status=200):
        return {"path": path, "t0": t0, "t1": t1, "status": status, "model": None}
    events = [ev("/v1/completions", 0.0, 1.0), ev("/pause", 2.0, 2.1),
              ev("/v1/completions", 1.5, 4.0), ev("/v1/completions", 2.5, 3.5, 500),
              ev("/v1/load_lora_adapter", 2.2, 2.8), ev("/resume", 2.9, 3.0),
              ev("/v1/completions", 5.0, 6.0)]
    syncs = [{"t0": 1.9, "t1": 3.1, "seconds": 1.2, "bytes": 100},
             {"t0": 7.0, "t1": 7.5, "seconds": 0.5, "bytes": 100}]
    history = [{"reward": 0.1}, {"reward": 0.5, "perf/step_s": 2.0, "perf/rollout_wait_s": 0.1}]
    row = summarize_run("trl", syncs, events, history, {"written": 200, "peak": 100, "left": 0})
    assert row["pauses"] == 1 and abs(row["paused_total_s"] - 1.0) < 1e-9
    held = row["held"]
    assert (held["requests"], held["in_flight_at_start"], held["sent_inside"]) == (2, 1, 1)
    assert abs(held["request_s_inside"] - (1.0 + 0.5)) < 1e-9
    assert row["through_syncs"]["requests"] == 2 and row["failed_requests"] == 1
    assert row["sync_cold_s"] == 1.2 and row["sync_median_s"] == 0.5  # cold one apart
    assert row["step_median_s"] == 2.0 and row["reward_last"] == 0.5
    quiet = summarize_run("lora-sync", syncs, [e for e in events if e["path"] not in
                                               ("/pause", "/resume")], history,
                          {"written": 0, "peak": 0, "left": 0})
    assert quiet["pauses"] == 0 and quiet["held"]["requests"] == 0
    text = table([row, quiet])
    assert "TRL 1.16 own adapter sync" in text and "| never |" not in text.split("\n")[0]
    assert text.count("\n") == 12
