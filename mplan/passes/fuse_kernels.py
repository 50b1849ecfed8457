"""`fuse_kernels`: swap ATen op chains of a captured model for mplan's fused kernels.

Input: an ATen-level `torch.fx.GraphModule`, as `torch.export.export(model, ..., strict=False)
.module()` gives for mplan's models (nodes carry `meta["val"]` fake tensors). Output: the same
GraphModule, rewritten in place and recompiled, with `gm.meta["fuse_kernels"]` holding a
`FusionReport` (how often each rule fired).

Rules are data: `FUSION_RULES`, one `FusionRule` per pattern with a comment saying what it
matches (and `ATTENTION_RULE`, used when the program will run on CUDA: `device=`; and
`FP8_LINEAR_RULE`, only when asked: `fp8=True`). Each rule is tried at its anchor (the chain's
last node); a match names the chain's nodes, the chain values the fused op returns, the graph
values it reads, and how to emit the call. The driver inserts the call (a `call_function`
node whose target is the kernel's dispatching op, e.g. `mplan.kernels.rms_norm_residual`,
which runs the Triton autograd Function on CUDA and the reference elsewhere), reroutes every
use of the returned values, and erases the chain.

Invariants:
- Results are unchanged (except under `fp8=True`, which rounds GEMM operands to FP8 on
  purpose): every fused op's reference is the chain's own ATen ops, so on the reference
  dispatch the fused graph computes the same function as the unfused one (bit for bit, except
  where a GEMM changes: bias+GELU moves the bias out of it, grouped projections concatenate
  weights, both rounding as float64 does; attention is the same SDPA op, run on the backend
  that times fastest, which on CUDA may round differently); tests hold fused and unfused
  forward and backward together.
- A chain is fused only when its intermediate values have no use outside it (nothing is
  computed twice), its constants are the ones the kernel assumes (eps a number, reductions
  over the last dim, slices at head_dim / 2, ...), and its shapes, read from `meta["val"]`,
  fit (a residual add that broadcasts is not a residual). Anything else is left as it is.
- The fused call is placed where every value it reads is defined and before every use of a
  value it returns; a match that admits no such place is skipped.
"""
from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from mplan.kernels import (
    attention,
    bias_gelu,
    cross_entropy,
    layer_norm_residual,
    rms_norm,
    rms_norm_residual,
    rope,
    swiglu,
    swiglu_packed,
)
from mplan.kernels.fp8 import Fp8Linear, Fp8Unavailable, fp8_unavailable_reason
from mplan.passes.local_ops import VocabParallelCrossEntropy
from mplan.kernels.op_bytes import FUSED_OP_TRAFFIC, FusedOpTraffic, fused_op_bytes

__all__ = ["ATTENTION_RULE", "FP8_LINEAR_RULE", "FUSED_OP_TRAFFIC", "FUSION_RULES", "FusedOpTraffic", "FusionReport",
           "FusionRule", "feeds_the_loss", "fuse_kernels", "fused_op_bytes"]

aten = torch.ops.aten
logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Match:
    """One matched chain and how to replace it."""

    chain: tuple[Node, ...]
    """the matched nodes; erased once the fused call has taken over their uses"""
    outputs: tuple[Node, ...]
    """chain nodes whose values the fused call returns, in the order it returns them"""
    inputs: tuple[Node, ...]
    """graph values the fused call reads (the call must come after all of them)"""
    emit: Callable[[Graph], Node]
    """adds the fused call(s) to the graph; returns the node giving `outputs` (a tuple if several)"""


@dataclass(frozen=True, kw_only=True, slots=True)
class FusionRule:
    name: str
    """the fused op's name; for the memory-bound ops also their key in `FUSED_OP_TRAFFIC`"""
    anchors: tuple[Any, ...]
    """ATen overloads the chain can end with"""
    match: Callable[[Node], Match | None]


