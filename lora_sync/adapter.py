"""The adapter value that travels from trainer to workers: PEFT-named tensors + PEFT config.

Also the checks that decide, from the header alone, whether a base model can serve it."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from . import moe, peft_cache, wire
from .errors import BadAdapter
from .fields import loads

# Header metadata keys of the wire format (docs/protocol.md).
META_NAME, META_CONFIG, META_VERSION, META_CHECKSUM = (
    "lora_name", "adapter_config", "version", "checksum")

# target_modules entries: one per LoRA pair at most (a config may name every module in full;
# each is looked up in ModelSpec's suffix index).
MAX_TARGETS = wire.MAX_TENSORS // 2
# PEFT's names: '<module>.lora_A.weight' on a linear layer, '<module>.lora_embedding_A' (a
# parameter, no '.weight') on an embedding.
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<embedding>embedding_)?"
                       r"(?P<half>[AB])(?:\.default)?(?(embedding)|\.weight)$")
# The vocabulary layers: the input embedding and the LM head.
VOCAB_LAYERS = ("embed_tokens", "lm_head")


# PEFT's save_embedding_layers (on by default when a vocabulary layer is adapted): a full
# copy of that layer's frozen base weight, '<module>.base_layer.weight'.
_BASE_COPY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.base_layer\.weight$")


def is_base_copy(key: str) -> bool:
    """Whether `key` is PEFT's copy of a vocabulary layer's base weight. Not a LoRA weight:
    both engines' disk loaders skip it (vLLM: is_base_embedding_weights), so every path
    skips it too (`lora_weights`, check_adapter, the workers' intake) and an adapter gets one
    verdict whether the copy is there or not."""
    if not key.endswith(_BASE_SUFFIX):  # the regex only where it can match: every push
        return False                    # asks of every tensor
    m = _BASE_COPY.match(key)
    return m is not None and m["module"].rsplit(".", 1)[-1] in VOCAB_LAYERS


_BASE_SUFFIX = ".base_layer.weight"


def lora_weights(tensors: dict) -> dict:
    """`tensors` less PEFT's vocabulary base copies (is_base_copy)."""
    if not any(k.endswith(_BASE_SUFFIX) for k in tensors) \
            or not any(is_base_copy(k) for k in tensors):
        return tensors
    return {k: v for k, v in tensors.items() if not is_base_copy(k)}


def parse_peft_key(key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight' -> ('model.layers.0.mlp.up_proj', 'A');
    'base_model.model.model.embed_tokens.lora_embedding_B' -> ('model.embed_tokens', 'B')."""
    return _parse_key(key)[:2]


def _parse_key(key: str) -> tuple[str, str, bool]:
    """(module, half, whether the key has PEFT's embedding form)."""
    if "modules_to_save" in key or "lora_magnitude" in key:
        what = "modules_to_save" if "modules_to_save" in key else "DoRA magnitude"
        raise BadAdapter(f"tensor {key!r}: {what} weights are not supported; only "
                         "lora_A/lora_B pairs can be synced", code="unsupported_module")
    m = _PEFT_KEY.match(key)
    if not m:
        if key.endswith(".base_layer.weight"):
            raise BadAdapter(f"tensor {key!r} is a base layer's weight, not a LoRA weight; "
                             "only the vocabulary layers' copies PEFT saves "
                             f"(save_embedding_layers, on {'/'.join(VOCAB_LAYERS)}) are "
                             "accepted, and ignored", code="unknown_tensor")
        raise BadAdapter(f"tensor {key!r} is not a PEFT LoRA weight name "
                         "(expected '<module>.lora_A.weight' or '<module>.lora_B.weight', or "
                         "'<module>.lora_embedding_A' / '_B' on an embedding)",
                         code="unknown_tensor")
    return m["module"], m["half"], bool(m["embedding"])


# Projections engines fuse into one layer, in the order they stack their LoRA weights
# (qkv_proj, gate_up_proj in vLLM and SGLang).
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_SIBLING = {leaf: (group, i) for group, leaves in enumerate(FUSED_SIBLINGS)
            for i, leaf in enumerate(leaves)}


def sibling_order(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with each fused group's lora_A tensors back to back in stacking order,
    then its lora_B ones (where the group's first tensor was), the rest as they came. An
    engine that stacks siblings can then view them as one instead of concatenating: the
    bytes sent are the same, only their order in the file."""
    order, groups = [], {}
    for key in tensors:
        m = _PEFT_KEY.match(key)
        parent, _, leaf = m["module"].rpartition(".") if m else ("", "", "")
        sibling = _SIBLING.get(leaf)
        if sibling is None:
            order.append(key)
            continue
        group = (parent, sibling[0], m["half"])
        if group not in groups:
            groups[group] = []
            order.append(group)
        groups[group].append((sibling[1], key))
    keys = [k for item in order
            for k in ([item] if isinstance(item, str) else [k for _, k in sorted(groups[item])])]
    return tensors if keys == list(tensors) else {k: tensors[k] for k in keys}


def _jsonable(x):
    if isinstance(x, (set, frozenset, tuple)):
        return sorted(x) if isinstance(x, (set, frozenset)) else list(x)
    if hasattr(x, "value"):  # enums such as TaskType
        return x.value
    return str(x)


@dataclass
class LoRAAdapter:
    """A LoRA adapter: tensors keyed by PEFT names and the PEFT adapter_config dict."""
    tensors: dict[str, torch.Tensor]
    config: dict = field(default_factory=dict)

    def __post_init__(self):
        self.tensors = lora_weights(self.tensors)  # never sent: no engine reads them
        self.config = normalize_config(self.config, self.tensors.keys())
        self.tensors = sibling_order(self.tensors)

    @classmethod
    def copy_of(cls, adapter: "LoRAAdapter", tensors: dict[str, torch.Tensor]) -> "LoRAAdapter":
        """`adapter` with `tensors` in place of its own: a copy of them, under the same names in
        the same order (what a push kept)."""
        if list(tensors) != list(adapter.tensors):
            raise ValueError("a copy of an adapter has its tensors' names, in its order")
        return cls.normalized(tensors, dict(adapter.config))

    @classmethod
    def normalized(cls, tensors: dict[str, torch.Tensor], config: dict) -> "LoRAAdapter":
        """An adapter of tensors and config that a LoRAAdapter normalized once already (names,
        order, config): doing it again walks every tensor's name, on every push."""
        adapter = cls.__new__(cls)
        adapter.tensors, adapter.config = tensors, config
        return adapter

    @classmethod
    def from_peft_model(cls, model, adapter_name: str = "default") -> "LoRAAdapter":
        """The adapter of a PEFT model, its tensors sharing the parameters' memory: read
        through PEFT the first time, then straight from the same parameters while they stay
        the adapter's (peft_cache: PEFT's read walks the whole model at every call)."""
        return peft_cache.read(model, adapter_name, cls._through_peft, cls.normalized)

    @classmethod
    def _through_peft(cls, model, adapter_name: str) -> "LoRAAdapter":
        state = peft_state(model, adapter_name)
        config = model.peft_config[adapter_name].to_dict()
        # LoRA on fused experts (target_parameters) travels in the engines' per-expert form.
        tensors, config = moe.per_expert({k: v.detach() for k, v in state.items()}, config,
                                         moe.peft_parameter_wrappers(model, adapter_name))
        return cls(tensors, config)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "LoRAAdapter":
        """Reads a PEFT directory (adapter_config.json + adapter_model.safetensors)."""
        from safetensors.torch import load_file
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        return cls(load_file(os.path.join(path, "adapter_model.safetensors")), config)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the adapter as a PEFT directory that vLLM/SGLang load from disk."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(self.config, f)
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
            for chunk in wire.encode(self.tensors, {"format": "pt"}):
                f.write(chunk)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def specs(self) -> list[wire.TensorSpec]:
        return [wire.TensorSpec.of(k, t) for k, t in self.tensors.items()]

    def checksum(self) -> str:
        """sha256 over tensor names and bytes in order: what the server recomputes."""
        return tensors_checksum(self.tensors)

    def metadata(self, name: str, version: int | None = None,
                 with_checksum: bool = False) -> dict[str, str]:
        meta = {META_NAME: name, META_CONFIG: json.dumps(self.config)}
        if version is not None:
            meta[META_VERSION] = str(int(version))
        if with_checksum:
            meta[META_CHECKSUM] = self.checksum()
        return meta

    def encode(self, name: str, version: int | None = None, with_checksum: bool = False):
        """The HTTP body as a list of chunks (header, then zero-copy tensor views)."""
        return wire.encode(self.tensors, self.metadata(name, version, with_checksum))


def parse_config(raw: str | None) -> dict:
    """PEFT's adapter_config.json text, as sent in the metadata or the broadcast request."""
    if raw is None:
        raise BadAdapter(f"safetensors __metadata__ has no {META_CONFIG!r} (the JSON text of "
                         "PEFT's adapter_config.json)", code="missing_metadata")
    try:
        cfg = loads(raw, META_CONFIG, code="bad_config")
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise BadAdapter(f"{META_CONFIG} is not valid JSON: {str(e)[:200]}",
                         code="bad_config") from e
    if not isinstance(cfg, dict):
        raise BadAdapter(f"{META_CONFIG} must be a JSON object", code="bad_config")
    return cfg


# A float is NaN or Inf exactly when all its exponent bits are set: checking the bits on an
# integer view is several times cheaper than torch.isfinite on CPU.
_EXPONENT = {torch.float32: (torch.int32, 0x7F800000), torch.float16: (torch.int16, 0x7C00),
             torch.bfloat16: (torch.int16, 0x7F80)}


def check_finite(tensors: dict[str, torch.Tensor], enabled: bool) -> None:
    """NaN/Inf weights would poison every request on the version: refuse them."""
    if not enabled:
        return
    for name, t in tensors.items():
        as_int, mask = _EXPONENT[t.dtype]
        if t.numel() and int((t.view(as_int) & mask).max()) == mask:
            raise BadAdapter(f"tensor {name!r} contains NaN or Inf values", code="non_finite")


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(wire.as_bytes(t))
    return "sha256:" + h.hexdigest()


def normalize_config(config: dict, tensor_names) -> dict:
    """A JSON-safe PEFT config with `target_modules` as an explicit sorted list.

    PEFT's 'all-linear' (and a config that lost its list) becomes the module base names
    that actually carry tensors, which is what both engines need."""
    if not isinstance(config, dict):
        raise BadAdapter("adapter_config must be a JSON object", code="bad_config")
    try:
        cfg = json.loads(json.dumps(config, default=_jsonable))
    except (RecursionError, ValueError) as e:
        raise BadAdapter(f"adapter_config cannot be read as JSON: {type(e).__name__}",
                         code="bad_config") from e
    targets = cfg.get("target_modules")
    if targets == "all-linear" or targets is None:
        bases = set()
        for key in tensor_names:
            module, _ = parse_peft_key(key)
            bases.add(module.rsplit(".", 1)[-1])
        cfg["target_modules"] = sorted(bases)
    elif isinstance(targets, str):
        raise BadAdapter(f"adapter_config target_modules is the pattern {targets!r}; send an "
                         "explicit list of module names (or 'all-linear')", code="bad_config")
    elif isinstance(targets, list) and len(targets) <= MAX_TARGETS:
        cfg["target_modules"] = sorted(set(map(str, targets)))
    else:
        raise BadAdapter(f"adapter_config target_modules must be a list of at most "
                         f"{MAX_TARGETS} names", code="bad_config")
    return cfg


@dataclass(frozen=True)
class FusedLayer:
    """One layer an engine builds from several projections of the same parent module (q/k/v
    -> qkv_proj), and the projections it needs whenever an adapter adapts any of them."""
    name: str
    parts: tuple[str, ...]  # the PEFT projections, in the order the engine stacks them
    needs: frozenset[str] = frozenset()


# PEFT config fields that set each module's rank and scaling (PEFT: LoraModel._create_and_replace
# and LoraLayer.update_layer). An engine that does not read one serves an adapter that uses
# it with r, lora_alpha and lora_alpha / r everywhere: check_config_features refuses it there
# wherever that differs from what PEFT computes.
CONFIG_FEATURES = ("rank_pattern", "alpha_pattern", "use_rslora")


@dataclass(frozen=True)
class Coverage:
    """What one engine's LoRA layers can serve beyond the base model's shapes and the max
    rank: the rows of the coverage matrix (docs/coverage.md). Each engine's bridge
    fills it from that engine's code; check_adapter applies it on the server, and the
    trainer applies the same one (it travels in lora_sync_info) before a broadcast. The
    default constrains nothing: what an old server's info, or a fake engine, gives.
    `config_features`: the CONFIG_FEATURES the engine reads (and serves as PEFT does).
    `vocab`: the VOCAB_LAYERS it serves LoRA on. `whole_experts`: it serves expert LoRA in
    an MoE block only when every expert of the block has all of moe.PROJECTIONS."""
    engine: str = "the engine"
    fused: tuple[FusedLayer, ...] = ()
    dtypes: frozenset[str] = frozenset(wire.DTYPES)  # safetensors tags
    config_features: frozenset[str] = frozenset(CONFIG_FEATURES)
    vocab: frozenset[str] = frozenset(VOCAB_LAYERS)
    whole_experts: bool = False

    def to_json(self) -> dict:
        return {"engine": self.engine, "dtypes": sorted(self.dtypes),
                "fused": [{"name": f.name, "parts": list(f.parts), "needs": sorted(f.needs)}
                          for f in self.fused],
                "config_features": sorted(self.config_features), "vocab": sorted(self.vocab),
                "whole_experts": self.whole_experts}

    @classmethod
    def from_json(cls, body: dict) -> "Coverage":
        """From a server's lora_sync_info: a malformed entry fails loudly (ValueError)."""
        def names(v, what):
            if not (isinstance(v, list) and len(v) <= 64
                    and all(isinstance(n, str) and 0 < len(n) <= 128 for n in v)):
                raise ValueError(f"lora_sync_info coverage {what} must be a list of names")
            return v
        if not isinstance(body, dict) or not isinstance(body.get("fused", []), list):
            raise ValueError("lora_sync_info coverage must be an object with a 'fused' list")
        fused = []
        for f in body.get("fused", [])[:64]:
            if not isinstance(f, dict):
                raise ValueError("lora_sync_info coverage fused entries must be objects")
            parts = tuple(names(f.get("parts"), "parts"))
            needs = frozenset(names(f.get("needs", []), "needs"))
            if not needs <= set(parts):
                raise ValueError("lora_sync_info coverage needs must be among its parts")
            fused.append(FusedLayer(names([f.get("name")], "name")[0], parts, needs))
        dtypes = frozenset(names(body.get("dtypes", sorted(wire.DTYPES)), "dtypes"))
        # A server from before config_features refuses every one of them itself (check_config).
        features = frozenset(names(body.get("config_features", list(CONFIG_FEATURES)),
                                   "config_features")) & frozenset(CONFIG_FEATURES)
        # A server from before vocab refuses LoRA on the vocabulary layers itself.
        vocab = frozenset(names(body.get("vocab", []), "vocab")) & frozenset(VOCAB_LAYERS)
        if not isinstance(body.get("whole_experts", False), bool):
            raise ValueError("lora_sync_info coverage whole_experts must be true or false")
        return cls(str(body.get("engine", cls.engine))[:64], tuple(fused), dtypes, features,
                   vocab, body.get("whole_experts", False))


@dataclass(frozen=True)
class ModelSpec:
    """What a base model can take: (in_features, out_features) of each LoRA-able linear
    layer, keyed by its Hugging Face module name (the names PEFT keys use), the max rank,
    and what the serving engine covers. `vocab`: the vocabulary layers, (fan in, fan out)
    as a LoRA on them sees it (an embedding: (num_embeddings, embedding_dim)); `embeddings`:
    which of them are nn.Embedding (PEFT names their tensors lora_embedding_A / _B);
    `tied`: the LM head shares the input embedding's weight; `experts`: the routed experts
    of each MoE layer, (experts, hidden, intermediate), LoRA-able per expert (lora_sync.moe)."""
    linear: dict[str, tuple[int, int]]
    max_rank: int
    coverage: Coverage = Coverage()
    vocab: dict[str, tuple[int, int]] = field(default_factory=dict)
    embeddings: frozenset[str] = frozenset()
    tied: bool = False
    experts: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, hf_config, max_rank: int,
                       coverage: Coverage = Coverage()) -> "ModelSpec":
        """Builds the model on the meta device (no memory, no weights) to read its layers."""
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        linear, vocab, embeddings = {}, {}, set()
        experts = moe.expert_layers(model)
        for name, m in model.named_modules():
            is_vocab = name.rsplit(".", 1)[-1] in VOCAB_LAYERS
            if moe.block_of(experts, name) is not None:
                continue  # an MoE block's router and shared experts (lora_sync.moe)
            if isinstance(m, torch.nn.Linear):
                (vocab if is_vocab else linear)[name] = (m.in_features, m.out_features)
            elif isinstance(m, torch.nn.Embedding) and is_vocab:
                vocab[name] = (m.num_embeddings, m.embedding_dim)
                embeddings.add(name)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        tied = bool(getattr(text, "tie_word_embeddings", False))
        return cls(linear, max_rank, coverage, vocab, frozenset(embeddings), tied, experts)

    def info(self) -> dict:
        """The lora_sync_info fields a trainer rebuilds this spec from (`from_info`)."""
        return {"max_lora_rank": self.max_rank,
                "linear_modules": {k: list(v) for k, v in self.linear.items()},
                "vocab_modules": {k: list(v) for k, v in self.vocab.items()},
                "embedding_modules": sorted(self.embeddings), "tied_embeddings": self.tied,
                "expert_modules": {k: list(v) for k, v in self.experts.items()},
                "coverage": self.coverage.to_json()}

    @classmethod
    def from_info(cls, info: dict) -> "ModelSpec":
        coverage = info.get("coverage")
        return cls({k: tuple(v) for k, v in info["linear_modules"].items()},
                   int(info["max_lora_rank"]),
                   Coverage() if coverage is None else Coverage.from_json(coverage),
                   {k: tuple(v) for k, v in info.get("vocab_modules", {}).items()},
                   frozenset(info.get("embedding_modules", [])),
                   bool(info.get("tied_embeddings", False)),
                   {k: tuple(v) for k, v in info.get("expert_modules", {}).items()})

    def layer(self, module: str) -> tuple[int, int] | None:
        """(fan in, fan out) of a LoRA-able module, None when the model has none by that name."""
        return (self.linear.get(module) or self.vocab.get(module)
                or moe.expert_layer(self.experts, module))

    def has_target(self, target: str) -> bool:
        """PEFT matches a target_modules entry against module-name suffixes."""
        return target in self._suffixes

    @functools.cached_property
    def _suffixes(self) -> frozenset[str]:
        # Every '.'-boundary suffix of every module name, once: a config may list thousands
        # of full names, each looked up here.
        names = (*self.linear, *self.vocab)
        return frozenset(self.module_bases).union(
            ".".join(parts[i:]) for parts in (n.split(".") for n in names)
            for i in range(len(parts)))

    @property
    def module_bases(self) -> set[str]:
        return ({n.rsplit(".", 1)[-1] for n in (*self.linear, *self.vocab)}
                | (set(moe.PROJECTIONS) if self.experts else set()))


def check_coverage(modules, coverage: Coverage) -> None:
    """Refuses a fused group (one parent's q/k/v, or gate/up) adapted without the parts the
    engine needs: the engine would take it and fail at load, or at the first request on it
    (SGLang: its scheduler dies)."""
    fused_of = {part: f for f in coverage.fused for part in f.parts}
    groups: dict[tuple[str, FusedLayer], set[str]] = {}
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        if leaf in fused_of:
            groups.setdefault((parent, fused_of[leaf]), set()).add(leaf)
    for (parent, f), have in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1].name)):
        missing = sorted(f.needs - have)
        if missing:
            first = f"{parent}.{min(have)}" if parent else min(have)
            raise BadAdapter(
                f"module {first!r}: {coverage.engine} serves "
                f"{'/'.join(f.parts)} as one layer {f.name} and cannot serve LoRA on "
                f"{', '.join(sorted(have))} without {', '.join(missing)} (it needs "
                f"{', '.join(sorted(f.needs))} wherever it adapts any of them); add "
                f"{', '.join(missing)} with a zero lora_B, which changes nothing",
                code="unsupported_module")


def check_whole_experts(modules, model: "ModelSpec") -> None:
    """Where the engine serves expert LoRA only on whole blocks (Coverage.whole_experts:
    vLLM's LoRALayerWeights.pack_moe asserts every expert has gate, up and down), an MoE
    block whose adapter leaves an expert or a projection out is refused by name."""
    if not model.coverage.whole_experts:
        return
    adapted: dict[str, set[tuple[int, str]]] = {}
    for parts in filter(None, (moe.expert_of(model.experts, m) for m in modules)):
        prefix, index, projection = parts  # the index was checked (expert_layer)
        adapted.setdefault(prefix, set()).add((int(index), projection))
    for prefix, have in sorted(adapted.items()):
        missing = [f"{prefix}.{e}.{p}" for e in range(model.experts[prefix][0])
                   for p in moe.PROJECTIONS if (e, p) not in have]
        if missing:
            raise BadAdapter(
                f"module {missing[0]!r}: {model.coverage.engine} serves expert LoRA only "
                f"when every expert of a block has {', '.join(moe.PROJECTIONS)}; this adapter "
                f"leaves out {len(missing)} of {prefix!r} ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}); add them with a zero lora_B, which "
                "changes nothing", code="unsupported_module")


# PEFT features that change what an adapter computes and that lora-sync does not serve: each
# must be absent or at its default (falsy), on both engines alike. (rank_pattern,
# alpha_pattern and use_rslora are served where the engine reads them: CONFIG_FEATURES.)
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA", "modules_to_save": "modules_to_save", "lora_bias": "LoRA bias",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)", "layer_replication": "layer_replication",
    "alora_invocation_tokens": "Activated LoRA", "use_bdlora": "block-diagonal LoRA",
    "use_qalora": "QALoRA", "megatron_config": "Megatron layers",
    "trainable_token_indices": "trainable tokens",
    # lora_sync.LoRAAdapter.from_peft_model converts it to the per-expert form (lora_sync.moe)
    "target_parameters": "target_parameters (LoRA on fused expert parameters: send it "
                         "per expert, as LoRAAdapter.from_peft_model does)",
    "ensure_weight_tying": "tied embeddings (ensure_weight_tying)"}
