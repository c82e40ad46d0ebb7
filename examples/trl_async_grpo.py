"""TRL's AsyncGRPOTrainer with lora-sync, on this repo's tiny local model and a vLLM CPU server.

    python -m examples.trl_async_grpo                  # starts a vLLM CPU server, trains 16 steps
    python -m examples.trl_async_grpo --server-url http://127.0.0.1:8000 --model-dir DIR

The only lora-sync line is the import of AsyncGRPOTrainer (plus `lora_sync_*` arguments for
a server that is not the config's `vllm_server_base_url`, or has an API key). Reward: the
fraction of completion tokens containing the letter "e" (about 0.12 for the initial policy).
On a CPU-only machine `lora_sync.integrations.trl_cpu.patch()` lets TRL's trainer run at all
(TRL 1.16 needs CUDA for its attention kernels and MFU metrics).

One run here (2-core CPU VM, about 75 s with the server's start):
    reward per step: 0.12 0.11 0.12 0.14 0.23 0.34 0.46 0.73 0.92 0.93 0.89 0.95 0.95 0.94 0.98 0.97
    pushed trl-policy-v1..v17 (shm); median sync 39 ms; nothing written under .../.vllm_lora: True
"""
from __future__ import annotations

import argparse
import functools
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model and tokenizer are local

PROMPTS = ["the quick brown", "hello world,", "one two three", "a small model",
           "lora adapters are", "how are you"]
# TRL's rollout worker parses completions with the tokenizer's response template; the tiny
# tokenizer's chat template is none TRL knows: plain text after the prompt, up to </s>.
PLAIN_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor_pattern": r" $",
                  "fields": {"content": {"close_pattern": r"</s>\s*", "content": "text"}}}


def token_reward(completions, completion_ids, targets=frozenset(), **kwargs):
    """Fraction of each completion's tokens in `targets` (module level: TRL scores rollouts
    in a spawned process, which unpickles this)."""
    return [sum(t in targets for t in ids) / max(len(ids), 1) for ids in completion_ids]


def trainer_arguments(model_dir: str, server_url: str, steps: int, out_dir: str,
                      seed: int = 42) -> dict:
    """AsyncGRPOTrainer's arguments for this demo (TRL's own trainer takes the same)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.response_template = PLAIN_TEMPLATE
    targets = frozenset(i for i in range(len(tokenizer)) if "e" in tokenizer.decode([i]))
    return dict(
        model=model_dir,
        reward_funcs=functools.partial(token_reward, targets=targets),
        args=AsyncGRPOConfig(
            output_dir=out_dir, vllm_server_base_url=server_url, max_steps=steps,
            per_device_train_batch_size=32, num_generations=8, max_completion_length=8,
            # a fast demo: a high learning rate, and no ratio clipping (with this rate the
            # default epsilon=0.2 clips about 40% of the tokens and the reward rises slowly)
            learning_rate=5e-2, epsilon=100.0, max_staleness=1, token_budget=-1, seed=seed,
            bf16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
            save_strategy="no", disable_tqdm=True),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}]
                                                    for p in PROMPTS]}),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                               lora_dropout=0.0))


def train(model_dir: str, server_url: str, api_key: str | None, steps: int, out_dir: str):
    import torch

    from lora_sync.integrations.trl import AsyncGRPOTrainer  # the one-line change
    if not torch.cuda.is_available():
        from lora_sync.integrations import trl_cpu
        trl_cpu.patch()
    trainer = AsyncGRPOTrainer(**trainer_arguments(model_dir, server_url, steps, out_dir),
                               lora_sync_api_key=api_key)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    syncs = [h["perf/weight_sync_s"] for h in trainer.state.log_history
             if "perf/weight_sync_s" in h]
    print(f"reward per step: {' '.join(f'{r:.2f}' for r in rewards)}")
    print(f"pushed trl-policy-v{trainer.lora_sync_pushes[0][0].version}.."
          f"v{trainer.model_version} ({trainer.lora_sync_pushes[-1][0].transport}); median sync "
          f"{sorted(syncs)[len(syncs) // 2] * 1e3:.0f} ms; nothing written under "
          f"{Path(out_dir) / '.vllm_lora'}: {not (Path(out_dir) / '.vllm_lora').exists()}")
    trainer.lora_sync_client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--server-url", help="a vLLM server with lora-sync (default: start one)")
    p.add_argument("--model-dir", help="its model (default: build the tiny model)")
    p.add_argument("--api-key", default=os.environ.get("LORA_SYNC_API_KEY"))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out-dir", default="runs/trl_async_grpo")
    a = p.parse_args()
    from testbed.processes import vllm_server
    from testbed.tiny_model import build_tiny_model
    model_dir = a.model_dir or str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    if a.server_url:
        train(model_dir, a.server_url, a.api_key, a.steps, a.out_dir)
        return
    print("starting a vLLM CPU server (about a minute)...", flush=True)
    with vllm_server(model_dir) as server:
        train(model_dir, server.url, None, a.steps, a.out_dir)


if __name__ == "__main__":
    main()
