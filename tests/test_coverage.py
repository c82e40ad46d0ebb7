"""The coverage matrix (tests/coverage_matrix.py -> docs/coverage.md): which PEFT features
each engine serves, checked against the engines' code, PEFT's own forward pass and real
servers. The rule (issue 44): lora-sync serves what the engine serves correctly from disk,
token for token, and refuses with a 4xx naming the feature what it would serve wrong.

Fast tests: PEFT's pattern matching restated in lora_sync.adapter.module_ranks, against
PEFT's and vLLM's own; the refusal codes per engine; hostile configs; docs/coverage.md is
what the matrix renders. Real servers (few, one per engine, each pushing a handful of
adapters): every "served" cell token-identical to the engine's disk route and to PEFT, every
engine-specific "refused" cell refused by code with the previous version still serving."""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import LoRAAdapter, LoRASyncClient, wire
from lora_sync.adapter import (CONFIG_FEATURES, MAX_PATTERN_KEYS, PATTERN_BUDGET_S, Coverage,
                               ModelSpec, check_adapter, module_ranks)
from lora_sync.errors import BadAdapter, LoRASyncError

from . import coverage_matrix
from .conftest import REPO, SGLANG_PYTHON, SGLANG_TEST_PATH
from .helpers import PROMPT, disk_model, greedy, push_by, versions_of
from .peft_oracle import oracle, peft_model, scalings, server_greedy

N_TOKENS = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# One LoraConfig per matrix row that is served somewhere (coverage_matrix.ROWS' `case`).
CASES = {
    # a key per kind: leaf name, full name, regular expression; a rank above r
    "rank_pattern": dict(r=8, lora_alpha=16, rank_pattern={
        "q_proj": 4, "model.layers.1.mlp.down_proj": 2, r"layers\.0\.self_attn\.v_proj": 16}),
    "alpha_pattern": dict(r=8, lora_alpha=16, alpha_pattern={"o_proj": 64, "up_proj": 4}),
    "use_rslora": dict(r=16, lora_alpha=8, use_rslora=True),
    "layers_to_transform": dict(r=8, lora_alpha=16, layers_to_transform=[1],
                                target_modules=ALL),
    "rank below max": dict(r=2, lora_alpha=4),
    # changes nothing on an engine that ignores it: served there too
    "rank_pattern giving every module r": dict(r=8, lora_alpha=16, rank_pattern={"q_proj": 8}),
    "use_rslora at r=1": dict(r=1, lora_alpha=2, use_rslora=True),
    "embed_tokens": dict(r=8, lora_alpha=16, target_modules=[*ALL, "embed_tokens"]),
    "lm_head": dict(r=8, lora_alpha=16, target_modules=[*ALL, "lm_head"]),
}
# Served cases also pushed by shm and broadcast on each real server.
EVERY_TRANSPORT = ("rank_pattern", "embed_tokens", "lm_head")
# Without the feature: what an engine that ignores it computes from the same weights.
WITHOUT = {"alpha_pattern": dict(r=8, lora_alpha=16), "use_rslora": dict(r=16, lora_alpha=8)}


def vllm_coverage() -> Coverage:
    from vllm_ext.bridge import COVERAGE
    return COVERAGE


# SGLang's bridge imports sglang (not in this venv): its COVERAGE is read by SGLang's Python
# in test_sglang_reads_no_config_feature_and_its_coverage_says_so, which checks this copy.
SGLANG_FEATURES = frozenset()


def sglang_like() -> Coverage:
    return Coverage("SGLang", config_features=SGLANG_FEATURES)


@pytest.fixture(scope="module")
def tiny_spec(model_dir):
    from transformers import AutoConfig
    return ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir), 64)


def spec_for(tiny_spec, engine: str) -> ModelSpec:
    return dataclasses.replace(
        tiny_spec, coverage=vllm_coverage() if engine == "vllm" else sglang_like())


def modules_of(adapter) -> list[str]:
    return sorted({k.split(".lora_")[0].removeprefix("base_model.model.")
                   for k in adapter.tensors})


