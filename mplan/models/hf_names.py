"""Where every parameter of a model sits in a Hugging Face checkpoint, and the Hugging Face
config of mplan's own families.

Input: a model's parameters (names and global shapes, tied aliases), its class name and a Hugging
Face config (a config.json's data). Output: `HfLayout`, which says for each parameter which
rectangles of which safetensors tensors hold it (`Link`s), in the form `transformers` writes
(`stored`) and in every other form a directory may hold it (`accepted`); and `hf_config(config)`,
the config of the matching Hugging Face architecture for one of mplan's families.

A `Link` ties a rectangle of a parameter to a rectangle of a file tensor, dimension by dimension
(`dims`): a plain copy, a transpose (GPT-2's Conv1D weights), or one slice of a stacked tensor
(an expert's `w1` is `gate_up_proj[e, :ffn]`). Links are composed in two steps:

    model parameter --(family table, mplan's families only)--> transformers parameter
                    --(transformers' own conversion mapping)--> tensor in the files

The second step reads the conversion mapping that `transformers` applies when it loads (Mixtral's
`experts.{e}.w1.weight` files become `experts.gate_up_proj`) and reverses it as `save_pretrained`
does; only the operations that move rectangles (`MergeModulelist`, `Concatenate` and their
reverses) are understood, anything else is refused naming it (`NotMappable`), never guessed.

mplan's families, checked layout by layout against transformers' modeling code:
  llama -> LlamaForCausalLM: separate q/k/v/o (no fused qkv), RMSNorm weights, rotate-half RoPE
           with inv_freq = theta^(-2i/head_dim) on both sides, SwiGLU gate/up/down; no biases.
  moe   -> MixtralForCausalLM: Llama blocks; router = `mlp.gate`; experts' gate and up stacked
           as `gate_up_proj` [E, 2*ffn, h] (gate first); softmax, top-k, renormalized top-k
           weights on both sides. Refused: a shared expert (Mixtral has none) and a capacity factor
           (Mixtral is dropless: dropped tokens would compute another function).
  gpt   -> GPT2LMHeadModel: learned positions, LayerNorm with biases, q/k/v fused into Conv1D
           `c_attn` [h, 3h] (transposed weights), GELU tanh ("gelu_new"), biased linears.
Hugging Face computes RMSNorm, the router softmax and the RoPE tables in float32 whatever the
model's dtype; mplan's families compute them in the model's dtype (the same function, other rounding).

Leaf module: imports nothing from mplan outside `mplan.models`; `transformers` only when a layout
is built.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mplan.models.config import GPTConfig, LlamaConfig, MoEConfig

Shape = tuple[int, ...]


class NotMappable(ValueError):
    """A model (or one parameter of it) that has no exact place in a Hugging Face checkpoint."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A rectangle of parameter `param` stored as a rectangle of file tensor `key`."""

    param: str
    at: Shape
    """offsets of the rectangle in the parameter"""
    size: Shape
    """its extent in the parameter (1 along every parameter dim that `dims` does not name)"""
    key: str
    key_at: Shape
    """offsets of the rectangle in the file tensor"""
    dims: Shape
    """for each dim of the file tensor, the parameter dim it runs along: (0, 1) a copy, (1, 0) a transpose"""

    @property
    def key_size(self) -> Shape:
        return tuple(self.size[d] for d in self.dims)


