"""A PEFT model's adapter as a push reads it, found through PEFT once and then taken
straight from the model's parameters.

PEFT's `get_peft_model_state_dict` walks every module of the model, the base model's
included, at each call: tens of microseconds per LoRA tensor, over a second a push for an
MoE adapter of tens of thousands of tensors. A trainer pushes the same parameters every
step, updated in place. So the first read records which parameter each tensor is (where
every tensor is a parameter's whole memory; a tensor PEFT makes of its own, such as fused
experts split per expert, or a sharded one, is read through PEFT every time), and later
reads take the tensors from those parameters while nothing can have changed which they are:

- the model's config of that adapter says the same (an edit of it in place included);
- no module or parameter was registered into any of the model's modules since (torch's
  global registration hooks count them: replacing a layer, merging, injecting adapters);
- each parameter is still in its module's parameter table (a parameter replaced there
  directly, as `module.to()` does when torch overwrites parameters on conversion).

A parameter whose data was swapped (`p.data = ...`, a dtype or device change) is still the
model's parameter: its new data is what the next read takes."""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

_generation = 0  # module and parameter registrations into a recorded model's modules
_hooks: list = []  # torch's handles of the two counting hooks, once installed
_hooks_lock = threading.Lock()
_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {name: _Picks}
# Every module of the recorded models: a model's forward may fill containers of its own
# (transformers slices its ModuleList of layers at every step), which must not count.
_recorded_modules: "weakref.WeakSet" = weakref.WeakSet()


def _registered(module, *_) -> None:
    global _generation
    if module in _recorded_modules:
        _generation += 1


def _hook_registrations() -> None:
    """Installs the counting hooks once per process (they return None: nothing changes)."""
    if _hooks:
        return
    from torch.nn.modules import module
    with _hooks_lock:
        if not _hooks:
            _hooks.extend([module.register_module_module_registration_hook(_registered),
                           module.register_module_parameter_registration_hook(_registered)])


@dataclass
class _Picks:
    peft_config: dict               # the model's PeftConfig of the adapter, as a dict
    generation: int
    names: tuple[str, ...]          # the adapter's tensor names, in its order
    places: list[tuple]             # each tensor's (module._parameters, name, parameter)
    adapter_config: dict            # the adapter's normalized config

    def still_hold(self, model, adapter_name: str) -> bool:
        config = model.peft_config.get(adapter_name)
        return _generation == self.generation and config is not None \
            and config.to_dict() == self.peft_config \
            and all(table.get(name) is p for table, name, p in self.places)


def read(model, adapter_name: str, read_through_peft, make):
    """The adapter of `model`: `make(tensors, config)` from the recorded parameters where the
    record still holds, else `read_through_peft(model, adapter_name)` (a LoRAAdapter), which
    is recorded when every tensor of it is a parameter's whole memory."""
    _hook_registrations()
    picks = _kept.get(model, {}).get(adapter_name)
    if picks is not None and picks.still_hold(model, adapter_name):
        return make(dict(zip(picks.names, (p.detach() for _, _, p in picks.places))),
                    dict(picks.adapter_config))
    generation = _generation
    adapter = read_through_peft(model, adapter_name)
    places = parameter_places(model, adapter.tensors.values())
    if None not in places:
        _recorded_modules.update(model.modules())
        _kept.setdefault(model, {})[adapter_name] = _Picks(
            model.peft_config[adapter_name].to_dict(), generation, tuple(adapter.tensors),
            places, dict(adapter.config))
    else:
        _kept.get(model, {}).pop(adapter_name, None)
    return adapter


def parameter_places(model, tensors) -> list[tuple | None]:
    """For each tensor, the (module._parameters, name, parameter) of the plain parameter
    whose whole memory it is (the same address, dtype, device, shape and strides), or None
    where it is no parameter's."""
    by_memory = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and type(p) is torch.nn.Parameter:
                by_memory[_memory(p)] = (module._parameters, name, p)
    return [by_memory.get(_memory(t)) for t in tensors]


def _memory(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride()
