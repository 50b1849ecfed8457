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
    return set(node.users) <= set(users)


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

def _rms_chain(anchor: Node) -> tuple[Node, Node, float, tuple[Node, ...]] | None:
    """(x, weight, eps, chain) for mul(mul(x, rsqrt(add(mean(pow(x, 2), [-1], True), eps))), weight)."""
    for scaled, weight in (anchor.args, anchor.args[::-1]):
        if not is_call(scaled, aten.mul.Tensor) or not isinstance(weight, Node) or not _used_only_by(scaled, anchor):
            continue
        for x, rsqrt in (scaled.args, scaled.args[::-1]):
            if not (is_call(rsqrt, aten.rsqrt.default) and _used_only_by(rsqrt, scaled)):
                continue
            add_eps = rsqrt.args[0]
            if not (is_call(add_eps, aten.add.Tensor, aten.add.Scalar) and _used_only_by(add_eps, rsqrt)):
                continue
            mean, eps = add_eps.args[0], add_eps.args[1]
            if not (is_call(mean, aten.mean.dim) and _used_only_by(mean, add_eps) and isinstance(eps, float)):
                continue
            dims = mean.args[1]
            if len(dims) != 1 or not _is_last_dim(dims[0], x) or mean.args[2:] != (True,) or mean.kwargs:
                continue
            square = mean.args[0]
            if not (is_call(square, aten.pow.Tensor_Scalar) and square.args == (x, 2) and _used_only_by(square, mean)):
                continue
            wv, xv = tensor_value(weight), tensor_value(x)
            if wv is None or xv is None or wv.dim() != 1 or wv.shape[0] != xv.shape[-1] or weight is x:
                continue
            return x, weight, eps, (square, mean, add_eps, rsqrt, scaled, anchor)
    return None


def _match_rms_norm_residual(anchor: Node) -> PatternMatch | None:
    """params: addends (the residual add's operands, in its order), weight, eps."""
    found = _rms_chain(anchor)
    if found is None:
        return None
    total, weight, eps, chain = found
    pair = _same_shape_add(total)
    if pair is None:
        return None
    return PatternMatch(anchor=anchor, chain=(total, *chain), outputs=(anchor, total), inputs=(*pair, weight),
                        params={"addends": pair, "weight": weight, "eps": eps})


def _match_rms_norm(anchor: Node) -> PatternMatch | None:
    """params: x, weight, eps."""
    found = _rms_chain(anchor)
    if found is None:
        return None
    x, weight, eps, chain = found
    return PatternMatch(anchor=anchor, chain=chain, outputs=(anchor,), inputs=(x, weight),
                        params={"x": x, "weight": weight, "eps": eps})


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


def _match_swiglu(anchor: Node) -> PatternMatch | None:
    """params: gate (silu's input), up."""
    for silu, up in (anchor.args, anchor.args[::-1]):
        if is_call(silu, aten.silu.default) and isinstance(up, Node) and _used_only_by(silu, anchor):
            gate = silu.args[0]
            return PatternMatch(anchor=anchor, chain=(silu, anchor), outputs=(anchor,), inputs=(gate, up),
                                params={"gate": gate, "up": up})
    return None


