"""Model specs: the strings users pass on the command line, resolved and built.

Grammar (docs/models.md), tried in this order:
  PRESET                 a name in `PRESETS` (`gpt3-175b`, `llama3-8b`, `mixtral-8x7b`, ...)
  FAMILY:KEY=VALUE,...   `gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200`; llama and
                         moe also need `ffn=`, moe `experts=` (keys: `FAMILY_KEYS`)
  PATH                   a Hugging Face `config.json`, or a directory holding one; built by
                         `transformers` from the config alone (local files only, no download)
  package.module:factory a callable taking no arguments, returning an nn.Module or a config

`resolve_model` only reads the spec (cheap, no weights); `build_model` makes the module, on
the meta device by default. Every malformed spec raises one ValueError that names the cause
and lists what is valid. `stated_shape` is what a spec's config says of the model's layers,
heads and experts before any capture (the planner refuses an impossible plan spec on it).

A ModelSource records where its sequence length came from (`seq_len_source`): a plan made at a
Hugging Face config's `max_position_embeddings` (40960 for some 8B configs) says so. A model built
from a Hugging Face config sets its attention implementation explicitly (`HF_ATTENTION`).
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from mplan.models.config import GPTConfig, LlamaConfig, ModelConfig, MoEConfig
from mplan.models.gpt import GPTModel
from mplan.models.llama import LlamaModel
from mplan.models.moe import MoEModel
from mplan.models.presets import PRESETS

MODEL_TYPES: dict[str, type[nn.Module]] = {"gpt": GPTModel, "llama": LlamaModel, "moe": MoEModel}
CONFIG_TYPES: dict[str, type] = {"gpt": GPTConfig, "llama": LlamaConfig, "moe": MoEConfig}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise ValueError("expected 0/1/true/false")


def _parse_capacity(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


_COMMON_KEYS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "layers": ("num_layers", int),
    "hidden": ("hidden", int),
    "heads": ("num_heads", int),
    "seq": ("seq_len", int),
    "vocab": ("vocab", int),
    "ffn": ("ffn_hidden", int),
    "tie": ("tie_embeddings", _parse_bool),
    "eps": ("norm_eps", float),
}
_LLAMA_KEYS = {**_COMMON_KEYS, "kv_heads": ("num_kv_heads", int), "theta": ("rope_theta", float)}
FAMILY_KEYS: dict[str, dict[str, tuple[str, Callable[[str], Any]]]] = {
    "gpt": _COMMON_KEYS,
    "llama": _LLAMA_KEYS,
    "moe": {
        **_LLAMA_KEYS,
        "experts": ("num_experts", int),
        "topk": ("top_k", int),
        "capacity": ("capacity_factor", _parse_capacity),
        "aux": ("aux_loss_coef", float),
        "shared": ("shared_ffn", int),
    },
}
"""Spec key -> (config field, parser), per family."""

_REQUIRED = {
    "gpt": ("layers", "hidden", "heads", "seq", "vocab"),
    "llama": ("layers", "hidden", "heads", "seq", "vocab", "ffn"),
    "moe": ("layers", "hidden", "heads", "seq", "vocab", "ffn", "experts"),
}
HF_ATTENTION = "sdpa"
"""The attention implementation of every model mplan builds from a Hugging Face config: fused SDPA,
what users train with. Left unset, the installed transformers release picks its own default (one
release captured eager matmul-softmax, another SDPA, for the same config), and the captured graph,
hence the plan, changed with the release. A model class without SDPA support gets "eager",
explicitly too. A user's own module (`autoparallel(model)`) is captured as the user set it."""

SEQ_LEN_GIVEN = "--seq-len"
"""`seq_len_source` of a sequence length given explicitly (`--seq-len`, or `seq_len=` in Python)."""

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

