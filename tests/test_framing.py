"""The broadcast framing (collective.Transfer), in-process: a real gloo group of two ranks on
threads (trainer and one worker), no engine. Whatever the trainer declares and whatever it
sends, the receiver either returns exactly the declared tensors or raises FrameMismatch;
it never takes partial data, never keeps bytes of an earlier transfer, and never posts a
receive smaller than what a conforming sender sends (gloo aborts the process on that)."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lora_sync import collective, host_copy
from lora_sync.wire import TensorSpec

DTYPE = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def specs_of(tensors):
    return [TensorSpec.of(k, v) for k, v in tensors.items()]


def make_tensors(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(shape, generator=g).to(DTYPE[dt])
            for i, (dt, shape) in enumerate(shapes)}


def run_pair(send, receive, timeout_s=20, streams=collective.DEFAULT_STREAMS):
    """Runs `send(group)` as rank 0 and `receive(group)` as rank 1 of a fresh gloo group;
    returns (sender outcome, receiver outcome): a value or the exception raised."""
    port = collective.free_port()
    out = [None, None]
    done = threading.Barrier(2)  # neither rank leaves the group before the other is done

    def rank(r, fn):
        try:
            group = collective.create_group("127.0.0.1", port, r, 2, "gloo", timeout_s=2,
                                            streams=streams)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[r] = e
            return
        try:
            out[r] = fn(group)
        except Exception as e:  # noqa: BLE001
            out[r] = e
        finally:
            try:
                done.wait(timeout_s)
            except threading.BrokenBarrierError:
                pass
            group.shutdown()
    threads = [threading.Thread(target=rank, args=(r, fn), daemon=True)
               for r, fn in ((0, send), (1, receive))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def frames_for(transfer, fill=None):
    frames = [torch.empty(b.frame_bytes, dtype=torch.uint8) for b in transfer.buckets]
    if fill is not None:
        for f in frames:
            f.fill_(fill)
    return frames


SHAPES = [("F32", (16, 8)), ("F32", (8, 16)), ("BF16", (3, 5)), ("F32", (7,))]


@pytest.mark.parametrize("streams", [1, 3])
def test_honest_transfer_round_trips_exactly(streams):
    tensors = make_tensors(SHAPES)
    transfer = collective.Transfer.plan(specs_of(tensors), 77, bucket_bytes=256)
    timings = {}

    def late_sender(g):  # the receiver waits on it: `header_wait`, not `transfer`
        time.sleep(0.2)
        collective.send_transfer(g, transfer, tensors, {})
    sent, got = run_pair(
        late_sender,
        lambda g: collective.receive_transfer(g, transfer, frames_for(transfer),
                                              timings_ms=timings),
        streams=streams)
    assert sent is None and isinstance(got, dict), (sent, got)
    assert set(got) == set(tensors)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert timings["header_wait"] >= 150 and 0 < timings["transfer"] < timings["header_wait"]


def test_kept_sender_frames_are_reused():
    tensors = make_tensors(SHAPES)
    transfer = collective.Transfer.plan(specs_of(tensors), 5, bucket_bytes=256)
    kept = {}
    first = collective.frame_buffers(transfer, kept)[0].data_ptr()
    assert collective.frame_buffers(transfer, kept)[0].data_ptr() == first
    assert all(f.data_ptr() % 64 == 0 for f in collective.frame_buffers(transfer, kept))


def test_packing_by_memcpy_matches_torch_and_falls_back_for_the_rest(monkeypatch):
    """Host tensors are packed by memcpy (host_copy: torch's copy spins against gloo's
    threads); a non-contiguous one is packed by torch; the bytes are the same either way."""
    tensors = make_tensors([("F32", (16, 8)), ("F32", (8, 16)), ("F32", (7,))])
    bucket = collective.Transfer.plan(specs_of(tensors), 1).buckets[0]
    expected = torch.cat([t.reshape(-1) for t in tensors.values()])
    memcpys = []
    real = host_copy.memmove_each
    monkeypatch.setattr(host_copy, "memmove_each", lambda c: (memcpys.append(len(c)), real(c)))
    out = torch.zeros_like(expected)
    collective.pack_bucket(bucket, tensors, out)
    assert memcpys == [3] and torch.equal(out, expected)

    strided = {**tensors, "t1": tensors["t1"].t().contiguous().t()}  # same values, strided
    assert not strided["t1"].is_contiguous() and torch.equal(strided["t1"], tensors["t1"])
    out = torch.zeros_like(expected)
    collective.pack_bucket(bucket, strided, out)
    assert memcpys == [3] and torch.equal(out, expected)  # torch packed it
    with pytest.raises(ValueError, match="do not fit"):
        host_copy.pack_into(torch.zeros(10), list(tensors.values()))


def test_copy_each_copies_host_pairs_by_memcpy_and_the_rest_by_torch(monkeypatch):
    memcpys = []
    real = host_copy.ctypes.memmove
    monkeypatch.setattr(host_copy.ctypes, "memmove", lambda *a: (memcpys.append(a[2]), real(*a)))
    src = make_tensors([("F32", (4, 6)), ("BF16", (5, 3))])
    strided = src["t0"].t().contiguous().t()
    dsts = [torch.zeros(4, 6), torch.zeros(5, 3, dtype=torch.bfloat16), torch.zeros(4, 6)]
    host_copy.copy_each(list(zip(dsts, [src["t0"], src["t1"], strided])))
    assert memcpys == [96, 30]  # the strided source went through torch
    assert torch.equal(dsts[0], src["t0"]) and torch.equal(dsts[1], src["t1"])
    assert torch.equal(dsts[2], src["t0"])


# Each lie: what the trainer declared over HTTP (receiver's plan) vs what it sends.
LIES = {
    "declared_bigger": lambda shapes: ([(dt, (s[0] * 2, *s[1:])) for dt, s in shapes], shapes),
    "declared_smaller": lambda shapes: (shapes[:-1], shapes),
    "other_layout": lambda shapes: ([(dt, tuple(reversed(s))) for dt, s in shapes], shapes),
    "other_dtype": lambda shapes: ([("F16" if dt == "BF16" else dt, s) for dt, s in shapes],
                                   shapes),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_declaration_is_refused_before_any_bucket(lie):
    declared_shapes, sent_shapes = LIES[lie](SHAPES)
    sent = make_tensors(sent_shapes)
    declared = collective.Transfer.plan(specs_of(make_tensors(declared_shapes)), 9, 4096)
    actual = collective.Transfer.plan(specs_of(sent), 9, 4096)
    frames = frames_for(declared)
    _, got = run_pair(lambda g: collective.send_transfer(g, actual, sent, {}),
                      lambda g: collective.receive_transfer(g, declared, frames))
    assert isinstance(got, collective.FrameMismatch), got
    assert "header" in str(got)


def test_short_bucket_in_a_reused_buffer_is_refused():
    """The case found: half the declared elements arrived and the rest came from another
    adapter's freed buffer. The reused frame holds a valid old transfer; the short message
    leaves the trailer zeroed, so it is refused."""
    tensors = make_tensors(SHAPES)
    transfer = collective.Transfer.plan(specs_of(tensors), 11, bucket_bytes=1 << 20)
    frames = frames_for(transfer)
    # The frame first holds a complete earlier transfer (another tenant's bytes).
    old = dataclasses.replace(transfer, transfer_id=10)
    run_pair(lambda g: collective.send_transfer(g, old, tensors, {}),
             lambda g: collective.receive_transfer(g, old, frames))

    def short_sender(g):
        g.broadcast(torch.frombuffer(bytearray(transfer.header()), dtype=torch.uint8))
        for b in transfer.buckets:  # every bucket sent, each with half its bytes
            g.broadcast(torch.zeros(b.nbytes // 2, dtype=torch.uint8))
    _, got = run_pair(short_sender, lambda g: collective.receive_transfer(g, transfer, frames))
    assert isinstance(got, collective.FrameMismatch), got
    assert "incomplete" in str(got)


def test_frames_of_another_transfer_are_refused():
    tensors = make_tensors(SHAPES)
    declared = collective.Transfer.plan(specs_of(tensors), 21, 4096)
    replayed = dataclasses.replace(declared, transfer_id=20)
    _, got = run_pair(lambda g: collective.send_transfer(g, replayed, tensors, {}),
                      lambda g: collective.receive_transfer(g, declared, frames_for(declared)))
    assert isinstance(got, collective.FrameMismatch), got


@settings(max_examples=10, deadline=None)
@given(shapes=st.lists(st.tuples(st.sampled_from(sorted(DTYPE)),
                                 st.tuples(st.integers(1, 40), st.integers(1, 40))),
                       min_size=1, max_size=6),
       bucket_bytes=st.sampled_from([4096, 8192, 1 << 20]),
       honest=st.booleans(), seed=st.integers(0, 1000))
def test_receiver_returns_the_declared_tensors_or_refuses(shapes, bucket_bytes, honest, seed):
    """Invariant over random layouts and random lies: the receiver's result is exactly the
    declared tensors when the sender sent them, and a FrameMismatch otherwise."""
    declared_t = make_tensors(shapes, seed)
    sent_t = declared_t if honest else make_tensors(
        [(dt, (s[0] + 1, s[1])) for dt, s in shapes], seed)
    declared = collective.Transfer.plan(specs_of(declared_t), seed + 1, bucket_bytes)
    actual = collective.Transfer.plan(specs_of(sent_t), seed + 1, bucket_bytes)
    _, got = run_pair(lambda g: collective.send_transfer(g, actual, sent_t, {}),
                      lambda g: collective.receive_transfer(g, declared, frames_for(declared,
                                                                                    0xAB)))
    if honest:
        assert isinstance(got, dict) and all(torch.equal(got[k], declared_t[k])
                                             for k in declared_t), got
    else:
        assert isinstance(got, collective.FrameMismatch), got
