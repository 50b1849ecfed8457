"""Fused norms: RMSNorm (after a residual add, alone, or before one) and LayerNorm (after a
residual add, or alone where it is hand-written or has casts around it).

Entries: LAYER_NORM_RESIDUAL, LAYER_NORM, RMS_NORM_RESIDUAL, RMS_NORM_ADD, RMS_NORM
(mplan.kernels.layernorm, .rmsnorm). Each matches the chain at its last node but RMS_NORM_ADD,
which takes the norm's chain and the add its output feeds; the residual forms return
(normed, a + b), the sum also being the next residual. The forms models write:
    pre-norm, a + b then norm       Llama, GPT (aten.layer_norm), Cohere (LayerNorm as ATen ops)
    the sum reshaped, then normed   OPT (reshape(a + b, [-1, hidden]): the rows regrouped, the
                                    reshaped sum the residual stream; the addends reshaped instead)
    the sum cast around the norm    OLMo-1 (F.layer_norm(x.to(float32), no weight or bias).to(dtype))
    the branch scaled, a + c * b    Granite's residual_multiplier (rms_norm_residual's `scale`)
    post-norm, a + norm(b)          OLMo-2 (rms_norm_add: the sum alone comes out)
The measured fractions are shares of the device-to-device copy bandwidth each kernel reached on
the H200 (benchmarks/results/kernels_h200-2026-11-29-session7.json, each kernel's main
16384-row training shape; `fit_kernel_copy_fraction`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import (FusedOpTraffic, FusedSave, FusionEntry, FusionPattern, Launches, MeasuredPricing,
                                PatternMatch, call, meta_like)
from mplan.fusion.graph_match import (VIEW_OPS, cast, is_call, is_last_dim, number, other, same_shape_add,
                                      tensor_value, used_only_by, uses)

__all__ = ["LAYER_NORM", "LAYER_NORM_RESIDUAL", "RMS_NORM", "RMS_NORM_ADD", "RMS_NORM_RESIDUAL"]

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
            users = uses(anchor)
            if len(users) == 1 and (out := _out_cast(users[0], anchor, x, stats)) is not None:
                output, tail, form["out_dtype"] = users[0], (users[0],), out
            return _RmsChain(x=x, weight=weight, eps=eps, chain=(*stats, scaled, *casts, anchor, *tail),
                             output=output, form=form)
    return None


def _normalization(x: Any, rsqrt: Any, scaled: Node) -> tuple[float, tuple[Node, ...]] | None:
    """(eps, [pow, mean, add, rsqrt]) when `rsqrt` is rsqrt(mean(x^2, -1, keepdim) + eps) used only by `scaled`."""
    found = _normalization_stats(rsqrt, scaled)
    if found is None or found[1][0].args[0] is not x:
        return None
    eps, stats = found
    return eps, (*stats, rsqrt)


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


@dataclass(frozen=True, slots=True)
class _LayerNormChain:
    x: Node
    """the value normalized (before any upcast): a fused kernel's input"""
    weight: Node | None
    """the weight as the model holds it (before a `.float()` the chain takes); None: no weight"""
    eps: float
    chain: tuple[Node, ...]
    output: Node
    form: dict[str, Any]
    """keywords of mplan.kernels.layer_norm: hand_written, and the casts upcast, weight_upcast,
    out_dtype where the model writes them"""
    bias: Node | None = None
    """aten.layer_norm's bias (a hand-written norm has none)"""

    @property
    def parameters(self) -> tuple[Node, ...]:
        """The weight and bias the norm reads, those it has: inputs of the fused call."""
        return tuple(v for v in (self.weight, self.bias) if v is not None)