# -- pattern matching: PEFT's rule, restated ---------------------------------------------
@pytest.mark.parametrize("case", ["rank_pattern", "alpha_pattern", "use_rslora",
                                  "layers_to_transform"])
def test_module_ranks_are_peft_and_vllms(model_dir, case):
    """module_ranks gives each module the rank and alpha PEFT's own layers have, and vLLM's
    PEFTHelper.get_rank_and_scaling (what its LoRAModel is built with) agrees."""
    from vllm.lora.peft_helper import PEFTHelper
    model = peft_model(model_dir, 3, **CASES[case])
    adapter = LoRAAdapter.from_peft_model(model)
    ranks = module_ranks(adapter.config, modules_of(adapter))
    helper = PEFTHelper.from_dict(adapter.config)
    rslora = adapter.config.get("use_rslora")
    for module, (rank, scaling) in scalings(model).items():
        r, alpha = ranks[module]
        assert (r, alpha / (math.sqrt(r) if rslora else r)) == (rank, scaling), module
        assert helper.get_rank_and_scaling(module) == (rank, pytest.approx(scaling)), module


# Random mixes of the served features: ranks and alphas per module (by leaf, full or regular-
# expression key), rsLoRA, a subset of layers and of projections (q/v and gate kept so that
# every fused group is one SGLang serves too).
_LEAVES = ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]
_KEYS = {"leaf": "{leaf}", "full": "model.layers.{layer}.{parent}.{leaf}",
         "regex": r"layers\.{layer}\.{parent}\.{leaf}"}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "o_proj": "self_attn",
           "up_proj": "mlp", "down_proj": "mlp"}


@st.composite
def feature_mixes(draw):
    r = draw(st.sampled_from([1, 2, 4, 8]))
    targets = ["q_proj", "v_proj", "gate_proj", *draw(st.sets(st.sampled_from(_LEAVES)))]
    config = dict(r=r, lora_alpha=draw(st.sampled_from([1, 2, 16, 24])),
                  target_modules=sorted(set(targets)), use_rslora=draw(st.booleans()))
    layers = draw(st.sampled_from([None, [0], [1]]))
    if layers is not None:
        config["layers_to_transform"] = layers
    for field, values in (("rank_pattern", [1, 4, 16]), ("alpha_pattern", [3, 32])):
        chosen = draw(st.lists(st.sampled_from(sorted(set(targets) & set(_LEAVES))),
                               unique=True, max_size=2))
        keyed = {}
        for leaf in chosen:
            layer = draw(st.sampled_from(layers or [0, 1]))
            form = draw(st.sampled_from(sorted(_KEYS)))
            keyed[_KEYS[form].format(leaf=leaf, layer=layer, parent=_PARENT[leaf])] = \
                draw(st.sampled_from(values))
        if keyed:
            config[field] = keyed
    return config


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=feature_mixes(), seed=st.integers(0, 2 ** 16))
def test_random_feature_mixes_are_peft_and_vllms_and_refused_by_sglang_exactly_where_they_matter(
        model_dir, tiny_spec, config, seed):
    """Over random mixes: vLLM's coverage accepts each, with the rank and scaling PEFT's own
    layers have on every module (module_ranks, and vLLM's PEFTHelper); SGLang's refuses it
    exactly when some module's rank or scaling differs from r and lora_alpha / r (what
    SGLang would serve instead)."""
    from vllm.lora.peft_helper import PEFTHelper
    model = peft_model(model_dir, seed, **config)
    adapter = LoRAAdapter.from_peft_model(model)
    check_adapter(adapter.specs(), adapter.config, spec_for(tiny_spec, "vllm"))
    ranks = module_ranks(adapter.config, modules_of(adapter))
    helper = PEFTHelper.from_dict(adapter.config)
    r, alpha, rslora = config["r"], config["lora_alpha"], config["use_rslora"]
    uniform = True
    for module, (rank, scaling) in scalings(model).items():
        ours, our_alpha = ranks[module]
        assert (ours, our_alpha / (math.sqrt(ours) if rslora else ours)) == \
            (rank, pytest.approx(scaling)), module
        assert helper.get_rank_and_scaling(module) == (rank, pytest.approx(scaling)), module
        uniform &= (rank, scaling) == (r, pytest.approx(alpha / r))
    try:
        check_adapter(adapter.specs(), adapter.config, spec_for(tiny_spec, "sglang"))
        assert uniform, config
    except BadAdapter as e:
        assert not uniform and e.code == "unsupported_module", (config, e.message)


