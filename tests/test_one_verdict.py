"""One adapter, one verdict (docs/coverage.md): whether an adapter is served, or refused with
which code, is a function of the adapter and the engine, computed once (check_adapter, and
the workers' intake checks), whatever way it comes in: each transport, each input form (a
LoRAAdapter, a PEFT directory, raw safetensors to the route) and the engine's own load route
on a server that runs lora-sync.

In process, on the FAKE engine (tests/engine_fakes.py: lora-sync's real routes, admission,
service, transports and workers; its "model" serves a digest of the weights it holds):
generated adapters (modules of every kind, vocabulary layers included, ranks, per-module
ranks and alphas, dtypes, PEFT's vocabulary base copies, and flaws) pushed every way; every way gives the same verdict, and
every accepted one serves the same weights. Real servers: tests/test_coverage.py (PEFT's
tokens per case) and test_native_routes_give_the_push_verdict_on_real_servers below."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import LoRAAdapter, LoRASyncClient, wire
from lora_sync.errors import LoRASyncError, error_from_json

from .engine_fakes import served_text, tiny_model_spec
from .helpers import PROMPT, post_body

SPEC = tiny_model_spec()
MODULES = sorted(SPEC.linear) + sorted(SPEC.vocab)
FLAWS = (None, None, "base copy", "half missing", "bad shape", "non-finite", "rank too large",
         "unknown module", "pattern says another rank")
_names = itertools.count()


@st.composite
def adapters(draw):
    """(PEFT-named tensors, config): a few modules of any kind, maybe with one flaw."""
    modules = draw(st.lists(st.sampled_from(MODULES), min_size=1, max_size=5, unique=True))
    flaw = draw(st.sampled_from(FLAWS))
    r = 80 if flaw == "rank too large" else draw(st.sampled_from([1, 4, 8]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    # per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern, full-name keys)
    patterned = draw(st.sampled_from([None, *modules])) if flaw != "rank too large" else None
    pattern_rank = draw(st.sampled_from([2, 16]))
    tensors = {}
    for m in modules:
        fan_in, fan_out = SPEC.layer(m)
        r_m = pattern_rank if m == patterned and flaw != "pattern says another rank" else r
        a, b = (("lora_embedding_A", "lora_embedding_B") if m in SPEC.embeddings else
                ("lora_A.weight", "lora_B.weight"))
        tensors[f"base_model.model.{m}.{a}"] = (torch.randn(r_m, fan_in, generator=gen) * .1).to(dtype)
        tensors[f"base_model.model.{m}.{b}"] = (torch.randn(fan_out, r_m, generator=gen) * .1).to(dtype)
    keys = list(tensors)
    if flaw == "base copy":  # what PEFT writes beside a vocabulary layer's LoRA by default
        vocab = sorted(SPEC.vocab)[draw(st.integers(0, len(SPEC.vocab) - 1))]
        rows, cols = SPEC.vocab[vocab] if vocab in SPEC.embeddings else SPEC.vocab[vocab][::-1]
        tensors[f"base_model.model.{vocab}.base_layer.weight"] = torch.zeros(rows, cols)
    elif flaw == "half missing":
        del tensors[keys[draw(st.integers(0, len(keys) - 1))]]
    elif flaw == "bad shape":
        key = keys[draw(st.integers(0, len(keys) - 1))]
        tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1],
                                   dtype=dtype)
    elif flaw == "non-finite":
        tensors[keys[-1]] = tensors[keys[-1]].clone()
        tensors[keys[-1]].view(-1)[0] = float("nan")
    elif flaw == "unknown module":
        tensors["base_model.model.model.layers.0.mlp.nope.lora_A.weight"] = torch.zeros(r, 8)
        tensors["base_model.model.model.layers.0.mlp.nope.lora_B.weight"] = torch.zeros(8, r)
    bases = sorted({m.rsplit(".", 1)[-1] for m in modules})
    config = {"r": r, "lora_alpha": 2 * r, "target_modules": bases, "peft_type": "LORA"}
    if patterned is not None or flaw == "pattern says another rank":
        key = patterned or modules[0]
        config.update(rank_pattern={key: pattern_rank}, alpha_pattern={key: 3 * pattern_rank})
    return tensors, config


def _verdict(fn) -> str:
    try:
        fn()
    except LoRASyncError as e:
        assert 400 <= e.status < 500, (e.status, e.code, e.message)
        return e.code
    return "served"


def _save_dir(tmp_path, tensors, config) -> str:
    """The adapter as a PEFT directory, tensors as given (a base copy included)."""
    path = tmp_path / f"dir-{next(_names)}"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(wire.encode_bytes(tensors, {"format": "pt"}))
    return str(path)


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(adapter=adapters())
def test_every_path_gives_one_verdict(fake_server, fake_client, tmp_path_factory, adapter):
    tensors, config = adapter
    c, tmp = fake_client, tmp_path_factory.mktemp("verdict")
    directory = _save_dir(tmp, tensors, config)
    served = []

    def push(form, transport):
        def run():
            name = f"verdict-{next(_names)}"
            if transport == "broadcast":
                [res] = c.broadcast(form(), name)
            else:
                [res] = c.push(form(), name, transport=transport)
            served.append(c.complete(PROMPT, res.name, 4)["text"])
            c.retire(name)
        return run

    def raw_body():
        body = wire.encode_bytes(tensors, {"lora_name": f"verdict-{next(_names)}",
                                           "adapter_config": json.dumps(config)})
        status, reply = post_body(c.servers[0].route("load_lora_adapter_from_tensors"), body,
                                  headers={"Authorization": f"Bearer {fake_server.api_key}"})
        if status >= 300:
            raise error_from_json(status, reply)
        served.append(c.complete(PROMPT, reply["name"], 4)["text"])
        c.retire(reply["lora_name"])

    def native():
        name = f"native{next(_names)}"
        c.load_from_disk(directory, name)
        c.unload_from_disk(name)

    def as_adapter():
        return LoRAAdapter(dict(tensors), dict(config))
    c.init_group(group_name="verdict", timeout_s=20)
    try:
        verdicts = {"tensors": _verdict(push(as_adapter, "tensors")),
                    "shm": _verdict(push(as_adapter, "shm")),
                    "broadcast": _verdict(push(as_adapter, "broadcast")),
                    "directory": _verdict(push(lambda: directory, "tensors")),
                    "raw safetensors": _verdict(raw_body),
                    "engine's own route": _verdict(native)}
    finally:
        c.destroy_group()
    assert len(set(verdicts.values())) == 1, verdicts
    if verdicts["tensors"] == "served":
        want = served_text(as_adapter())
        assert served == [want] * len(served) and len(served) == 5, served


def test_native_loads_need_a_directory_lora_sync_can_check(fake_server, fake_client, tmp_path):
    """The engine's own load route on a lora-sync server: a path that is not a local PEFT
    directory with safetensors weights (a hub id, a file, pickle weights, a FIFO for the
    weights) is refused by name before the engine reads it; nothing is loaded."""
    import os
    c = fake_client
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04.")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    (fifo / "adapter_config.json").write_text(json.dumps({"r": 1, "lora_alpha": 1}))
    os.mkfifo(fifo / "adapter_model.safetensors")
    for path, named in (("org/some-hub-adapter", "not a local directory"),
                        (str(pickled), "pickle"), (str(fifo), "not a regular file"),
                        (str(pickled / "adapter_model.bin"), "not a local directory")):
        loaded = dict(fake_server.bridge.disk)
        with pytest.raises(LoRASyncError) as e:
            c.load_from_disk(path, "native-refused")
        assert (e.value.status, e.value.code) == (400, "bad_adapter_dir"), e.value
        assert named in e.value.message, e.value.message
        assert fake_server.bridge.disk == loaded


def test_native_load_paths_a_local_user_controls_are_refused(fake_server, fake_client,
                                                             make_adapter, tmp_path):
    """What another local user could plant in an adapter directory is never followed or read
    past its bound: a config or weights file that is a symlink (to a file that exists), an
    oversized config, and a path that is not a string; nothing is loaded."""
    import os
    good = tmp_path / "good"
    make_adapter(53).save(good)
    cases = []
    for planted in ("adapter_config.json", "adapter_model.safetensors"):
        d = tmp_path / f"link-{planted}"
        d.mkdir()
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if f == planted:
                os.symlink(good / f, d / f)
            else:
                (d / f).write_bytes((good / f).read_bytes())
        cases.append((str(d), "links are not followed"))
    big = tmp_path / "big-config"
    big.mkdir()
    (big / "adapter_config.json").write_text(" " * (2 << 20) + "{}")
    (big / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors")
                                                    .read_bytes())
    cases.append((str(big), "larger than"))
    loaded = dict(fake_server.bridge.disk)
    for path, named in cases:
        with pytest.raises(LoRASyncError) as e:
            fake_client.load_from_disk(path, "native-planted")
        assert (e.value.status, e.value.code) == (400, "bad_adapter_dir"), e.value
        assert named in e.value.message, e.value.message
    from lora_sync import http
    status, reply, _ = http.request(
        "POST", f"{fake_server.url}/v1/load_lora_adapter",
        headers={"Authorization": f"Bearer {fake_server.api_key}"},
        json_body={"lora_name": "native-planted", "lora_path": ["a", "list"]})
    assert status == 400 and reply["error"]["code"] == "bad_adapter_dir", reply
    assert fake_server.bridge.disk == loaded
    fake_client.load_from_disk(str(good), "native-good-one")  # the real one loads
    fake_client.unload_from_disk("native-good-one")


# -- real servers ---------------------------------------------------------------------------
def test_native_routes_give_the_push_verdict_on_real_servers(server, make_adapter, tmp_path):
    """Each engine's own load route, on a server running lora-sync: an adapter on v_proj
    alone (SGLang serves q/k/v as one layer: its scheduler died on the first request) gets
    the push's verdict by code on both routes; a good one loads and serves; the server
    keeps serving."""
    with LoRASyncClient(server.url, engine=server.engine, api_key=server.api_key) as c:
        good = make_adapter(52)
        v_only = LoRAAdapter({k: v for k, v in good.tensors.items()
                              if ".q_proj." not in k and ".k_proj." not in k}, good.config)
        push_verdict = _verdict(lambda: c.push(v_only, "verdict-v-only", transport="tensors"))
        v_only.save(tmp_path / "v-only")
        native_verdict = _verdict(lambda: c.load_from_disk(str(tmp_path / "v-only"),
                                                           "native-v-only"))
        assert native_verdict == push_verdict
        assert push_verdict == ("unsupported_module" if server.engine == "sglang"
                                else "served")
        if native_verdict == "served":
            c.unload_from_disk("native-v-only")
        good.save(tmp_path / "good")
        c.load_from_disk(str(tmp_path / "good"), "native-good")
        try:
            from .helpers import disk_model
            assert c.complete(PROMPT, disk_model(c, "native-good"), 4)["text"]
        finally:
            c.unload_from_disk("native-good")
        with pytest.raises(LoRASyncError) as e:
            c.load_from_disk("org/hub-adapter", "native-hub")
        assert e.value.code == "bad_adapter_dir"
    assert server.alive(), server.log_tail()