# Larger is not a LoRA anyone trained: it overflows float16/bfloat16 activations of every
# request batched with it (observed: 1e38 turned other tenants' outputs to garbage).
MAX_LORA_ALPHA = 65536.0


def check_config(cfg: dict, max_rank: int) -> int:
    """Checks every field of a (normalized) PEFT config that changes the computation; returns
    the rank `r`. Numbers must be finite and in range anywhere in the config."""
    _finite_everywhere(cfg, "adapter_config")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int):
        raise BadAdapter(f"adapter_config r must be an integer, got {type(r).__name__}",
                         code="bad_config")
    if not 1 <= r <= max_rank:
        raise BadAdapter(f"adapter_config r={r if r.bit_length() < 64 else '<huge>'} must be "
                         f"between 1 and the server's max LoRA rank {max_rank} "
                         "(--max-lora-rank)", code="rank_too_large" if r > 0 else "bad_config")
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or \
            not 0 < alpha <= MAX_LORA_ALPHA:
        raise BadAdapter(f"adapter_config lora_alpha must be a number in (0, {MAX_LORA_ALPHA:g}]"
                         f", got {str(alpha)[:40]}", code="bad_config")
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise BadAdapter("adapter_config use_rslora must be true or false", code="bad_config")
    _check_patterns(cfg, max_rank)
    if cfg.get("bias", "none") != "none":
        raise BadAdapter(f"adapter_config bias={str(cfg['bias'])[:40]!r} is not supported; "
                         "only 'none'", code="unsupported_module")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica",
                                                        "lora_ga"):
        raise BadAdapter(f"adapter_config init_lora_weights={init[:40]!r} modifies the base "
                         "model; convert the adapter to a plain LoRA", code="unsupported_module")
    for flag, what in UNSUPPORTED_FEATURES.items():
        if cfg.get(flag):
            raise BadAdapter(f"adapter_config uses {what}, which lora-sync cannot serve",
                             code="unsupported_module")
    return r