def _match_linear_swiglu(anchor: Node) -> PatternMatch | None:
    """params: x, gate (the gate projection's node), weights (gate's, up's), biases (the same,
    both None or both given)."""
    for silu, up in (anchor.args, anchor.args[::-1]):
        if not (is_call(silu, aten.silu.default) and is_call(up, aten.linear.default) and _used_only_by(silu, anchor)):
            continue
        gate = silu.args[0]
        if not (is_call(gate, aten.linear.default) and gate is not up and _used_only_by(gate, silu)
                and _used_only_by(up, anchor) and not gate.kwargs and not up.kwargs):
            continue
        (x, w_gate, b_gate), (x_up, w_up, b_up) = ((list(n.args) + [None])[:3] for n in (gate, up))
        values = (tensor_value(w_gate), tensor_value(w_up))
        if x_up is not x or (b_gate is None) != (b_up is None) or tensor_value(gate) is None:
            continue
        if any(v is None or v.dim() != 2 for v in values) or values[0].shape != values[1].shape:
            continue
        inputs = tuple(n for n in (x, w_gate, w_up, b_gate, b_up) if isinstance(n, Node))
        return PatternMatch(anchor=anchor, chain=(gate, up, silu, anchor), outputs=(anchor,), inputs=inputs,
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
    return PatternMatch(anchor=anchor, chain=(anchor,), outputs=(anchor,), inputs=(logits, labels),
                        params={"logits": logits, "labels": labels, "ignore_index": options["ignore_index"]})


def _match_attention(anchor: Node) -> PatternMatch | None:
    """params: qkv (q, k, v), options (is_causal, then SDPA's scale / enable_gqa where given)."""
    names = ("attn_mask", "dropout_p", "is_causal")
    options = dict(zip(names, (None, 0.0, False)))
    options.update(zip(names, anchor.args[3:]))
    if options["attn_mask"] is not None or options["dropout_p"] != 0.0:
        return None
    if set(anchor.kwargs) - {"scale", "enable_gqa"}:
        return None
    qkv = tuple(anchor.args[:3])
    return PatternMatch(anchor=anchor, chain=(anchor,), outputs=(anchor,), inputs=qkv,
                        params={"qkv": qkv, "options": {"is_causal": options["is_causal"], **anchor.kwargs}})


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _viewable_as_slices(outputs: list[Node], sizes: list[int]) -> bool:
    """Whether every use of each output is a view that still works when the output is a slice of
    the last dim of one wider tensor (a `split` of a grouped GEMM's result)."""
    first = tensor_value(outputs[0])
    if first is None:
        return False
    wide = torch.empty((*first.shape[:-1], sum(sizes)), dtype=first.dtype, device="meta")
    for part, out in zip(wide.split(sizes, dim=-1), outputs):
        for user in out.users:
            shape = user.args[1] if is_call(user, *_VIEWS) and len(user.args) == 2 else None
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


def sole_consumer(value: Node, *, attention_ops: tuple[Any, ...]) -> str | None:
    """"linear" when every use of `value`, through views, is a linear's input (not its weight),
    "attention" when every use is q, k or v of one of `attention_ops` (ATTENTION_OPS, plus any
    fused attention op already in the graph); else None."""
    kinds = set()
    for user in value.users:
        if is_call(user, *_VIEWS) and user.args[0] is value:
            kinds.add(sole_consumer(user, attention_ops=attention_ops))
        elif is_call(user, aten.linear.default) and user.args[0] is value and value not in user.args[1:]:
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
    FusionPattern(name="linear_swiglu", anchors=(aten.mul.Tensor,), match=_match_linear_swiglu),
    # aten.mul(aten.silu(gate), up), either operand order (any other SwiGLU)
    FusionPattern(name="swiglu", anchors=(aten.mul.Tensor,), match=_match_swiglu),
    # x * cos + cat([-x[..., d/2:], x[..., :d/2]], -1) * sin (apply_rope on q or k)
    FusionPattern(name="rope", anchors=(aten.add.Tensor,), match=_match_rope),
    # aten.cross_entropy_loss, mean reduction, no class weights, no label smoothing (the LM loss)
    FusionPattern(name="cross_entropy", anchors=(aten.cross_entropy_loss.default,), match=_match_cross_entropy),
)

ATTENTION_PATTERN = FusionPattern(name="attention", anchors=(aten.scaled_dot_product_attention.default,),
                                  match=_match_attention)
"""aten.scaled_dot_product_attention without a mask or dropout (any fused SDPA backend can run it)."""


def fp8_linear_pattern(*, losses: tuple[Any, ...]) -> FusionPattern:
    """aten.linear with every GEMM dimension a multiple of 16 (what FP8 GEMMs can run), except the
    output head: a linear whose value reaches one of `losses` (LOSS_OPS, plus the fused loss's
    target where the graph may already hold it)."""
    return FusionPattern(name="fp8_linear", anchors=(aten.linear.default,),
                         match=partial(_match_fp8_linear, losses=losses))

