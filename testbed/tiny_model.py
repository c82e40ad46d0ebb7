"""A tiny causal LM (Llama architecture) and tokenizer built locally, for demos, tests and
quick benchmarks. Nothing is downloaded: the tokenizer is trained on a built-in text and the
weights are random with a fixed seed, so every machine builds the same model."""
from __future__ import annotations

import os
from pathlib import Path

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. a small model learns to say yes. "
    "lora adapters are synced from the trainer into the inference server every step. "
    "one two three four five six seven eight nine ten. hello world, how are you today? "
) * 8

# head_dim = hidden / heads = 32: vLLM's CPU attention refuses head_dim 16.
TINY_CONFIG = dict(
    vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _build_tokenizer(out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    # The chat-shaped routes (/v1/chat/completions, /v1/responses, /v1/messages) need one.
    fast.chat_template = ("{% for m in messages %}{{ m['content'] if m['content'] is string "
                          "else m['content'] | map(attribute='text') | join(' ') }} "
                          "{% endfor %}")
    fast.save_pretrained(out)
    return fast


# The shapes of Qwen2.5-0.5B (random weights), for benchmarks at a realistic adapter size.
QWEN_05B_SHAPES = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
    tie_word_embeddings=True)


# A tiny Qwen3-MoE: 8 routed experts, top-2, on every layer (the MoE rows of the coverage
# matrix, docs/coverage.md).
TINY_MOE_CONFIG = dict(
    TINY_CONFIG, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, dtype: str = "float32",
                     arch: str = "llama", **overrides) -> Path:
    """Writes a model (`arch`: "llama", or "qwen3_moe" for the MoE one; tiny unless
    `overrides` say otherwise) + tokenizer to `out_dir` (once) and returns the path."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls, base = {
        "llama": (LlamaConfig, LlamaForCausalLM, TINY_CONFIG),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, TINY_MOE_CONFIG)}[arch]
    cfg = dict(base, **overrides)
    tok = _build_tokenizer(out, min(cfg["vocab_size"], TINY_CONFIG["vocab_size"]))
    torch.manual_seed(seed)
    config = config_cls(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        torch_dtype=dtype, **cfg)
    model = model_cls(config).to(getattr(torch, dtype))
    # Larger-than-default init so greedy output is varied rather than one repeated token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # linear weights and (MoE) 3-D expert stacks
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_lora(model_dir: str | os.PathLike, rank: int = 8, seed: int = 1,
              target_modules="all-linear", scale: float = 0.5):
    """Returns a PEFT model with non-zero random LoRA weights (B is zero in a fresh PEFT
    LoRA, which would make every adapter equal to the base model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=target_modules, lora_dropout=0.0))
    randomize_lora(peft_model, seed, scale)
    return peft_model


def randomize_lora(peft_model, seed: int, scale: float = 0.5) -> None:
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
