"""One decoder layer's shapes (`dynamic_context.LayerShape`) read from the model a user named.

Input: a resolved model spec (`mplan.models.resolve_model`: a preset, a family spec, a Hugging
Face config.json or a factory). Output: the `LayerShape` the dynamic-CP pricing takes (hidden,
heads, KV heads, head dim, gated-MLP width, layers), or `ShapeUnknown` naming why there is none.

Why: `mplan plan --documents` prices the data's length mix on the model being planned, so its
shapes come from that model's config, resolved as `plan` resolves it, never from a constant.
Only a dense decoder with a gated MLP (q, k, v, o; gate, up, down) fits `LayerShape`: mplan's
llama family, or a Hugging Face config stating hidden_size, num_attention_heads,
intermediate_size and num_hidden_layers (num_key_value_heads defaulting to the heads, head_dim to
hidden / heads) and no experts. GPT's plain MLP, MoE experts and a factory module without a
config are refused, each in one line naming why.
"""
from __future__ import annotations

from typing import Any

from mplan.models.config import GPTConfig, LlamaConfig, MoEConfig
from mplan.models.spec import ModelSource
from mplan.planner.dynamic_context import LayerShape


class ShapeUnknown(ValueError):
    """The model's layer cannot be read as a gated-MLP decoder layer; the message says why."""


_HF_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
_HF_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def layer_shape(source: ModelSource, *, dtype: str = "bf16") -> LayerShape:
    """The layer shape `source`'s config states (module docstring), in `dtype`."""
    config = source.config
    if isinstance(config, MoEConfig):
        raise ShapeUnknown(f"{source.name}: an MoE model's layers hold experts, not one gated MLP")
    if isinstance(config, GPTConfig):
        raise ShapeUnknown(f"{source.name}: a GPT layer's MLP is not gated (gate, up, down)")
    if isinstance(config, LlamaConfig):
        return LayerShape(hidden=config.hidden, heads=config.num_heads, kv_heads=config.kv_heads,
                          head_dim=config.head_dim, ffn=config.ffn, num_layers=config.num_layers, dtype=dtype)
    if config is None or not callable(getattr(config, "to_dict", None)):
        raise ShapeUnknown(f"{source.name}: the model states no config to read its layer's shapes from "
                           f"(a package.module:factory module without one)")
    return _from_hf(config.to_dict(), source.name, dtype)


def _from_hf(fields: dict[str, Any], name: str, dtype: str) -> LayerShape:
    if any(_whole(fields.get(key)) for key in _HF_EXPERTS):
        raise ShapeUnknown(f"{name}: an MoE model's layers hold experts, not one gated MLP")
    missing = [key for key in _HF_FIELDS if not _whole(fields.get(key))]
    if missing:
        raise ShapeUnknown(f"{name}: its config states no {', '.join(missing)} (not a gated-MLP decoder's config)")
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") if _whole(fields.get("num_key_value_heads")) else heads
    head_dim = fields.get("head_dim") if _whole(fields.get("head_dim")) else hidden // heads
    return LayerShape(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      ffn=fields["intermediate_size"], num_layers=fields["num_hidden_layers"], dtype=dtype)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
