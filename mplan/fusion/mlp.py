"""Fused MLP activations: bias + GELU, and the gated ones (SwiGLU, GeGLU) with or without their GEMM.

Entries: BIAS_GELU (mplan.kernels.gelu), GELU_TANH (GELU's tanh approximation written out as
Hugging Face's `gelu_new` writes it, eight elementwise ops, as ATen's one `gelu`), LINEAR_SWIGLU /
LINEAR_GEGLU (gate and up as one GEMM,
then the packed kernel of mplan.kernels.glu) and SWIGLU / GEGLU (the gated product alone). The
GEMM forms take the gate and up projections written apart (Llama's gate_proj and up_proj) or
packed in one linear whose result is split in halves (Phi-3's gate_up_proj, then `chunk(2, -1)`):
either way the kernel reads one [..., 2F] buffer, [gate | up].
"""
from __future__ import annotations

import math
import operator
from functools import partial
from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import (FusedOpTraffic, FusedSave, FusionEntry, FusionPattern, Launches, MeasuredPricing,
                                Miss, PatternMatch, call)
from mplan.fusion.graph_match import is_call, is_last_dim, other, tensor_value, used_only_by
from mplan.fusion.projections import grouped_product

__all__ = ["BIAS_GELU", "GELU_TANH", "GEGLU", "LINEAR_GEGLU", "LINEAR_SWIGLU", "SWIGLU"]

aten = torch.ops.aten
_KERNELS_RUN = "benchmarks/results/kernels_h200-2026-11-29-session7.json"


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _times(node: Any, target: Any, constant: float) -> Node | None:
    """y when `node` is target(y, c) or target(c, y) (aten.mul / aten.add with a Python number c ==
    `constant`, to float64's last bits: a model writes sqrt(2/pi) as a literal or computes it)."""
    if not is_call(node, target) or node.kwargs or len(node.args) != 2:
        return None
    for value, c in (node.args, node.args[::-1]):
        if isinstance(value, Node) and isinstance(c, (int, float)) and math.isclose(c, constant, rel_tol=1e-15):
            return value
    return None


