"""Fused norms: RMSNorm (after a residual add, or alone) and LayerNorm after a residual add.

Entries: RMS_NORM_RESIDUAL, RMS_NORM, LAYER_NORM_RESIDUAL (mplan.kernels.rmsnorm, .layernorm).
Each matches the chain at its last node; the residual forms return (normed, a + b), the sum
also being the next residual. The measured fractions are shares of the device-to-device copy
bandwidth each kernel reached on the H200 (benchmarks/results/kernels_h200-2026-11-29-session7.json,
each kernel's main 16384-row training shape; `fit_kernel_copy_fraction`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import (FusedOpTraffic, FusedSave, FusionEntry, FusionPattern, Launches, MeasuredPricing,
                                PatternMatch, call)
from mplan.fusion.graph_match import cast, is_call, is_last_dim, same_shape_add, tensor_value, used_only_by

__all__ = ["LAYER_NORM_RESIDUAL", "RMS_NORM", "RMS_NORM_RESIDUAL"]

aten = torch.ops.aten
_KERNELS_RUN = "benchmarks/results/kernels_h200-2026-11-29-session7.json"


@dataclass(frozen=True, slots=True)
class _RmsChain:
    x: Node
    """the value normalized (before any upcast): a fused kernel's input"""
    weight: Node
    eps: float
    chain: tuple[Node, ...]
    output: Node
    """the anchor, or the cast of it that ends the chain"""
    form: dict[str, Any]
    """the casts around the normalization, as keywords of mplan.kernels.rms_norm: upcast,
    norm_dtype, out_dtype (each only where the model writes it)"""


def _rms_chain(anchor: Node) -> _RmsChain | None:
    """RMSNorm written as y = weight * n or n * weight, n = X * rsqrt(mean(X^2, -1, keepdim) + eps),
    in the forms models write it: X = x or x.to(float32) (Hugging Face's upcast; folded only when
    the upcast feeds nothing else), n optionally cast (`.to(input_dtype)`) before the weight, y
    optionally cast after it (`.to(dtype)`, or Gemma's `type_as(x)`). The weight is any node
    with one value per channel (Gemma's `1 + weight.float()` included)."""
    for normed, weight in (anchor.args, anchor.args[::-1]):
        if not isinstance(normed, Node) or not isinstance(weight, Node) or not used_only_by(normed, anchor):
            continue
        form: dict[str, Any] = {}
        scaled, casts = normed, ()
        if (found_cast := cast(normed)) is not None:
            (scaled, form["norm_dtype"]), casts = found_cast, (normed,)
        if not is_call(scaled, aten.mul.Tensor) or not used_only_by(scaled, normed if casts else anchor):
            continue
        for x, rsqrt in (scaled.args, scaled.args[::-1]):
            found = _normalization(x, rsqrt, scaled)
            if found is None:
                continue
            eps, stats = found
            if (upcast := cast(x)) is not None and upcast[1] == torch.float32 and used_only_by(x, stats[0], scaled):
                stats, x, form["upcast"] = (x, *stats), upcast[0], True
            wv, xv = tensor_value(weight), tensor_value(x)
            if wv is None or xv is None or wv.dim() != 1 or wv.shape[0] != xv.shape[-1] or weight is x:
                continue
            output, tail = anchor, ()
            users = list(anchor.users)
            if len(users) == 1 and (out := _out_cast(users[0], anchor, x, stats)) is not None:
                output, tail, form["out_dtype"] = users[0], (users[0],), out
            return _RmsChain(x=x, weight=weight, eps=eps, chain=(*stats, scaled, *casts, anchor, *tail),
                             output=output, form=form)
    return None


def _normalization(x: Any, rsqrt: Any, scaled: Node) -> tuple[float, tuple[Node, ...]] | None:
    """(eps, [pow, mean, add, rsqrt]) when `rsqrt` is rsqrt(mean(x^2, -1, keepdim) + eps) used only by `scaled`."""
    if not (is_call(rsqrt, aten.rsqrt.default) and used_only_by(rsqrt, scaled)):
        return None
    add_eps = rsqrt.args[0]
    if not (is_call(add_eps, aten.add.Tensor, aten.add.Scalar) and used_only_by(add_eps, rsqrt)):
        return None
    mean, eps = add_eps.args[0], add_eps.args[1]
    if not (is_call(mean, aten.mean.dim) and used_only_by(mean, add_eps) and isinstance(eps, float)):
        return None
    dims = mean.args[1]
    if len(dims) != 1 or not is_last_dim(dims[0], x) or mean.args[2:] != (True,) or mean.kwargs:
        return None
    square = mean.args[0]
    if not (is_call(square, aten.pow.Tensor_Scalar) and square.args == (x, 2) and used_only_by(square, mean)):
        return None
    return eps, (square, mean, add_eps, rsqrt)


def _out_cast(user: Node, anchor: Node, x: Node, stats: tuple[Node, ...]) -> torch.dtype | None:
    """The dtype `user` casts the norm's result to: `.to(dtype)`, or `type_as` of the norm's own
    input or its upcast (whose dtype is the captured one: the residual stream keeps its dtype,
    under autocast too, where it is fp32)."""
    if (found := cast(user)) is not None and found[0] is anchor:
        return found[1]
    if is_call(user, aten.type_as.default) and user.args[0] is anchor and (user.args[1] is x or user.args[1] in stats):
        value = tensor_value(user.args[1])
        return None if value is None else value.dtype
    return None