MAX_PATTERN_KEY = 256  # characters of one rank_pattern / alpha_pattern key
# Keys of one rank_pattern / alpha_pattern: regular expressions, each compiled and matched
# (bounded in time by PATTERN_BUDGET_S); configs name a few module kinds.
MAX_PATTERN_KEYS = 1024
# Wall-clock bound on matching every pattern key against every module name of one adapter
# (keys are regular expressions: one can backtrack for ever).
PATTERN_BUDGET_S = 2.0


def _check_patterns(cfg: dict, max_rank: int) -> None:
    """rank_pattern: {key: rank in 1..max_rank}; alpha_pattern: {key: alpha, in lora_alpha's
    range}. The keys are matched against the adapter's modules by module_ranks."""
    for field_name in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(field_name)
        if pattern is None:
            continue
        if not isinstance(pattern, dict) or len(pattern) > MAX_PATTERN_KEYS:
            raise BadAdapter(f"adapter_config {field_name} must be an object of at most "
                             f"{MAX_PATTERN_KEYS} module patterns", code="bad_config")
        for key, value in pattern.items():
            if not 0 < len(key) <= MAX_PATTERN_KEY:
                raise BadAdapter(f"adapter_config {field_name} keys must be 1 to "
                                 f"{MAX_PATTERN_KEY} characters", code="bad_config")
            where = f"adapter_config {field_name}[{key[:60]!r}]"
            ranks = field_name == "rank_pattern"
            if isinstance(value, bool) or not isinstance(value, int if ranks else (int, float)):
                raise BadAdapter(f"{where} must be {'an integer' if ranks else 'a number'}, "
                                 f"got {str(value)[:40]}", code="bad_config")
            if ranks and not 1 <= value <= max_rank:
                raise BadAdapter(
                    f"{where}={value if value.bit_length() < 64 else '<huge>'}: per-module "
                    f"ranks must be between 1 and the server's max LoRA rank {max_rank} "
                    "(--max-lora-rank)", code="rank_too_large" if value > 0 else "bad_config")
            if not ranks and not 0 < value <= MAX_LORA_ALPHA:
                raise BadAdapter(f"{where} must be a number in (0, {MAX_LORA_ALPHA:g}]",
                                 code="bad_config")