Links = tuple[Link, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HfLayout:
    """Where a model's parameters sit in a Hugging Face checkpoint of `architecture`."""

    architecture: str
    """the transformers class (`LlamaForCausalLM`)"""
    config: dict[str, Any]
    """the config.json to write (transformers' complete form, `architectures` set)"""
    shapes: dict[str, Shape]
    """the full shape of every tensor a form names (what a save writes and every name a load accepts)"""
    stored: dict[str, Links]
    """per parameter: the links to `shapes`' tensors (what a save writes)"""
    accepted: dict[str, tuple[Links, ...]]
    """per parameter: every form a load accepts, the stored form first (then transformers' own
    parameter names, then tied aliases)"""
    ignored: tuple[str, ...] = field(default=())
    """patterns of file tensors transformers itself ignores on load (old buffers)"""


# -- mplan's families ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Rule:
    """mplan parameter name (regex) -> transformers parameter (template); `transpose`: stored as
    its transpose; `part`: (transformers dim, k): the k-th block of that dim, blocks as wide as
    the parameter along the dim it maps to."""

    pattern: str
    target: str
    transpose: bool = False
    part: tuple[int, int] | None = None


_LAYER = r"layers\.(\d+)\."
_LLAMA_COMMON = (
    _Rule(r"embed\.weight", "model.embed_tokens.weight"),
    _Rule(_LAYER + r"attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    _Rule(_LAYER + r"attn\.(q|k|v|o)_proj\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    _Rule(_LAYER + r"mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    _Rule(r"norm\.weight", "model.norm.weight"),
    _Rule(r"lm_head\.weight", "lm_head.weight"),
)
_FAMILY_RULES: dict[str, tuple[str, tuple[_Rule, ...]]] = {
    "LlamaModel": ("LlamaForCausalLM", _LLAMA_COMMON + (
        _Rule(_LAYER + r"mlp\.(gate|up|down)_proj\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    )),
    "MoEModel": ("MixtralForCausalLM", _LLAMA_COMMON + (
        _Rule(_LAYER + r"mlp\.router\.weight", r"model.layers.\1.mlp.gate.weight"),
        _Rule(_LAYER + r"mlp\.experts\.w_gate", r"model.layers.\1.mlp.experts.gate_up_proj", part=(1, 0)),
        _Rule(_LAYER + r"mlp\.experts\.w_up", r"model.layers.\1.mlp.experts.gate_up_proj", part=(1, 1)),
        _Rule(_LAYER + r"mlp\.experts\.w_down", r"model.layers.\1.mlp.experts.down_proj"),
    )),
    "GPTModel": ("GPT2LMHeadModel", (
        _Rule(r"embed\.weight", "transformer.wte.weight"),
        _Rule(r"pos_embed\.weight", "transformer.wpe.weight"),
        _Rule(_LAYER + r"attn_norm\.(weight|bias)", r"transformer.h.\1.ln_1.\2"),
        _Rule(_LAYER + r"attn\.q_proj\.weight", r"transformer.h.\1.attn.c_attn.weight", True, (1, 0)),
        _Rule(_LAYER + r"attn\.k_proj\.weight", r"transformer.h.\1.attn.c_attn.weight", True, (1, 1)),
        _Rule(_LAYER + r"attn\.v_proj\.weight", r"transformer.h.\1.attn.c_attn.weight", True, (1, 2)),
        _Rule(_LAYER + r"attn\.q_proj\.bias", r"transformer.h.\1.attn.c_attn.bias", part=(0, 0)),
        _Rule(_LAYER + r"attn\.k_proj\.bias", r"transformer.h.\1.attn.c_attn.bias", part=(0, 1)),
        _Rule(_LAYER + r"attn\.v_proj\.bias", r"transformer.h.\1.attn.c_attn.bias", part=(0, 2)),
        _Rule(_LAYER + r"attn\.o_proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True),
        _Rule(_LAYER + r"attn\.o_proj\.bias", r"transformer.h.\1.attn.c_proj.bias"),
        _Rule(_LAYER + r"mlp_norm\.(weight|bias)", r"transformer.h.\1.ln_2.\2"),
        _Rule(_LAYER + r"mlp\.fc_in\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
        _Rule(_LAYER + r"mlp\.fc_in\.bias", r"transformer.h.\1.mlp.c_fc.bias"),
        _Rule(_LAYER + r"mlp\.fc_out\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
        _Rule(_LAYER + r"mlp\.fc_out\.bias", r"transformer.h.\1.mlp.c_proj.bias"),
        _Rule(r"norm\.(weight|bias)", r"transformer.ln_f.\1"),
        _Rule(r"lm_head\.weight", "lm_head.weight"),
    )),
}
"""mplan family (its class name) -> (transformers architecture, name rules)"""
FAMILY_ARCHITECTURES = {family: arch for family, (arch, _) in _FAMILY_RULES.items()}


def hf_config(config: Any) -> dict[str, Any]:
    """The Hugging Face config (config.json's data) of the architecture matching one of mplan's
    family configs; `NotMappable` naming why where none computes the same function. Plain data,
    built without importing transformers (which fills every other field with its defaults)."""
    common = {"vocab_size": config.vocab, "tie_word_embeddings": config.tie_embeddings,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": True}
    if isinstance(config, MoEConfig):
        if config.shared_ffn:
            raise NotMappable(f"{config.name}: an MoE with a shared expert (shared={config.shared_ffn}) has no "
                              f"Hugging Face Mixtral equivalent (Mixtral has routed experts only)")
        if config.capacity_factor is not None:
            raise NotMappable(f"{config.name}: an expert capacity (capacity={config.capacity_factor}) drops tokens; "
                              f"Hugging Face Mixtral is dropless, so it would compute another function")
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common, **_llama_fields(config),
                "num_local_experts": config.num_experts, "num_experts_per_tok": config.top_k,
                "router_aux_loss_coef": config.aux_loss_coef, "output_router_logits": False,
                "router_jitter_noise": 0.0, "sliding_window": None}
    if isinstance(config, LlamaConfig):
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, **_llama_fields(config),
                "attention_bias": False, "mlp_bias": False}
    if isinstance(config, GPTConfig):
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_embd": config.hidden, "n_layer": config.num_layers, "n_head": config.num_heads,
                "n_positions": config.seq_len, "n_inner": config.ffn, "activation_function": "gelu_new",
                "layer_norm_epsilon": config.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    raise NotMappable(f"{type(config).__name__} is not one of mplan's model families (gpt, llama, moe)")


def _llama_fields(config: LlamaConfig) -> dict[str, Any]:
    return {"hidden_size": config.hidden, "intermediate_size": config.ffn, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim, "max_position_embeddings": config.seq_len, "rms_norm_eps": config.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "hidden_act": "silu", "attention_dropout": 0.0}


def _family_links(model_name: str, params: Mapping[str, Shape]) -> dict[str, Links] | None:
    """mplan parameter -> its rectangle of a transformers parameter, for one of mplan's families
    (every parameter named as the family names them); None for any other model."""
    if model_name not in _FAMILY_RULES:
        return None
    _, rules = _FAMILY_RULES[model_name]
    out = {}
    for name, shape in params.items():
        rule = next((r for r in rules if re.fullmatch(r.pattern, name)), None)
        if rule is None:
            return None
        dims = tuple(reversed(range(len(shape)))) if rule.transpose else tuple(range(len(shape)))
        key_at = [0] * len(shape)
        if rule.part is not None:
            dim, k = rule.part
            key_at[dim] = k * shape[dims[dim]]
        out[name] = (Link(param=name, at=(0,) * len(shape), size=tuple(shape),
                          key=re.sub(rule.pattern, rule.target, name), key_at=tuple(key_at), dims=dims),)
    return out


# -- transformers' checkpoint layout -------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _meta_model(config_json: str) -> Any:
    """The transformers model a config describes, on the meta device (no memory, no weights)."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    doc = json.loads(config_json)
    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise NotMappable(f"model_type {model_type!r} is not a transformers model type")
    config = CONFIG_MAPPING[model_type].from_dict(doc)
    named = doc.get("architectures") or []
    with torch.device("meta"):
        if named and isinstance(named[0], str) and hasattr(transformers, named[0]):
            return getattr(transformers, named[0])._from_config(config)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as err:
            raise NotMappable(f"{model_type}: transformers has no causal LM for it ({err})") from None


def _native_parameters(model: Any) -> tuple[dict[str, Shape], dict[str, tuple[str, ...]]]:
    """transformers' parameters (the name its files store a tied group under) and tied aliases."""
    targets = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    groups: dict[int, list[str]] = {}
    shapes: dict[int, Shape] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
        shapes[id(param)] = tuple(param.shape)
    params, aliases = {}, {}
    for pid, names in groups.items():
        first = next((n for n in names if n not in targets), names[0])
        params[first] = shapes[pid]
        aliases[first] = tuple(n for n in names if n != first)
    return params, aliases


def _file_links(model: Any, params: Mapping[str, Shape]) -> dict[str, Links]:
    """transformers parameter -> the file tensors `save_pretrained` writes it as: its own name
    (renamed), or the pieces its conversion mapping's reverse cuts it into."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            apply_converters,
            apply_renamings,
        )
    except ImportError:  # transformers 4: files hold every parameter under its own name
        return {name: (_whole_link(name, name, shape),) for name, shape in params.items()}

    # as transformers' revert_weight_conversion does for a model built from its config
    forward = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    reverse = [t.reverse_transform() for t in forward[::-1]]
    renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]
    out = {}
    for name, shape in params.items():
        renamed, pattern = apply_converters(name, converters)
        if pattern is None:
            out[name] = (_whole_link(name, apply_renamings(name, renamings), shape),)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        pieces = _cut(name, shape, pattern, converter)
        full = renamed.replace("*.", "0.")
        known = next((k for k in pieces if k in full), None)
        if known is None:
            raise NotMappable(f"{name}: transformers names its converted pieces in a way mplan does not follow")
        prefix, _, suffix = full.partition(known)
        out[name] = tuple(Link(param=name, at=at, size=size, key=apply_renamings(prefix + k + suffix, renamings),
                               key_at=(0,) * len(dims), dims=dims) for k, (at, size, dims) in pieces.items())
    return out


def _cut(name: str, shape: Shape, pattern: str, converter: Any) -> dict[str, tuple[Shape, Shape, Shape]]:
    """The pieces a reversed converter makes of parameter `name`, by target pattern: (offsets,
    extents, the parameter dims the piece keeps), following transformers' Chunk and
    SplitModulelist (the reverses of Concatenate and MergeModulelist) and nothing else."""
    pieces: dict[str, tuple[list[int], list[int], list[int]]] = {pattern: ([0] * len(shape), list(shape),
                                                                          list(range(len(shape))))}
    targets = list(converter.target_patterns)
    for op in converter.operations:
        kind = type(op).__name__
        if kind == "Chunk" and op.num_shards_attribute is None and len(pieces) == 1:
            (at, size, dims), = pieces.values()
            dim = dims[op.dim]
            step = -(-size[dim] // len(targets))  # torch.chunk's
            pieces = {}
            for k, target in enumerate(targets):
                if k * step >= size[dim]:
                    break
                piece_at, piece_size = list(at), list(size)
                piece_at[dim] += k * step
                piece_size[dim] = min(step, size[dim] - k * step)
                pieces[target] = (piece_at, piece_size, dims)
        elif kind == "SplitModulelist":
            single = len(pieces) == 1 and len(targets) == 1
            split = {}
            for source, (at, size, dims) in pieces.items():
                dim = dims[op.dim]
                for i in range(size[dim]):
                    piece_at, piece_size = list(at), list(size)
                    piece_at[dim] += i
                    piece_size[dim] = 1
                    split[(targets[0] if single else source).replace("*", str(i))] = (
                        piece_at, piece_size, [d for d in dims if d != dim])
            pieces = split
        else:
            raise NotMappable(f"{name}: transformers converts it with {kind}, which mplan does not read or write "
                              f"(only stacking and concatenation: MergeModulelist, Concatenate)")
    return {k: (tuple(at), tuple(size), tuple(dims)) for k, (at, size, dims) in pieces.items()}


def _compose(first: Link, then: Sequence[Link]) -> Links:
    """`first` (a parameter's rectangle of a transformers parameter) through `then` (that
    parameter's rectangles of file tensors): the parameter's rectangles of the file tensors."""
    out = []
    for link in then:
        at, size = list(first.at), list(first.size)
        bounds = []
        for i, d in enumerate(first.dims):  # transformers dim i <-> parameter dim d
            lo = max(first.key_at[i], link.at[i])
            hi = min(first.key_at[i] + first.size[d], link.at[i] + link.size[i])
            if lo >= hi:
                break
            at[d] = first.at[d] + lo - first.key_at[i]
            size[d] = hi - lo
            bounds.append(lo)
        else:
            key_at = tuple(link.key_at[j] + bounds[i] - link.at[i] for j, i in enumerate(link.dims))
            out.append(Link(param=first.param, at=tuple(at), size=tuple(size), key=link.key, key_at=key_at,
                            dims=tuple(first.dims[i] for i in link.dims)))
    return tuple(out)


def hf_layout(model_name: str, params: Mapping[str, Sequence[int]], aliases: Mapping[str, Sequence[str]],
              config: Mapping[str, Any]) -> HfLayout:
    """Where `params` (name -> global shape; `aliases`: name -> its tied names) of a model of class
    `model_name` sit in a Hugging Face checkpoint described by `config`: mplan's families through
    their tables, any other model by its own (transformers') parameter names. Checked against the
    transformers model `config` builds: every file tensor it would load is written, with its
    shape, and nothing else (`NotMappable` naming the first difference)."""
    model = _meta_model(json.dumps(dict(config), sort_keys=True))
    architecture = type(model).__name__
    native, native_aliases = _native_parameters(model)
    files = _file_links(model, native)
    shapes = {**{alias: shape for name, shape in native.items() for alias in (name, *native_aliases[name])},
              **{link.key: link.key_size for links in files.values() for link in links}}
    # a form that lists every transformers name, tied aliases too
    by_any_name = {alias: name for name in native for alias in (name, *native_aliases[name])}
    params = {name: tuple(shape) for name, shape in params.items()}
    family = _family_links(model_name, params)
    if family is None:
        family = {}
        for name, shape in params.items():
            found = next((by_any_name[a] for a in (name, *aliases.get(name, ())) if a in by_any_name), None)
            if found is None:
                raise NotMappable(f"{name} is not a parameter of {architecture} (what the config describes)")
            family[name] = (_whole_link(name, found, shape),)
    elif FAMILY_ARCHITECTURES[model_name] != architecture:
        raise NotMappable(f"mplan's {model_name} exports as {FAMILY_ARCHITECTURES[model_name]}, the config "
                          f"describes {architecture}")
    stored, accepted = {}, {}
    covered: dict[str, int] = {}
    for name, links in family.items():
        for link in links:
            if link.key not in native:
                raise NotMappable(f"{name} maps to {link.key}, which {architecture} does not have")
            bound = native[link.key]
            if len(link.dims) != len(bound) or any(link.key_at[i] + link.size[d] > bound[i]
                                                   for i, d in enumerate(link.dims)):
                raise NotMappable(f"{name} has shape {params[name]}, which does not fit {architecture}'s "
                                  f"{link.key} {bound} (as the config describes it)")
            covered[link.key] = covered.get(link.key, 0) + _numel(link.size)
        stored[name] = tuple(piece for link in links for piece in _compose(link, files[link.key]))
        forms = [stored[name], links]
        whole = [link for link in links if _is_whole(link) and link.dims == tuple(range(len(link.dims)))]
        if len(links) == 1 and whole:
            forms += [(Link(param=name, at=link.at, size=link.size, key=alias, key_at=link.key_at, dims=link.dims),)
                      for link in whole for alias in native_aliases[link.key]]
        accepted[name] = tuple(dict.fromkeys(forms))
    for key, shape in native.items():
        if covered.get(key, 0) != _numel(shape):
            missing = "no parameter of this model" if key not in covered else "parameters of other shapes"
            raise NotMappable(f"{architecture}'s {key} {shape} (as the config describes it) would be filled by "
                              f"{missing}")
    ignored = tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    full = json.loads(model.config.to_json_string(use_diff=False))
    full["architectures"] = [architecture]
    return HfLayout(architecture=architecture, config=full, shapes=shapes, stored=stored, accepted=accepted,
                    ignored=ignored)


def _whole_link(param: str, key: str, shape: Shape) -> Link:
    """The whole parameter stored as the whole tensor `key`."""
    return Link(param=param, at=(0,) * len(shape), size=tuple(shape), key=key, key_at=(0,) * len(shape),
                dims=tuple(range(len(shape))))


def _is_whole(link: Link) -> bool:
    return link.at == (0,) * len(link.at)


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def hf_parameters(config: Mapping[str, Any]) -> tuple[str, dict[str, Shape], dict[str, tuple[str, ...]]]:
    """The transformers model `config` describes: its class name, parameters (global shapes,
    under the names its files store tied ones) and their tied aliases."""
    model = _meta_model(json.dumps(dict(config), sort_keys=True))
    params, aliases = _native_parameters(model)
    return type(model).__name__, params, aliases