def _match_rms_norm_residual(anchor: Node) -> PatternMatch | None:
    """params: addends (the residual add's operands, in its order), weight, eps, form (the casts
    around the normalization, keywords of the fused op)."""
    found = _rms_chain(anchor)
    if found is None:
        return None
    pair = same_shape_add(found.x)
    if pair is None:
        return None  # a norm of anything but a residual sum: RMS_NORM's
    return PatternMatch(anchor=anchor, chain=(found.x, *found.chain), outputs=(found.output, found.x),
                        inputs=(*pair, found.weight),
                        params={"addends": pair, "weight": found.weight, "eps": found.eps, "form": found.form})


def _match_rms_norm(anchor: Node) -> PatternMatch | None:
    """params: x, weight, eps, form (as for rms_norm_residual)."""
    found = _rms_chain(anchor)
    if found is None:
        return None
    return PatternMatch(anchor=anchor, chain=found.chain, outputs=(found.output,), inputs=(found.x, found.weight),
                        params={"x": found.x, "weight": found.weight, "eps": found.eps, "form": found.form})


def _match_layer_norm_residual(anchor: Node) -> PatternMatch | None:
    """params: addends (the residual add's operands, in its order), weight, bias (or None), eps."""
    total, normalized_shape, weight, bias, eps = (list(anchor.args) + [None, None, 1e-5])[:5]
    pair = same_shape_add(total)
    if pair is None or anchor.kwargs or weight is None or len(normalized_shape) != 1:
        return None
    inputs = (*pair, weight) if bias is None else (*pair, weight, bias)
    return PatternMatch(anchor=anchor, chain=(total, anchor), outputs=(anchor, total), inputs=inputs,
                        params={"addends": pair, "weight": weight, "bias": bias, "eps": eps})


def _emit_rms_norm_residual(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import rms_norm_residual

    p = match.params
    return call(graph, rms_norm_residual, (*p["addends"], p["weight"], p["eps"]), match.anchor, dict(p["form"]))


def _emit_rms_norm(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import rms_norm

    p = match.params
    return call(graph, rms_norm, (p["x"], p["weight"], p["eps"]), match.anchor, dict(p["form"]))


def _emit_layer_norm_residual(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import layer_norm_residual

    p = match.params
    return call(graph, layer_norm_residual, (*p["addends"], p["weight"], p["bias"], p["eps"]), match.anchor)


_RMS_FRACTION = (0.965, 0.943)
_NORM_LAUNCHES = Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=1)  # + sum_partials

RMS_NORM_RESIDUAL = FusionEntry(
    name="rms_norm_residual",
    # (a + b) -> pow 2 / mean(-1, keepdim) / add eps / rsqrt / mul / mul weight, the sum also used
    # later: Llama's pre-norm after each residual add
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=_match_rms_norm_residual),
    forms=("weight * n or n * weight", "Hugging Face's fp32 upcast and cast back", "Gemma's (1 + weight) and type_as"),
    keeps=lambda m: FusedSave((m.outputs[1].name,), ((m.anchor.name, "rows4"),)),  # the sum, rstd
    pricing=MeasuredPricing(
        traffic=FusedOpTraffic(
            forward_row_tensors=4, backward_row_tensors=4, forward_vectors=1, backward_vectors=2,
            forward_row_stats=1, backward_row_stats=1,
            what="read x, residual, weight; write normed, new_residual, rstd; "
                 "read d_normed, d_new_residual, new_residual, weight, rstd; write dx, d_weight"),
        copy_fraction=_RMS_FRACTION, source=_KERNELS_RUN),
    launches=_NORM_LAUNCHES,
    emit=_emit_rms_norm_residual,
    marks=0,
    lesser="rms_norm",
)

RMS_NORM = FusionEntry(
    name="rms_norm",
    # the same chain on anything else (the first block's embedding output, q/k norms)
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=_match_rms_norm),
    forms=RMS_NORM_RESIDUAL.forms,
    keeps=lambda m: FusedSave((m.params["x"].name,), ((m.anchor.name, "rows4"),)),  # x, rstd
    pricing=MeasuredPricing(
        traffic=FusedOpTraffic(
            forward_row_tensors=2, backward_row_tensors=3, forward_vectors=1, backward_vectors=2,
            forward_row_stats=1, backward_row_stats=1,
            what="read x, weight; write normed, rstd; read d_normed, x, weight, rstd; write dx, d_weight"),
        copy_fraction=_RMS_FRACTION, source=f"{_KERNELS_RUN}: RMSNorm + residual's (the same kernel)"),
    launches=_NORM_LAUNCHES,
    emit=_emit_rms_norm,
    marks=None,
)

LAYER_NORM_RESIDUAL = FusionEntry(
    name="layer_norm_residual",
    # (a + b) -> aten.layer_norm over the last dim with a weight: GPT's pre-LayerNorm after each
    # residual add
    pattern=FusionPattern(anchors=(aten.layer_norm.default,), match=_match_layer_norm_residual),
    forms=("aten.layer_norm of a residual sum, with or without a bias",),
    keeps=lambda m: FusedSave((m.outputs[1].name,), ((m.anchor.name, "rows8"),)),  # the sum, mean and rstd
    pricing=MeasuredPricing(
        traffic=FusedOpTraffic(
            forward_row_tensors=4, backward_row_tensors=4, forward_vectors=2, backward_vectors=3,
            forward_row_stats=2, backward_row_stats=2,
            what="read x, residual, weight, bias; write normed, new_residual, mean, rstd; read d_normed, "
                 "d_new_residual, new_residual, weight, mean, rstd; write dx, d_weight, d_bias"),
        copy_fraction=(0.971, 0.899), source=_KERNELS_RUN),
    launches=_NORM_LAUNCHES,
    emit=_emit_layer_norm_residual,
    marks=0,
)
