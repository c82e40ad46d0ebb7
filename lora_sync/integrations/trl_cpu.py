"""TRL 1.16's AsyncGRPOTrainer on a CPU-only machine, which it does not support by itself:

    from lora_sync.integrations import trl_cpu
    trl_cpu.patch()          # before building the trainer; a CUDA machine keeps TRL's own code

  * its __init__ asks `torch.cuda.get_device_name` for the device's peak FLOPs (MFU metrics),
    which raises without CUDA: on CPU the lookup answers None (TRL's "unknown device": MFU
    metrics off, everything else logged);
  * its model attends with FlashAttention-3 kernels fetched from the Hub (CUDA / ROCm), over
    a packed prefix tree of the samples: `torch_tree_attention` computes the same in plain
    PyTorch, and TRL's trainer registers it instead.

`patch()` makes both changes for this process (the rollout worker's child process trains
nothing and needs neither). Needs only torch, transformers and trl (`pip install
"lora-sync[trl]"`). Every TRL name touched is in TOUCHED, checked against TRL's wheel with
lora_sync/integrations/trl.py's list (scripts/drift_check.py)."""
from __future__ import annotations

import torch

TOUCHED = [
    "trl.experimental.async_grpo:async_grpo_trainer",
    # replaced in async_grpo_trainer's namespace, where AsyncGRPOTrainer.__init__ calls them
    "trl.experimental.async_grpo.async_grpo_trainer:get_peak_flops_per_device(accelerator, "
    "dtype)",
    "trl.experimental.async_grpo.async_grpo_trainer:register_tree_attention()",
    # the attention name TRL's model is built with, and the call torch_tree_attention mirrors
    "trl.experimental.async_grpo.packing:TREE_ATTENTION",
    "trl.experimental.async_grpo.packing:tree_attention(module, query, key, value, "
    "attention_mask, *, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, "
    "tree_max_seqlen_q, tree_max_seqlen_k, scaling, sliding_window, softcap)",
]


def patch() -> None:
    """Lets TRL's AsyncGRPOTrainer be built and trained on CPU in this process (idempotent;
    a CUDA device keeps TRL's own behaviour)."""
    from trl.experimental.async_grpo import async_grpo_trainer as trainer
    if getattr(trainer.get_peak_flops_per_device, "lora_sync_cpu", False):
        return
    peak_flops, register = trainer.get_peak_flops_per_device, trainer.register_tree_attention

    def get_peak_flops_per_device(accelerator, dtype):
        return None if accelerator.device.type == "cpu" else peak_flops(accelerator, dtype)

    def register_tree_attention():
        register()
        if not torch.cuda.is_available():
            from transformers import AttentionInterface
            from trl.experimental.async_grpo.packing import TREE_ATTENTION
            AttentionInterface.register(TREE_ATTENTION, torch_tree_attention)

    get_peak_flops_per_device.lora_sync_cpu = True
    trainer.get_peak_flops_per_device = get_peak_flops_per_device
    trainer.register_tree_attention = register_tree_attention


def torch_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index,
                         tree_cu_seqlens_q, tree_cu_seqlens_k, tree_max_seqlen_q=None,
                         tree_max_seqlen_k=None, scaling=None, sliding_window=None,
                         softcap=None, **kwargs):
    """What TRL's `tree_attention` computes with FA3's varlen kernel: segment s of the packed
    row (queries cu_q[s]:cu_q[s+1]) attends causally, aligned at the end, to the keys at
    tree_kv_index[cu_k[s]:cu_k[s+1]] (its root-to-segment path)."""
    if softcap:
        raise NotImplementedError("torch_tree_attention: softcap is not supported")
    q = query.transpose(1, 2)[0]                                   # [N, H, D]
    k = key.transpose(1, 2)[0].index_select(0, tree_kv_index)     # [K, Hkv, D]
    v = value.transpose(1, 2)[0].index_select(0, tree_kv_index)
    if k.shape[1] != q.shape[1]:                                   # grouped-query attention
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    out = []
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)                # [H, lq, D]
        ks, vs = (x[cu_k[s]:cu_k[s + 1]].transpose(0, 1) for x in (k, v))
        lq, lk = qs.shape[1], ks.shape[1]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        if sliding_window:
            allowed &= ~torch.ones_like(allowed).tril(lk - lq - sliding_window)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=allowed, scale=scaling).transpose(0, 1))
    return torch.cat(out).unsqueeze(0), None
