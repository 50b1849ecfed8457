"""The ATen op chains that form one fused op (RMSNorm + residual, bias + GELU, SwiGLU, RoPE, ...).

Input: a node of an ATen-level `torch.fx` graph, as `torch.export.export(model, ...,
strict=False).module()` gives for mplan's models (nodes carry `meta["val"]` fake tensors).
Output: a `PatternMatch` when the node ends a chain some `FusionPattern` describes: the chain's
nodes, the chain values a fused op would return, the graph values it reads, and the operands and
constants it needs (eps, split sizes, ...) by name. Nothing is rewritten here: the
`fuse_kernels` pass (mplan.passes) pairs each pattern with the kernel call that replaces the
chain, and the planner (mplan.planner.fused_pricing) prices the chains it finds as those kernels.
Both read `FUSION_PATTERNS` in its order, so they find the same chains.

Patterns are data: `FUSION_PATTERNS`, one `FusionPattern` per chain with a comment saying what
it matches, tried at the chain's last node (its anchor), the first that matches winning; plus
`ATTENTION_PATTERN` and `fp8_linear_pattern` (the pass uses them only on CUDA / when asked).

Invariants:
- A chain matches only when its intermediate values have no use outside it (a fused op would
  otherwise compute them twice), its constants are the ones a fused kernel assumes (eps a
  number, reductions over the last dim, slices at head_dim / 2, ...), and its shapes, read from
  `meta["val"]`, fit (a residual add that broadcasts is not a residual).
- Nothing of mplan outside mplan.ir is imported, and neither mplan.kernels nor Triton: the
  planner imports this module for every plan. Where recognition must also accept an op the
  pass has already fused (the loss, attention), the caller passes that op's target in
  (`losses=`, `attention_ops=`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.fx import Node

from mplan.ir.causal_mask import example_int, is_causal_mask

__all__ = ["ATTENTION_OPS", "ATTENTION_PATTERN", "FUSION_PATTERNS", "LOSS_OPS", "FusionPattern", "PatternMatch",
           "feeds_the_loss", "fp8_linear_pattern", "is_call", "sole_consumer", "tensor_value"]

aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True, slots=True)
class PatternMatch:
    """One matched chain: what a fused op replacing it takes over, reads and needs."""

    anchor: Node
    """the node the pattern was matched at (the fused call copies its source metadata)"""
    chain: tuple[Node, ...]
    """the matched nodes; a rewrite erases them once the fused call has taken over their uses"""
    outputs: tuple[Node, ...]
    """chain nodes whose values the fused op returns, in the order it returns them"""
    inputs: tuple[Node, ...]
    """graph values the fused op reads (a fused call must come after all of them)"""
    params: Mapping[str, Any]
    """the fused op's operands by name: graph values (also in `inputs`) and constants (eps,
    split sizes, SDPA's options); each pattern's matcher says which"""


@dataclass(frozen=True, kw_only=True, slots=True)
class FusionPattern:
    """A chain some fused op can replace, and how to find it."""

    name: str
    """the fused op's name; for the memory-bound ops also their key in
    mplan.kernels.op_bytes.FUSED_OP_TRAFFIC and the planner's measured bandwidths"""
    anchors: tuple[Any, ...]
    """ATen overloads the chain can end with"""
    match: Callable[[Node], PatternMatch | None]


# ---- node predicates -------------------------------------------------------------------------