@pytest.mark.parametrize("key,module,matches", [
    ("q_proj", "model.layers.0.self_attn.q_proj", True),
    ("proj", "model.layers.0.self_attn.q_proj", False),  # a suffix at a '.' only
    ("self_attn.q_proj", "model.layers.0.self_attn.q_proj", True),
    (r"layers\.[01]\.self_attn\.q_proj", "model.layers.1.self_attn.q_proj", True),
    ("layers.0.mlp.up_proj", "model.layers.0.mlp.up_proj", True),
    ("q.proj", "model.layers.0.self_attn.q_proj", True),  # '.' is a regex: PEFT's too
    ("model.layers.0", "model.layers.0.self_attn.q_proj", False),
    ("(q|v)_proj", "model.layers.0.self_attn.v_proj", True),
    (".*_proj", "model.layers.0.mlp.down_proj", True)])
def test_a_pattern_key_matches_as_peft_matches(key, module, matches):
    from peft.utils.other import get_pattern_key
    cfg = {"r": 8, "lora_alpha": 16, "rank_pattern": {key: 4}}
    assert (get_pattern_key([key], module) == key) == matches
    if matches:
        assert module_ranks(cfg, [module])[module] == (4, 16)
    else:
        with pytest.raises(BadAdapter) as e:
            module_ranks(cfg, [module])
        assert e.value.code == "bad_config" and "matches no module" in e.value.message


def test_the_first_matching_key_wins_as_in_peft():
    from peft.utils.other import get_pattern_key
    pattern = {"q_proj": 2, "layers.0.self_attn.q_proj": 4}
    module = "model.layers.0.self_attn.q_proj"
    assert get_pattern_key(pattern, module) == "q_proj"
    cfg = {"r": 8, "lora_alpha": 16, "rank_pattern": pattern}
    # the shadowed key still matches a module: not refused as matching nothing
    assert module_ranks(cfg, [module]) == {module: (2, 16)}


# -- refusal codes, per engine (in process) -------------------------------------------------
def peft_case(model_dir, case, seed=3):
    return LoRAAdapter.from_peft_model(peft_model(model_dir, seed, **CASES[case]))


@pytest.mark.parametrize("case", list(CASES))
def test_each_engine_serves_or_refuses_each_case_by_name(model_dir, tiny_spec, case):
    """What the matrix says per engine, from check_adapter with each engine's coverage."""
    adapter = peft_case(model_dir, case)
    for engine in ("vllm", "sglang"):
        want = coverage_matrix.cell_for_case(case, engine)
        if want.served:
            check_adapter(adapter.specs(), adapter.config, spec_for(tiny_spec, engine))
            continue
        with pytest.raises(BadAdapter) as e:
            check_adapter(adapter.specs(), adapter.config, spec_for(tiny_spec, engine))
        assert e.value.code == want.code and want.feature in e.value.message, e.value.message


def one_module(r=4, fan=(128, 128), module="model.layers.0.self_attn.q_proj"):
    p = f"base_model.model.{module}"
    return {f"{p}.lora_A.weight": torch.zeros(r, fan[0]),
            f"{p}.lora_B.weight": torch.zeros(fan[1], r)}


def specs_of(tensors):
    return [wire.TensorSpec.of(k, v) for k, v in tensors.items()]