# A key a plain `re` matches in bounded time (no quantifier, no group): used when the `regex`
# package (a dependency of transformers, so always on a server) is missing on a trainer.
_PLAIN_KEY = re.compile(r"(?:[A-Za-z0-9_.]|\\\.)+")


def _pattern_matcher(key: str, field_name: str):
    """`match(module, timeout) -> bool`: PEFT's rule (peft.utils.other.get_pattern_key, and
    vLLM's PEFTHelper._match_pattern): the key is a regular expression that matches a
    suffix of the module name starting at a '.' boundary. vLLM matches with the `regex`
    package, PEFT with `re`; `regex` also bounds the time."""
    text = rf"(.*\.)?({key})$"
    try:
        import regex
    except ImportError:
        if not _PLAIN_KEY.fullmatch(key):
            raise BadAdapter(f"adapter_config {field_name} key {key[:60]!r} is a regular "
                             "expression; checking it safely needs the 'regex' package "
                             "(pip install regex)", code="bad_config") from None
        compiled = re.compile(text)
        return lambda module, timeout: compiled.match(module) is not None
    try:
        compiled = regex.compile(text)
    except (regex.error, RecursionError, OverflowError, ValueError) as e:
        raise BadAdapter(f"adapter_config {field_name} key {key[:60]!r} is not a valid "
                         f"regular expression: {str(e)[:100]}", code="bad_config") from e
    return lambda module, timeout: compiled.match(module, timeout=timeout) is not None


