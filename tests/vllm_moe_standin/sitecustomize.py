"""TEST-ONLY startup patch: lets vLLM CPU serve MoE models with --enable-lora (tests only).

vLLM 0.32.0 picks the Triton MoE experts whenever LoRA is enabled
(vllm/model_executor/layers/fused_moe/oracle/unquantized.py:234-248, no platform check), so
on a CPU build the first forward pass of any request -- base model included -- dies in
TritonExperts.apply (experts/triton_moe.py:322, ``tl.float32`` on the Triton placeholder),
and past that in the Triton GEMM, moe_align_block_size and the Punica MoE-LoRA kernels.

Python imports ``sitecustomize`` at startup in every process whose PYTHONPATH holds this
directory (API server, EngineCore, workers). Nothing is patched at startup: an import hook
waits for ``vllm.model_executor.layers.fused_moe.experts.triton_moe`` to be executed and,
only without an accelerator, replaces ``TritonExperts.apply`` with a pure-torch version:
per-expert GEMMs, SiLU-and-mul, the expert LoRA deltas (w13 and w2, read from the
MoELoRAContext the LoRA layer sets, token -> slot from the Punica wrapper) and the top-k
weighted sum. Unquantized weights, no expert parallelism, no fully sharded LoRA.
"""
import importlib.abc
import importlib.machinery
import sys

_TRIGGER = "vllm.model_executor.layers.fused_moe.experts.triton_moe"


def _torch_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                 global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                 expert_tokens_meta, apply_router_weight_on_input):
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    if self.quant_dtype is not None or getattr(self, "w1_scale", None) is not None:
        raise NotImplementedError("vllm_moe_standin: quantized MoE is not implemented")
    ctx = self._lora_context
    if ctx is not None and ctx.fully_sharded and ctx.tp_size > 1:
        raise NotImplementedError("vllm_moe_standin: fully sharded MoE LoRA is not implemented")

    x = hidden_states
    M, K = x.shape
    topk = topk_ids.shape[1]
    N = w1.shape[1]
    tok = torch.arange(M, device=x.device).repeat_interleave(topk)       # (M*topk,)
    eid = topk_ids.reshape(-1).long()
    if expert_map is not None:
        eid = expert_map[eid].long()                                       # -1: not local
    groups = [(int(e), (eid == e).nonzero().squeeze(1)) for e in eid.unique().tolist() if e >= 0]

    # LoRA: slot of each (token, k) row; -1 = no adapter.
    slot = None
    if ctx is not None:
        lx = ctx.original_hidden_states
        lx = lx if lx is not None and lx.shape[0] == M else x
        idx = ctx.local_token_lora_mapping
        if idx is None:
            idx = ctx.punica_wrapper.token_lora_indices
        idx = idx[:M].long()
        if idx.shape[0] < M:
            idx = torch.cat([idx, idx.new_full((M - idx.shape[0],), -1)])
        slot = idx[tok]

        def lora_pairs(rows):
            for s in slot[rows].unique().tolist():
                if s >= 0 and int(ctx.adapter_enabled[s]):
                    yield s, rows[slot[rows] == s]

    def expand(t):  # shared (expert-dim 1) factors -> per expert
        return t.expand(-1, ctx.local_num_experts, -1, -1) if t.shape[1] == 1 else t

    h1 = x.new_zeros(M * topk, N)
    for e, rows in groups:
        h1[rows] = F.linear(x[tok[rows]], w1[e], None if self.w1_bias is None else self.w1_bias[e])
        if slot is not None:
            for s, r in lora_pairs(rows):
                xin = lx[tok[r]]
                col = 0
                for a, b in zip(ctx.w13_lora_a_stacked, ctx.w13_lora_b_stacked):
                    a, b = expand(a)[s, e], expand(b)[s, e]                 # (r, K), (n, r)
                    h1[r, col:col + b.shape[0]] += F.linear(F.linear(xin.to(a.dtype), a), b).to(h1.dtype)
                    col += b.shape[0]

    if activation == MoEActivation.SILU and self.activation_config.clamp_limit is None:
        h2 = F.silu(h1[:, : N // 2]) * h1[:, N // 2:]
    else:
        h2 = x.new_empty(M * topk, self.adjust_N_for_activation(N, activation))
        self.activation(activation, h2, h1)

    h3 = x.new_zeros(M * topk, K)
    for e, rows in groups:
        y = F.linear(h2[rows], w2[e], None if self.w2_bias is None else self.w2_bias[e])
        if not apply_router_weight_on_input:
            y = y * topk_weights.reshape(-1)[rows, None].to(y.dtype)
        h3[rows] = y
        if slot is not None:  # GPU kernel: mul_routed_weight=True for the w2 LoRA delta
            a_all, b_all = ctx.w2_lora_a_stacked[0], expand(ctx.w2_lora_b_stacked[0])
            for s, r in lora_pairs(rows):
                d = F.linear(F.linear(h2[r].to(a_all.dtype), a_all[s, e]), b_all[s, e])
                h3[r] += (d * topk_weights.reshape(-1)[r, None].to(d.dtype)).to(h3.dtype)
    output.copy_(h3.view(M, topk, K).sum(1))


def _patch(module):
    import torch
    try:
        has_accel = torch.accelerator.is_available()
    except AttributeError:
        has_accel = torch.cuda.is_available()
    if has_accel:
        return
    module.TritonExperts.apply = _torch_apply
    module.TritonExperts._lora_sync_torch_standin = True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _MoEStandinHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TRIGGER:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if not any(isinstance(f, _MoEStandinHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _MoEStandinHook())