def is_call(node: Any, *targets: Any) -> bool:
    """Whether `node` is a graph node calling one of `targets`."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def tensor_value(node: Any) -> torch.Tensor | None:
    """The (fake) tensor `node` computes, from `meta["val"]`; None if it has none."""
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _used_only_by(node: Node, *users: Node) -> bool:
    """Every use of `node` is one of `users` (export's dtype assertions do not count: a fused op
    never exposes the value they check, and the pass drops them)."""
    return {u for u in node.users if not is_call(u, aten._assert_tensor_metadata.default)} <= set(users)


def _is_last_dim(dim: Any, node: Node) -> bool:
    value = tensor_value(node)
    return dim == -1 or (value is not None and dim == value.dim() - 1)


def _same_shape_add(node: Any) -> tuple[Node, Node] | None:
    """(a, b) when `node` is a + b of two tensors of one shape and dtype (a residual add)."""
    if not is_call(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    va, vb = tensor_value(a), tensor_value(b)
    if va is None or vb is None or va.shape != vb.shape or va.dtype != vb.dtype:
        return None
    return a, b


def _other(pair: tuple[Any, Any], node: Any) -> Any:
    return pair[1] if pair[0] is node else pair[0]


# ---- matchers, one per pattern ---------------------------------------------------------------

def _cast(node: Any) -> tuple[Node, torch.dtype] | None:
    """(source, dtype) when `node` is source.to(dtype) and nothing else (no copy or layout flags)."""
    if is_call(node, aten.to.dtype) and len(node.args) == 2 and not node.kwargs and isinstance(node.args[0], Node):
        return node.args[0], node.args[1]
    return None


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
        if not isinstance(normed, Node) or not isinstance(weight, Node) or not _used_only_by(normed, anchor):
            continue
        form: dict[str, Any] = {}
        scaled, casts = normed, ()
        if (cast := _cast(normed)) is not None:
            (scaled, form["norm_dtype"]), casts = cast, (normed,)
        if not is_call(scaled, aten.mul.Tensor) or not _used_only_by(scaled, normed if casts else anchor):
            continue
        for x, rsqrt in (scaled.args, scaled.args[::-1]):
            found = _normalization(x, rsqrt, scaled)
            if found is None:
                continue
            eps, stats = found
            if (upcast := _cast(x)) is not None and upcast[1] == torch.float32 and _used_only_by(x, stats[0], scaled):
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
    if not (is_call(rsqrt, aten.rsqrt.default) and _used_only_by(rsqrt, scaled)):
        return None
    add_eps = rsqrt.args[0]
    if not (is_call(add_eps, aten.add.Tensor, aten.add.Scalar) and _used_only_by(add_eps, rsqrt)):
        return None
    mean, eps = add_eps.args[0], add_eps.args[1]
    if not (is_call(mean, aten.mean.dim) and _used_only_by(mean, add_eps) and isinstance(eps, float)):
        return None
    dims = mean.args[1]
    if len(dims) != 1 or not _is_last_dim(dims[0], x) or mean.args[2:] != (True,) or mean.kwargs:
        return None
    square = mean.args[0]
    if not (is_call(square, aten.pow.Tensor_Scalar) and square.args == (x, 2) and _used_only_by(square, mean)):
        return None
    return eps, (square, mean, add_eps, rsqrt)


def _out_cast(user: Node, anchor: Node, x: Node, stats: tuple[Node, ...]) -> torch.dtype | None:
    """The dtype `user` casts the norm's result to: `.to(dtype)`, or `type_as` of the norm's own
    input or its upcast (whose dtype is the captured one: the residual stream keeps its dtype,
    under autocast too, where it is fp32)."""
    if (cast := _cast(user)) is not None and cast[0] is anchor:
        return cast[1]
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
    pair = _same_shape_add(found.x)
    if pair is None:
        return None
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
    pair = _same_shape_add(total)
    if pair is None or anchor.kwargs or weight is None or len(normalized_shape) != 1:
        return None
    inputs = (*pair, weight) if bias is None else (*pair, weight, bias)
    return PatternMatch(anchor=anchor, chain=(total, anchor), outputs=(anchor, total), inputs=inputs,
                        params={"addends": pair, "weight": weight, "bias": bias, "eps": eps})


def _match_bias_gelu(anchor: Node) -> PatternMatch | None:
    """params: linear (the biased GEMM, whose value the unbiased one has), x, weight, bias."""
    approximate = anchor.kwargs.get("approximate", anchor.args[1] if len(anchor.args) > 1 else "none")
    linear = anchor.args[0]
    if approximate != "tanh" or not is_call(linear, aten.linear.default) or not _used_only_by(linear, anchor):
        return None
    if len(linear.args) < 3 or linear.args[2] is None:
        return None
    x, weight, bias = linear.args
    return PatternMatch(anchor=anchor, chain=(linear, anchor), outputs=(anchor,), inputs=(x, weight, bias),
                        params={"linear": linear, "x": x, "weight": weight, "bias": bias})


def _activation_input(node: Any, activation: str) -> Node | None:
    """x when `node` is silu(x) ("silu") or gelu(x, approximate="tanh") ("gelu_tanh")."""
    if activation == "silu" and is_call(node, aten.silu.default):
        return node.args[0]
    if activation == "gelu_tanh" and is_call(node, aten.gelu.default):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return node.args[0] if approximate == "tanh" else None
    return None


def _match_gated(anchor: Node, *, activation: str) -> PatternMatch | None:
    """params: gate (the activation's input), up."""
    for act, up in (anchor.args, anchor.args[::-1]):
        gate = _activation_input(act, activation)
        if gate is not None and isinstance(up, Node) and _used_only_by(act, anchor):
            return PatternMatch(anchor=anchor, chain=(act, anchor), outputs=(anchor,), inputs=(gate, up),
                                params={"gate": gate, "up": up})
    return None


def _match_linear_gated(anchor: Node, *, activation: str) -> PatternMatch | None:
    """params: x, gate (the gate projection's node), weights (gate's, up's), biases (the same,
    both None or both given)."""
    for act, up in (anchor.args, anchor.args[::-1]):
        gate = _activation_input(act, activation)
        if gate is None or not (is_call(up, aten.linear.default) and _used_only_by(act, anchor)):
            continue
        if not (is_call(gate, aten.linear.default) and gate is not up and _used_only_by(gate, act)
                and _used_only_by(up, anchor) and not gate.kwargs and not up.kwargs):
            continue
        (x, w_gate, b_gate), (x_up, w_up, b_up) = ((list(n.args) + [None])[:3] for n in (gate, up))
        values = (tensor_value(w_gate), tensor_value(w_up))
        if x_up is not x or (b_gate is None) != (b_up is None) or tensor_value(gate) is None:
            continue
        if any(v is None or v.dim() != 2 for v in values) or values[0].shape != values[1].shape:
            continue
        inputs = tuple(n for n in (x, w_gate, w_up, b_gate, b_up) if isinstance(n, Node))
        return PatternMatch(anchor=anchor, chain=(gate, up, act, anchor), outputs=(anchor,), inputs=inputs,
                            params={"x": x, "gate": gate, "weights": (w_gate, w_up), "biases": (b_gate, b_up)})
    return None


def _match_rope(anchor: Node) -> PatternMatch | None:
    """params: x, cos, sin."""
    if len(anchor.args) != 2 or anchor.kwargs:
        return None
    for plain, rotated in (anchor.args, anchor.args[::-1]):
        if not (is_call(plain, aten.mul.Tensor) and is_call(rotated, aten.mul.Tensor)):
            continue
        if not (_used_only_by(plain, anchor) and _used_only_by(rotated, anchor)):
            continue
        for cat, sin in (rotated.args, rotated.args[::-1]):
            found = _rotate_half_input(cat, rotated)
            if found is None:
                continue
            x, chain = found
            if x not in plain.args or not isinstance(sin, Node):
                continue
            cos = _other(plain.args, x)
            if not isinstance(cos, Node) or x in (cos, sin):
                continue
            return PatternMatch(anchor=anchor, chain=(*chain, rotated, plain, anchor), outputs=(anchor,),
                                inputs=(x, cos, sin), params={"x": x, "cos": cos, "sin": sin})
    return None


def _rotate_half_input(cat: Any, user: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """(x, chain) for cat([neg(x[..., d/2:]), x[..., :d/2]], -1) used only by `user`."""
    if not (is_call(cat, aten.cat.default) and _used_only_by(cat, user)) or len(cat.args[0]) != 2:
        return None
    neg, first = cat.args[0]
    if not (is_call(neg, aten.neg.default) and _used_only_by(neg, cat) and is_call(first, aten.slice.Tensor)):
        return None
    second = neg.args[0]
    if not (is_call(second, aten.slice.Tensor) and _used_only_by(second, neg) and _used_only_by(first, cat)):
        return None
    x = first.args[0]
    xv = tensor_value(x)
    if second.args[0] is not x or xv is None or xv.shape[-1] % 2:
        return None
    half, dim = xv.shape[-1] // 2, (cat.args[1] if len(cat.args) > 1 else 0)
    if not all(_is_last_dim(d, x) for d in (dim, first.args[1], second.args[1])):
        return None
    first_bounds = tuple(first.args[2:]) + (None,) * (5 - len(first.args))  # start, end, step
    second_bounds = tuple(second.args[2:]) + (None,) * (5 - len(second.args))
    if first_bounds[0] not in (0, None) or first_bounds[1] != half or first_bounds[2] not in (1, None):
        return None
    if second_bounds[0] != half or (second_bounds[1] or 0) < xv.shape[-1] or second_bounds[2] not in (1, None):
        return None
    return x, (first, second, neg, cat)


def _match_cross_entropy(anchor: Node) -> PatternMatch | None:
    """params: logits, labels, ignore_index."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    options = dict(zip(names, (None, 1, -100, 0.0)))
    options.update(zip(names, anchor.args[2:]))
    options.update(anchor.kwargs)
    if options["weight"] is not None or options["reduction"] != 1 or options["label_smoothing"] != 0.0:
        return None
    logits, labels = anchor.args[:2]
    chain: tuple[Node, ...] = (anchor,)
    upcast = _upcast_logits(logits, anchor)
    if upcast is not None:
        logits, chain = upcast[0], (*upcast[1], anchor)
    return PatternMatch(anchor=anchor, chain=chain, outputs=(anchor,), inputs=(logits, labels),
                        params={"logits": logits, "labels": labels, "ignore_index": options["ignore_index"],
                                "upcast": upcast is not None})


def _match_linear_cross_entropy(anchor: Node) -> PatternMatch | None:
    """params: x, weight, bias (or None), labels, ignore_index, upcast (as for cross_entropy).

    The output head's linear whose logits only reach the loss (through a view to [rows, vocab]
    and Hugging Face's fp32 upcast), and the loss: the pair a chunked kernel computes without
    the whole logits."""
    found = _match_cross_entropy(anchor)
    if found is None:
        return None
    logits = found.params["logits"]
    if is_call(logits, aten.view.default, aten.reshape.default) and _used_only_by(logits, *found.chain):
        chain, head = (logits, *found.chain), logits.args[0]
    else:
        chain, head = found.chain, logits
    if not (is_call(head, aten.linear.default) and not head.kwargs and _used_only_by(head, *chain)):
        return None
    x, weight, bias = (list(head.args) + [None])[:3]
    wv, xv = tensor_value(weight), tensor_value(x)
    if wv is None or xv is None or wv.dim() != 2 or tensor_value(head).shape[-1] != wv.shape[0]:
        return None
    labels = found.params["labels"]
    inputs = tuple(n for n in (x, weight, bias, labels) if isinstance(n, Node))
    return PatternMatch(anchor=anchor, chain=(head, *chain), outputs=(anchor,), inputs=inputs,
                        params={"x": x, "weight": weight, "bias": bias, "labels": labels,
                                "ignore_index": found.params["ignore_index"], "upcast": found.params["upcast"]})


def _upcast_logits(logits: Any, loss: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """(the unconverted logits, [cast, view]) when the loss reads view(logits.to(float32), [-1,
    vocab]) (Hugging Face's loss upcasts first; under autocast a float32 capture's no-op cast is
    a real one), each used only on the way to the loss; the fused op computes in fp32 and
    returns an fp32 loss, never making the fp32 copy."""
    if not (is_call(logits, aten.view.default) and _used_only_by(logits, loss)):
        return None
    cast = _cast(logits.args[0])
    if cast is None or cast[1] != torch.float32 or not _used_only_by(logits.args[0], logits):
        return None
    return cast[0], (logits.args[0], logits)


def _match_attention(anchor: Node) -> PatternMatch | None:
    """params: qkv (q, k, v), options (is_causal, then SDPA's scale / enable_gqa where given).

    Two rewrites make what Hugging Face models trace run as the kernels they run eagerly: a mask
    computed from shapes alone (no input, no parameter) that equals the causal mask at the
    program's shapes becomes `is_causal=True` (torch.export cannot take transformers' eager
    shortcut to is_causal, so the trace builds and passes the mask: a fused backend then reads
    a [batch, 1, seq, seq] mask and skips no block); and keys and values repeated over the
    query heads (`repeat_kv`) are read unrepeated with `enable_gqa=True`."""
    names = ("attn_mask", "dropout_p", "is_causal")
    options = dict(zip(names, (None, 0.0, False)))
    options.update(zip(names, anchor.args[3:]))
    options.update((name, anchor.kwargs[name]) for name in names if name in anchor.kwargs)
    extra = {name: value for name, value in anchor.kwargs.items() if name not in names}
    if options["dropout_p"] != 0.0 or set(extra) - {"scale", "enable_gqa"}:
        return None
    q, k, v = anchor.args[:3]
    is_causal = options["is_causal"]
    if options["attn_mask"] is not None:
        if is_causal or not is_causal_mask(options["attn_mask"], q, k):
            return None
        is_causal = True
    chain: tuple[Node, ...] = (anchor,)
    if not extra.get("enable_gqa") and (repeated := _repeated_kv(k, v, anchor)) is not None:
        (k, v), repeats = repeated
        chain, extra = (*repeats, anchor), {**extra, "enable_gqa": True}
    return PatternMatch(anchor=anchor, chain=chain, outputs=(anchor,), inputs=(q, k, v),
                        params={"qkv": (q, k, v), "options": {"is_causal": is_causal, **extra}})


def _repeated_kv(k: Any, v: Any, anchor: Node) -> tuple[tuple[Node, Node], tuple[Node, ...]] | None:
    """((k0, v0), chain) when k and v are k0 and v0 repeated alike over the heads, each used only
    by `anchor`: reshape(expand(unsqueeze(x, 2), [b, kv_heads, n_rep, s, d]), [b, kv_heads *
    n_rep, s, d]) (transformers' repeat_kv; a full slice of x first counts as x). Query head h
    then reads kv head h // n_rep, as SDPA's enable_gqa does."""
    found = [_repeat_kv_source(t, anchor) for t in (k, v)]
    if any(f is None for f in found):
        return None
    (k0, k_rep, k_chain), (v0, v_rep, v_chain) = found
    if k_rep != v_rep or k_rep < 2:
        return None
    return (k0, v0), (*k_chain, *v_chain)


def _repeat_kv_source(node: Any, user: Node) -> tuple[Node, int, tuple[Node, ...]] | None:
    if not (is_call(node, *VIEW_OPS) and _used_only_by(node, user)):
        return None
    expand = node.args[0]
    if not (is_call(expand, aten.expand.default) and _used_only_by(expand, node)):
        return None
    unsqueeze = expand.args[0]
    if not (is_call(unsqueeze, aten.unsqueeze.default) and unsqueeze.args[1] == 2 and _used_only_by(unsqueeze, expand)):
        return None
    source, chain = unsqueeze.args[0], (unsqueeze, expand, node)
    if is_call(source, aten.slice.Tensor) and _full_slice(source) and _used_only_by(source, unsqueeze):
        source, chain = source.args[0], (source, *chain)
    sv, ev, out = tensor_value(source), tensor_value(expand), tensor_value(node)
    if sv is None or ev is None or out is None or sv.dim() != 4 or ev.dim() != 5:
        return None
    b, heads, s, d = sv.shape
    repeats = ev.shape[2]
    if tuple(ev.shape) != (b, heads, repeats, s, d) or tuple(out.shape) != (b, heads * repeats, s, d):
        return None
    return source, repeats, chain


def _full_slice(node: Node) -> bool:
    """x[a:b] over a whole dim (start 0, no end or an end past the size, step 1)."""
    value = tensor_value(node.args[0])
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    if value is None:
        return False
    return start in (0, None) and step in (1, None) and (end is None or (isinstance(end, int) and end >= value.shape[dim]))


VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
"""The reshaping views a rule looks through (shape changes, no data movement)."""


def _viewable_as_slices(outputs: list[Node], sizes: list[int]) -> bool:
    """Whether every use of each output is a view that still works when the output is a slice of
    the last dim of one wider tensor (a `split` of a grouped GEMM's result)."""
    first = tensor_value(outputs[0])
    if first is None:
        return False
    try:  # a symbolic batch (the planner's capture) is tried at its example value
        wide = torch.empty((*(example_int(d) for d in first.shape[:-1]), sum(sizes)), dtype=first.dtype,
                           device="meta")
    except ValueError:
        return False
    for part, out in zip(wide.split(sizes, dim=-1), outputs):
        for user in out.users:
            shape = user.args[1] if is_call(user, *VIEW_OPS) and len(user.args) == 2 else None
            try:
                shape = None if shape is None else [
                    example_int(d.meta.get("val") if isinstance(d, Node) else d) for d in shape]
            except ValueError:
                shape = None
            if shape is None or not all(isinstance(d, int) for d in shape):
                return False
            try:
                aten.view.default(part, list(shape))
            except RuntimeError:
                return False
    return True


def _match_linear_group(anchor: Node) -> PatternMatch | None:
    """params: x, weights, biases (all None or all given), sizes (each linear's out_features),
    all in graph order."""
    x = anchor.args[0]
    if not isinstance(x, Node):
        return None
    group = [u for u in x.users if is_call(u, aten.linear.default) and not u.kwargs and u.args[0] is x]
    order = {node: i for i, node in enumerate(anchor.graph.nodes)} if len(group) > 1 else {}
    group.sort(key=lambda node: order.get(node, 0))
    if len(group) < 2 or group[0] is not anchor:
        return None
    weights = [node.args[1] for node in group]
    biases = [(list(node.args) + [None])[2] for node in group]
    values = [tensor_value(w) for w in weights]
    if any(v is None or v.dim() != 2 for v in values) or len({v.shape[1] for v in values}) != 1:
        return None
    if len({b is None for b in biases}) != 1 or any(tensor_value(node) is None for node in group):
        return None
    sizes = [v.shape[0] for v in values]
    if not _viewable_as_slices(group, sizes):
        return None
    inputs = tuple(n for n in (x, *weights, *biases) if isinstance(n, Node))
    return PatternMatch(anchor=anchor, chain=tuple(group), outputs=tuple(group), inputs=inputs,
                        params={"x": x, "weights": tuple(weights), "biases": tuple(biases), "sizes": tuple(sizes)})


# ---- what a value feeds (the output head; a norm whose output only feeds GEMMs) ---------------

LOSS_OPS: tuple[Any, ...] = (aten.cross_entropy_loss.default,)
"""The ATen ops that compute a loss (the output head is the linear feeding one)."""
_PASS_THROUGH = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default,
                 aten.to.dtype, aten.contiguous.default)


def feeds_the_loss(node: Node, hops: int = 4, *, losses: tuple[Any, ...] = LOSS_OPS) -> bool:
    """Whether `node`'s value reaches a loss (a call of one of `losses`) through at most `hops`
    reshapes or casts (the output head)."""
    if hops < 0:
        return False
    return any(is_call(user, *losses)
               or (is_call(user, *_PASS_THROUGH) and feeds_the_loss(user, hops - 1, losses=losses))
               for user in node.users)


ATTENTION_OPS: tuple[Any, ...] = (aten.scaled_dot_product_attention.default,)
"""The ATen ops that compute attention from q, k, v (their first three arguments)."""


def sole_consumer(value: Node, *, attention_ops: tuple[Any, ...], linear_ops: tuple[Any, ...] = ()) -> str | None:
    """"linear" when every use of `value`, through views, is a linear's input (not its weight:
    aten.linear, or one of `linear_ops`, fused ops whose first argument is a GEMM's input cast
    as F.linear casts it), "attention" when every use is q, k or v of one of `attention_ops`
    (ATTENTION_OPS, plus any fused attention op already in the graph); else None."""
    kinds = set()
    for user in value.users:
        if is_call(user, *VIEW_OPS) and user.args[0] is value:
            kinds.add(sole_consumer(user, attention_ops=attention_ops, linear_ops=linear_ops))
        elif is_call(user, aten.linear.default, *linear_ops) and user.args[0] is value and value not in user.args[1:]:
            kinds.add("linear")
        elif is_call(user, *attention_ops) and value in user.args[:3]:
            kinds.add("attention")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def _match_fp8_linear(anchor: Node, *, losses: tuple[Any, ...]) -> PatternMatch | None:
    """params: x, weight, bias (or None)."""
    x, weight, bias = (list(anchor.args) + [None])[:3]
    xv, wv = tensor_value(x), tensor_value(weight)
    if anchor.kwargs or xv is None or wv is None or wv.dim() != 2 or feeds_the_loss(anchor, losses=losses):
        return None
    if any(d % 16 for d in (xv.numel() // max(xv.shape[-1], 1), *wv.shape)):
        return None  # cuBLASLt's FP8 GEMMs need every dimension a multiple of 16
    inputs = tuple(a for a in (x, weight, bias) if isinstance(a, Node))
    return PatternMatch(anchor=anchor, chain=(anchor,), outputs=(anchor,), inputs=inputs,
                        params={"x": x, "weight": weight, "bias": bias})


FUSION_PATTERNS: tuple[FusionPattern, ...] = (
    # aten.linear x2+ reading the same input, each result used only by views that still hold on a
    # slice (attention's q, k, v projections): one GEMM on the concatenated weights can replace them
    FusionPattern(name="linear_group", anchors=(aten.linear.default,), match=_match_linear_group),
    # (a + b) -> pow 2 / mean(-1, keepdim) / add eps / rsqrt / mul / mul weight, the sum also used
    # later: Llama's pre-norm after each residual add
    FusionPattern(name="rms_norm_residual", anchors=(aten.mul.Tensor,), match=_match_rms_norm_residual),
    # the same chain on anything else (the first block's embedding output)
    FusionPattern(name="rms_norm", anchors=(aten.mul.Tensor,), match=_match_rms_norm),
    # (a + b) -> aten.layer_norm over the last dim with a weight: GPT's pre-LayerNorm after each
    # residual add
    FusionPattern(name="layer_norm_residual", anchors=(aten.layer_norm.default,), match=_match_layer_norm_residual),
    # aten.gelu(approximate="tanh") of a biased aten.linear used only there (GPT's MLP)
    FusionPattern(name="bias_gelu", anchors=(aten.gelu.default,), match=_match_bias_gelu),
    # aten.mul(aten.silu(linear(x, W_gate)), linear(x, W_up)), the two linears used only there and
    # of one shape (Llama's MLP)
    FusionPattern(name="linear_swiglu", anchors=(aten.mul.Tensor,), match=partial(_match_linear_gated,
                                                                                  activation="silu")),
    # aten.mul(aten.silu(gate), up), either operand order (any other SwiGLU)
    FusionPattern(name="swiglu", anchors=(aten.mul.Tensor,), match=partial(_match_gated, activation="silu")),
    # the same two with aten.gelu(approximate="tanh") (Gemma's MLP, GeGLU)
    FusionPattern(name="linear_geglu", anchors=(aten.mul.Tensor,), match=partial(_match_linear_gated,
                                                                                 activation="gelu_tanh")),
    FusionPattern(name="geglu", anchors=(aten.mul.Tensor,), match=partial(_match_gated, activation="gelu_tanh")),
    # x * cos + cat([-x[..., d/2:], x[..., :d/2]], -1) * sin (apply_rope on q or k)
    FusionPattern(name="rope", anchors=(aten.add.Tensor,), match=_match_rope),
    # aten.linear (the output head) -> [view] -> [.to(float32)] -> aten.cross_entropy_loss as
    # below, the logits used only on the way: the loss without the whole logits
    FusionPattern(name="linear_cross_entropy", anchors=(aten.cross_entropy_loss.default,),
                  match=_match_linear_cross_entropy),
    # aten.cross_entropy_loss, mean reduction, no class weights, no label smoothing (the LM loss),
    # reading 16-bit logits' fp32 copy (Hugging Face) or the logits themselves
    FusionPattern(name="cross_entropy", anchors=(aten.cross_entropy_loss.default,), match=_match_cross_entropy),
)

ATTENTION_PATTERN = FusionPattern(name="attention", anchors=(aten.scaled_dot_product_attention.default,),
                                  match=_match_attention)
"""aten.scaled_dot_product_attention without dropout, and without a mask or with one proven causal
(any fused SDPA backend can run it); repeated keys and values read once with enable_gqa."""


def fp8_linear_pattern(*, losses: tuple[Any, ...]) -> FusionPattern:
    """aten.linear with every GEMM dimension a multiple of 16 (what FP8 GEMMs can run), except the
    output head: a linear whose value reaches one of `losses` (LOSS_OPS, plus the fused loss's
    target where the graph may already hold it)."""
    return FusionPattern(name="fp8_linear", anchors=(aten.linear.default,),
                         match=partial(_match_fp8_linear, losses=losses))