def module_ranks(cfg: dict, modules) -> dict[str, tuple[int, float]]:
    """(rank, lora_alpha) that PEFT gives each module of a (checked) config: the value of
    the first rank_pattern / alpha_pattern key that matches it, else r / lora_alpha. A key
    that matches none of `modules` is refused: PEFT only warns and ignores it, but an adapter
    that says a module has another rank than it has is not one to guess about (and vLLM
    counts that rank against --max-lora-rank)."""
    deadline = time.monotonic() + PATTERN_BUDGET_S
    modules = list(modules)
    out = {m: [cfg["r"], cfg["lora_alpha"]] for m in modules}

    def too_slow(field_name):
        return BadAdapter(f"adapter_config {field_name}: matching its keys against the "
                          f"adapter's {len(modules)} module names took over "
                          f"{PATTERN_BUDGET_S:g} s; use plain module names", code="bad_config")

    def matches(match, module, field_name) -> bool:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return match(module, left)
        except TimeoutError:
            raise too_slow(field_name) from None

    def compiled(pattern: dict, field_name):
        keys = []  # compiling counts against the budget too: a key can be slow to compile
        for key, value in pattern.items():
            if time.monotonic() > deadline:
                raise too_slow(field_name)
            keys.append((key, value, _pattern_matcher(key, field_name)))
        return keys

    for slot, field_name in enumerate(("rank_pattern", "alpha_pattern")):
        pattern = cfg.get(field_name) or {}
        if not pattern:
            continue
        keys = compiled(pattern, field_name)
        used = set()
        for module in modules:
            for key, value, match in keys:
                if matches(match, module, field_name):
                    out[module][slot] = value
                    used.add(key)
                    break
        for key, _, match in keys:  # a key shadowed by an earlier one still matches
            if key not in used and not any(matches(match, m, field_name) for m in modules):
                raise BadAdapter(f"adapter_config {field_name} key {key[:60]!r} matches no "
                                 "module of the adapter (PEFT matches it as a suffix of the "
                                 "module name at a '.')", code="bad_config")
    return {m: (int(rank), alpha) for m, (rank, alpha) in out.items()}


