"""LoRAAdapter.from_peft_model reads through PEFT once, then from the same parameters
(lora_sync/peft_cache.py): what it returns is always what a read through PEFT returns, and
anything that can change which parameters are the adapter's makes it read through PEFT
again."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import LoRAAdapter, wire
from lora_sync import adapter as adapter_module

from .helpers import tiny_peft_model


@pytest.fixture
def peft_reads(monkeypatch):
    """The reads through PEFT, counted."""
    calls = []
    real = adapter_module.peft_state

    def counted(model, adapter_name="default"):
        calls.append(adapter_name)
        return real(model, adapter_name)
    monkeypatch.setattr(adapter_module, "peft_state", counted)
    return calls


def _through_peft(model, adapter_name="default") -> LoRAAdapter:
    return LoRAAdapter._through_peft(model, adapter_name)


def _same(a: LoRAAdapter, b: LoRAAdapter) -> bool:
    return list(a.tensors) == list(b.tensors) and a.config == b.config \
        and wire.encode_bytes(a.tensors, {}) == wire.encode_bytes(b.tensors, {})


def test_reads_after_the_first_skip_peft_and_see_every_step(peft_reads):
    model = tiny_peft_model(seed=1)
    first = LoRAAdapter.from_peft_model(model)
    again = LoRAAdapter.from_peft_model(model)
    assert peft_reads == ["default"] and _same(again, first) and _same(again, _through_peft(model))
    assert all(t.data_ptr() == u.data_ptr() and not t.requires_grad
               for t, u in zip(again.tensors.values(), first.tensors.values()))

    before = wire.encode_bytes(first.tensors, {})  # `first` views the parameters
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    stepped = LoRAAdapter.from_peft_model(model)
    assert peft_reads == ["default"] * 2  # the check above read through PEFT once more
    assert _same(stepped, _through_peft(model))
    assert wire.encode_bytes(stepped.tensors, {}) != before  # the step changed them


def test_new_data_of_the_same_parameters_is_read_without_peft(peft_reads):
    model = tiny_peft_model(seed=2)
    LoRAAdapter.from_peft_model(model)
    lora_a = next(p for n, p in model.named_parameters() if "lora_A" in n)
    lora_a.data = torch.full_like(lora_a.data, 0.5)  # new memory, the same parameter
    read = LoRAAdapter.from_peft_model(model)
    assert peft_reads == ["default"] and _same(read, _through_peft(model))
    assert any(torch.equal(t, lora_a.data) for t in read.tensors.values())


def _replace_a_parameter(model):
    """A LoRA parameter replaced in its module's table directly, as module.to() does when
    torch overwrites parameters on conversion: no registration hook runs."""
    name, p = next((n, p) for n, p in model.named_parameters() if "lora_B" in n)
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    owner._parameters["weight"] = torch.nn.Parameter(torch.full_like(p, 0.25))


def _add_an_adapter(model):
    from peft import LoraConfig
    model.add_adapter(f"other-{len(model.peft_config)}", LoraConfig(target_modules=["q_proj"],
                                                                    r=4))


def _replace_a_layer(model):
    """A LoRA layer's lora_A module swapped for a new one (registered: the hooks count it)."""
    name = next(n for n, _ in model.named_modules() if n.endswith("lora_A.default"))
    parent, child = name.rsplit(".", 1)
    old = model.get_submodule(name)
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    torch.nn.init.constant_(new.weight, 0.125)
    model.get_submodule(parent)[child] = new


def _edit_the_config(model):
    model.peft_config["default"].lora_alpha *= 2  # in place: the same object


def _delete_and_add_again(model):
    from peft import LoraConfig
    model.delete_adapter("default")
    model.add_adapter("default", LoraConfig(target_modules=["v_proj"], r=4))


@pytest.mark.parametrize("change", [_replace_a_parameter, _add_an_adapter, _replace_a_layer,
                                    _edit_the_config, _delete_and_add_again])
def test_what_may_change_the_adapters_parameters_reads_through_peft_again(peft_reads, change):
    model = tiny_peft_model(seed=3)
    LoRAAdapter.from_peft_model(model)
    change(model)
    read = LoRAAdapter.from_peft_model(model)
    assert peft_reads == ["default"] * 2
    assert _same(read, _through_peft(model))
    LoRAAdapter.from_peft_model(model)  # recorded again: the next read skips PEFT
    assert peft_reads == ["default"] * 3  # (the _through_peft check above is the third)


def test_tensors_peft_made_of_its_own_are_read_through_peft_every_time(peft_reads, monkeypatch):
    """Tensors that are no parameter's memory (PEFT transforms some kinds; here copies) are
    never recorded: each read goes through PEFT."""
    model = tiny_peft_model(seed=4)
    real = adapter_module.peft_state
    monkeypatch.setattr(adapter_module, "peft_state", lambda m, name="default": {
        k: v.clone() for k, v in real(m, name).items()})
    first = LoRAAdapter.from_peft_model(model)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)
    second = LoRAAdapter.from_peft_model(model)
    assert not _same(first, second) and _same(second, _through_peft(model))


def _step(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.01)


def _swap_data(model):
    p = next(p for n, p in model.named_parameters() if "lora_A" in n)
    p.data = p.data * 2.0


def _forward(model):
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(input_ids=ids)


OPERATIONS = {"step": _step, "swap .data": _swap_data, "forward": _forward,
              "replace a parameter": _replace_a_parameter, "add an adapter": _add_an_adapter,
              "replace a layer": _replace_a_layer, "edit the config": _edit_the_config,
              "pack": lambda m: __import__("lora_sync").pack_parameters(m)}


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.sampled_from(sorted(OPERATIONS)), min_size=1, max_size=8))
def test_any_sequence_of_changes_reads_what_peft_reads(ops):
    """Random sequences of what a trainer or a user may do to the model between pushes: each
    read (PEFT's once, the recorded parameters after) equals a read through PEFT."""
    model = tiny_peft_model(seed=5)
    for op in ops:
        OPERATIONS[op](model)
        assert _same(LoRAAdapter.from_peft_model(model), _through_peft(model)), ops
