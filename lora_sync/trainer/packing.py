"""A trainer's LoRA parameters moved into one buffer, in the order a push sends them.

Each push copies or sends every tensor of the adapter; tensors that lie back to back go as
one (`host_copy.host_runs`), so an adapter of tens of thousands of
tensors (an MoE's per-expert pairs) costs its bytes, not a call per tensor. A trainer packs
once, after building the PEFT model; its optimizer, made before or after, keeps working:
each parameter stays the same object, its data a view of the buffer."""
from __future__ import annotations

import torch

from ..adapter import LoRAAdapter, _is_dtensor
from ..peft_cache import parameter_places


def pack_parameters(model, adapter_name: str = "default") -> torch.Tensor:
    """Moves the LoRA parameters of a PEFT model's adapter into one new buffer, back to back
    in the order `LoRAAdapter.from_peft_model` lists them, and returns the buffer. Values,
    shapes, `requires_grad` and the parameter objects are unchanged.

    ValueError where they cannot share one buffer: different dtypes or devices, sharded
    (FSDP2: its own flat storage is the place to pack), or none of the adapter's tensors is a
    parameter (PEFT made them, as for fused experts: nothing to pack)."""
    tensors = LoRAAdapter.from_peft_model(model, adapter_name).tensors.values()
    if any(_is_dtensor(t) for t in tensors):
        raise ValueError("sharded (FSDP2) parameters cannot be packed: FSDP keeps its own "
                         "flat storage")
    params = [place[2] for place in parameter_places(model, tensors)
              if place is not None and place[2].numel()]
    if not params:
        raise ValueError(f"adapter {adapter_name!r} has no LoRA parameter to pack")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"the LoRA parameters mix dtypes or devices ({sorted(map(str, kinds))}): "
                         "one buffer holds one dtype on one device")
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    start = 0
    with torch.no_grad():
        for p in params:
            view = flat[start:start + p.numel()].view(p.shape)
            view.copy_(p)
            p.data = view
            start += p.numel()
    return flat