def _layer_norm_chain(anchor: Node) -> _LayerNormChain | None:
    """LayerNorm without a bias written as ATen ops (Cohere's): y = w * n or n * w,
    n = (X - m) * rsqrt(mean((X - m)^2, -1, keepdim) + eps), m = mean(X, -1, keepdim), X = x or
    x.to(float32) (folded when the upcast feeds only the norm), w = weight or weight.to(float32)
    (folded likewise), y optionally cast (`.to(input_dtype)`). X - m may be written once or twice."""
    for normed, weight in (anchor.args, anchor.args[::-1]):
        if not (is_call(normed, aten.mul.Tensor) and isinstance(weight, Node) and used_only_by(normed, anchor)):
            continue
        for centred, rsqrt in (normed.args, normed.args[::-1]):
            found = _standardization(centred, rsqrt, normed)
            if found is None:
                continue
            x, eps, stats = found
            form: dict[str, Any] = {"hand_written": True}
            if (upcast := cast(x)) is not None and upcast[1] == torch.float32 and \
                    used_only_by(x, *(n for n in stats if is_call(n, aten.mean.dim, aten.sub.Tensor))):
                stats, x, form["upcast"] = (x, *stats), upcast[0], True
            weights: tuple[Node, ...] = ()
            if (w_cast := cast(weight)) is not None and w_cast[1] == torch.float32 and used_only_by(weight, anchor):
                weights, weight, form["weight_upcast"] = (weight,), w_cast[0], True
            wv, xv = tensor_value(weight), tensor_value(x)
            if wv is None or xv is None or wv.dim() != 1 or wv.shape[0] != xv.shape[-1] or weight is x:
                continue
            output, tail = anchor, ()
            users = uses(anchor)
            if len(users) == 1 and (out := cast(users[0])) is not None and out[0] is anchor:
                output, tail, form["out_dtype"] = users[0], (users[0],), out[1]
            return _LayerNormChain(x=x, weight=weight, eps=eps, chain=(*stats, normed, *weights, anchor, *tail),
                                   output=output, form=form)
    return None


def _any_layer_norm_chain(anchor: Node) -> _LayerNormChain | None:
    """The LayerNorm ending at `anchor`: aten.layer_norm with its casts, or one written as ATen ops."""
    return _aten_layer_norm_chain(anchor) if is_call(anchor, aten.layer_norm.default) else _layer_norm_chain(anchor)


def _aten_layer_norm_chain(anchor: Node) -> _LayerNormChain | None:
    """aten.layer_norm over the last dim (weight and bias each optional) with the casts a model
    writes around it: its input x or x.to(float32) (OLMo-1's upcast, folded when it feeds only
    the norm), its result optionally cast (`.to(input_dtype)`, folded when that is its only use)."""
    if anchor.kwargs or len(anchor.args) < 2:
        return None
    defaults = (None, None, 1e-5)  # weight, bias, eps
    x, normalized_shape, weight, bias, eps = (*anchor.args, *defaults[len(anchor.args) - 2:])[:5]
    if not isinstance(x, Node) or len(normalized_shape) != 1 or not isinstance(eps, float):
        return None
    form: dict[str, Any] = {}
    chain: tuple[Node, ...] = (anchor,)
    if (upcast := cast(x)) is not None and upcast[1] == torch.float32 and used_only_by(x, anchor):
        chain, x, form["upcast"] = (x, anchor), upcast[0], True
    output, users = anchor, uses(anchor)
    if len(users) == 1 and (out := cast(users[0])) is not None and out[0] is anchor:
        output, chain, form["out_dtype"] = users[0], (*chain, users[0]), out[1]
    return _LayerNormChain(x=x, weight=weight, eps=eps, chain=chain, output=output, form=form, bias=bias)


