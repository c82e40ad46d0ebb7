"""lora_sync.trainer.sharded under a real FSDP2 trainer: 2 ranks (torchrun, gloo, CPU) train a sharded
LoRA, gather it and share a result. The checks against independent references run inside the
worker (tests/sharded_worker.py); here we check its exit code and what it wrote."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from .helpers import torchrun

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "sharded_worker.py"
HIDDEN, R = 128, 8  # testbed.tiny_model.TINY_CONFIG hidden_size; the worker's LoRA rank

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    rc, log = torchrun(WORKER, out, timeout=180)
    return rc, log, out


def test_workers_pass(run):
    rc, log, _ = run
    assert rc == 0, log[-8000:]


def test_state_dict_holds_shards(run):
    rc, log, out = run
    assert rc == 0, log[-8000:]
    report = json.loads((out / "report.json").read_text())
    assert report["placements"] == "(Shard(dim=0),)"
    assert report["local_shape_A"] == [R // 2, HIDDEN] and report["global_shape_A"] == [R, HIDDEN]
    # PEFT names, without the adapter name and without any FSDP prefix
    assert all(k.startswith("base_model.model.model.layers.") and ".default." not in k
               for k in report["keys"])
    assert report["odd_local_rows_rank0"] == {"uneven": 3, "empty": 1, "dim1": 6, "repl": 3}
    assert report["max_abs_diff_vs_replica"] < 1e-5
    print(f"\ngather (tiny model, 2 ranks, gloo): rank {R} "
          f"{report['gather_ms_r8']:.1f} ms; rank 64 fp32 {report['gather_ms_r64_fp32']:.1f} ms "
          f"({report['r64_fp32_mb']:.2f} MiB), bf16 {report['gather_ms_r64_bf16']:.1f} ms")


def test_saved_adapter_is_full(run):
    from lora_sync import LoRAAdapter
    rc, log, out = run
    assert rc == 0, log[-8000:]
    fp32 = LoRAAdapter.from_dir(out / "gathered")
    bf16 = LoRAAdapter.from_dir(out / "gathered_bf16")
    assert fp32.config["r"] == R and fp32.config["target_modules"] == ["q_proj", "v_proj"]
    assert len(fp32.tensors) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    kv_out = HIDDEN // 4 * 2  # v_proj: num_key_value_heads * head_dim
    for k, t in fp32.tensors.items():
        out_features = kv_out if "v_proj" in k else HIDDEN
        want = [R, HIDDEN] if ".lora_A." in k else [out_features, R]
        assert list(t.shape) == want and t.dtype == torch.float32, (k, t.shape)
        assert bool(torch.isfinite(t).all()) and t.abs().sum() > 0, k
        assert bf16.tensors[k].dtype == torch.bfloat16
        assert torch.equal(bf16.tensors[k], t.to(torch.bfloat16)), k


def test_share_result_reaches_every_rank(run):
    rc, log, out = run
    assert rc == 0, log[-8000:]
    r0 = json.loads((out / "share_0.json").read_text())
    r1 = json.loads((out / "share_1.json").read_text())
    assert r1 == r0 and r0["nested"]["text"] == "é ✓ 漢字" and r0["version"] == 3


def test_without_torch_distributed(run):
    """Outside torchrun: the plain adapter, copied and cast; share_result is a JSON round trip."""
    from lora_sync import LoRAAdapter
    from lora_sync.trainer.sharded import gather_adapter, share_result
    from testbed.tiny_model import make_lora
    assert not (dist.is_available() and dist.is_initialized())
    model = make_lora(run[2] / "tiny", rank=4, target_modules=["q_proj"])  # built by the worker
    plain = LoRAAdapter.from_peft_model(model)
    got = gather_adapter(model)
    assert list(got.tensors) == list(plain.tensors) and got.config == plain.config
    for k, t in got.tensors.items():
        assert torch.equal(t, plain.tensors[k]) and t.data_ptr() != plain.tensors[k].data_ptr()
    half = gather_adapter(plain, dtype="float16")
    assert all(t.dtype == torch.float16 for t in half.tensors.values())
    for bad in ("fp8", torch.float64, "float64"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            gather_adapter(plain, dtype=bad)
    assert share_result({"a": (1, 2)}) == {"a": [1, 2]}
