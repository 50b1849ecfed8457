"""Grouped projections: several linears on one input as one GEMM (attention's q, k, v).

Entry: LINEAR_GROUP. Two forms, one kernel: separate projections (q_proj, k_proj, v_proj each an
aten.linear of the same input) run as `grouped_linear` on their weights, split back; a packed
projection (Phi-3's `qkv_proj`, one linear whose result is sliced along its last dim into q, k
and v) is already one GEMM, and its slices become the same `split_with_sizes`, so what follows
(RoPE on q and k in one launch, the copy that lets the packed buffer go) is the same for both.
`grouped_product` is the GEMM both this entry and the GLU entries emit.

Which linears of one input join the group: those whose results are read only through views
(attention's q, k, v reshaped to heads), and those whose results reach attention's q, k or v
through other ops but no GEMM (OLMo-2's q_norm and k_norm over all heads, between the projection
and the reshape: the norms then read their slices of the one GEMM's result). The others stay
apart: a parallel block's MLP projections of the same input (Cohere, Phi) are the GLU entries'
or their own. Every form is exact: each part is its linear's value, a strided slice.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import (SPLIT_BACKWARD_KEY, AtenPricing, FusedSave, FusionEntry, FusionPattern, Launches,
                                Miss, PatternMatch, call, meta_like)
from mplan.fusion.graph_match import ATTENTION_OPS, VIEW_OPS, is_call, is_last_dim, tensor_value
from mplan.ir.causal_mask import example_int

__all__ = ["LINEAR_GROUP", "grouped_product"]

aten = torch.ops.aten


def grouped_product(graph: Graph, like: Node, x: Node, weights: Sequence[Any], biases: Sequence[Any],
                    out: torch.Tensor) -> Node:
    """F.linear(x, cat(weights), cat(biases)): several linears on one input as one GEMM (its
    result [..., sum of out_features] carries a meta value, as later rules read shapes). As
    `grouped_linear`, which keeps the weights rather than their concatenation for the backward;
    as `aten.linear` on `joined_weights` (a view of weights lying end to end, no copy) where the
    backward is split into input and weight gradients (zero-bubble schedules), whose split runs
    a GEMM's dX and dW apart, and under FP8, whose sweep replaces `aten.linear`. One weight (a
    packed projection) is one aten.linear either way."""
    from mplan.kernels.grouped_linear import grouped_linear, joined_weights

    w = tensor_value(weights[0])
    rows = sum(tensor_value(weight).shape[0] for weight in weights)
    shape = (*out.shape[:-1], rows)
    if len(weights) == 1:
        args = (x, weights[0]) if biases[0] is None else (x, weights[0], biases[0])
        product = call(graph, aten.linear.default, args, like)
    elif not graph.owning_module.meta.get(SPLIT_BACKWARD_KEY, False):
        product = call(graph, grouped_linear, (x, list(weights), list(biases)), like)
    else:
        wide = call(graph, joined_weights, (list(weights),), like)
        wide.meta["val"] = meta_like(w, (rows, w.shape[1]))
        args = (x, wide)
        if biases[0] is not None:
            bias = call(graph, joined_weights, (list(biases),), like)
            bias.meta["val"] = meta_like(w, (rows,))
            args = (x, wide, bias)
        product = call(graph, aten.linear.default, args, like)
    product.meta["val"] = meta_like(out, shape)
    return product


def _viewable_as_slices(outputs: list[Node], sizes: list[int]) -> bool:
    """Whether every view (VIEW_OPS) reading an output still works when the output is a slice of
    the last dim of one wider tensor (a `split` of a grouped GEMM's result); other ops take any strides."""
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
            if not is_call(user, *VIEW_OPS):
                continue
            shape = user.args[1] if len(user.args) == 2 else None
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


_GEMMS = (aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default)
_PRODUCTS = (aten.matmul.default, aten.bmm.default)
_REACH = 64
"""Most nodes `_reaches_attention` looks at (OLMo-2's norm, reshape, RoPE and casts are ~20)."""


def _reaches_attention(value: Node) -> bool:
    """Whether `value` flows into attention's q, k or v (an ATTENTION_OPS call, or eager
    attention's product of two activations) through ops that are no GEMM: norms, casts, views,
    RoPE (a q/k norm between the projection and the reshape)."""
    seen: set[Node] = set()
    frontier = [value]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if is_call(user, *ATTENTION_OPS) and node in user.args[:3]:
                return True
            if is_call(user, *_PRODUCTS) and all(isinstance(a, Node) and a.op == "call_function" for a in user.args):
                return True
            if user in seen or user.op != "call_function" or is_call(user, *_GEMMS) or len(seen) >= _REACH:
                continue
            seen.add(user)
            frontier.append(user)
    return False


def _joins_group(part: Node) -> bool:
    """A linear (or a packed one's slice) whose value is read only through views, or reaches
    attention (module docstring)."""
    return all(is_call(u, *VIEW_OPS, aten._assert_tensor_metadata.default) for u in part.users) or \
        _reaches_attention(part)


def _match_linear_group(anchor: Node) -> PatternMatch | Miss | None:
    """params: x, weights, biases (all None or all given), sizes (each part's width), parts (the
    nodes the split replaces: the linears, or the packed projection's slices), all in graph order."""
    x = anchor.args[0]
    if not isinstance(x, Node) or anchor.kwargs:
        return None
    linears = [u for u in x.users if is_call(u, aten.linear.default) and not u.kwargs and u.args[0] is x]
    if len(linears) < 2:
        return _match_packed(anchor)
    order = {node: i for i, node in enumerate(anchor.graph.nodes)}
    # a projection read otherwise (an MLP's gate and up: a GLU's; a parallel block's MLP) stays apart
    group = sorted((node for node in linears if _joins_group(node)), key=order.__getitem__)
    if len(group) < 2 or group[0] is not anchor:
        return None
    weights = [node.args[1] for node in group]
    biases = [(list(node.args) + [None])[2] for node in group]
    values = [tensor_value(w) for w in weights]
    if any(v is None or v.dim() != 2 for v in values) or len({v.shape[1] for v in values}) != 1:
        return None
    if len({b is None for b in biases}) != 1:
        return Miss("some projections of one input have a bias and others not")
    if any(tensor_value(node) is None for node in group):
        return None
    sizes = [v.shape[0] for v in values]
    if not _viewable_as_slices(group, sizes):
        return Miss("a projection's view does not hold on its slice of the grouped GEMM's result")
    inputs = tuple(n for n in (x, *weights, *biases) if isinstance(n, Node))
    return PatternMatch(anchor=anchor, chain=tuple(group), outputs=tuple(group), inputs=inputs,
                        params={"x": x, "weights": tuple(weights), "biases": tuple(biases), "sizes": tuple(sizes)})


def _match_packed(linear: Node) -> PatternMatch | Miss | None:
    """One linear whose every use is a slice of its last dim, the slices tiling it in order (two
    or more, each used only through views): a packed projection (`qkv_proj`)."""
    users = list(linear.users)
    out = tensor_value(linear)
    if len(users) < 2 or out is None or not all(is_call(u, aten.slice.Tensor) for u in users):
        return None
    bounds = []
    for part in users:
        dim, start, end, step = (list(part.args[1:]) + [0, None, None, 1][len(part.args) - 1:])[:4]
        if not is_last_dim(dim, linear) or step not in (1, None) or part.kwargs:
            return None
        bounds.append((start or 0, min(out.shape[-1], end if isinstance(end, int) else out.shape[-1]), part))
    bounds.sort(key=lambda b: b[0])
    if bounds[0][0] != 0 or bounds[-1][1] != out.shape[-1] or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return Miss("a packed projection's slices do not tile its output in order")
    parts = [b[2] for b in bounds]
    sizes = [end - start for start, end, _ in bounds]
    if not (all(_joins_group(part) for part in parts) and _viewable_as_slices(parts, sizes)):
        return Miss("a part of a packed projection is read other than through views on its way to attention")
    x, weight, bias = (list(linear.args) + [None])[:3]
    inputs = tuple(n for n in (x, weight, bias) if isinstance(n, Node))
    return PatternMatch(anchor=linear, chain=(linear, *parts), outputs=tuple(parts), inputs=inputs,
                        params={"x": x, "weights": (weight,), "biases": (bias,), "sizes": tuple(sizes)})


def _emit_linear_group(graph: Graph, match: PatternMatch) -> Node:
    p = match.params
    product = grouped_product(graph, match.anchor, p["x"], p["weights"], p["biases"], tensor_value(match.anchor))
    return call(graph, aten.split_with_sizes.default, (product, list(p["sizes"]), -1), match.anchor)


LINEAR_GROUP = FusionEntry(
    name="linear_group",
    # aten.linear x2+ reading the same input, each result used only by views that still hold on a
    # slice (attention's q, k, v projections): one GEMM on the concatenated weights can replace
    # them; or one packed linear sliced into its parts (Phi-3's qkv_proj)
    pattern=FusionPattern(anchors=(aten.linear.default,), match=_match_linear_group),
    forms=("separate q/k/v projections of one input, biases or none", "one packed qkv_proj sliced into q, k, v",
           "q/k/v beside a parallel block's MLP projections of the same input (Cohere, Phi)",
           "q and k normed over all heads before the reshape to heads (OLMo-2's q_norm, k_norm)"),
    keeps=lambda m: FusedSave((m.params["x"].name,)),  # the input; the weights are parameters
    pricing=AtenPricing(why="one GEMM of the summed width: priced as its parts' GEMMs, the same FLOPs; the "
                            "weights lie end to end in one storage, read in place (runtime/grouped_storage.py)"),
    # the weights' concatenation and one GEMM; backward: dX and dW GEMMs
    launches=Launches(forward_triton=0, forward_aten=2, backward_triton=0, backward_aten=2),
    emit=_emit_linear_group,
)