@pytest.mark.parametrize("change,code,named", [
    ({"rank_pattern": {"k_proj": 4}}, "bad_config", "'k_proj' matches no module"),
    ({"alpha_pattern": {"nope": 4}}, "bad_config", "'nope' matches no module"),
    ({"rank_pattern": {"q_proj": 65}}, "rank_too_large", "65"),
    ({"rank_pattern": {"q_proj": 0}}, "bad_config", "between 1"),
    ({"rank_pattern": {"q_proj": True}}, "bad_config", "integer"),
    ({"rank_pattern": {"q_proj": 4.0}}, "bad_config", "integer"),
    ({"rank_pattern": {"q_proj": 2 ** 70}}, "rank_too_large", "<huge>"),
    ({"alpha_pattern": {"q_proj": float("nan")}}, "bad_config", "finite"),
    ({"alpha_pattern": {"q_proj": 1e9}}, "bad_config", "alpha_pattern"),
    ({"alpha_pattern": {"q_proj": -1}}, "bad_config", "alpha_pattern"),
    ({"rank_pattern": ["q_proj"]}, "bad_config", "must be an object"),
    ({"rank_pattern": {"": 4}}, "bad_config", "keys must be"),
    ({"rank_pattern": {"x" * 300: 4}}, "bad_config", "keys must be"),
    ({"rank_pattern": {f"k{i}": 4 for i in range(MAX_PATTERN_KEYS + 1)}}, "bad_config", "at most"),
    ({"rank_pattern": {"q_proj(": 4}}, "bad_config", "not a valid regular expression"),
    ({"rank_pattern": {"q_proj": 8}}, "bad_shape", "rank 4 but adapter_config"),  # tensors: 4
    ({"use_rslora": "yes"}, "bad_config", "use_rslora"),
])
def test_hostile_and_wrong_patterns_are_refused(change, code, named):
    spec = ModelSpec({"model.layers.0.self_attn.q_proj": (128, 128)}, 64, vllm_coverage())
    with pytest.raises(BadAdapter) as e:
        check_adapter(specs_of(one_module()), {"r": 4, "lora_alpha": 8,
                                                "target_modules": ["q_proj"], **change}, spec)
    assert (e.value.code, e.value.status) == (code, 400) and named in e.value.message, \
        e.value.message


def test_a_rank_above_the_slot_in_one_module_only_is_refused():
    """The issue's hostile variant: every module fits but one, whose pattern (and tensors)
    exceed --max-lora-rank."""
    spec = ModelSpec({"model.layers.0.self_attn.q_proj": (128, 128),
                      "model.layers.0.self_attn.o_proj": (128, 128)}, 16, vllm_coverage())
    tensors = {**one_module(8), **one_module(32, module="model.layers.0.self_attn.o_proj")}
    with pytest.raises(BadAdapter) as e:
        check_adapter(specs_of(tensors), {"r": 8, "lora_alpha": 16, "rank_pattern": {
            "o_proj": 32}, "target_modules": ["q_proj", "o_proj"]}, spec)
    assert e.value.code == "rank_too_large" and "o_proj" in e.value.message
    with pytest.raises(BadAdapter) as e:  # and without a pattern that says so
        check_adapter(specs_of(tensors), {"r": 8, "lora_alpha": 16,
                                          "target_modules": ["q_proj", "o_proj"]}, spec)
    assert e.value.code == "bad_shape" and "o_proj" in e.value.message