def check_config_features(cfg: dict, ranks: dict[str, tuple[int, float]],
                          coverage: Coverage) -> None:
    """Refuses a config feature the engine does not read (Coverage.config_features) wherever
    it changes what PEFT computes for a module: the engine would serve r, lora_alpha and
    lora_alpha / r there, and so serve the adapter wrong (or fail on its shapes). Where it
    changes nothing (a rank_pattern that gives every module r, use_rslora at r = 1) it is
    served."""
    unread = [f for f in CONFIG_FEATURES if f not in coverage.config_features]
    if not unread:
        return
    r, alpha = cfg["r"], cfg["lora_alpha"]
    for module, (rank, module_alpha) in ranks.items():
        if "rank_pattern" in unread and rank != r:
            raise BadAdapter(
                f"module {module!r}: adapter_config rank_pattern gives it rank {rank}, but "
                f"{coverage.engine} does not read rank_pattern (it would take rank r={r}): "
                f"per-module ranks cannot be served there", code="unsupported_module")
        if "alpha_pattern" in unread and module_alpha != alpha:
            raise BadAdapter(
                f"module {module!r}: adapter_config alpha_pattern gives it lora_alpha "
                f"{module_alpha}, but {coverage.engine} does not read alpha_pattern (it would "
                f"scale it by lora_alpha={alpha}): per-module alphas cannot be served there",
                code="unsupported_module")
        if "use_rslora" in unread and cfg.get("use_rslora") and rank != 1:
            raise BadAdapter(
                f"adapter_config use_rslora: {coverage.engine} does not read use_rslora and "
                f"would scale module {module!r} by lora_alpha/r = {module_alpha}/{rank} instead "
                f"of rsLoRA's lora_alpha/sqrt(r): rsLoRA cannot be served there",
                code="unsupported_module")