def _standardization(centred: Any, rsqrt: Any, normed: Node) -> tuple[Node, float, tuple[Node, ...]] | None:
    """(X, eps, [mean, X - m (once or twice), pow, mean, add, rsqrt]) when `centred` is X - m and
    `rsqrt` is rsqrt(mean((X - m)^2, -1, keepdim) + eps), m = mean(X, -1, keepdim), every value
    used only inside (the centred value by `normed` and the square alone)."""
    found = _normalization_stats(rsqrt, normed)
    if found is None or not is_call(centred, aten.sub.Tensor) or len(centred.args) != 2 or centred.kwargs:
        return None
    eps, (square, variance, add_eps) = found
    x, mean = centred.args
    diff = square.args[0]
    if not (is_call(diff, aten.sub.Tensor) and diff.args == (x, mean) and not diff.kwargs):
        return None
    if diff is centred:
        if not used_only_by(centred, square, normed):
            return None
        diffs: tuple[Node, ...] = (centred,)
    elif used_only_by(centred, normed) and used_only_by(diff, square):
        diffs = (diff, centred)
    else:
        return None
    if not (_last_dim_mean(mean, x) and mean.args[0] is x and used_only_by(mean, *diffs)):
        return None
    return x, eps, (mean, *diffs, square, variance, add_eps, rsqrt)


def _normalization_stats(rsqrt: Any, user: Node) -> tuple[float, tuple[Node, Node, Node]] | None:
    """(eps, [pow, mean, add]) when `rsqrt` is rsqrt(mean(v^2, -1, keepdim) + eps) used only by
    `user`, each inner value used once."""
    if not (is_call(rsqrt, aten.rsqrt.default) and used_only_by(rsqrt, user)):
        return None
    add_eps = rsqrt.args[0]
    if not (is_call(add_eps, aten.add.Tensor, aten.add.Scalar) and used_only_by(add_eps, rsqrt)):
        return None
    variance, eps = add_eps.args[0], add_eps.args[1]
    if not (is_call(variance, aten.mean.dim) and used_only_by(variance, add_eps) and isinstance(eps, float)):
        return None
    square = variance.args[0]
    if not (is_call(square, aten.pow.Tensor_Scalar) and square.args[1:] == (2,) and used_only_by(square, variance)
            and isinstance(square.args[0], Node) and _last_dim_mean(variance, square.args[0])):
        return None
    return eps, (square, variance, add_eps)


def _last_dim_mean(mean: Any, x: Node) -> bool:
    """mean(..., [-1], keepdim=True) over x's last dim."""
    if not is_call(mean, aten.mean.dim) or mean.kwargs or mean.args[2:] != (True,):
        return False
    dims = mean.args[1]
    return len(dims) == 1 and is_last_dim(dims[0], x)


def _scaled_branch(pair: tuple[Node, Node], total: Node) -> tuple[tuple[Node, Node], float | None, tuple[Node, ...]]:
    """((branch, residual), scale, [the mul]) when one addend of the residual add `total` is
    branch * c (c a number, the product used only by the add: Granite's residual_multiplier),
    the second addend first when both are; else (pair, None, ())."""
    for scaled in pair[::-1]:
        branch, scale = _scaled_input(scaled)
        if scale is not None and used_only_by(scaled, total):
            return (branch, other(pair, scaled)), scale, (scaled,)
    return pair, None, ()


def _match_rms_norm_residual(anchor: Node) -> PatternMatch | None:
    """params: addends (the residual add's operands, in its order), weight, eps, form (the casts
    around the normalization, keywords of the fused op)."""
    found = _rms_chain(anchor)
    if found is None:
        return None
    pair = same_shape_add(found.x)
    if pair is None:
        return None  # a norm of anything but a residual sum: RMS_NORM's
    pair, scale, scaling = _scaled_branch(pair, found.x)
    form = found.form if scale is None else {**found.form, "scale": scale}
    return PatternMatch(anchor=anchor, chain=(*scaling, found.x, *found.chain), outputs=(found.output, found.x),
                        inputs=(*pair, found.weight),
                        params={"addends": pair, "weight": found.weight, "eps": found.eps, "form": form})