def test_vocabulary_layers_are_checked_by_shape_name_form_and_tying(tiny_spec):
    """embed_tokens (PEFT's lora_embedding_A [r, vocab] / _B [hidden, r]) and lm_head
    (lora_A [r, hidden] / lora_B [vocab, r]) pass where they fit; a wrong shape, the other
    name form, an engine that serves no LoRA there, and a model that ties them are refused
    by name."""
    emb = "base_model.model.model.embed_tokens.lora_embedding_"
    head = "base_model.model.lm_head.lora_"
    good = {f"{emb}A": torch.ones(8, 384), f"{emb}B": torch.ones(128, 8),
            f"{head}A.weight": torch.ones(8, 128), f"{head}B.weight": torch.ones(384, 8)}
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["embed_tokens", "lm_head"]}
    spec = spec_for(tiny_spec, "vllm")
    assert spec.vocab == {"model.embed_tokens": (384, 128), "lm_head": (128, 384)}
    assert check_adapter(specs_of(good), config, spec)["target_modules"] == \
        ["embed_tokens", "lm_head"]
    assert ModelSpec.from_info(spec.info()) == spec  # what a trainer checks a broadcast with

    def refused(tensors, code, named, model=spec):
        with pytest.raises(BadAdapter) as e:
            check_adapter(specs_of(tensors), config, model)
        assert e.value.code == code and named in e.value.message, e.value.message
    refused({**good, f"{emb}A": torch.ones(8, 385)}, "bad_shape", "embed_tokens")
    refused({**good, f"{head}B.weight": torch.ones(383, 8)}, "bad_shape", "lm_head")
    # the linear form on an embedding, the embedding form on a linear layer
    renamed = {k.replace("lora_embedding_A", "lora_A.weight"): v for k, v in good.items()}
    refused(renamed, "unknown_tensor", "embedding")
    renamed = {k.replace("lora_A.weight", "lora_embedding_A"): v for k, v in good.items()}
    refused(renamed, "unknown_tensor", "linear")
    no_head = ModelSpec(spec.linear, 64, Coverage("X", vocab=frozenset({"embed_tokens"})),
                        spec.vocab, spec.embeddings)
    refused(good, "unsupported_module", "lm_head", no_head)
    tied = ModelSpec(spec.linear, 64, spec.coverage, spec.vocab, spec.embeddings, tied=True)
    refused(good, "unsupported_module", "tie", tied)
    # an old server's info (no vocab in its coverage): the trainer assumes none is served
    assert Coverage.from_json({"fused": []}).vocab == frozenset()


def test_a_backtracking_pattern_key_is_bounded_in_time():
    """Pattern keys are regular expressions (PEFT's rule): one that backtracks for ever is
    refused within the matching budget, not run to the end."""
    n = 200
    modules = {f"model.layers.{i}.self_attn.q_proj": (128, 128) for i in range(n)}
    spec = ModelSpec(modules, 64, vllm_coverage())
    tensors = {}
    for m in modules:
        tensors.update(one_module(4, module=m))
    started = time.monotonic()
    with pytest.raises(BadAdapter) as e:
        check_adapter(specs_of(tensors), {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                          "rank_pattern": {"q_proj": 4,
                                                           "(a|aa)+(a|aa)+b": 4}}, spec)
    assert e.value.code == "bad_config"
    assert time.monotonic() - started < PATTERN_BUDGET_S + 2


def test_many_keys_slow_to_compile_are_bounded_by_the_same_budget():
    """The most keys a pattern may have (MAX_PATTERN_KEYS), each slow to compile (a long
    alternation), are refused within the matching budget: the cap bounds the compiling, which
    counts against the budget too (50,000 such keys once held a check for 79 s)."""
    spec = ModelSpec({"model.layers.0.self_attn.q_proj": (128, 128)}, 64, vllm_coverage())
    keys = {(f"k{i}" + "(a|b)" * 40)[:250]: 4 for i in range(MAX_PATTERN_KEYS)}
    started = time.monotonic()
    with pytest.raises(BadAdapter) as e:
        check_adapter(specs_of(one_module()), {"r": 4, "lora_alpha": 8,
                                               "target_modules": ["q_proj"],
                                               "rank_pattern": keys}, spec)
    assert e.value.code == "bad_config"
    assert time.monotonic() - started < PATTERN_BUDGET_S + 2


def test_config_features_travel_in_lora_sync_info(tiny_spec):
    """The trainer applies the server's config features before a broadcast; a server from
    before them (no config_features) refuses every one itself, so the trainer assumes all."""
    spec = spec_for(tiny_spec, "sglang")
    info = json.loads(json.dumps(spec.info()))
    assert info["coverage"]["config_features"] == []
    assert ModelSpec.from_info(info) == spec
    old = json.loads(json.dumps(info))
    del old["coverage"]["config_features"]
    assert ModelSpec.from_info(old).coverage.config_features == frozenset(CONFIG_FEATURES)
    newer = json.loads(json.dumps(info))
    newer["coverage"]["config_features"] = ["rank_pattern", "some_future_feature"]
    assert ModelSpec.from_info(newer).coverage.config_features == {"rank_pattern"}
    with pytest.raises(ValueError):
        ModelSpec.from_info({**info, "coverage": {**info["coverage"], "config_features": "x"}})