def _gelu_tanh_formula(anchor: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """(x, chain) when `anchor` is 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x ** 3))), as
    Hugging Face's NewGELUActivation writes it (`gelu_new`: GPT-2, GPT-J, Phi-1/2, CodeGen), each
    step used only by the next: GELU's tanh approximation, what gelu(x, approximate="tanh")
    computes (to rounding: ATen evaluates it in one pass, in fp32 for 16-bit x)."""
    if not is_call(anchor, aten.mul.Tensor) or anchor.kwargs or len(anchor.args) != 2:
        return None
    for half, plus_one in (anchor.args, anchor.args[::-1]):
        x, tanh = _times(half, aten.mul.Tensor, 0.5), _times(plus_one, aten.add.Tensor, 1.0)
        if x is None or not is_call(tanh, aten.tanh.default):
            continue
        inner = tanh.args[0]
        summed = _times(inner, aten.mul.Tensor, _SQRT_2_OVER_PI)
        if not is_call(summed, aten.add.Tensor) or summed.kwargs or x not in summed.args:
            continue
        scaled = other(summed.args, x)
        cube = _times(scaled, aten.mul.Tensor, 0.044715)
        if not (is_call(cube, aten.pow.Tensor_Scalar) and cube.args[0] is x and cube.args[1] in (3, 3.0)):
            continue
        chain = (half, cube, scaled, summed, inner, tanh, plus_one, anchor)
        if all(used_only_by(n, after) for n, after in zip(chain[1:-1], chain[2:])) and \
                used_only_by(half, anchor) and used_only_by(plus_one, anchor):
            return x, chain
    return None


def _match_gelu_tanh(anchor: Node) -> PatternMatch | None:
    """params: x (GELU's input), for the formula `_gelu_tanh_formula` names."""
    found = _gelu_tanh_formula(anchor)
    if found is None:
        return None
    x, chain = found
    return PatternMatch(anchor=anchor, chain=chain, outputs=(anchor,), inputs=(x,), params={"x": x})


def _match_bias_gelu(anchor: Node) -> PatternMatch | None:
    """params: linear (the biased GEMM, whose value the unbiased one has), x, weight, bias; the
    GELU aten.gelu(approximate="tanh") or its formula written out (`_gelu_tanh_formula`)."""
    if is_call(anchor, aten.gelu.default):
        approximate = anchor.kwargs.get("approximate", anchor.args[1] if len(anchor.args) > 1 else "none")
        linear, gelu = (anchor.args[0], (anchor,)) if approximate == "tanh" else (None, ())
    else:
        linear, gelu = _gelu_tanh_formula(anchor) or (None, ())
    if not gelu or not is_call(linear, aten.linear.default) or not used_only_by(linear, *gelu):
        return None
    if len(linear.args) < 3 or linear.args[2] is None:
        return None
    x, weight, bias = linear.args
    return PatternMatch(anchor=anchor, chain=(linear, *gelu), outputs=(anchor,), inputs=(x, weight, bias),
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
        if gate is not None and isinstance(up, Node) and used_only_by(act, anchor):
            return PatternMatch(anchor=anchor, chain=(act, anchor), outputs=(anchor,), inputs=(gate, up),
                                params={"gate": gate, "up": up})
    return None


def _match_linear_gated(anchor: Node, *, activation: str) -> PatternMatch | Miss | None:
    """params: x, gate (the node whose value is the gate), weights (gate's and up's, or the packed
    one), biases (the same, all None or all given), product (the packed linear, or None)."""
    for act, up in (anchor.args, anchor.args[::-1]):
        gate = _activation_input(act, activation)
        if gate is None or not isinstance(up, Node) or not used_only_by(act, anchor):
            continue
        packed = _packed_halves(gate, up, act, anchor)
        if packed is not None:
            return packed
        if not is_call(up, aten.linear.default):
            continue
        if not (is_call(gate, aten.linear.default) and gate is not up and used_only_by(gate, act)
                and used_only_by(up, anchor) and not gate.kwargs and not up.kwargs):
            continue
        (x, w_gate, b_gate), (x_up, w_up, b_up) = ((list(n.args) + [None])[:3] for n in (gate, up))
        values = (tensor_value(w_gate), tensor_value(w_up))
        if x_up is not x or tensor_value(gate) is None:
            continue
        if (b_gate is None) != (b_up is None):
            return Miss("one of the gate and up projections has a bias and the other not")
        if any(v is None or v.dim() != 2 for v in values) or values[0].shape != values[1].shape:
            return Miss("the gate and up projections differ in shape")
        inputs = tuple(n for n in (x, w_gate, w_up, b_gate, b_up) if isinstance(n, Node))
        return PatternMatch(anchor=anchor, chain=(gate, up, act, anchor), outputs=(anchor,), inputs=inputs,
                            params={"x": x, "gate": gate, "weights": (w_gate, w_up), "biases": (b_gate, b_up)})
    return None


def _halves(node: Node) -> tuple[Node, Node | None, int] | None:
    """(product, split node or None, index) when `node` is the first (0) or second (1) half of the
    last dim of `product`: getitem of chunk(product, 2, -1) or of split(product, F, -1) /
    split_with_sizes(product, [F, F], -1), or slice(product, -1, 0, F) / (F, 2F)."""
    if is_call(node, operator.getitem) and node.args[1] in (0, 1):
        split = node.args[0]
        if is_call(split, aten.chunk.default) and split.args[1] == 2 and \
                is_last_dim(split.args[2] if len(split.args) > 2 else 0, split.args[0]):
            return split.args[0], split, node.args[1]
        value = tensor_value(split.args[0]) if is_call(split, aten.split.Tensor, aten.split_with_sizes.default) else None
        if value is not None and len(split.args) == 3 and is_last_dim(split.args[2], split.args[0]):
            sizes = split.args[1] if isinstance(split.args[1], (list, tuple)) else [split.args[1]] * 2
            if list(sizes) == [value.shape[-1] // 2] * 2 and value.shape[-1] % 2 == 0:
                return split.args[0], split, node.args[1]
        return None
    if is_call(node, aten.slice.Tensor) and len(node.args) >= 4 and not node.kwargs:
        value = tensor_value(node.args[0])
        if value is None or not is_last_dim(node.args[1], node.args[0]) or value.shape[-1] % 2:
            return None
        half = value.shape[-1] // 2
        start, end = node.args[2] or 0, node.args[3]
        step = node.args[4] if len(node.args) > 4 else 1
        if step == 1 and (start, min(end, value.shape[-1])) in ((0, half), (half, 2 * half)):
            return node.args[0], None, int(start == half)
    return None


def _packed_halves(gate: Any, up: Any, act: Node, anchor: Node) -> PatternMatch | Miss | None:
    """The packed form: gate and up the first and second halves of one linear (`gate_up_proj`)."""
    found = [_halves(n) if isinstance(n, Node) else None for n in (gate, up)]
    if any(f is None for f in found):
        return None
    (product, split, first), (product_up, split_up, second) = found
    if product is not product_up or (first, second) != (0, 1):
        return Miss("the gate is not the first half of the packed projection and up the second") \
            if product is product_up else None
    if not (is_call(product, aten.linear.default) and not product.kwargs):
        return None
    links = (gate, up) if split is None else (gate, up, split)
    if not (used_only_by(gate, act) and used_only_by(up, anchor)
            and (split is None or used_only_by(split, gate, up)) and used_only_by(product, *(links[2:] or links))):
        return Miss("a half of the packed gate/up projection is also used elsewhere")
    x, weight, bias = (list(product.args) + [None])[:3]
    inputs = tuple(n for n in (x, weight, bias) if isinstance(n, Node))
    return PatternMatch(anchor=anchor, chain=(product, *links, act, anchor), outputs=(anchor,), inputs=inputs,
                        params={"x": x, "gate": gate, "weights": (weight,), "biases": (bias,), "product": product})


def _emit_gelu_tanh(graph: Graph, match: PatternMatch) -> Node:
    return call(graph, aten.gelu.default, (match.params["x"],), match.anchor, {"approximate": "tanh"})


def _emit_bias_gelu(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import bias_gelu

    p = match.params
    unbiased = call(graph, aten.linear.default, (p["x"], p["weight"]), p["linear"])
    unbiased.meta["val"] = p["linear"].meta.get("val")
    return call(graph, bias_gelu, (unbiased, p["bias"]), match.anchor)


def _emit_linear_gated(graph: Graph, match: PatternMatch, *, activation: str) -> Node:
    from mplan.kernels import geglu_packed, swiglu_packed

    p = match.params
    gate = tensor_value(p["gate"])
    product = grouped_product(graph, match.anchor, p["x"], p["weights"], p["biases"], gate)
    return call(graph, swiglu_packed if activation == "silu" else geglu_packed, (product,), match.anchor)


def _emit_gated(graph: Graph, match: PatternMatch, *, activation: str) -> Node:
    from mplan.kernels import geglu, swiglu

    return call(graph, swiglu if activation == "silu" else geglu, (match.params["gate"], match.params["up"]),
                match.anchor)


def _keeps_linear_gated(m: PatternMatch) -> FusedSave:
    """The GEMM's input and the packed [gate | up] product: the packed linear's node, or (written
    apart) the gate's and up's nodes, the IR's names for its two halves."""
    product = m.params.get("product")
    halves = (product.name,) if product is not None else (m.params["gate"].name, m.chain[1].name)
    return FusedSave((m.params["x"].name, *halves))


_GLU_TRAFFIC = FusedOpTraffic(forward_row_tensors=3, backward_row_tensors=5,
                              what="read gate, up; write y; read dy, gate, up; write d_gate, d_up")
# SwiGLU's: above copy bandwidth at the headline shape, capped; GeGLU's kernels are SwiGLU's with
# GELU-tanh: 103% forward at 16384 x 14336 (H200, 2026-12-02, one ad hoc run, no result file)
_SWIGLU_PRICE = MeasuredPricing(traffic=_GLU_TRAFFIC, copy_fraction=(1.0, 1.0), source=_KERNELS_RUN)
_GEGLU_PRICE = MeasuredPricing(traffic=_GLU_TRAFFIC, copy_fraction=(1.0, 1.0),
                               source="an ad hoc H200 run of 2026-12-02 with no result file")
# the packed [gate | up] GEMM, then the packed kernel; backward: the packed kernel, dX and dW GEMMs
_LINEAR_GATED_LAUNCHES = Launches(forward_triton=1, forward_aten=1, backward_triton=1, backward_aten=2)
_GATED_LAUNCHES = Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=0)
_LINEAR_FORMS = ("gate_proj and up_proj apart, biases or none", "one packed gate_up_proj split in halves")

BIAS_GELU = FusionEntry(
    name="bias_gelu",
    # aten.gelu(approximate="tanh") of a biased aten.linear used only there (GPT's MLP), or the
    # same GELU written out (GPT-J's and Phi's gelu_new: the formula's last mul anchors it)
    pattern=FusionPattern(anchors=(aten.gelu.default, aten.mul.Tensor), match=_match_bias_gelu),
    forms=("gelu(linear(x, W, b), approximate='tanh')",
           "0.5 * y * (1 + tanh(sqrt(2/pi) * (y + 0.044715 * y**3))) of y = linear(x, W, b) (gelu_new)"),
    keeps=lambda m: FusedSave((m.params["x"].name, m.params["linear"].name)),  # the GEMM's input, its unbiased output
    pricing=MeasuredPricing(
        traffic=FusedOpTraffic(forward_row_tensors=2, backward_row_tensors=3, forward_vectors=1, backward_vectors=2,
                               what="read x, bias; write y; read dy, x, bias; write dx, d_bias"),
        copy_fraction=(0.940, 0.944), source=_KERNELS_RUN),
    launches=Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=1),  # + db's sum
    emit=_emit_bias_gelu,
)

GELU_TANH = FusionEntry(
    name="gelu_tanh",
    # the formula alone (GPT-2's, whose Conv1D adds its bias inside addmm): ATen's one gelu kernel
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=_match_gelu_tanh),
    forms=("0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))), either operand order (gelu_new)",),
    keeps=lambda m: FusedSave((m.params["x"].name,)),  # gelu's backward reads x
    pricing=MeasuredPricing(
        traffic=FusedOpTraffic(forward_row_tensors=2, backward_row_tensors=3,
                               what="read x; write y; read dy, x; write dx"),
        copy_fraction=(0.940, 0.944),
        source=f"bias_gelu's fractions ({_KERNELS_RUN}): ATen's gelu kernel itself is not yet measured"),
    launches=Launches(forward_triton=0, forward_aten=1, backward_triton=0, backward_aten=1),
    emit=_emit_gelu_tanh,
)

LINEAR_SWIGLU = FusionEntry(
    name="linear_swiglu",
    # aten.mul(aten.silu(gate), up), gate and up two linears of one input and shape used only
    # there (Llama's MLP), or the halves of one linear (Phi-3's): one GEMM, then swiglu_packed
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=partial(_match_linear_gated, activation="silu")),
    forms=_LINEAR_FORMS,
    keeps=_keeps_linear_gated,
    pricing=_SWIGLU_PRICE,  # the packed kernel moves SwiGLU's bytes; the GEMM keeps its price
    launches=_LINEAR_GATED_LAUNCHES,
    emit=partial(_emit_linear_gated, activation="silu"),
    lesser="swiglu",
)