def _match_rms_norm_add(anchor: Node) -> PatternMatch | None:
    """params: x (the sublayer output normed), residual, weight, eps, form (the norm's casts). The
    norm's result (after its cast) must feed only a residual add of its own shape and dtype."""
    found = _rms_chain(anchor)
    if found is None:
        return None
    users = uses(found.output)
    pair = same_shape_add(users[0]) if len(users) == 1 else None
    if pair is None or found.output not in pair or pair[0] is pair[1] or _feeds_a_norm(users[0]):
        return None
    total = users[0]
    residual = other(pair, found.output)
    return PatternMatch(anchor=anchor, chain=(*found.chain, total), outputs=(total,),
                        inputs=(found.x, residual, found.weight),
                        params={"x": found.x, "residual": residual, "weight": found.weight, "eps": found.eps,
                                "form": found.form})


def _match_rms_norm(anchor: Node) -> PatternMatch | None:
    """params: x, weight, eps, form (as for rms_norm_residual). x * c (c a number) also read past
    the norm (Granite's embeddings times embedding_multiplier, the residual stream) is taken as
    the norm's `scale`: the fused op returns (normed, x * c)."""
    found = _rms_chain(anchor)
    if found is None:
        return None
    scaled = found.x
    x, scale = _scaled_input(scaled)
    if scale is None:
        return PatternMatch(anchor=anchor, chain=found.chain, outputs=(found.output,), inputs=(found.x, found.weight),
                            params={"x": found.x, "weight": found.weight, "eps": found.eps, "form": found.form})
    return PatternMatch(anchor=anchor, chain=(scaled, *found.chain), outputs=(found.output, scaled),
                        inputs=(x, found.weight),
                        params={"x": x, "weight": found.weight, "eps": found.eps, "form": {**found.form, "scale": scale}})


def _scaled_input(scaled: Any) -> tuple[Any, float | None]:
    """(x, c) when `scaled` is x * c or c * x, c a number, x of its shape and dtype; else (scaled, None)."""
    if is_call(scaled, aten.mul.Tensor) and len(scaled.args) == 2 and not scaled.kwargs:
        for x, c in (scaled.args, scaled.args[::-1]):
            xv, sv = tensor_value(x), tensor_value(scaled)
            if number(c) is not None and xv is not None and sv is not None and xv.shape == sv.shape \
                    and xv.dtype == sv.dtype:
                return x, number(c)
    return scaled, None


_NORM_STARTS = (aten.pow.Tensor_Scalar, aten.mean.dim, aten.layer_norm.default)


def _feeds_a_norm(total: Node) -> bool:
    """Whether the sum `total` is normed next (read by a pow, mean or layer_norm, directly or
    through a cast) and read past that norm too: Gemma-2's post-norm, add, then pre-norm, the
    sum going on as the residual stream. The add is then better the pre-norm's residual add
    (rms_norm_residual, whose backward takes the stream's gradient in): taken by the post-norm,
    it leaves the sum read by two ops, whose gradients one more kernel sums, so the two fused
    norms meeting at the add would move more bytes than post-norm alone + norm with residual.
    A sum that only the next norm reads (the last block's, into the final norm) is not such."""
    users = uses(total)
    reads = [*users, *(u for c in users if cast(c) is not None for u in c.users)]
    return len(users) > 1 and any(is_call(u, *_NORM_STARTS) for u in reads)


def _match_layer_norm_residual(anchor: Node) -> PatternMatch | None:
    """params: addends (the residual add's operands, in its order), weight, bias (each a node or
    None), eps, form (the norm's casts and a hand-written norm's keywords: `_layer_norm_chain`,
    `_aten_layer_norm_chain`), reshape (None, or the shape the sum is reshaped to before the norm
    reads it, `_seen_through`: the addends are reshaped to it instead)."""
    found = _any_layer_norm_chain(anchor)
    if found is None:
        return None
    total, seen = _seen_through(found.x)
    pair = same_shape_add(total)
    if pair is None:
        return None  # a norm of anything but a residual sum: LAYER_NORM's (hand-written or with casts)
    addends, inner = _three_addends(pair, total)
    shape = seen[0].args[1] if seen and is_call(seen[0], *VIEW_OPS) else None
    sizes = tuple(size for size in shape or () if isinstance(size, Node))  # symbolic ones
    return PatternMatch(anchor=anchor, chain=(*inner, total, *seen, *found.chain), outputs=(found.output, found.x),
                        inputs=(*addends, *sizes, *found.parameters),
                        params={"addends": addends, "weight": found.weight, "bias": found.bias, "eps": found.eps,
                                "form": found.form, "reshape": shape})


