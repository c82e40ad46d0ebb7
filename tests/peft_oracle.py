"""PEFT's own forward pass as the oracle for what an adapter must serve: adapters built by
PEFT from a LoraConfig (rank_pattern, alpha_pattern, use_rslora, layers_to_transform, ...),
random non-zero weights, and PEFT's greedy decode in float32 of the prompt the server tests
send (tests/helpers.PROMPT)."""
from __future__ import annotations

import functools

import torch

from lora_sync import LoRAAdapter


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def peft_model(model_dir, seed: int, **lora_config):
    """A PEFT model over the tiny base model, `lora_config` as LoraConfig's arguments
    (target_modules defaults to all-linear), its LoRA weights random and non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from testbed.tiny_model import randomize_lora
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = LoraConfig(**{"target_modules": "all-linear", "lora_dropout": 0.0, **lora_config})
    model = get_peft_model(base, config)
    randomize_lora(model, seed)
    return model.eval()


def peft_greedy(model, model_dir, prompt: str, n: int) -> list[int]:
    """The token ids of PEFT's greedy continuation: what a server's greedy completion of
    `prompt` with `n` tokens must return (the same tokenizer, special tokens added the same
    way). Ids, not text: the random model emits partial UTF-8 sequences, which a server's
    incremental detokenizer holds back at the end of a completion and decode() does not."""
    tok = _tokenizer(str(model_dir))
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return out[0, ids["input_ids"].shape[1]:].tolist()


def server_greedy(client, model: str, prompt: str, n: int) -> list[int]:
    """A server's greedy completion, as token ids (return_token_ids: vLLM and SGLang)."""
    body = client.complete(prompt, model, n, return_token_ids=True)["raw"]
    return list(body["choices"][0]["token_ids"])


def oracle(model_dir, seed: int, prompt: str, n: int, **lora_config):
    """(the adapter as lora-sync sends it, PEFT's greedy token ids for it)."""
    model = peft_model(model_dir, seed, **lora_config)
    adapter = LoRAAdapter.from_peft_model(model)
    adapter = LoRAAdapter({k: v.clone() for k, v in adapter.tensors.items()}, adapter.config)
    return adapter, peft_greedy(model, model_dir, prompt, n)


def scalings(model) -> dict[str, tuple[int, float]]:
    """PEFT's (rank, scaling) of each adapted module, by its name in the adapter's keys."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "scaling") and isinstance(getattr(module, "r", None), dict) \
                and "default" in module.r:
            out[name.removeprefix("base_model.model.")] = (module.r["default"],
                                                           module.scaling["default"])
    return out
