"""Tensors that lie back to back go as one: copies coalesced (host_copy), byte views per
run (wire.byte_views), and a trainer's LoRA parameters packed into one buffer
(trainer.pack_parameters) so that every push of it makes one copy, not one per tensor."""
from __future__ import annotations

import pytest
import torch

from lora_sync import LoRAAdapter, host_copy, wire
from lora_sync.trainer.packing import pack_parameters

from .helpers import tiny_peft_model


def _packed(adapter: LoRAAdapter) -> LoRAAdapter:
    """The same adapter, its tensors views of one buffer (as pack_parameters leaves a
    trainer's parameters)."""
    ts = list(adapter.tensors.values())
    flat = torch.cat([t.reshape(-1) for t in ts])
    views, start = [], 0
    for t in ts:
        views.append(flat[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return LoRAAdapter(dict(zip(adapter.tensors, views)), adapter.config)


def _tensors(*numels, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(numels))
    return [torch.randn(n, generator=g).to(dtype) for n in numels]


def test_host_runs_finds_the_runs_or_none():
    loose = _tensors(3, 5)
    flat = torch.cat(_tensors(4, 6, 2))
    packed = [flat[:4], flat[4:10], flat[10:]]
    runs = host_copy.host_runs([loose[0], *packed, torch.empty(0), loose[1]])
    assert runs == [(loose[0].data_ptr(), 12), (flat.data_ptr(), 48), (loose[1].data_ptr(), 20)]
    assert host_copy.host_runs([packed[1], packed[0]]) == [(packed[1].data_ptr(), 24),
                                                           (packed[0].data_ptr(), 16)]
    assert host_copy.host_runs([torch.empty(0)]) == [] == host_copy.host_runs([])
    assert host_copy.host_runs([loose[0], torch.randn(3, 2).t()]) is None  # not contiguous


def test_coalesced_merges_only_neighbours_on_both_sides():
    copies = [(100, 1000, 10), (110, 1010, 5), (115, 2000, 5), (130, 2005, 5), (135, 2010, 0)]
    assert host_copy.coalesced(copies) == [(100, 1000, 15), (115, 2000, 5), (130, 2005, 5)]
    assert host_copy.coalesced([]) == []


@pytest.mark.parametrize("sizes", [[1000], [10, 990], [400, 200, 400], [999, 1]])
def test_halves_split_the_bytes_in_two_and_copy_them_all(sizes):
    src = torch.arange(sum(sizes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copies, at = [], 0
    for n in sizes:  # each copy its own source range, destination back to back
        copies.append((dst.data_ptr() + at, src.data_ptr() + at, n))
        at += n
    first, rest = host_copy.halves(copies)
    assert sum(n for *_, n in first) == sum(sizes) // 2
    host_copy.memmove_each(first)
    host_copy.memmove_each(rest)
    assert torch.equal(dst, src)


def test_byte_views_are_one_per_run_and_the_same_bytes():
    loose = _tensors(3, 5, 7)
    flat = torch.cat(loose)
    packed = [flat[:3], flat[3:8], flat[8:]]
    empty = torch.empty(0)
    strided = torch.randn(4, 3).t()  # not contiguous: a view of its own, after a copy
    expected = b"".join(t.contiguous().numpy().tobytes() for t in loose)
    assert len(wire.byte_views(loose)) == 3 and len(wire.byte_views(packed)) == 1
    assert b"".join(wire.byte_views(packed)) == expected == b"".join(wire.byte_views(loose))
    assert len(wire.byte_views([packed[0], empty, packed[1], packed[2]])) == 1
    # one tensor not contiguous: a view each (that one copied), the same bytes
    views = wire.byte_views([packed[0], empty, packed[1], strided, packed[2]])
    assert len(views) == 4
    assert b"".join(views) == expected[:32] + strided.contiguous().numpy().tobytes() \
        + expected[32:]


def test_a_packed_adapter_encodes_as_one_view_and_the_same_file(make_adapter):
    adapter = make_adapter(seed=3)
    packed = _packed(adapter)
    chunks = wire.encode(packed.tensors, {"k": "v"})
    assert len(chunks) == 2  # the header, then every tensor in one view
    assert b"".join(chunks) == wire.encode_bytes(adapter.tensors, {"k": "v"})


def test_pushes_of_a_packed_adapter_copy_once_and_serve_the_same(fake_client, make_adapter,
                                                                  monkeypatch):
    """Every same-host transport and HTTP take a packed adapter and serve what the loose one
    serves; shm's copy into its lease (by memcpy into a ready one, else by pwritev), the
    HTTP body and the client's own copy each take its tensors in one piece (two halves at
    most), not one a tensor."""
    from .engine_fakes import served_text
    from .helpers import greedy
    pieces = []
    real_memmove, real_views = host_copy.ctypes.memmove, wire.byte_views
    monkeypatch.setattr(host_copy.ctypes, "memmove",
                        lambda *a: (pieces.append(a[2]), real_memmove(*a))[1])
    monkeypatch.setattr(wire, "byte_views",
                        lambda ts: (lambda v: (pieces.extend(x.nbytes for x in v), v)[1])(
                            real_views(ts)))
    fake_client.init_group(timeout_s=20)
    for seed, transport in enumerate(("shm", "shm", "tensors", "shared", "broadcast")):
        adapter = make_adapter(seed=40 + seed)
        pieces.clear()
        fake_client.push(_packed(adapter), "packed", transport=transport)
        assert greedy(fake_client, "packed") == served_text(adapter), transport
        if transport in ("shm", "tensors"):  # tensors: the body, and the client's copy
            copies, rest = divmod(sum(pieces), adapter.nbytes)
            assert copies >= 1 and not rest, (transport, pieces)
            assert len(pieces) <= 2 * copies < len(adapter.tensors), (transport, pieces)
    fake_client.retire("packed")


def test_pack_parameters_keeps_values_and_parameters_and_training_goes_on():
    model = tiny_peft_model()
    before = LoRAAdapter.from_peft_model(model)
    file_before = wire.encode_bytes(before.tensors, {})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)  # made before packing: still works
    flat = pack_parameters(model)
    after = LoRAAdapter.from_peft_model(model)
    assert wire.encode_bytes(after.tensors, {}) == file_before
    assert len(wire.byte_views(after.tensors.values())) == 1
    assert [p for p in model.parameters() if p.requires_grad] == params
    assert all(p.requires_grad for p in params)
    assert flat.numel() == sum(t.numel() for t in after.tensors.values())

    ids = torch.tensor([[1, 2, 3, 4, 5]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    stepped = LoRAAdapter.from_peft_model(model)
    assert wire.encode_bytes(stepped.tensors, {}) != file_before  # the step changed them
    assert len(wire.byte_views(stepped.tensors.values())) == 1   # and they are still one run
    assert next(iter(stepped.tensors.values())).data_ptr() == flat.data_ptr()


def test_pack_parameters_refuses_what_one_buffer_cannot_hold(monkeypatch):
    model = tiny_peft_model()
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    lora_b.data = lora_b.data.double()
    with pytest.raises(ValueError, match="mix dtypes"):
        pack_parameters(model)

    # Tensors PEFT made of its own (as for fused experts) are no parameter: nothing to pack.
    from lora_sync import adapter as adapter_module
    real = adapter_module.peft_state
    monkeypatch.setattr(adapter_module, "peft_state", lambda m, name="default": {
        k: v.clone() for k, v in real(m, name).items()})
    with pytest.raises(ValueError, match="no LoRA parameter"):
        pack_parameters(tiny_peft_model())


def test_a_packed_peft_model_serves_pefts_tokens_push_after_push(client, model_dir, tmp_path):
    """Real engines: a PEFT model packed by pack_parameters, pushed as the model itself by
    shm and tensors (its adapter read through PEFT the first time, from its parameters after)
    serves PEFT's own greedy tokens and the engine's disk route's; after an in-place change
    of its weights (a training step's kind), the next pushes serve the new tokens."""
    from .helpers import PROMPT, disk_model
    from .peft_oracle import peft_greedy, peft_model, server_greedy
    n = 12
    model = peft_model(model_dir, seed=970)
    pack_parameters(model)
    served = []
    for step in range(2):
        want = peft_greedy(model, model_dir, PROMPT, n)
        for transport in ("shm", "tensors"):
            [res] = client.push(model, "packed-peft", transport=transport)
            assert res.transport == transport
            assert server_greedy(client, res.name, PROMPT, n) == want, (step, transport)
        served.append(want)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-2.0)
    assert served[0] != served[1]  # the second pushes served the changed weights
    name = f"packed-disk-{tmp_path.name[-8:]}"
    LoRAAdapter.from_peft_model(model).save(tmp_path / name)  # the weights as changed last
    client.load_from_disk(str(tmp_path / name), name)
    try:
        assert server_greedy(client, disk_model(client, name), PROMPT, n) == \
            peft_greedy(model, model_dir, PROMPT, n)
    finally:
        client.unload_from_disk(name)
    client.retire("packed-peft")