def test_the_trainer_refuses_a_broadcast_the_engine_would_serve_wrong(model_dir, tiny_spec):
    from lora_sync.transports.broadcast import TrainerGroup
    group = TrainerGroup("g", None, 2, "gloo", "cpu", 1 << 20, 10.0)
    group.specs = [ModelSpec.from_info(json.loads(json.dumps(
        spec_for(tiny_spec, "sglang").info())))]
    with pytest.raises(BadAdapter) as e:
        group.plan(peft_case(model_dir, "use_rslora"))
    assert e.value.code == "unsupported_module" and "use_rslora" in e.value.message
    group.specs = [ModelSpec.from_info(spec_for(tiny_spec, "vllm").info())]
    group.plan(peft_case(model_dir, "use_rslora"))


# -- engine code: SGLang reads none of the features (its own classes, its Python) ---------
SGLANG_PROBE = r'''
import json, types
from sglang.srt.lora.lora import LoRAAdapter
from sglang.srt.lora.lora_config import LoRAConfig
from sglang_ext.bridge import COVERAGE
out = {"config_features": sorted(COVERAGE.config_features), "scaling": []}
for cfg in [{"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}},
            {"r": 8, "lora_alpha": 16, "alpha_pattern": {"q_proj": 64}},
            {"r": 16, "lora_alpha": 8, "use_rslora": True}]:
    cfg.update(peft_type="LORA", target_modules=["q_proj"])
    config = LoRAConfig.from_dict(cfg, None, base_vocab_size=1000)
    lora = LoRAAdapter("x", config, types.SimpleNamespace(num_hidden_layers=1), None, None)
    out["scaling"].append([config.r, lora.scaling, cfg["lora_alpha"] / cfg["r"],
                           sorted(k for k in ("rank_pattern", "alpha_pattern", "use_rslora")
                                  if hasattr(config, k))])
print(json.dumps(out))
'''