def _finite_everywhere(value, where: str, depth: int = 0) -> None:
    if depth > 16:
        raise BadAdapter(f"{where} is nested too deeply", code="bad_config")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadAdapter(f"{where} is {value}: numbers in adapter_config must be finite",
                         code="bad_config")
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        _finite_everywhere(v, f"{where}.{k}"[:200], depth + 1)


def _check_vocab_layer(key: str, module: str, model: ModelSpec) -> None:
    leaf = module.rsplit(".", 1)[-1]
    if leaf not in model.coverage.vocab:
        raise BadAdapter(f"tensor {key!r}: {model.coverage.engine} serves no LoRA on {leaf}",
                         code="unsupported_module")
    if model.tied:
        # PEFT adapts the tied weight through one module only; the engines' tied layers
        # were not checked against it: refused rather than guessed.
        raise BadAdapter(f"tensor {key!r}: the base model ties its embeddings "
                         "(tie_word_embeddings), and LoRA on tied embeddings is not served",
                         code="unsupported_module")


# The verdicts of the last few (tensor specs, config, model) a server or client checked:
# a trainer pushes the same layout every step, and checking it again costs microseconds
# per tensor (10,000+ tensors for an MoE adapter). A verdict depends on nothing else; a
# refusal is not kept (it is raised again, in full, each time).
_VERDICTS: "OrderedDict[tuple, tuple[ModelSpec, str]]" = OrderedDict()
VERDICTS_KEPT = 8


def check_adapter(specs: list[wire.TensorSpec], config: dict, model: ModelSpec) -> dict:
    """Checks that `model` can serve an adapter with these tensors and config, from the header
    alone (before any tensor data is read). Returns the normalized config (the caller's own
    copy)."""
    try:
        key = (tuple(specs), json.dumps(config, sort_keys=True), id(model))
    except (TypeError, ValueError):  # a config JSON cannot hold: checked in full, refused
        return _check_adapter(specs, config, model)
    kept = _VERDICTS.get(key)
    if kept is not None and kept[0] is model:  # the very model, not one at a reused id
        _VERDICTS.move_to_end(key)
        return json.loads(kept[1])
    cfg = _check_adapter(specs, config, model)
    _VERDICTS[key] = (model, json.dumps(cfg))
    while len(_VERDICTS) > VERDICTS_KEPT:
        _VERDICTS.popitem(last=False)
    return cfg


