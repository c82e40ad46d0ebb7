"""A small on-policy RL loop whose LoRA is synced into a live vLLM server every step.

    python -m examples.rl_loop --transport auto      # or shm | tensors | broadcast | disk | none

The trainer (this process) holds a tiny local causal LM with a PEFT LoRA. Each step it asks
the server for a group of sampled completions per prompt (model=<alias>), scores them, takes a
GRPO-style policy-gradient step on the LoRA, and pushes the new version to the server.
Reward: the fraction of generated tokens that contain the letter "e" (the base model is near
0.3; a policy that learns the task approaches 1). `--transport none` never syncs after the
first version: the server keeps sampling from the initial policy, so the reward stays flat.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lora_sync import LoRAAdapter, LoRASyncClient
from lora_sync.errors import LoRASyncError
from testbed.processes import vllm_server
from testbed.tiny_model import build_tiny_model

PROMPTS = ["the quick brown", "hello world,", "one two three", "a small model",
           "lora adapters are", "how are you"]


@dataclass
class LoopConfig:
    steps: int = 30
    transport: str = "auto"  # auto (shm on this host, else tensors) | shm | tensors | broadcast | disk | none
    prompts_per_step: int = 4
    group_size: int = 8
    max_tokens: int = 8
    lr: float = 3e-2
    rank: int = 8
    seed: int = 0
    name: str = "policy"
    server_url: str | None = None   # default: start a local vLLM CPU server
    engine: str = "vllm"            # vllm | sglang (sglang needs --server-url)
    model_dir: str | None = None    # default: the embedded tiny model
    api_key: str | None = None      # the server's LORA_SYNC_API_KEY, if it has one
    out_dir: str = "runs/rl_loop"
    progress: bool = True
    server_wait_s: float = 300.0    # how long a step waits for a restarted server


def target_tokens(tokenizer) -> torch.Tensor:
    """Token ids the reward likes: those whose text contains 'e'."""
    ids = [i for i in range(len(tokenizer)) if "e" in tokenizer.decode([i])]
    return torch.tensor(ids)


def make_policy(model_dir: Path, cfg: LoopConfig):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(cfg.seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=cfg.rank, lora_alpha=2 * cfg.rank,
                                             target_modules="all-linear", lora_dropout=0.0))
    return policy, AutoTokenizer.from_pretrained(model_dir)


def token_logprobs(policy, samples) -> list[torch.Tensor]:
    """Log-probs of each sample's completion tokens under the trainer's policy."""
    out = []
    for prompt_ids, completion_ids in samples:
        ids = torch.tensor([prompt_ids + completion_ids])
        logits = policy(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1)
        out.append(logp.gather(1, torch.tensor(completion_ids)[:, None])[:, 0])
    return out


def logprob_mismatch(trainer: list[torch.Tensor], server: list[list[float]]) -> float:
    """Mean |trainer - server| log-prob of the sampled tokens. Near 0 when the server ran
    exactly the policy the trainer pushed; a stale or corrupted sync shows up here first."""
    diffs = [(t.detach() - torch.tensor(s, dtype=t.dtype)).abs() for t, s in zip(trainer, server)]
    return torch.cat(diffs).mean().item()


class Restarts:
    """Rides out a server restart (crash, preemption, redeploy) inside a step: waits until
    the server answers again, gives it the newest version back (client.resync) and retries.
    Bounded by `server_wait_s`; any other error is raised as it is."""

    def __init__(self, client: LoRASyncClient, wait_s: float):
        self.client, self.wait_s, self.events = client, wait_s, []

    def run(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LoRASyncError as e:
            # 5xx/unreachable: the server is down; 404: it is up but lost the alias.
            if e.status < 500 and e.code not in ("not_found", "push_failed"):
                raise
            self.recover(e)
            return fn(*args, **kwargs)

    def recover(self, error: LoRASyncError) -> None:
        t0 = time.monotonic()
        while not all(h["ok"] for h in self.client.health()):
            if time.monotonic() - t0 > self.wait_s:
                raise TimeoutError(f"the server did not come back within {self.wait_s:g} s "
                                   f"after: {error}") from error
            time.sleep(1.0)
        resynced = self.client.resync()
        self.events.append({"error": f"{error.code}: {error.message[:200]}",
                            "down_s": time.monotonic() - t0,
                            "resynced": [n for r in resynced for n in r["pushed"]]})


class Syncer:
    """Pushes the policy's LoRA with the chosen transport; returns (served name, seconds)."""

    def __init__(self, client: LoRASyncClient, cfg: LoopConfig, scratch: Path):
        self.client, self.cfg, self.scratch = client, cfg, scratch
        self.version = 0
        if cfg.transport == "broadcast":
            client.init_group()

    def push(self, policy) -> tuple[str, float]:
        t0 = time.perf_counter()
        adapter = LoRAAdapter.from_peft_model(policy)
        if self.cfg.transport == "disk":
            self.version += 1
            path = self.scratch / f"v{self.version}"
            policy.save_pretrained(path)
            served = f"{self.cfg.name}-disk{self.version}"  # -v<N> names are lora-sync's
            self.client.load_from_disk(str(path), served)
            if self.version > 1:  # the previous version's rollouts are done: unload it
                self.client.unload_from_disk(f"{self.cfg.name}-disk{self.version - 1}")
        else:
            transport = "auto" if self.cfg.transport == "none" else self.cfg.transport
            [res] = self.client.push(adapter, self.cfg.name, transport=transport)
            self.version, served = res.version, self.cfg.name  # request the alias
        return served, time.perf_counter() - t0