def test_sglang_reads_no_config_feature_and_its_coverage_says_so():
    """SGLang 0.5.23's LoRAConfig keeps r and lora_alpha only, and its LoRAAdapter scales
    every module by lora_alpha / r: rank_pattern, alpha_pattern and use_rslora are ignored.
    Its bridge's COVERAGE declares no config feature, as this test's copy does."""
    if not SGLANG_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail("no .venv-sglang in CI")
        pytest.skip("no .venv-sglang: run scripts/install.sh")
    run = subprocess.run([str(SGLANG_PYTHON), "-c", SGLANG_PROBE], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": SGLANG_TEST_PATH})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert frozenset(out["config_features"]) == SGLANG_FEATURES
    for r, scaling, plain, attrs in out["scaling"]:
        assert scaling == plain and attrs == [], out


# -- the matrix and its page ---------------------------------------------------------------
def test_docs_coverage_md_is_the_matrix():
    """docs/coverage.md is generated: `python -m tests.coverage_matrix` rewrites it."""
    text = coverage_matrix.render()
    on_disk = (REPO / "docs" / "coverage.md").read_text() if (
        REPO / "docs" / "coverage.md").exists() else ""
    assert on_disk == text, ("docs/coverage.md is not the matrix; run "
                             "`python -m tests.coverage_matrix`. The new text:\n" + text)


def test_every_cell_names_a_test_that_exists_and_the_engines_agree():
    """Each cell's proof is a test function in this repository; the config-feature rows say
    what each bridge's Coverage.config_features says."""
    defined = {}
    for path in (REPO / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text())
        defined[path.name] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for row in coverage_matrix.ROWS:
        for engine, cell in row.cells.items():
            assert cell.proofs, (row.name, engine)
            for proof in cell.proofs:
                file, _, fn = proof.partition("::")
                assert fn in defined.get(file.removeprefix("tests/"), ()), (row.name, proof)
        if row.name in CONFIG_FEATURES:
            assert row.cells["vllm"].served == (row.name in vllm_coverage().config_features)
            assert row.cells["sglang"].served == (row.name in SGLANG_FEATURES)


REFUSED_ADAPTERS = {
    # row -> (tensors changed, config changed) of a plain rank-8 all-linear adapter
    # as PEFT writes them: the module in target_modules, and its tensors
    "tied embeddings": ({}, {"target_modules": ["embed_tokens", "lm_head", "q_proj"],
                             "ensure_weight_tying": True}),
    "modules_to_save": ({}, {"modules_to_save": ["lm_head"]}),
    "DoRA": ({"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
              torch.ones(128)}, {"use_dora": True}),
    "bias": ({}, {"bias": "lora_only"}),
    "LoRA bias": ({}, {"lora_bias": True}),
    "MoE experts, fused 3-D": ({"base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight":
                     torch.ones(8, 8, 128),
                     "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight":
                     torch.ones(8, 512, 8)}, {"target_parameters": ["mlp.experts.gate_up_proj"]}),
}


def refused_adapter(make_adapter, row: str, seed: int) -> LoRAAdapter:
    base = make_adapter(seed)
    tensors, config = REFUSED_ADAPTERS[row]
    variants = [LoRAAdapter({**base.tensors, **tensors}, {**base.config, **config})]
    if tensors:  # the tensors alone, under a config that does not say so, too
        variants.append(LoRAAdapter({**base.tensors, **tensors}, base.config))
    return variants


def test_refused_rows_are_refused_by_code_on_each_engine(make_adapter, tiny_spec):
    """Rows refused on every engine: check_adapter with each engine's coverage gives the
    matrix's code, whatever the engine (these refusals do not depend on it)."""
    for row in coverage_matrix.ROWS:
        if row.name not in REFUSED_ADAPTERS:
            continue
        for engine in ("vllm", "sglang"):
            cell = row.cells[engine]
            assert not cell.served
            for adapter in refused_adapter(make_adapter, row.name, 40):
                with pytest.raises(BadAdapter) as e:
                    check_adapter(adapter.specs(), adapter.config, spec_for(tiny_spec, engine))
                assert e.value.code == cell.code, (row.name, engine, e.value.message)


def test_refused_rows_leave_the_previous_version_serving(fake_client, make_adapter):
    """The same adapters pushed to a server (fake engine): each is a 400 with its row's
    code, and the version pushed before keeps serving."""
    c = fake_client
    c.push(make_adapter(seed=41), "cov-refused", transport="tensors")
    before = greedy(c, "cov-refused")
    for row in coverage_matrix.ROWS:
        if row.name not in REFUSED_ADAPTERS:
            continue
        for adapter in refused_adapter(make_adapter, row.name, 42):
            with pytest.raises(LoRASyncError) as e:
                c.push(adapter, "cov-refused", transport="tensors")
            assert (e.value.status, e.value.code) == (400, row.cells["vllm"].code), row.name
            assert versions_of(c, "cov-refused") == [1]
            assert greedy(c, "cov-refused") == before


# -- real servers ------------------------------------------------------------------------------
def disk_text(client, adapter, tag: str, tmp_path: Path) -> list[int]:
    """What the engine's own disk route serves for these weights."""
    name = f"cov-disk-{tag}-{time.monotonic_ns() % 10 ** 9}"
    adapter.save(tmp_path / name)
    client.load_from_disk(str(tmp_path / name), name)
    try:
        return server_greedy(client, disk_model(client, name), PROMPT, N_TOKENS)
    finally:
        client.unload_from_disk(name)


def served_cases(engine: str) -> list[str]:
    return [case for case in CASES if coverage_matrix.cell_for_case(case, engine).served]


def served_as_disk_and_peft(c, engine: str, case: str, seed: int, name: str, model_dir,
                            workdir) -> list:
    """Pushes the case's adapter by every transport its matrix cell names (tensors first):
    each serves PEFT's tokens, and so does the engine's disk route. Returns them."""
    adapter, want = oracle(model_dir, seed, PROMPT, N_TOKENS, **CASES[case])
    transports = coverage_matrix.cell_for_case(case, engine).transports.split(", ")
    assert transports[0] == "tensors", case
    for transport in transports:
        res = push_by(c, adapter, name, transport)
        assert res.transport == transport
        assert server_greedy(c, res.name, PROMPT, N_TOKENS) == want, (case, transport)
    assert disk_text(c, adapter, name, workdir) == want, case
    return want


def test_vllm_serves_per_module_ranks_alphas_and_rslora_as_disk_and_peft(vllm, model_dir,
                                                                        workdir):
    """Every case the matrix says vLLM serves, pushed by each transport its cell names: the
    same tokens as vLLM's disk route and as PEFT's forward (and not the base model's)."""
    with LoRASyncClient(vllm.url, engine="vllm", api_key=vllm.api_key) as c:
        base = server_greedy(c, "base", PROMPT, N_TOKENS)
        for i, case in enumerate(served_cases("vllm")):
            want = served_as_disk_and_peft(c, "vllm", case, 700 + i, f"cov-v-{i}",
                                           model_dir, workdir)
            assert want != base, case
    assert vllm.alive(), vllm.log_tail()


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(config=feature_mixes(), seed=st.integers(0, 2 ** 16))
def test_random_feature_mixes_serve_pefts_tokens_on_a_real_vllm(vllm, model_dir, config, seed):
    """A few random mixes (fixed examples: derandomized) pushed to the real vLLM server: each
    serves PEFT's greedy tokens."""
    adapter, want = oracle(model_dir, seed, PROMPT, N_TOKENS, **config)
    with LoRASyncClient(vllm.url, engine="vllm", api_key=vllm.api_key) as c:
        [res] = c.push(adapter, "cov-mix", transport="tensors")
        assert server_greedy(c, res.name, PROMPT, N_TOKENS) == want, config


def test_sglang_serves_what_it_reads_and_refuses_what_it_would_serve_wrong(sglang, model_dir,
                                                                          workdir):
    """SGLang: the cases it serves are token-identical to its disk route and to PEFT; the
    ones it would serve wrong are refused by name (400 unsupported_module), the version
    before keeps serving, and SGLang's own disk route on this server refuses them with the
    same code (unchecked, it served the weights as if the feature were absent: alpha_pattern,
    use_rslora; rank_pattern's other ranks failed SGLang's buffer-shape assert)."""
    with LoRASyncClient(sglang.url, engine="sglang", api_key=sglang.api_key) as c:
        for i, case in enumerate(served_cases("sglang")):
            served_as_disk_and_peft(c, "sglang", case, 800 + i, f"cov-s-{i}",
                                    model_dir, workdir)
        adapter, _ = oracle(model_dir, 850, PROMPT, N_TOKENS, **CASES["rank below max"])
        [res] = c.push(adapter, "cov-s-keep", transport="tensors")
        before = server_greedy(c, "cov-s-keep", PROMPT, N_TOKENS)
        for i, case in enumerate(c_ for c_ in CASES if c_ not in served_cases("sglang")):
            cell = coverage_matrix.cell_for_case(case, "sglang")
            adapter, want = oracle(model_dir, 860 + i, PROMPT, N_TOKENS, **CASES[case])
            with pytest.raises(LoRASyncError) as e:
                c.push(adapter, "cov-s-keep", transport="tensors")
            assert (e.value.status, e.value.code) == (400, cell.code), case
            assert cell.feature in e.value.message, e.value.message
            assert versions_of(c, "cov-s-keep") == [res.version]
            assert server_greedy(c, "cov-s-keep", PROMPT, N_TOKENS) == before
            if case in WITHOUT:
                _, plain = oracle(model_dir, 860 + i, PROMPT, N_TOKENS, **WITHOUT[case])
                assert plain != want, case  # the feature changes the output
            # SGLang's own disk route on this server: the same verdict (it used to serve
            # these weights as if the feature were absent)
            with pytest.raises(LoRASyncError) as e:
                disk_text(c, adapter, f"sw{i}", workdir)
            assert (e.value.status, e.value.code) == (400, cell.code), case
    assert sglang.alive(), sglang.log_tail()