def _check_adapter(specs: list[wire.TensorSpec], config: dict, model: ModelSpec) -> dict:
    specs = [s for s in specs if not is_base_copy(s.name)]  # read by no engine
    if not specs:
        raise BadAdapter("the adapter has no tensors", code="empty_adapter")
    cfg = normalize_config(config, [s.name for s in specs])
    r = check_config(cfg, model.max_rank)
    unknown = sorted(t for t in cfg["target_modules"] if not model.has_target(t))
    if unknown:
        raise BadAdapter(f"adapter_config target_modules {unknown[:20]} are not linear layers "
                         f"of the base model (it has {sorted(model.module_bases)})",
                         code="unknown_module")
    halves: dict[str, dict[str, tuple]] = {}
    for s in specs:
        module, half, embedding_form = _parse_key(s.name)
        if len(s.shape) == 3:
            raise BadAdapter(f"tensor {s.name!r} is 3-D {list(s.shape)}: fused expert LoRA "
                             "(PEFT target_parameters) travels per expert, "
                             "'<experts>.<e>.gate_proj.lora_A.weight' (LoRAAdapter."
                             "from_peft_model converts it)", code="unsupported_module")
        if module.rsplit(".", 1)[-1] in VOCAB_LAYERS:
            _check_vocab_layer(s.name, module, model)
        if model.layer(module) is None:
            hint = ("; in an MoE block only the routed experts are served, per expert: "
                    "'<experts>.<e>.gate_proj.lora_A.weight' (LoRAAdapter.from_peft_model "
                    "converts PEFT's target_parameters), not its router or shared experts"
                    if moe.block_of(model.experts, module) is not None else "")
            raise BadAdapter(f"tensor {s.name!r}: the base model has no LoRA-able module "
                             f"{module!r}{hint}", code="unknown_module")
        if embedding_form != (module in model.embeddings):
            raise BadAdapter(f"tensor {s.name!r}: PEFT names the LoRA tensors of an embedding "
                             "'<module>.lora_embedding_A' / '_B' and those of a linear layer "
                             f"'<module>.lora_A.weight' / '_B'; {module!r} is "
                             f"{'an embedding' if module in model.embeddings else 'linear'}",
                             code="unknown_tensor")
        if len(s.shape) != 2:
            raise BadAdapter(f"tensor {s.name!r} must be 2-D, got shape {list(s.shape)}",
                             code="bad_shape")
        if s.dtype not in model.coverage.dtypes:
            raise BadAdapter(f"tensor {s.name!r} has dtype {s.dtype}; {model.coverage.engine} "
                             f"serves LoRA weights in {sorted(model.coverage.dtypes)}",
                             code="bad_dtype")
        if half in halves.setdefault(module, {}):
            # 'base_model.model.X.lora_A.weight' and 'X.lora_A.weight' are the same weight:
            # an engine would keep one of the two silently.
            raise BadAdapter(f"tensor {s.name!r}: module {module!r} has a second lora_{half} "
                             "under another name", code="duplicate_module")
        halves[module][half] = s.shape
    for module, h in halves.items():
        if set(h) != {"A", "B"}:
            missing = ({"A", "B"} - set(h)).pop()
            raise BadAdapter(f"module {module!r} has no lora_{missing} tensor",
                             code="missing_tensor")
        fan_in, fan_out = model.layer(module)
        (ra, a_in), (b_out, rb) = h["A"], h["B"]
        if a_in != fan_in or b_out != fan_out or ra != rb:
            raise BadAdapter(
                f"module {module!r}: lora_A {list(h['A'])} / lora_B {list(h['B'])} do not fit "
                f"the base layer (in={fan_in}, out={fan_out}); expected A [r, {fan_in}] and "
                f"B [{fan_out}, r]", code="bad_shape")
    ranks = module_ranks(cfg, halves)
    for module, h in halves.items():
        ra, rank = h["A"][0], ranks[module][0]
        if ra != rank:
            given = ("adapter_config r" if rank == r and not cfg.get("rank_pattern") else
                     "adapter_config (r and rank_pattern)")
            raise BadAdapter(f"module {module!r} has rank {ra} but {given} gives it rank "
                             f"{rank}: each lora_A/lora_B pair must have its module's rank",
                             code="bad_shape")
    check_config_features(cfg, ranks, model.coverage)
    check_coverage(halves, model.coverage)
    check_whole_experts(halves, model)
    return cfg


def peft_state(model, adapter_name: str = "default") -> dict:
    """A PEFT model's adapter tensors, named as PEFT saves them: LoRA weights only (not the
    vocabulary layers' base weights PEFT adds when it adapts them, save_embedding_layers,
    which no engine reads), still sharded under FSDP2. PEFT 0.22 gathers every DTensor
    itself, one collective per tensor with a full copy on every rank; it is handed the shards'
    local tensors instead and its picks get their DTensors back (sharded.gather_adapter
    then gathers them in one flat collective)."""
    from peft import get_peft_model_state_dict
    pick = functools.partial(get_peft_model_state_dict, model, adapter_name=adapter_name,
                             save_embedding_layers=False)
    if not any(_is_dtensor(p) for p in model.parameters()):
        return pick()  # unsharded: one walk of the model, PEFT's (FSDP2 shards parameters)
    state = model.state_dict()
    shards = {k: v for k, v in state.items() if _is_dtensor(v)}
    local = {k: shards[k].to_local() if k in shards else v for k, v in state.items()}
    sharded = {id(local[k]): v for k, v in shards.items()}
    plain = {id(v) for k, v in state.items() if k not in shards}
    picked = pick(state_dict=local)
    if all(id(v) in sharded or id(v) in plain for v in picked.values()):
        return {k: sharded.get(id(v), v) for k, v in picked.items()}
    return pick()  # PEFT made tensors of its own (a kind it transforms): its gather is right


def _is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)