GRAMMAR = (
    "a model spec is a preset, FAMILY:key=value,... (families gpt, llama, moe; e.g. "
    "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128), a Hugging Face config.json path, "
    "or package.module:factory"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    """A resolved spec: what to build, without building it."""

    spec: str
    """the string it came from (or the config's name)"""
    family: str
    """"gpt", "llama", "moe", "hf" (a transformers config) or "factory" (a module factory)"""
    config: Any
    """our ModelConfig, the transformers PretrainedConfig, or None for a module factory"""
    name: str
    seq_len: int | None
    """tokens per sequence the model is made for; None when the module does not say"""
    vocab: int | None
    factory: Callable[[], Any] | None = None
    """the callable, for family "factory" """
    seq_len_source: str | None = None
    """where `seq_len` came from: SEQ_LEN_GIVEN, "model preset", "model spec seq=", "config
    max_position_embeddings" (or the config field that said it), "factory config"; None with no seq_len"""


@dataclass(frozen=True, kw_only=True, slots=True)
class StatedShape:
    """What a model's config says of its shape before any capture; None where it does not say."""

    name: str
    num_layers: int | None = None
    """repeated blocks (transformer layers)"""
    num_heads: int | None = None
    """attention (query) heads"""
    num_experts: int | None = None
    """experts per MoE layer; 0: the config says the model has no MoE layer"""


def resolve_model(spec: str, *, seq_len: int | None = None, vocab: int | None = None) -> ModelSource:
    """Parse a spec string (see the module docstring) into a ModelSource. Never downloads.

    `seq_len` (the command's --seq-len) replaces the model's own sequence length, and says so in
    `seq_len_source`; `vocab` (--vocab) gives the vocabulary of a factory module that states none,
    and is refused, naming both, where the model states another."""
    source = _resolve(spec.strip())
    if vocab is not None:
        if source.vocab is not None and source.vocab != vocab:
            raise ValueError(f"model spec {source.spec!r} states its vocabulary, {source.vocab} tokens; --vocab "
                             f"{vocab} is for a package.module:factory model that states none")
        source = replace(source, vocab=vocab)
    if seq_len is not None:
        source = replace(source, seq_len=seq_len, seq_len_source=SEQ_LEN_GIVEN)
    return source


def _resolve(spec: str) -> ModelSource:
    if spec in PRESETS:
        return _from_config(PRESETS[spec], spec, "model preset")
    family, sep, rest = spec.partition(":")
    if sep and family in FAMILY_KEYS:
        return _from_config(_parse_family(family, rest, spec), spec, "model spec seq=")
    if os.path.exists(spec):
        return _from_hf_config(spec)
    if _FACTORY.match(spec):
        return _from_factory(spec)
    if spec.endswith(".json"):
        raise ValueError(f"model spec {spec!r}: no such file")
    raise ValueError(f"unknown model {spec!r}: {GRAMMAR}; presets: {', '.join(PRESETS)}")


def _from_config(config: ModelConfig, spec: str, seq_len_source: str) -> ModelSource:
    return ModelSource(
        spec=spec, family=config.family, config=config, name=config.name,
        seq_len=config.seq_len, vocab=config.vocab, seq_len_source=seq_len_source,
    )


def stated_shape(config: Any, name: str) -> StatedShape:
    """The layers, heads and experts a model's `config` states (a ModelSource's, or a module's
    `.config`; None each where there is none or it does not say): mplan's families always say; a
    Hugging Face config says through its own field names; one with no field naming experts is dense."""
    if isinstance(config, tuple(CONFIG_TYPES.values())):
        experts = config.num_experts if isinstance(config, MoEConfig) else 0
        return StatedShape(name=name, num_layers=config.num_layers, num_heads=config.num_heads, num_experts=experts)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return StatedShape(name=name)
    fields = config.to_dict()
    return StatedShape(name=name, num_layers=_positive(fields, _HF_LAYERS), num_heads=_positive(fields, _HF_HEADS),
                       num_experts=_positive(fields, _HF_EXPERTS) if any("expert" in key for key in fields) else 0)


_HF_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HF_HEADS = ("num_attention_heads", "n_head", "num_heads")
_HF_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Hugging Face config fields that state layers, heads and experts, as the model families name them"""


def _positive(fields: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = fields.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _parse_family(family: str, body: str, spec: str) -> ModelConfig:
    keys = FAMILY_KEYS[family]
    valid = ", ".join(keys)
    fields: dict[str, Any] = {"name": spec}
    given: set[str] = set()
    for item in filter(None, body.split(",")):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"model spec {spec!r}: expected key=value, got {item!r}; valid keys: {valid}")
        if key not in keys:
            raise ValueError(f"model spec {spec!r}: unknown key {key!r} for {family}; valid keys: {valid}")
        if key in given:
            raise ValueError(f"model spec {spec!r}: key {key!r} given twice")
        field, parse = keys[key]
        try:
            fields[field] = parse(text.strip())
        except ValueError as err:
            raise ValueError(f"model spec {spec!r}: bad value {text!r} for key {key!r} ({err})") from None
        given.add(key)
    missing = [key for key in _REQUIRED[family] if key not in given]
    if missing:
        raise ValueError(
            f"model spec {spec!r}: missing key(s) {', '.join(missing)}; "
            f"{family} requires {', '.join(_REQUIRED[family])} (valid keys: {valid})"
        )
    try:
        return CONFIG_TYPES[family](**fields)
    except ValueError as err:
        raise ValueError(f"model spec {spec!r}: {err}") from None


def _from_hf_config(path: str) -> ModelSource:
    from transformers import AutoConfig  # optional dependency, only for this spec form

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"model spec {path!r}: a directory without config.json")
    _check_hf_config(path, file)
    try:
        config = AutoConfig.from_pretrained(file, local_files_only=True)
    except Exception as err:  # transformers' own checks (their messages name the field) or its failures
        where = f"model spec {path!r}:" + ("" if file == path else f" {file}:")
        raise ValueError(f"{where} transformers cannot read it: {type(err).__name__}: "
                         f"{' '.join(str(err).split())}") from err
    # no generation here: a KV cache would only add outputs to the captured graph
    config.use_cache = False
    _hf_model_class(config, path)  # an architecture mplan cannot train is refused here, before any capture
    name = os.path.basename(os.path.dirname(os.path.abspath(file))) or config.model_type
    seq_len, field = _hf_seq_len(config)
    return ModelSource(
        spec=path, family="hf", config=config, name=name,
        seq_len=seq_len, vocab=getattr(config, "vocab_size", None),
        seq_len_source=None if field is None else f"config {field}",
    )


_HF_SIZES = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "vocab_size")
"""config.json fields mplan reads itself (`_hf_seq_len`, the vocabulary)"""


def _check_hf_config(path: str, file: str) -> None:
    """The file is a JSON object, its model type (if given) a string, and the sizes mplan reads
    positive integers: one ValueError naming the file and the field (before transformers reads it)."""
    from mplan.json_fields import HugeNumber, load_json_file

    doc = load_json_file(file, ValueError)
    where = f"model spec {path!r}:" + ("" if file == path else f" {file}:")
    if not isinstance(doc, dict):
        raise ValueError(f"{where} the top level must be a JSON object, got {type(doc).__name__}")
    for key, value in doc.items():
        if isinstance(value, HugeNumber):
            raise ValueError(f"{where} {key} is {value!r}, more than mplan reads")
    if "model_type" in doc and not isinstance(doc["model_type"], str):
        raise ValueError(f"{where} model_type must be a string naming a transformers model type, "
                         f"got {doc['model_type']!r}")
    for key in _HF_SIZES:
        value = doc.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{where} {key} must be a positive integer, got {value!r}")


def _hf_model_class(config: Any, spec: str) -> Any:
    """The transformers class a config.json's `architectures` names (its first), when mplan can
    train it: a causal or masked LM, whose loss takes labels of the inputs' shape. Without
    `architectures`, AutoModelForCausalLM's class for the model type. Anything else is refused
    in one line naming the class: never another class built in its place."""
    import transformers
    from transformers.models.auto import modeling_auto

    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    trainable = set(causal.values()) | set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.values())
    named = getattr(config, "architectures", None) or []
    named = [named] if isinstance(named, str) else named
    if not isinstance(named, (list, tuple)) or not all(isinstance(n, str) for n in named):
        raise ValueError(f"model spec {spec!r}: config.json's \"architectures\" must be a list of class names, "
                         f"got {named!r}")
    if not named:
        return transformers.AutoModelForCausalLM
    if named[0] in trainable and hasattr(transformers, named[0]):
        return getattr(transformers, named[0])
    instead = causal.get(getattr(config, "model_type", ""))
    raise ValueError(
        f"model spec {spec!r}: config.json names architecture {named[0]}, which mplan cannot train: it plans "
        f"causal LMs (*ForCausalLM) and masked LMs (*ForMaskedLM), whose loss takes labels shaped like the inputs"
        + (f"; for this model type set \"architectures\": [\"{instead}\"]" if instead else ""))


def _hf_seq_len(config: Any) -> tuple[int | None, str | None]:
    """The sequence length a Hugging Face config states, and the field that states it."""
    for attribute in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, attribute, None)
        if isinstance(value, int):
            return value, attribute
    return None, None


def _from_factory(spec: str) -> ModelSource:
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model spec {spec!r}: cannot load factory ({err}); {GRAMMAR}") from None
    if not callable(factory):
        raise ValueError(f"model spec {spec!r}: {attribute} is not callable")
    try:
        with torch.device("meta"):
            made = factory()
    except Exception as err:  # the user's code: its own error, in one line naming the spec
        raise ValueError(f"model spec {spec!r}: calling {attribute}() failed: {type(err).__name__}: {err}") from err
    if isinstance(made, tuple(CONFIG_TYPES.values())):
        return ModelSource(
            spec=spec, family=made.family, config=made, name=made.name,
            seq_len=made.seq_len, vocab=made.vocab, factory=factory, seq_len_source="factory config",
        )
    if not isinstance(made, nn.Module):
        raise ValueError(
            f"model spec {spec!r}: factory returned {type(made).__name__}, not an nn.Module or a config"
        )
    config = getattr(made, "config", None)
    seq_len, vocab = _seq_len_and_vocab(config) if config is not None else (None, None)
    return ModelSource(
        spec=spec, family="factory", config=config, name=attribute,
        seq_len=seq_len, vocab=vocab, factory=factory,
        seq_len_source=None if seq_len is None else "factory config",
    )


def build_model(
    spec_or_config: str | ModelSource | ModelConfig,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """The module for a spec, a ModelSource or one of our configs, on `device` in `dtype`.

    On a real device the weights are initialized from `seed` (ours: `init_weights(seed)`;
    transformers and factory models: their own init under a seeded, forked RNG)."""
    if isinstance(spec_or_config, str):
        source = resolve_model(spec_or_config)
    elif isinstance(spec_or_config, ModelSource):
        source = spec_or_config
    else:
        source = _from_config(spec_or_config, spec_or_config.name, "model spec seq=")
    if source.family in MODEL_TYPES:
        return MODEL_TYPES[source.family](source.config, device=device, dtype=dtype, seed=seed)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if source.family == "hf":  # the class config.json names (AutoModelForCausalLM's when it names none)
            model_class = _hf_model_class(source.config, source.spec)
            attention = _hf_attention(model_class, source.config)
            if hasattr(model_class, "_from_config"):
                return model_class._from_config(source.config, dtype=dtype, attn_implementation=attention)
            return model_class.from_config(source.config, dtype=dtype, attn_implementation=attention)
        assert source.factory is not None
        return source.factory().to(dtype)


def _hf_attention(model_class: Any, config: Any) -> str:
    """HF_ATTENTION, or "eager" for a class that has no SDPA path (an Auto class is asked about the
    class it builds for this config)."""
    if not hasattr(model_class, "_supports_sdpa"):
        try:
            model_class = model_class._model_mapping[type(config)]
        except (AttributeError, KeyError):
            return HF_ATTENTION
    return HF_ATTENTION if model_class._supports_sdpa else "eager"


def _seq_len_and_vocab(config: Any) -> tuple[int | None, int | None]:
    if isinstance(config, tuple(CONFIG_TYPES.values())):
        return config.seq_len, config.vocab
    return _hf_seq_len(config)[0], getattr(config, "vocab_size", None)


def example_inputs(
    model_or_config: nn.Module | ModelConfig | ModelSource | Any,
    batch: int,
    seq_len: int | None = None,
    device: torch.device | str = "meta",
    *,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), int64 [batch, seq_len], labels the next token of each input.

    Random ids from a CPU generator seeded with `seed` on real devices (the same on every
    device); zeros on meta, where the vocabulary is not needed. seq_len defaults to the model's."""
    if isinstance(model_or_config, ModelSource):
        default_seq, vocab = model_or_config.seq_len, model_or_config.vocab
    else:
        config = getattr(model_or_config, "config", model_or_config)
        default_seq, vocab = _seq_len_and_vocab(config)
    seq_len = default_seq if seq_len is None else seq_len
    if seq_len is None:
        raise ValueError("example_inputs: the model states no sequence length; pass seq_len (--seq-len)")
    if vocab is None and torch.device(device).type != "meta":
        raise ValueError("example_inputs: the model states no vocabulary to draw token ids from; pass a config "
                         "(or --vocab)")
    if torch.device(device).type == "meta":
        ids = torch.zeros(batch, seq_len + 1, dtype=torch.int64, device="meta")
    else:
        generator = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator).to(device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