@dataclass(frozen=True, slots=True)
class FusionReport:
    """How many chains each rule replaced, and how many fused outputs were marked with the op
    that consumes them (`_mark_consumers`)."""

    counts: dict[str, int] = field(default_factory=dict)
    consumer_marks: int = 0

    def __str__(self) -> str:
        fired = ", ".join(f"{name} x{count}" for name, count in self.counts.items())
        marks = f"; {self.consumer_marks} outputs marked for autocast's casts" if self.consumer_marks else ""
        return f"fuse_kernels: {fired or 'no rule fired'}{marks}"


# ---- node predicates -------------------------------------------------------------------------

def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _used_only_by(node: Node, *users: Node) -> bool:
    return set(node.users) <= set(users)


def _val(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_last_dim(dim: Any, node: Node) -> bool:
    value = _val(node)
    return dim == -1 or (value is not None and dim == value.dim() - 1)


def _same_shape_add(node: Any) -> tuple[Node, Node] | None:
    """(a, b) when `node` is a + b of two tensors of one shape and dtype (a residual add)."""
    if not _is(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    va, vb = _val(a), _val(b)
    if va is None or vb is None or va.shape != vb.shape or va.dtype != vb.dtype:
        return None
    return a, b


def _other(pair: tuple[Any, Any], node: Any) -> Any:
    return pair[1] if pair[0] is node else pair[0]


def _call(graph: Graph, target: Callable[..., Any], args: tuple[Any, ...], like: Node,
          kwargs: dict[str, Any] | None = None) -> Node:
    node = graph.call_function(target, args, kwargs)
    node.meta.update({key: like.meta[key] for key in ("stack_trace", "nn_module_stack") if key in like.meta})
    return node


# ---- matchers, one per rule ------------------------------------------------------------------

def _rms_chain(anchor: Node) -> tuple[Node, Node, float, tuple[Node, ...]] | None:
    """(x, weight, eps, chain) for mul(mul(x, rsqrt(add(mean(pow(x, 2), [-1], True), eps))), weight)."""
    for scaled, weight in (anchor.args, anchor.args[::-1]):
        if not _is(scaled, aten.mul.Tensor) or not isinstance(weight, Node) or not _used_only_by(scaled, anchor):
            continue
        for x, rsqrt in (scaled.args, scaled.args[::-1]):
            if not (_is(rsqrt, aten.rsqrt.default) and _used_only_by(rsqrt, scaled)):
                continue
            add_eps = rsqrt.args[0]
            if not (_is(add_eps, aten.add.Tensor, aten.add.Scalar) and _used_only_by(add_eps, rsqrt)):
                continue
            mean, eps = add_eps.args[0], add_eps.args[1]
            if not (_is(mean, aten.mean.dim) and _used_only_by(mean, add_eps) and isinstance(eps, float)):
                continue
            dims = mean.args[1]
            if len(dims) != 1 or not _is_last_dim(dims[0], x) or mean.args[2:] != (True,) or mean.kwargs:
                continue
            square = mean.args[0]
            if not (_is(square, aten.pow.Tensor_Scalar) and square.args == (x, 2) and _used_only_by(square, mean)):
                continue
            wv, xv = _val(weight), _val(x)
            if wv is None or xv is None or wv.dim() != 1 or wv.shape[0] != xv.shape[-1] or weight is x:
                continue
            return x, weight, eps, (square, mean, add_eps, rsqrt, scaled, anchor)
    return None


def _match_rms_norm_residual(anchor: Node) -> Match | None:
    found = _rms_chain(anchor)
    if found is None:
        return None
    total, weight, eps, chain = found
    pair = _same_shape_add(total)
    if pair is None:
        return None
    return Match(chain=(total, *chain), outputs=(anchor, total), inputs=(*pair, weight),
                 emit=lambda g: _call(g, rms_norm_residual, (*pair, weight, eps), anchor))


def _match_rms_norm(anchor: Node) -> Match | None:
    found = _rms_chain(anchor)
    if found is None:
        return None
    x, weight, eps, chain = found
    return Match(chain=chain, outputs=(anchor,), inputs=(x, weight),
                 emit=lambda g: _call(g, rms_norm, (x, weight, eps), anchor))


def _match_layer_norm_residual(anchor: Node) -> Match | None:
    total, normalized_shape, weight, bias, eps = (list(anchor.args) + [None, None, 1e-5])[:5]
    pair = _same_shape_add(total)
    if pair is None or anchor.kwargs or weight is None or len(normalized_shape) != 1:
        return None
    inputs = (*pair, weight) if bias is None else (*pair, weight, bias)
    return Match(chain=(total, anchor), outputs=(anchor, total), inputs=inputs,
                 emit=lambda g: _call(g, layer_norm_residual, (*pair, weight, bias, eps), anchor))


def _match_bias_gelu(anchor: Node) -> Match | None:
    approximate = anchor.kwargs.get("approximate", anchor.args[1] if len(anchor.args) > 1 else "none")
    linear = anchor.args[0]
    if approximate != "tanh" or not _is(linear, aten.linear.default) or not _used_only_by(linear, anchor):
        return None
    if len(linear.args) < 3 or linear.args[2] is None:
        return None
    x, weight, bias = linear.args

    def emit(graph: Graph) -> Node:
        unbiased = _call(graph, aten.linear.default, (x, weight), linear)
        unbiased.meta["val"] = linear.meta.get("val")
        return _call(graph, bias_gelu, (unbiased, bias), anchor)

    return Match(chain=(linear, anchor), outputs=(anchor,), inputs=(x, weight, bias), emit=emit)


def _match_swiglu(anchor: Node) -> Match | None:
    for silu, up in (anchor.args, anchor.args[::-1]):
        if _is(silu, aten.silu.default) and isinstance(up, Node) and _used_only_by(silu, anchor):
            gate = silu.args[0]
            return Match(chain=(silu, anchor), outputs=(anchor,), inputs=(gate, up),
                         emit=lambda g, args=(gate, up): _call(g, swiglu, args, anchor))
    return None


def _match_linear_swiglu(anchor: Node) -> Match | None:
    for silu, up in (anchor.args, anchor.args[::-1]):
        if not (_is(silu, aten.silu.default) and _is(up, aten.linear.default) and _used_only_by(silu, anchor)):
            continue
        gate = silu.args[0]
        if not (_is(gate, aten.linear.default) and gate is not up and _used_only_by(gate, silu)
                and _used_only_by(up, anchor) and not gate.kwargs and not up.kwargs):
            continue
        (x, w_gate, b_gate), (x_up, w_up, b_up) = ((list(n.args) + [None])[:3] for n in (gate, up))
        values = (_val(w_gate), _val(w_up))
        if x_up is not x or (b_gate is None) != (b_up is None) or _val(gate) is None:
            continue
        if any(v is None or v.dim() != 2 for v in values) or values[0].shape != values[1].shape:
            continue

        def emit(graph: Graph, x: Node = x, gate: Node = gate, weights: tuple[Any, ...] = (w_gate, w_up),
                 biases: tuple[Any, ...] = (b_gate, b_up)) -> Node:
            product = _grouped_linear(graph, anchor, x, weights, biases, _val(gate))
            return _call(graph, swiglu_packed, (product,), anchor)

        inputs = tuple(n for n in (x, w_gate, w_up, b_gate, b_up) if isinstance(n, Node))
        return Match(chain=(gate, up, silu, anchor), outputs=(anchor,), inputs=inputs, emit=emit)
    return None


def _match_rope(anchor: Node) -> Match | None:
    if len(anchor.args) != 2 or anchor.kwargs:
        return None
    for plain, rotated in (anchor.args, anchor.args[::-1]):
        if not (_is(plain, aten.mul.Tensor) and _is(rotated, aten.mul.Tensor)):
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
            return Match(chain=(*chain, rotated, plain, anchor), outputs=(anchor,), inputs=(x, cos, sin),
                         emit=lambda g, args=(x, cos, sin): _call(g, rope, args, anchor))
    return None


def _rotate_half_input(cat: Any, user: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """(x, chain) for cat([neg(x[..., d/2:]), x[..., :d/2]], -1) used only by `user`."""
    if not (_is(cat, aten.cat.default) and _used_only_by(cat, user)) or len(cat.args[0]) != 2:
        return None
    neg, first = cat.args[0]
    if not (_is(neg, aten.neg.default) and _used_only_by(neg, cat) and _is(first, aten.slice.Tensor)):
        return None
    second = neg.args[0]
    if not (_is(second, aten.slice.Tensor) and _used_only_by(second, neg) and _used_only_by(first, cat)):
        return None
    x = first.args[0]
    xv = _val(x)
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


def _match_cross_entropy(anchor: Node) -> Match | None:
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    options = dict(zip(names, (None, 1, -100, 0.0)))
    options.update(zip(names, anchor.args[2:]))
    options.update(anchor.kwargs)
    if options["weight"] is not None or options["reduction"] != 1 or options["label_smoothing"] != 0.0:
        return None
    logits, labels = anchor.args[:2]
    ignore_index = options["ignore_index"]
    return Match(chain=(anchor,), outputs=(anchor,), inputs=(logits, labels),
                 emit=lambda g: _call(g, cross_entropy, (logits, labels, ignore_index), anchor))


def _match_attention(anchor: Node) -> Match | None:
    names = ("attn_mask", "dropout_p", "is_causal")
    options = dict(zip(names, (None, 0.0, False)))
    options.update(zip(names, anchor.args[3:]))
    if options["attn_mask"] is not None or options["dropout_p"] != 0.0:
        return None
    if set(anchor.kwargs) - {"scale", "enable_gqa"}:
        return None
    qkv = tuple(anchor.args[:3])
    kwargs = {"is_causal": options["is_causal"], **anchor.kwargs}
    return Match(chain=(anchor,), outputs=(anchor,), inputs=qkv,
                 emit=lambda g: _call(g, attention, qkv, anchor, kwargs))


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _meta_like(value: torch.Tensor, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=value.dtype, device="meta")


def _grouped_linear(graph: Graph, like: Node, x: Node, weights: Sequence[Any], biases: Sequence[Any],
                    out: torch.Tensor) -> Node:
    """aten.linear(x, cat(weights), cat(biases)): several linears on one input as one GEMM (its
    result [..., sum of out_features] carries a meta value, as later rules read shapes)."""
    w = _val(weights[0])
    rows = sum(_val(weight).shape[0] for weight in weights)
    wide = _call(graph, aten.cat.default, (list(weights),), like)
    wide.meta["val"] = _meta_like(w, (rows, w.shape[1]))
    args: tuple[Any, ...] = (x, wide)
    if biases[0] is not None:
        bias = _call(graph, aten.cat.default, (list(biases),), like)
        bias.meta["val"] = _meta_like(w, (rows,))
        args = (x, wide, bias)
    product = _call(graph, aten.linear.default, args, like)
    product.meta["val"] = _meta_like(out, (*out.shape[:-1], rows))
    return product


def _viewable_as_slices(outputs: list[Node], sizes: list[int]) -> bool:
    """Whether every use of each output is a view that still works when the output is a slice of
    the last dim of one wider tensor (a `split` of a grouped GEMM's result)."""
    first = _val(outputs[0])
    if first is None:
        return False
    wide = _meta_like(first, (*first.shape[:-1], sum(sizes)))
    for part, out in zip(wide.split(sizes, dim=-1), outputs):
        for user in out.users:
            shape = user.args[1] if _is(user, *_VIEWS) and len(user.args) == 2 else None
            if shape is None or not all(isinstance(d, int) for d in shape):
                return False
            try:
                aten.view.default(part, list(shape))
            except RuntimeError:
                return False
    return True


def _match_linear_group(anchor: Node) -> Match | None:
    x = anchor.args[0]
    if not isinstance(x, Node):
        return None
    group = [u for u in x.users if _is(u, aten.linear.default) and not u.kwargs and u.args[0] is x]
    order = {node: i for i, node in enumerate(anchor.graph.nodes)} if len(group) > 1 else {}
    group.sort(key=lambda node: order.get(node, 0))
    if len(group) < 2 or group[0] is not anchor:
        return None
    weights = [node.args[1] for node in group]
    biases = [(list(node.args) + [None])[2] for node in group]
    values = [_val(w) for w in weights]
    if any(v is None or v.dim() != 2 for v in values) or len({v.shape[1] for v in values}) != 1:
        return None
    if len({b is None for b in biases}) != 1 or any(_val(node) is None for node in group):
        return None
    sizes = [v.shape[0] for v in values]
    if not _viewable_as_slices(group, sizes):
        return None

    def emit(graph: Graph) -> Node:
        product = _grouped_linear(graph, anchor, x, weights, biases, _val(anchor))
        return _call(graph, aten.split_with_sizes.default, (product, sizes, -1), anchor)

    inputs = tuple(n for n in (x, *weights, *biases) if isinstance(n, Node))
    return Match(chain=tuple(group), outputs=tuple(group), inputs=inputs, emit=emit)


_LOSSES = (aten.cross_entropy_loss.default, cross_entropy)
_PASS_THROUGH = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default,
                 aten.to.dtype, aten.contiguous.default)


def feeds_the_loss(node: Node, hops: int = 4) -> bool:
    """Whether `node`'s value reaches a loss through at most `hops` reshapes or casts (the output head)."""
    if hops < 0:
        return False
    return any(_is(user, *_LOSSES) or (_is(user, *_PASS_THROUGH) and feeds_the_loss(user, hops - 1))
               for user in node.users)


def _match_fp8_linear(anchor: Node) -> Match | None:
    x, weight, bias = (list(anchor.args) + [None])[:3]
    xv, wv = _val(x), _val(weight)
    if anchor.kwargs or xv is None or wv is None or wv.dim() != 2 or feeds_the_loss(anchor):
        return None
    if any(d % 16 for d in (xv.numel() // max(xv.shape[-1], 1), *wv.shape)):
        return None  # cuBLASLt's FP8 GEMMs need every dimension a multiple of 16
    args = (x, weight) if bias is None else (x, weight, bias)
    return Match(chain=(anchor,), outputs=(anchor,), inputs=tuple(a for a in args if isinstance(a, Node)),
                 emit=lambda g: _call(g, Fp8Linear(), args, anchor))


FUSION_RULES: tuple[FusionRule, ...] = (
    # aten.linear x2+ reading the same input, each result used only by views that still hold on a
    # slice (attention's q, k, v projections) -> one linear on the concatenated weights, split:
    # one GEMM instead of several narrow ones, and one input gradient instead of a sum of them
    FusionRule(name="linear_group", anchors=(aten.linear.default,), match=_match_linear_group),
    # (a + b) -> pow 2 / mean(-1, keepdim) / add eps / rsqrt / mul / mul weight, the sum also used
    # later: Llama's pre-norm after each residual add -> rms_norm_residual(a, b, weight, eps)
    FusionRule(name="rms_norm_residual", anchors=(aten.mul.Tensor,), match=_match_rms_norm_residual),
    # the same chain on anything else (the first block's embedding output) -> rms_norm(x, weight, eps)
    FusionRule(name="rms_norm", anchors=(aten.mul.Tensor,), match=_match_rms_norm),
    # (a + b) -> aten.layer_norm over the last dim with a weight: GPT's pre-LayerNorm after each
    # residual add -> layer_norm_residual(a, b, weight, bias, eps)
    FusionRule(name="layer_norm_residual", anchors=(aten.layer_norm.default,), match=_match_layer_norm_residual),
    # aten.gelu(approximate="tanh") of a biased aten.linear used only there (GPT's MLP) ->
    # aten.linear without the bias, then bias_gelu(y, bias)
    FusionRule(name="bias_gelu", anchors=(aten.gelu.default,), match=_match_bias_gelu),
    # aten.mul(aten.silu(linear(x, W_gate)), linear(x, W_up)), the two linears used only there (Llama's
    # MLP) -> one linear on [W_gate; W_up], then swiglu_packed: one GEMM, and a gradient already in
    # the layout its backward reads
    FusionRule(name="linear_swiglu", anchors=(aten.mul.Tensor,), match=_match_linear_swiglu),
    # aten.mul(aten.silu(gate), up), either operand order (any other SwiGLU) -> swiglu(gate, up)
    FusionRule(name="swiglu", anchors=(aten.mul.Tensor,), match=_match_swiglu),
    # x * cos + cat([-x[..., d/2:], x[..., :d/2]], -1) * sin (apply_rope on q or k) -> rope(x, cos, sin)
    FusionRule(name="rope", anchors=(aten.add.Tensor,), match=_match_rope),
    # aten.cross_entropy_loss, mean reduction, no class weights, no label smoothing (the LM loss)
    # -> cross_entropy(logits, labels, ignore_index)
    FusionRule(name="cross_entropy", anchors=(aten.cross_entropy_loss.default,), match=_match_cross_entropy),
)

ATTENTION_RULE = FusionRule(name="attention", anchors=(aten.scaled_dot_product_attention.default,),
                            match=_match_attention)
"""aten.scaled_dot_product_attention without a mask or dropout -> attention(q, k, v, ...): the same
op on whichever fused backend (cuDNN, flash, memory-efficient) times fastest for the shape. Added
to the rules when the program runs on CUDA; elsewhere SDPA has one backend to choose from."""

FP8_LINEAR_RULE = FusionRule(name="fp8_linear", anchors=(aten.linear.default,), match=_match_fp8_linear)
"""aten.linear with every GEMM dimension a multiple of 16, except the output head (a linear whose
value reaches the loss: kept in the training dtype, as Transformer Engine recipes keep it) ->
Fp8Linear()(x, weight, bias), each call with its own scaling state. Not exact: FP8 rounds to 3
mantissa bits (e4m3) and 2 for gradients (e5m2), so it runs only when asked (`fp8=True`), in a
sweep after the other rules (bias+GELU leaves a new bias-free linear behind)."""


# ---- the driver ------------------------------------------------------------------------------

def fuse_kernels(gm: GraphModule, rules: tuple[FusionRule, ...] | None = None, *,
                 device: torch.device | str | None = None, fp8: bool = False) -> GraphModule:
    """Replace every chain some rule matches (first matching rule wins, nodes in graph order);
    returns `gm`, recompiled, with `gm.meta["fuse_kernels"]` = FusionReport. `rules` defaults to
    FUSION_RULES, plus ATTENTION_RULE when `device` (where `gm` will run) is a CUDA device.
    `fp8` then sweeps FP8_LINEAR_RULE, first raising `Fp8Unavailable` (naming why) unless
    `device` can run FP8 GEMMs."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if rules is None:
        rules = FUSION_RULES + (ATTENTION_RULE,) if on_cuda else FUSION_RULES
    sweeps = [rules]
    if fp8:
        where = torch.device(device) if device is not None else torch.device("cpu")
        reason = fp8_unavailable_reason(where)
        if reason is not None:
            raise Fp8Unavailable(f"fuse_kernels(fp8=True): {reason}")
        sweeps.append((FP8_LINEAR_RULE,))
    graph = gm.graph
    counts: Counter[str] = Counter()
    erased: set[Node] = set()
    for sweep in sweeps:
        for node in list(graph.nodes):
            if node in erased or node.op != "call_function":
                continue
            for rule in sweep:
                if node.target not in rule.anchors:
                    continue
                match = rule.match(node)
                if match is not None and _rewrite(graph, match, erased):
                    counts[rule.name] += 1
                    break
    counts.update(_fuse_vocab_parallel_losses(gm))
    marks = _mark_consumers(graph)
    graph.lint()
    gm.recompile()
    gm.meta["fuse_kernels"] = report = FusionReport(dict(counts), consumer_marks=marks)
    logger.info("%s", report)
    return gm


def _fuse_vocab_parallel_losses(gm: GraphModule) -> Counter[str]:
    """TP programs compute a vocabulary-sharded loss in a module (`insert_collectives`), which no
    ATen rule sees: its mean runs mplan's vocabulary-parallel cross-entropy kernel instead."""
    fused: Counter[str] = Counter()
    for module in gm.modules():
        if isinstance(module, VocabParallelCrossEntropy) and module.reduction == "mean":
            module.fused = True
            fused["vocab_parallel_cross_entropy"] += 1
    return fused


_MARKED_OUTPUTS: dict[Any, int | None] = {
    layer_norm_residual: 0, rms_norm_residual: 0, rms_norm: None, rope: None}
"""Fused ops whose output autocast would otherwise leave in fp32 (norms of an fp32 residual
stream, RoPE with fp32 tables) -> which of their outputs is marked (None: the op's only one)."""
_ATTENTION_OPS = (aten.scaled_dot_product_attention.default, attention)


def _consumer(value: Node) -> str | None:
    """"linear" when every use of `value`, through views, is a linear's input (not its weight),
    "attention" when every use is attention's q, k or v; else None."""
    kinds = set()
    for user in value.users:
        if _is(user, *_VIEWS) and user.args[0] is value:
            kinds.add(_consumer(user))
        elif _is(user, aten.linear.default) and user.args[0] is value and value not in user.args[1:]:
            kinds.add("linear")
        elif _is(user, *_ATTENTION_OPS) and value in user.args[:3]:
            kinds.add("attention")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def _mark_consumers(graph: Graph) -> int:
    """Give each fused norm or RoPE whose output only feeds linears (or attention) a `consumer=`
    keyword: under autocast, which casts those inputs to its lower dtype, the kernel then writes
    that dtype itself (`mplan.kernels.dispatch.consumer_cast_dtype`), the same values without
    the fp32 round trip. Outside autocast the keyword changes nothing. Returns how many."""
    marked = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _MARKED_OUTPUTS:
            continue
        index = _MARKED_OUTPUTS[node.target]
        outputs = [node] if index is None else [u for u in node.users if _is(u, operator.getitem)
                                                  and u.args[1] == index]
        consumer = _consumer(outputs[0]) if len(outputs) == 1 else None
        if consumer is not None:
            node.kwargs = {**node.kwargs, "consumer": consumer}
            marked += 1
    return marked


def _rewrite(graph: Graph, match: Match, erased: set[Node]) -> bool:
    """Insert the fused call, reroute the outputs' uses, erase the chain; False if no valid place."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    chain = set(match.chain)
    outside_users = [user for out in match.outputs for user in out.users if user not in chain]
    latest_input = max((order[n] for n in match.inputs if isinstance(n, Node)), default=-1)
    first_chain = min(match.chain, key=order.__getitem__)
    if latest_input < order[first_chain]:
        before = first_chain
    elif outside_users and latest_input >= min(order[user] for user in outside_users):
        return False
    else:
        before = list(graph.nodes)[latest_input + 1]
    with graph.inserting_before(before):
        fused = match.emit(graph)
        if len(match.outputs) == 1:
            results = [fused]
        else:
            results = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(match.outputs))]
    vals = [out.meta.get("val") for out in match.outputs]
    fused.meta["val"] = vals[0] if len(vals) == 1 else tuple(vals)
    for out, result, val in zip(match.outputs, results, vals):
        result.meta["val"] = val
        out.replace_all_uses_with(result, delete_user_cb=lambda user: user not in chain)
    for node in sorted(match.chain, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
            erased.add(node)
    return True