def run(cfg: LoopConfig, server=None, on_step=None) -> dict:
    """Runs the loop; `on_step(step)` is called after each step (tests use it to kill and
    restart the server mid-run)."""
    torch.set_num_threads(1)  # two cores: one for the server, one for the trainer
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="lora-sync-rl-"))
    # The trainer and the server must share the base model: the embedded tiny model is
    # built deterministically, so a server started on it elsewhere matches too.
    model_dir = Path(cfg.model_dir) if cfg.model_dir else build_tiny_model(scratch / "model")
    own_server = None
    if cfg.server_url is None and server is None:
        print("starting a vLLM CPU server (about a minute)...", flush=True)
        own_server = server = vllm_server(model_dir).start()
    url = cfg.server_url or server.url
    policy, tokenizer = make_policy(model_dir, cfg)
    targets = target_tokens(tokenizer)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
    log = {"config": asdict(cfg), "steps": []}
    client = LoRASyncClient(url, engine=cfg.engine, api_key=cfg.api_key)
    restarts = Restarts(client, cfg.server_wait_s)
    try:
        syncer = Syncer(client, cfg, scratch)
        served, sync_s = syncer.push(policy)  # version 1: the initial policy
        steps = range(cfg.steps)
        if cfg.progress:
            from tqdm import tqdm
            steps = tqdm(steps, desc=f"RL ({cfg.transport})", unit="step")
        for step in steps:
            prompts = [PROMPTS[(step * cfg.prompts_per_step + i) % len(PROMPTS)]
                       for i in range(cfg.prompts_per_step)]
            events_before = len(restarts.events)
            reply = restarts.run(client.completions, model=served, prompt=prompts,
                                 n=cfg.group_size, max_tokens=cfg.max_tokens, temperature=1.0,
                                 seed=cfg.seed * 100003 + step, return_token_ids=True,
                                 logprobs=1)
            samples, rewards, server_logprobs = [], [], []
            for choice in reply["choices"]:
                prompt_ids = reply["choices"][choice["index"]].get("prompt_token_ids") \
                    or choice["prompt_token_ids"]
                ids = choice["token_ids"] or [tokenizer.eos_token_id]
                samples.append((prompt_ids, ids))
                server_logprobs.append(choice["logprobs"]["token_logprobs"][:len(ids)])
                rewards.append(torch.isin(torch.tensor(ids), targets).float().mean().item())
            r = torch.tensor(rewards).view(cfg.prompts_per_step, cfg.group_size)
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
            logprobs = token_logprobs(policy, samples)
            loss = -(adv * torch.stack([lp.sum() for lp in logprobs])).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            served_version = reply["served_version"] or syncer.version
            if cfg.transport != "none":
                served, sync_s = restarts.run(syncer.push, policy)
            entry = {"step": step, "reward": r.mean().item(), "sync_s": sync_s,
                     "rollout_version": served_version, "pushed_version": syncer.version,
                     "loss": loss.item(),
                     "logprob_mismatch": logprob_mismatch(logprobs, server_logprobs),
                     "restarts": restarts.events[events_before:]}
            log["steps"].append(entry)
            if on_step is not None:
                on_step(step)
            if cfg.progress:
                steps.set_postfix(reward=f"{entry['reward']:.2f}", sync=f"{sync_s*1e3:.0f}ms",
                                  version=syncer.version,
                                  mismatch=f"{entry['logprob_mismatch']:.0e}")
        log["samples"] = {m: client.complete(PROMPTS[0], m, cfg.max_tokens)["text"]
                          for m in ("base", served)}
    finally:
        client.close()
        if own_server is not None:
            own_server.stop()
        shutil.rmtree(scratch, ignore_errors=True)  # the saved versions (disk) and built model
    (out / f"log_{cfg.transport}.json").write_text(json.dumps(log, indent=1))
    plot(log, out / f"reward_{cfg.transport}.png")
    return log


def summary(log: dict, k: int = 5) -> tuple[float, float]:
    """Mean reward over the first and the last k steps."""
    r = [s["reward"] for s in log["steps"]]
    return statistics.mean(r[:k]), statistics.mean(r[-k:])


def plot(log: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [s["step"] for s in log["steps"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [s["reward"] for s in log["steps"]], marker=".")
    a.set(xlabel="step", ylabel="mean reward", title=f"reward ({log['config']['transport']})",
          ylim=(0, 1))
    b.plot(steps, [s["sync_s"] * 1e3 for s in log["steps"]], marker=".", color="tab:orange")
    b.set(xlabel="step", ylabel="ms", title="LoRA sync time per step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for f, v in asdict(LoopConfig()).items():
        if isinstance(v, bool):
            p.add_argument(f"--no-{f.replace('_', '-')}", dest=f, action="store_false")
        else:
            p.add_argument(f"--{f.replace('_', '-')}", type=type(v) if v is not None else str,
                           default=v)
    cfg = LoopConfig(**vars(p.parse_args()))
    log = run(cfg)
    first, last = summary(log)
    syncs = [s["sync_s"] for s in log["steps"]]
    print(f"mean reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f}; "
          f"median sync {statistics.median(syncs)*1e3:.1f} ms ({cfg.transport}); worst "
          f"trainer-server log-prob mismatch {max(s['logprob_mismatch'] for s in log['steps']):.1e}")
    for model, text in log["samples"].items():
        print(f"greedy {model!r:>12}: {PROMPTS[0]!r} -> {text!r}")
    print(f"log: {cfg.out_dir}/log_{cfg.transport}.json  plot: {cfg.out_dir}/reward_{cfg.transport}.png")


if __name__ == "__main__":
    main()