def _seen_through(value: Node) -> tuple[Node, tuple[Node, ...]]:
    """(s, [value]) when `value` is s under another name and s is read by nothing else: s reshaped
    keeping its rows whole (the same last dim: OPT flattens the residual sum to [tokens, hidden],
    normalizes that and adds on to it), or s cast to the dtype it has (a float32 model's upcast,
    a no-op the residual stream reads on: OLMo-1's); else (value, ())."""
    if not (is_call(value, *VIEW_OPS, aten.to.dtype) and len(value.args) == 2 and not value.kwargs
            and isinstance(value.args[0], Node) and used_only_by(value.args[0], value)):
        return value, ()
    source = value.args[0]
    sv, vv = tensor_value(source), tensor_value(value)
    if sv is None or vv is None or sv.dtype != vv.dtype or not (sv.dim() and vv.dim()) or sv.shape[-1] != vv.shape[-1]:
        return value, ()
    return source, (value,)


def _three_addends(pair: tuple[Node, Node], total: Node) -> tuple[tuple[Node, ...], tuple[Node, ...]]:
    """((a, b, c), [a + b]) when one addend of the residual add `total` is itself a residual add
    a + b that only `total` reads (a parallel block's residual + attn + mlp: Cohere's, GPT-NeoX's),
    the sum added first as the model adds it; else (pair, ())."""
    for inner in pair:
        inner_pair = same_shape_add(inner)
        if inner_pair is not None and used_only_by(inner, total) and inner is not other(pair, inner):
            return (*inner_pair, other(pair, inner)), (inner,)
    return pair, ()


def _match_layer_norm(anchor: Node) -> PatternMatch | None:
    """params: x, weight, bias, eps, form (as for layer_norm_residual). aten.layer_norm is taken
    only with a cast around it (OLMo-1's norm of the embedding): alone it is one ATen kernel already."""
    found = _any_layer_norm_chain(anchor)
    if found is None or not found.form:
        return None
    return PatternMatch(anchor=anchor, chain=found.chain, outputs=(found.output,), inputs=(found.x, *found.parameters),
                        params={"x": found.x, "weight": found.weight, "bias": found.bias, "eps": found.eps,
                                "form": found.form})


