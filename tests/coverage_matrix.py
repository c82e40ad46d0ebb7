"""The coverage matrix: PEFT features (rows) x engine, each cell "served" (token-identical
to the engine's own disk route and to PEFT's forward, on the transports it names) or
"refused" (the 4xx code lora-sync answers, and why). docs/coverage.md is rendered from it;
tests/test_coverage.py checks the page, that every cell names tests that exist, and the
cells themselves. Rewrite the page with:

    python -m tests.coverage_matrix
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "coverage.md"
ENGINES = ("vllm", "sglang")
VLLM_ALL = "tests/test_coverage.py::test_vllm_serves_per_module_ranks_alphas_and_rslora_as_disk_and_peft"
SGLANG_ALL = ("tests/test_coverage.py::"
              "test_sglang_serves_what_it_reads_and_refuses_what_it_would_serve_wrong")
BY_ENGINE = "tests/test_coverage.py::test_each_engine_serves_or_refuses_each_case_by_name"
REFUSED_BY_CODE = "tests/test_coverage.py::test_refused_rows_are_refused_by_code_on_each_engine"
PREVIOUS_SERVES = "tests/test_coverage.py::test_refused_rows_leave_the_previous_version_serving"
SGLANG_CODE = "tests/test_coverage.py::test_sglang_reads_no_config_feature_and_its_coverage_says_so"
MOE_SERVED = "tests/test_moe_serving.py::test_moe_lora_syncs_as_disk_and_peft_on_each_engine"
MOE_CHECKED = "tests/test_moe_serving.py::test_expert_adapters_are_checked_against_the_models_experts"
MOE_LEFT_OUT = ("tests/test_moe_serving.py::"
                "test_a_block_with_experts_left_out_is_refused_where_the_engine_needs_it_whole")
MOE_SHARED = "tests/test_moe_serving.py::test_a_shared_expert_is_refused_by_name"


@dataclass(frozen=True)
class Cell:
    served: bool
    why: str
    proofs: tuple[str, ...]
    transports: str = ""       # served: the transports proven on a real server
    code: str | None = None    # refused: the 4xx code
    feature: str = ""          # refused: the name its message gives


def served(why, proofs, transports="tensors"):
    return Cell(True, why, tuple(proofs), transports)


def refused(code, feature, why, proofs):
    return Cell(False, why, tuple(proofs), code=code, feature=feature)


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    cells: dict
    case: str | None = None  # tests/test_coverage.py CASES key, for the rows served somewhere


# Why an engine-independent refusal: lora-sync's own check (lora_sync/adapter.py).
OURS = ("lora-sync's check_adapter takes 2-D lora_A/lora_B pairs on the base model's "
        "nn.Linear layers only")


def both(cell):
    return {"vllm": cell, "sglang": cell}


ROWS = (
    Row("rank_pattern", "per-module ranks (PEFT `rank_pattern`, keys matched as PEFT does)", {
        "vllm": served("vllm/lora/peft_helper.py PEFTHelper.get_rank_and_scaling; slots sized "
                       "by --max-lora-rank", [VLLM_ALL, BY_ENGINE], "tensors, shm, broadcast"),
        "sglang": refused("unsupported_module", "rank_pattern",
                          "sglang/srt/lora/lora_config.py LoRAConfig reads r only; "
                          "mem_pool.py load_lora_weight_to_buffer asserts every weight has "
                          "rank r (in the scheduler)", [SGLANG_ALL, BY_ENGINE, SGLANG_CODE]),
    }, "rank_pattern"),
    Row("rank_pattern giving every module r", "a `rank_pattern` that changes no rank", {
        "vllm": served("as rank_pattern", [VLLM_ALL, BY_ENGINE]),
        "sglang": served("ignored, and it changes nothing", [SGLANG_ALL, BY_ENGINE]),
    }, "rank_pattern giving every module r"),
    Row("alpha_pattern", "per-module alphas (PEFT `alpha_pattern`)", {
        "vllm": served("vllm/lora/peft_helper.py PEFTHelper.get_rank_and_scaling",
                       [VLLM_ALL, BY_ENGINE]),
        "sglang": refused("unsupported_module", "alpha_pattern",
                          "sglang/srt/lora/lora.py LoRAAdapter.__init__: one scaling "
                          "lora_alpha / r for every module; its disk route serves the adapter "
                          "as if alpha_pattern were absent", [SGLANG_ALL, BY_ENGINE, SGLANG_CODE]),
    }, "alpha_pattern"),
    Row("use_rslora", "rsLoRA scaling lora_alpha / sqrt(r)", {
        "vllm": served("vllm/lora/peft_helper.py PEFTHelper._scaling", [VLLM_ALL, BY_ENGINE]),
        "sglang": refused("unsupported_module", "use_rslora",
                          "sglang/srt/lora/lora.py LoRAAdapter.__init__ scales by lora_alpha / r "
                          "(LoRAConfig does not read use_rslora); its disk route serves the "
                          "adapter as plain LoRA", [SGLANG_ALL, BY_ENGINE, SGLANG_CODE]),
    }, "use_rslora"),
    Row("use_rslora at r=1", "rsLoRA where sqrt(r) = r", {
        "vllm": served("as use_rslora", [VLLM_ALL, BY_ENGINE]),
        "sglang": served("ignored, and it changes nothing", [SGLANG_ALL, BY_ENGINE]),
    }, "use_rslora at r=1"),
    Row("layers_to_transform", "adapters on some layers only", both(
        served("the engine zeroes the slots of the layers an adapter lacks (vLLM set_lora / "
               "reset_lora, SGLang mem_pool.load_lora_weight_to_buffer)",
               [VLLM_ALL, SGLANG_ALL, BY_ENGINE])), "layers_to_transform"),
    Row("rank below max", "r below the server's --max-lora-rank", both(
        served("the adapter fills the first r rows of its slot",
               [VLLM_ALL, SGLANG_ALL, BY_ENGINE])), "rank below max"),
    Row("embed_tokens", "LoRA on the input embedding (PEFT `lora_embedding_A` / `_B`)", {
        "vllm": served("vllm/lora/layers/vocab_parallel_embedding.py "
                       "VocabParallelEmbeddingWithLoRA (the model's embedding_modules); "
                       "LoRAModel.from_lora_tensors checks lora_embedding_A against the vocabulary",
                       [VLLM_ALL, BY_ENGINE], "tensors, shm, broadcast"),
        "sglang": served("sglang/srt/lora/lora.py _process_weight keeps it in embedding_layers; "
                         "mem_pool.py copies it into embedding_A/B buffers (--lora-target-modules "
                         "all includes embed_tokens)", [SGLANG_ALL, BY_ENGINE],
                         "tensors, shm, broadcast"),
    }, "embed_tokens"),
    Row("lm_head", "LoRA on the LM head", {
        "vllm": served("vllm/lora/model_manager.py wraps lm_head's logits processor in "
                       "LogitsProcessorWithLoRA", [VLLM_ALL, BY_ENGINE],
                       "tensors, shm, broadcast"),
        "sglang": served("sglang/srt/lora/mem_pool.py lm_head_A/B buffers, "
                         "layers.py ParallelLMHeadWithLoRA", [SGLANG_ALL, BY_ENGINE],
                         "tensors, shm, broadcast"),
    }, "lm_head"),
    Row("tied embeddings", "LoRA on embed_tokens or lm_head of a model that ties them "
        "(`tie_word_embeddings`, PEFT `ensure_weight_tying`)", both(refused(
            "unsupported_module", "tied embeddings",
            "PEFT adapts a tied weight through one module; neither engine's tied layers were "
            "checked against PEFT's forward, so lora-sync refuses rather than guesses",
            [REFUSED_BY_CODE, PREVIOUS_SERVES, "tests/test_coverage.py::"
             "test_vocabulary_layers_are_checked_by_shape_name_form_and_tying"]))),
    Row("modules_to_save", "fully trained copies of modules", both(refused(
        "unsupported_module", "modules_to_save",
        "vLLM's PEFTHelper._validate_features refuses it (but for classifier heads); "
        "SGLang's LoRAConfig and LoRAAdapter read no modules_to_save (it would be served "
        "without them)", [REFUSED_BY_CODE, PREVIOUS_SERVES]))),
    Row("DoRA", "`use_dora` / lora_magnitude_vector", both(refused(
        "unsupported_module", "DoRA",
        "vLLM's PEFTHelper._validate_features and SGLang's lora_manager.py "
        "LoRAManager.validate_new_adapter refuse it",
        [REFUSED_BY_CODE, PREVIOUS_SERVES]))),
    Row("bias", "`bias` other than none", both(refused(
        "unsupported_module", "bias",
        "vLLM's PEFTHelper.validate_legal refuses it; it trains the base layers' biases, "
        "which no LoRA slot holds",
        [REFUSED_BY_CODE, PREVIOUS_SERVES]))),
    Row("LoRA bias", "`lora_bias` (a bias on lora_B)", both(refused(
        "unsupported_module", "LoRA bias",
        "vLLM's PEFTHelper._validate_features refuses it; SGLang's LoRAConfig reads no "
        "lora_bias (it would be served without it)",
        [REFUSED_BY_CODE, PREVIOUS_SERVES]))),
    Row("MoE attention", "LoRA on the attention layers of an MoE model (Qwen3-MoE, 8 experts, "
        "top-2)", both(served(
            "needs no expert LoRA; on a CPU the MoE layers run through TEST-ONLY torch "
            "stand-ins (see MoE experts)", [MOE_SERVED]))),
    Row("MoE experts", "routed-expert LoRA, per expert (`<experts>.<e>.<gate_proj, up_proj or "
        "down_proj>.lora_A/B.weight`); PEFT's `target_parameters` converted to it by "
        "`LoRAAdapter.from_peft_model`", {
            "vllm": served("vllm/lora/layers/fused_moe.py FusedMoEWithLoRA reads per-expert "
                           "pairs. vLLM 0.32 runs them (and any request on a LoRA-enabled MoE "
                           "model) with Triton only: on a CPU build lora-sync refuses every "
                           "push (`model_unsupported`); the tests run a TEST-ONLY torch "
                           "stand-in for TritonExperts.apply (tests/vllm_moe_standin)",
                           [MOE_SERVED, MOE_CHECKED], "tensors, shm, broadcast"),
            "sglang": served("sglang/srt/lora/mem_pool.py reads per-expert pairs (--lora-target-"
                             "modules all adds gate_up_proj/down_proj). On a CPU its MoE LoRA "
                             "path is Triton only: the tests run TEST-ONLY torch stand-ins for "
                             "the fused-MoE runner core, fused_moe_lora and "
                             "moe_lora_align_block_size (tests/sgl_kernel_standin)",
                             [MOE_SERVED, MOE_CHECKED], "tensors, shm, broadcast"),
        }),
    Row("MoE experts, some left out", "routed-expert LoRA on some experts of a block only, "
        "or on an expert without all of gate_proj, up_proj and down_proj", {
            "vllm": refused("unsupported_module", "zero lora_B",
                            "vllm/lora/lora_weights.py LoRALayerWeights.pack_moe asserts that "
                            "every expert of the block has all three: send the "
                            "ones left out with a zero lora_B, which changes nothing",
                            [MOE_LEFT_OUT, MOE_SERVED]),
            "sglang": served("served with the experts it has, token-identical to SGLang's own "
                             "disk route",
                             [MOE_LEFT_OUT, MOE_SERVED]),
        }),
    Row("MoE shared experts and router", "LoRA on an MoE block's shared expert "
        "(Qwen2-MoE `shared_expert`) or its router", both(refused(
            "unknown_module", "shared experts",
            "not checked against PEFT's forward on either engine (SGLang names shared experts "
            "like the routed ones, so they cannot be adapted apart): every linear layer of an "
            "MoE block other than its routed experts is refused", [MOE_SHARED]))),
    Row("MoE experts, fused 3-D", "PEFT `target_parameters` tensors as PEFT saves them "
        "(lora_A [E*r, in] per fused parameter), sent as they are", both(refused(
            "unsupported_module", "target_parameters",
            "neither engine reads PEFT's fused form the way PEFT computes it (SGLang 0.5.23's "
            "disk route accepts it and its scheduler dies on the first request): send it per "
            "expert", [REFUSED_BY_CODE, PREVIOUS_SERVES, MOE_CHECKED]))),
)


def cell_for_case(case: str, engine: str) -> Cell:
    return next(row.cells[engine] for row in ROWS if row.case == case)


def _cell_text(cell: Cell) -> str:
    if cell.served:
        return f"served ({cell.transports}): {cell.why}"
    return f"refused: `{cell.code}` ({cell.why})"


def render() -> str:
    lines = [
        "# Coverage: which PEFT features each engine serves",
        "",
        "<!-- Generated by `python -m tests.coverage_matrix` from tests/coverage_matrix.py; "
        "tests/test_coverage.py fails when this page differs. Do not edit by hand. -->",
        "",
        "The rule: lora-sync serves every adapter the engine serves correctly from disk, "
        "token for token, and refuses with a 4xx naming the feature what the engine would "
        "refuse or serve wrongly. \"Served\" cells are token-identical to the engine's own "
        "disk route and to PEFT's forward pass (transformers, float32, greedy) on a real "
        "server, on the transports named. \"Refused\" cells answer 400 with the code shown "
        "and the previous version keeps serving. Engines: vLLM 0.32 and SGLang 0.5.23 on CPU. "
        "What each engine reads is its bridge's `Coverage` (`vllm_ext/bridge.py`, "
        "`sglang_ext/bridge.py`: `config_features`), which also travels to the trainer in "
        "`lora_sync_info`, so a broadcast is refused before any transfer.",
        "",
        "A feature an engine does not read is refused there only where it changes what PEFT "
        "computes: a `rank_pattern` that gives every module `r`, or `use_rslora` at `r = 1`, "
        "is served. Every `rank_pattern` / `alpha_pattern` key must match a module of the "
        "adapter (PEFT's rule: a regular expression matching a suffix of the module name at "
        "a `.`; matching is bounded in time), each module's tensors must have the rank the "
        "config gives it, and no rank may exceed `--max-lora-rank`.",
        "",
        "One adapter, one verdict: the verdict is computed in one place (`check_adapter`, "
        "then the workers' intake checks) for every way an adapter comes in: each transport, "
        "each input form (a PEFT model, a PEFT directory as PEFT writes it, a state dict, raw "
        "safetensors) and the engine's own load route on a server running lora-sync, which "
        "reads the directory's config and tensor header first and refuses a path it cannot "
        "check (`bad_adapter_dir`: not a local directory, pickle weights). PEFT's copies of "
        "a vocabulary layer's base weight (`save_embedding_layers`, on by default) are read "
        "by no engine's disk loader and are skipped on every path "
        "(tests/test_one_verdict.py, generated adapters).",
        "",
        "One output per name: no adapter changes another name's output, base included, alone "
        "or in the same batch. vLLM's CPU LoRA ops give a row without an adapter (index -1) "
        "the last slot's weights; lora-sync masks those rows in every worker "
        "(`vllm_ext.engine_api.mask_unadapted_rows`; tests/test_no_cross_talk.py runs random "
        "pushes, retirements and mixed batches of linear, embedding and LM-head adapters on "
        "both engines).",
        "",
        "| Feature | What | vLLM 0.32 | SGLang 0.5.23 |",
        "|---|---|---|---|",
    ]
    for row in ROWS:
        cells = " | ".join(_cell_text(row.cells[e]).replace("|", "\\|") for e in ENGINES)
        lines.append(f"| `{row.name}` | {row.what} | {cells} |")
    lines += ["", "Tests that prove each cell:", ""]
    for row in ROWS:
        for engine in ENGINES:
            proofs = ", ".join(f"`{p}`" for p in row.cells[engine].proofs)
            lines.append(f"- `{row.name}` on {engine}: {proofs}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
