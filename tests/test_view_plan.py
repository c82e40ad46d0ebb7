"""The views of an adapter's tensors cut by period (wire.plan_views, for the 10,000-tensor
adapters of MoE models): the same views as cut tensor by tensor, for any layout; a layout
that does not repeat is cut tensor by tensor."""
import warnings

import torch
from hypothesis import given, settings, strategies as st

from lora_sync import collective, wire

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
shapes = st.tuples(st.integers(0, 5), st.integers(1, 6))
entry = st.tuples(st.sampled_from(DTYPES), shapes)


def adapter_of(period, repeats, tail):
    g = torch.Generator().manual_seed(len(period) * 31 + repeats)
    tensors = {}
    for r in range(repeats):
        for k, (dtype, shape) in enumerate(period):
            tensors[f"layers.{r}.m{k}.lora_A.weight"] = torch.randn(shape, generator=g).to(dtype)
    for k, (dtype, shape) in enumerate(tail):
        tensors[f"tail.m{k}.lora_B.weight"] = torch.randn(shape, generator=g).to(dtype)
    return tensors


def assert_same_views(got: dict, ref: dict, tensors: dict) -> None:
    assert list(got) == list(ref) == list(tensors)
    for name, t in tensors.items():
        a, b = got[name], ref[name]
        assert (a.dtype, a.shape, a.stride(), a.data_ptr()) == \
            (b.dtype, b.shape, b.stride(), b.data_ptr()), name
        assert torch.equal(a, t), name


@settings(max_examples=60, deadline=None)
@given(st.lists(entry, min_size=1, max_size=6), st.integers(1, 5),
       st.lists(entry, max_size=2))
def test_views_by_period_are_the_views_tensor_by_tensor(period, repeats, tail):
    tensors = adapter_of(period, repeats, tail)
    buf = bytearray(wire.encode_bytes(tensors, {"name": "a"}))
    wire.parse_header(buf)
    header = wire.parse_header(buf)  # kept: the plan is kept under its layout too
    assert header.layout_key is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(buf, dtype=torch.uint8)
        ref = wire._views_by_run(buf, whole, header.data_start, header.specs, header.offsets)
        for _ in range(2):  # the plan made, then the plan kept
            assert_same_views(wire.view_tensors(buf, header), ref, tensors)


def test_a_repeating_adapter_gets_a_plan_and_one_that_does_not_is_cut_by_tensor():
    layer = [(torch.bfloat16, (4, 8)), (torch.bfloat16, (8, 4)), (torch.bfloat16, (4, 16))]
    plan_of = {}
    for label, tail in (("repeats", []), ("tail", [(torch.float32, (3, 3))])):
        tensors = adapter_of(layer, 4, tail)
        header = wire.parse_header(wire.encode_bytes(tensors, {}))
        plan_of[label] = wire.plan_views(header.specs, header.offsets)
    assert plan_of["repeats"] is not None and len(plan_of["repeats"].columns) == 3
    assert [c.count for c in plan_of["repeats"].columns] == [4, 4, 4]
    assert plan_of["tail"] is None


def test_broadcast_frames_are_viewed_by_period_and_the_plan_is_kept_per_layout():
    tensors = adapter_of([(torch.bfloat16, (4, 8)), (torch.bfloat16, (8, 4))], 50,
                         [(torch.float32, (2, 2))])
    specs = [wire.TensorSpec.of(k, v) for k, v in tensors.items()]
    transfer = collective.Transfer.plan(specs, 7, bucket_bytes=4096)
    assert len(transfer.buckets) > 2
    frames = collective.frame_buffers(transfer, {})
    for b, frame in zip(transfer.buckets, frames):
        collective.pack_bucket(b, tensors, collective.payload(b, frame))
    for transfer_id in (7, 8):  # the second push of the layout uses the kept plans
        got = collective.unpack_frames(collective.Transfer.plan(specs, transfer_id, 4096),
                                       frames)
        assert list(got) == [s.name for b in transfer.buckets for s in b.specs]
        for name, t in tensors.items():
            assert got[name].shape == t.shape and torch.equal(got[name], t), name
    plans = collective._view_plans(transfer)
    assert any(p is not None for p in plans)
    # buckets of other specs under the same layout digest never get these plans
    other = [wire.TensorSpec(s.name, s.dtype, tuple(reversed(s.shape))) for s in specs]
    moved = collective.Transfer(9, tuple(collective.plan_buckets(other, 4096)), 4096,
                                transfer.layout)
    got = collective.unpack_frames(moved, frames)
    assert all(got[s.name].shape == s.shape for s in other)


def test_the_period_is_found_in_one_pass_whatever_the_layout():
    """A layout that repeats until its last tensor (a hostile header may be one): no plan,
    found in linear time (a search period by period would compare n tensors for each of
    thousands of candidate periods); a long periodic one gets its period."""
    n, kind, other = 50_000, (torch.bfloat16, (4, 4)), (torch.bfloat16, (2, 16))
    offsets = [(32 * i, 32 * i + 32) for i in range(n)]
    names = [f"t{i}" for i in range(n)]
    assert wire.plan_tensor_views(names, [kind] * (n - 1) + [other], offsets) is None
    kinds = ([kind, other, other] * (n // 3 + 1))[:n]  # a partial period at the end
    plan = wire.plan_tensor_views(names, kinds, offsets)
    assert plan is not None and [(c.shape, c.step) for c in plan.columns] == \
        [((4, 4), 96), ((2, 16), 96), ((2, 16), 96)]
    assert sum(c.count for c in plan.columns) == n