SWIGLU = FusionEntry(
    name="swiglu",
    # aten.mul(aten.silu(gate), up), either operand order (any other SwiGLU: an MoE's experts)
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=partial(_match_gated, activation="silu")),
    forms=("silu(gate) * up, either order",),
    keeps=lambda m: FusedSave((m.params["gate"].name, m.params["up"].name)),
    pricing=_SWIGLU_PRICE,
    launches=_GATED_LAUNCHES,
    emit=partial(_emit_gated, activation="silu"),
)

LINEAR_GEGLU = FusionEntry(
    name="linear_geglu",
    # the same with aten.gelu(approximate="tanh") (Gemma's MLP)
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=partial(_match_linear_gated, activation="gelu_tanh")),
    forms=_LINEAR_FORMS,
    keeps=_keeps_linear_gated,
    pricing=_GEGLU_PRICE,
    launches=_LINEAR_GATED_LAUNCHES,
    emit=partial(_emit_linear_gated, activation="gelu_tanh"),
    lesser="geglu",
)

GEGLU = FusionEntry(
    name="geglu",
    pattern=FusionPattern(anchors=(aten.mul.Tensor,), match=partial(_match_gated, activation="gelu_tanh")),
    forms=("gelu(gate, approximate='tanh') * up, either order",),
    keeps=lambda m: FusedSave((m.params["gate"].name, m.params["up"].name)),
    pricing=_GEGLU_PRICE,
    launches=_GATED_LAUNCHES,
    emit=partial(_emit_gated, activation="gelu_tanh"),
)
