"""TEST-ONLY stand-ins so SGLang 0.5.23 runs routed-expert (MoE) LoRA on a CPU-only
machine. SGLang's MoE-LoRA path is Triton/CUDA only:
  * FusedMoEWithLoRA always runs MoeRunner(TRITON, lora_enabled=True) -> pre_permute ->
    try_get_optimal_moe_config -> get_device_name() is None on CPU (AttributeError), and the
    Triton fused-MoE GEMM kernels cannot run on CPU;
  * lora_moe_runners.moe_lora_align_block_size is only imported on CUDA/HIP/XPU (NameError on
    CPU once M*top_k*8 > num_experts*max_loras, i.e. any prefill over 4 tokens here);
  * kernels.ops.lora.moe.fused_moe_lora_kernel.fused_moe_lora is a Triton kernel.
Each stand-in below is plain PyTorch with the semantics of the kernel it replaces, and is
installed only when no accelerator is present. Everything else (adapter parsing and
normalisation, memory-pool buffers, scaling, token->adapter mapping, the alignment, the
gate/up slicing in _add_lora_gate_up_delta, the hook call points) is SGLang's own code."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_lora_standin(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked,
                           topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                           max_lora_rank, top_k_num, lora_ids, adapter_enabled,
                           shrink_block_size_m, *_block_args, mul_routed_weight=False,
                           fully_sharded=False, offset=0, **_kw):
    """Semantics of sglang/kernels/ops/lora/moe/fused_moe_lora_kernel.py::_fused_moe_lora
    (shrink then expand, per (adapter, aligned block of one expert))."""
    assert not fully_sharded
    M = topk_weights.shape[0]
    num_valid = M * top_k_num
    expanded = qcurr_hidden_states.shape[0] == num_valid  # down path: rows are (token, k)
    bm = shrink_block_size_m
    n_out = lora_b_stacked[0].shape[2]
    out2 = output.view(num_valid, output.shape[-1])
    w_flat = topk_weights.reshape(-1)
    for li in range(lora_ids.shape[0]):
        lora_id = int(lora_ids[li])
        if lora_id == -1 or int(adapter_enabled[lora_id]) == 0:
            continue
        ntpp = int(num_tokens_post_padded[lora_id])
        for m in range((ntpp + bm - 1) // bm):
            e = int(expert_ids[lora_id, m])
            if e == -1:
                continue
            toks = sorted_token_ids[lora_id, m * bm:(m + 1) * bm].long()
            toks = toks[toks < num_valid]
            if toks.numel() == 0:
                continue
            x = qcurr_hidden_states[toks if expanded else toks // top_k_num]
            for s, (a_w, b_w) in enumerate(zip(lora_a_stacked, lora_b_stacked)):
                mid = (x.float() @ a_w[lora_id, e, :max_lora_rank].float().T).to(output.dtype)
                delta = mid.float() @ b_w[lora_id, e, :, :max_lora_rank].float().T
                if mul_routed_weight:
                    delta = delta * w_flat[toks].float()[:, None]
                out2[toks, s * n_out + offset:(s + 1) * n_out + offset] += delta.to(output.dtype)


def moe_lora_align_block_size_standin(topk_ids, seg_indptr, req_to_lora, num_experts,
                                      block_size_m, max_loras, max_num_tokens_padded,
                                      max_num_m_blocks, sorted_token_ids, expert_ids,
                                      num_tokens_post_padded, adapter_enabled, lora_ids,
                                      cumsum_buffer=None, token_mask=None):
    """The CUDA op's outputs, computed by SGLang's own CPU helper
    (lora_moe_runners._naive_moe_lora_align_block_size), written into the given buffers."""
    from sglang.srt.lora.lora_moe_runners import _naive_moe_lora_align_block_size
    s, e, n = _naive_moe_lora_align_block_size(
        topk_ids, seg_indptr, req_to_lora, num_experts, block_size_m, max_loras,
        max_num_tokens_padded, max_num_m_blocks, adapter_enabled, topk_ids.device)
    sorted_token_ids.copy_(s)
    expert_ids.copy_(e)
    num_tokens_post_padded.copy_(n)


def make_torch_moe_runner_core(config):
    """A DispatchMoeRunnerCore for the built-in name "triton" (SGLang's
    register_moe_runner_core accepts built-in names): the unquantised gated-SiLU expert GEMMs
    of _fused_moe_kernel_sequence in PyTorch, with the LoRA hooks called at the same points and
    with the same tensors (after_gate_up on (M, top_k, 2I); after_down on the (M*top_k, I)
    activations and the routed-weighted (M, top_k, H) outputs, before the top-k sum)."""
    from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    class TorchMoeRunnerCoreStandin(DispatchMoeRunnerCore):
        @property
        def runner_backend(self):
            return MoeRunnerBackend.TRITON

        def run_from_dispatch(self, dispatch_output, quant_info, runner_config, hooks=None):
            cfg = runner_config
            assert cfg.activation == "silu" and cfg.is_gated, cfg
            assert not cfg.apply_router_weight_on_input and cfg.gemm1_alpha is None
            assert getattr(quant_info, "b13", None) is None and getattr(quant_info, "b2", None) is None
            x = dispatch_output.hidden_states
            topk_weights, topk_ids, _ = dispatch_output.topk_output
            assert bool((topk_ids >= 0).all()), "dropped routes not supported by the stand-in"
            M, top_k = topk_ids.shape
            w13, w2 = quant_info.w13_weight, quant_info.w2_weight  # (E, 2I, H), (E, H, I)
            ids = topk_ids.long()
            cache1 = torch.einsum("mh,mkoh->mko", x, w13[ids])
            if hooks and hooks.after_gate_up:
                hooks.after_gate_up(x, cache1, topk_weights, topk_ids)
            gate, up = cache1.chunk(2, dim=-1)
            cache2 = (F.silu(gate) * up).reshape(M * top_k, -1)
            cache3 = torch.einsum("ti,thi->th", cache2, w2[ids.reshape(-1)]).view(M, top_k, -1)
            cache3 = cache3 * topk_weights.to(cache3.dtype)[..., None]
            if hooks and hooks.after_down:
                hooks.after_down(cache2, cache3, topk_weights, topk_ids)
            out = cache3.sum(dim=1)
            if cfg.routed_scaling_factor not in (None, 1.0):
                out = out * cfg.routed_scaling_factor
            return StandardCombineInput(hidden_states=out)

    return TorchMoeRunnerCoreStandin(config)
