"""Routed experts (MoE): the form lora-sync syncs their LoRA in, and the conversion from
PEFT's.

Transformers 5 keeps an MoE layer's experts as fused 3-D parameters (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]), and PEFT adapts them with `target_parameters`,
saving one lora_A [E*r, in] / lora_B [out, r*E] pair per parameter. The engines read another
form: one 2-D pair per expert and projection, `<experts>.<e>.gate_proj.lora_A.weight` [r, H]
and so on (vLLM 0.32's FusedMoEWithLoRA, SGLang 0.5.23's mem_pool). PEFT loads that form back
as the same adapter (its transformers-5 weight conversion), so it is the one lora-sync
checks and sends; `per_expert` converts PEFT's into it on the trainer side."""
from __future__ import annotations

import re

import torch

from .errors import BadAdapter

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_layers(model) -> dict[str, tuple[int, int, int]]:
    """{experts module name: (experts, hidden, intermediate)} of a transformers model's fused
    expert modules (gate_up_proj [E, 2I, H] and down_proj [E, H, I]; a transposed layout is
    left out, so its experts are not LoRA-able here)."""
    out = {}
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
                and gate_up.dim() == 3 and down.dim() == 3) or getattr(module, "is_transposed",
                                                                       False):
            continue
        experts, two_i, hidden = gate_up.shape
        if down.shape == (experts, hidden, two_i // 2) and two_i % 2 == 0:
            out[name] = (experts, hidden, two_i // 2)
    return out


def block_of(experts: dict[str, tuple[int, int, int]], module: str) -> str | None:
    """The MoE block (the experts' parent) `module` lies in, None outside every block. In a
    block only the routed experts are LoRA-able here (expert_layer): neither engine's LoRA
    path on its router or shared experts (SGLang names them like the routed ones) was
    checked against PEFT's, so those are refused rather than guessed."""
    for prefix in experts:
        block = prefix.rpartition(".")[0]
        if module.startswith(block + "."):
            return block
    return None


def expert_of(experts: dict[str, tuple[int, int, int]], module: str):
    """(experts module, expert index as written, projection) of
    '<experts>.<e>.<projection>', None when `module` is not one."""
    parent, _, projection = module.rpartition(".")
    prefix, _, index = parent.rpartition(".")
    if projection not in PROJECTIONS or prefix not in experts:
        return None
    return prefix, index, projection


def expert_layer(experts: dict[str, tuple[int, int, int]], module: str):
    """(fan in, fan out) of '<experts>.<e>.<projection>', None when it is not one; an expert
    index out of range is refused by name."""
    parts = expert_of(experts, module)
    if parts is None:
        return None
    prefix, index, projection = parts
    count, hidden, inter = experts[prefix]
    if not (index.isdigit() and str(int(index)) == index and int(index) < count):
        raise BadAdapter(f"module {module!r}: expert index {index[:20]!r} is not one of the "
                         f"{count} experts of {prefix!r} (0 to {count - 1})",
                         code="unknown_module")
    return (inter, hidden) if projection == "down_proj" else (hidden, inter)


_PEFT_PARAM_KEY = re.compile(r"^(?P<wrapper>(?P<prefix>.*\.experts)(?:\.base_layer)*)"
                             r"\.lora_(?P<half>[AB])\.weight$")


def peft_parameter_wrappers(peft_model, adapter_name: str = "default") -> dict:
    """{wrapper name as in the adapter's keys: (parameter name, experts)} of a PEFT model's
    target_parameters wrappers (PEFT's ParamWrapper; nested ones sit under `base_layer`)."""
    out = {}
    for name, module in peft_model.named_modules():
        parameter = getattr(module, "parameter_name", None)
        if isinstance(parameter, str) and adapter_name in getattr(module, "lora_A", {}):
            out[name] = (parameter, int(getattr(module, "num_experts", 1)))
    return out


def per_expert(tensors: dict[str, torch.Tensor], config: dict,
               wrappers: dict[str, tuple[str, int]]) -> tuple[dict, dict]:
    """A PEFT adapter with `target_parameters` on fused experts, as per-expert 2-D pairs.
    `wrappers`: peft_parameter_wrappers of the model it came from (PEFT's keys do not name
    the parameter). Expert e of a parameter gets A[e*r:(e+1)*r] and the columns e, E+e, ...
    of B (PEFT's ParamWrapper: A is expert-major, B's columns rank-major); gate_up_proj's B
    splits into gate_proj (its first half of rows) and up_proj, which share A. Other tensors
    pass as they are."""
    targets = config.get("target_parameters") or []
    if not targets:
        return tensors, config
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise BadAdapter("adapter_config target_parameters with rank_pattern/alpha_pattern "
                         "cannot be converted to per-expert LoRA", code="unsupported_module")
    r = int(config["r"])
    out, projections = {}, set()
    for key, t in tensors.items():
        m = _PEFT_PARAM_KEY.match(key)
        if m is None:
            out[key] = t
            continue
        param, count = next((v for k, v in wrappers.items()
                             if k == m["wrapper"] or k.endswith("." + m["wrapper"])),
                            (None, 0))
        parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(param)
        size = t.shape[0] if m["half"] == "A" else t.shape[1]
        if parts is None or t.dim() != 2 or size != count * r:
            raise BadAdapter(f"tensor {key!r}: not LoRA on a fused expert parameter "
                             f"gate_up_proj / down_proj of {count or 'known'} experts at rank {r}",
                             code="unsupported_module")
        for e in range(count):
            if m["half"] == "A":
                halves = [t[e * r:(e + 1) * r]] * len(parts)
            else:
                halves = t[:, e::count].chunk(len(parts), dim=0)  # rank i: column i * E + e
            for projection, half in zip(parts, halves):
                out[f"{m['prefix']}.{e}.{projection}.lora_{m['half']}.weight"] = \
                    half.contiguous().clone()
        projections.update(parts)
    cfg = {k: v for k, v in config.items() if k != "target_parameters"}
    modules = cfg.get("target_modules")
    if isinstance(modules, (list, set, tuple)):
        cfg["target_modules"] = sorted(set(modules) | projections)
    return out, cfg