def _emit_rms_norm_residual(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import rms_norm_residual

    p = match.params
    return call(graph, rms_norm_residual, (*p["addends"], p["weight"], p["eps"]), match.anchor, dict(p["form"]))


def _emit_rms_norm(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import rms_norm

    p = match.params
    return call(graph, rms_norm, (p["x"], p["weight"], p["eps"]), match.anchor, dict(p["form"]))


def _emit_rms_norm_add(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels.rmsnorm import rms_norm_add

    p = match.params
    return call(graph, rms_norm_add, (p["x"], p["residual"], p["weight"], p["eps"]), match.anchor, dict(p["form"]))


def _emit_layer_norm_residual(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import layer_norm_residual

    p = match.params
    (x, residual, *third) = (_reshape(graph, a, p["reshape"], match.outputs[1]) for a in p["addends"])
    return call(graph, layer_norm_residual, (x, residual, p["weight"], p["bias"], p["eps"]), match.anchor,
                {**p["form"], **({"third": third[0]} if third else {})})


def _reshape(graph: Graph, addend: Node, shape: Any, like: Node) -> Node:
    """`addend` reshaped to `shape` as the sum was (`like`, the reshaped sum): a view where its
    strides allow, as the kernel reads it contiguous anyway; `addend` itself when `shape` is None."""
    if shape is None:
        return addend
    reshaped = call(graph, aten.reshape.default, (addend, shape), like)
    reshaped.meta["val"] = meta_like(tensor_value(addend), tensor_value(like).shape)
    return reshaped


def _emit_layer_norm(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels.layernorm import layer_norm

    p = match.params
    return call(graph, layer_norm, (p["x"], p["weight"], p["bias"], p["eps"]), match.anchor, dict(p["form"]))


_RMS_FRACTION = (0.965, 0.943)
_NORM_LAUNCHES = Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=1)  # + sum_partials

RMS_NORM_RESIDUAL = FusionEntry(
    name="rms_norm_residual",
    # (a + b) -> pow 2 / mean(-1, keepdim) / add eps / rsqrt / mul / mul weight, the sum also used
    # later: Llama's pre-norm after each residual add
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=_match_rms_norm_residual),
    forms=("weight * n or n * weight", "Hugging Face's fp32 upcast and cast back", "Gemma's (1 + weight) and type_as",
           "Granite's residual + branch * residual_multiplier (the scale applied in the kernel)"),
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
    notes={"scale": "a scaled branch's backward writes its gradient apart from the residual's (one row "
                    "tensor more than `traffic` counts; Granite only)"},
)

RMS_NORM_ADD = FusionEntry(
    name="rms_norm_add",
    # pow 2 / mean / add eps / rsqrt / mul / mul weight [/ cast] -> residual + normed: a post-norm
    # block (OLMo-2) norms each sublayer's output, then adds it to the residual stream. Matched
    # at the norm's last mul (before RMS_NORM would take the norm alone), the add taken with it.
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=_match_rms_norm_add),
    forms=("OLMo-2's residual + post_attention_layernorm(attn) and + post_feedforward_layernorm(mlp)",
           "the norm in any of RMS_NORM's forms, its result used by the add alone"),
    keeps=lambda m: FusedSave((m.params["x"].name,), ((m.anchor.name, "rows4"),)),  # x, rstd
    pricing=MeasuredPricing(
        traffic=FusedOpTraffic(
            forward_row_tensors=3, backward_row_tensors=3, forward_vectors=1, backward_vectors=2,
            forward_row_stats=1, backward_row_stats=1,
            what="read x, residual, weight; write the sum, rstd; read d_sum, x, weight, rstd; write dx, d_weight "
                 "(the residual's gradient is d_sum itself)"),
        # not measured on a GPU: its forward is RMSNorm + residual's row loop with the add moved
        # after the weight, its backward RMSNorm's, so that kernel's measured fraction stands in
        copy_fraction=_RMS_FRACTION,
        source=f"{_KERNELS_RUN}: RMSNorm + residual's (not measured itself: the same row kernels)"),
    launches=_NORM_LAUNCHES,
    emit=_emit_rms_norm_add,
    lesser="rms_norm",
)

RMS_NORM = FusionEntry(
    name="rms_norm",
    # the same chain on anything else (the first block's embedding output, q/k norms)
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=_match_rms_norm),
    forms=(*RMS_NORM_RESIDUAL.forms[:3],
           "Granite's embeddings * embedding_multiplier, normed and returned (the scale applied in the kernel)"),
    # x (or x * scale, which it writes), rstd
    keeps=lambda m: FusedSave((m.outputs[-1].name if "scale" in m.params["form"] else m.params["x"].name,),
                              ((m.anchor.name, "rows4"),)),
    pricing=MeasuredPricing(
        traffic=FusedOpTraffic(
            forward_row_tensors=2, backward_row_tensors=3, forward_vectors=1, backward_vectors=2,
            forward_row_stats=1, backward_row_stats=1,
            what="read x, weight; write normed, rstd; read d_normed, x, weight, rstd; write dx, d_weight"),
        copy_fraction=_RMS_FRACTION, source=f"{_KERNELS_RUN}: RMSNorm + residual's (the same kernel)"),
    launches=_NORM_LAUNCHES,
    emit=_emit_rms_norm,
    marks=None,
    notes={"scale": "a scaled input's product is written too: one row tensor more in the forward than "
                    "`traffic` counts (Granite's first norm only); its two outputs are not marked for autocast"},
)

LAYER_NORM_RESIDUAL = FusionEntry(
    name="layer_norm_residual",
    # (a + b) [-> reshape keeping the rows] [-> .to(float32)] -> aten.layer_norm over the last dim
    # [-> cast]: GPT's pre-LayerNorm after each residual add, OPT's of the flattened sum, OLMo-1's
    # without parameters in fp32; or (a + b) -> Cohere's LayerNorm written as ATen ops (mean, sub,
    # pow, mean, add eps, rsqrt, mul, mul weight, casts), matched at its weight's mul
    pattern=FusionPattern(anchors=(aten.layer_norm.default, aten.mul.Tensor), match=_match_layer_norm_residual),
    forms=("aten.layer_norm of a residual sum, with or without a bias",
           "Cohere's LayerNorm as ATen ops (no bias, fp32 upcast, weight.float(), cast back)",
           "a parallel block's (residual + attn) + mlp: three addends",
           "OPT's sum reshaped to [tokens, hidden] before the norm, the reshaped sum the residual stream",
           "OLMo-1's F.layer_norm(x.to(float32)) without weight or bias, cast back"),
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
    lesser="layer_norm",
    notes={"third": "three addends read one row tensor more in the forward than `traffic` counts (and "
                    "save the add that wrote and read their first sum)",
           "parameters": "a norm without weight or bias (OLMo-1's) reads and writes neither: two vectors "
                         "fewer in the forward and three in the backward than `traffic` counts, and no "
                         "sum_partials launch; without a bias alone, one fewer each way"},
)

LAYER_NORM = FusionEntry(
    name="layer_norm",
    # a hand-written LayerNorm of anything but a residual sum (Cohere's first block reads the
    # embedding; its parallel block feeds attention and the MLP from one norm), or aten.layer_norm
    # with casts around it (OLMo-1's first norm, of the embedding). aten.layer_norm without casts
    # is not taken: it already runs as one ATen kernel.
    pattern=FusionPattern(anchors=(aten.layer_norm.default, aten.mul.Tensor), match=_match_layer_norm),
    forms=(*LAYER_NORM_RESIDUAL.forms[1:2],
           "aten.layer_norm with a cast around it (OLMo-1's F.layer_norm(x.to(float32)).to(dtype)), "
           "weight and bias each optional"),
    keeps=lambda m: FusedSave((m.params["x"].name,), ((m.anchor.name, "rows8"),)),  # x, mean and rstd
    pricing=MeasuredPricing(
        traffic=FusedOpTraffic(
            forward_row_tensors=2, backward_row_tensors=3, forward_vectors=1, backward_vectors=2,
            forward_row_stats=2, backward_row_stats=2,
            what="read x, weight; write normed, mean, rstd; read d_normed, x, weight, mean, rstd; "
                 "write dx, d_weight"),
        # not measured alone: LayerNorm + residual's kernels with the add skipped
        copy_fraction=(0.971, 0.899), source=f"{_KERNELS_RUN}: LayerNorm + residual's (the same kernels)"),
    launches=_NORM_LAUNCHES,
    emit=_emit_layer_norm,
    marks=None,
    notes={"parameters": "aten.layer_norm's bias reads one vector more in the forward and writes one more in "
                         "the backward than `traffic` counts; without a weight (OLMo-1's) one fewer each way, "
                         "and without either no sum_partials launch"},
)
