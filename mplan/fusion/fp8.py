"""FP8 linears (mplan.kernels.fp8), only when asked: `fuse_kernels(fp8=True)`.

Entry: `fp8_linear_entry(losses=)`: aten.linear with every GEMM dimension a multiple of 16 (what
FP8 GEMMs can run), except the output head: a linear whose value reaches one of `losses` (kept in
the training dtype, as Transformer Engine recipes keep it). Not exact: FP8 rounds to 3 mantissa
bits (e4m3) and 2 for gradients (e5m2), so it runs in a sweep after the other entries.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import AtenPricing, FusedSave, FusionEntry, FusionPattern, Launches, PatternMatch, call
from mplan.fusion.graph_match import feeds_the_loss, tensor_value

__all__ = ["fp8_linear_entry"]

aten = torch.ops.aten


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


def _emit_fp8_linear(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels.fp8 import Fp8Linear

    p = match.params
    args = (p["x"], p["weight"]) if p["bias"] is None else (p["x"], p["weight"], p["bias"])
    return call(graph, Fp8Linear(), args, match.anchor)


def fp8_linear_entry(*, losses: tuple[Any, ...]) -> FusionEntry:
    """The FP8 linear entry, its pattern leaving alone linears that reach one of `losses` (the
    ATen loss, plus the fused loss ops where the graph may already hold them)."""
    return FusionEntry(
        name="fp8_linear",
        pattern=FusionPattern(anchors=(aten.linear.default,), match=partial(_match_fp8_linear, losses=losses)),
        forms=("aten.linear with every GEMM dimension a multiple of 16, not the output head",),
        keeps=lambda m: FusedSave((m.params["x"].name,)),  # as fp8 copies of x and W, not yet modelled apart
        pricing=AtenPricing(why="priced apart by fused_pricing.fp8_linear_time: three FP8 GEMMs and their casts"),
        # the casts of x and W, one FP8 GEMM; backward: the gradient's cast, dX and dW FP8 GEMMs
        launches=Launches(forward_triton=2, forward_aten=1, backward_triton=1, backward_aten=2),
        emit=_emit_fp8_linear,
    )
