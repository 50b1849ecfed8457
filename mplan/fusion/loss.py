"""The fused loss: cross-entropy alone, and with the output head's GEMM in chunks of rows.

Entries: LINEAR_CROSS_ENTROPY (mplan.kernels.head_loss: the whole logits never exist) and
CROSS_ENTROPY (mplan.kernels.cross_entropy_loss: the loss of the logits, never their fp32 copy).
The head's GEMM and the loss fuse through what models put between them: a view to [rows,
vocab], Hugging Face's fp32 upcast, scalings by a constant (Cohere's logit_scale, Granite's
1 / logits_scaling) and Gemma-2's soft-cap c * tanh(z / c), all applied by the kernel chunk by
chunk, forward and backward.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import (HEAD_CHUNK_ROWS_KEY, FusedOpTraffic, FusedSave, FusionEntry, FusionPattern, Launches,
                                MeasuredPricing, Miss, PatternMatch, call, meta_like)
from mplan.fusion.graph_match import VIEW_OPS, cast, is_call, number, tensor_value, used_only_by

__all__ = ["CROSS_ENTROPY", "LINEAR_CROSS_ENTROPY"]

aten = torch.ops.aten


def _match_cross_entropy(anchor: Node) -> PatternMatch | None:
    """params: logits, labels, ignore_index, upcast."""
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


def _upcast_logits(logits: Any, loss: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """(the unconverted logits, [cast, view]) when the loss reads view(logits.to(float32), [-1,
    vocab]) (Hugging Face's loss upcasts first; under autocast a float32 capture's no-op cast is
    a real one), each used only on the way to the loss; the fused op computes in fp32 and
    returns an fp32 loss, never making the fp32 copy."""
    if not (is_call(logits, aten.view.default) and used_only_by(logits, loss)):
        return None
    found = cast(logits.args[0])
    if found is None or found[1] != torch.float32 or not used_only_by(logits.args[0], logits):
        return None
    return found[0], (logits.args[0], logits)


def _scaled_by(node: Node) -> tuple[Node, float] | None:
    """(z, s) when `node` is z * s, s * z or z / s for a Python number s."""
    if is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        for z, s in (node.args, node.args[::-1]):
            if isinstance(z, Node) and number(s) is not None:
                return z, number(s)
    if is_call(node, aten.div.Tensor) and len(node.args) == 2 and isinstance(node.args[0], Node):
        s = number(node.args[1])
        if s:
            return node.args[0], 1.0 / s
    return None


def _softcapped(node: Node) -> tuple[Node, float, tuple[Node, ...]] | None:
    """(z, c, [div, tanh, mul]) when `node` is tanh(z / c) * c (Gemma-2's final_logit_softcapping)."""
    outer = _scaled_by(node)
    if outer is None or not is_call(outer[0], aten.tanh.default) or not used_only_by(outer[0], node):
        return None
    tanh, cap = outer
    inner = _scaled_by(tanh.args[0]) if isinstance(tanh.args[0], Node) else None
    if inner is None or not used_only_by(tanh.args[0], tanh) or abs(inner[1] * cap - 1.0) > 1e-12 or cap <= 0:
        return None
    return inner[0], cap, (tanh.args[0], tanh, node)


def _match_linear_cross_entropy(anchor: Node) -> PatternMatch | Miss | None:
    """params: x, weight, bias (or None), labels, ignore_index, upcast (as for cross_entropy),
    logit_scale, softcap (None: no cap).

    The output head's linear whose logits only reach the loss, through a view to [rows, vocab],
    Hugging Face's fp32 upcast, scalings and a soft-cap, and the loss: the pair a chunked kernel
    computes without the whole logits."""
    found = _match_cross_entropy(anchor)
    if found is None:
        return None
    value, chain = found.params["logits"], found.chain
    scale, softcap = 1.0, None
    while not is_call(value, aten.linear.default):
        if not isinstance(value, Node) or not used_only_by(value, *chain):
            return Miss(f"the logits ({_what(value)}) are also used outside the loss") \
                if isinstance(value, Node) else None
        capped = _softcapped(value) if softcap is None else None
        if is_call(value, *VIEW_OPS):
            value, chain = value.args[0], (value, *chain)
        elif capped is not None:
            if scale != 1.0:
                return Miss("the logits are scaled after the soft-cap (the kernel scales before it)")
            value, softcap, chain = capped[0], capped[1], (*capped[2], *chain)
        elif (scaled := _scaled_by(value)) is not None:
            value, scale, chain = scaled[0], scale * scaled[1], (value, *chain)
        else:
            return Miss(f"the logits come from {_what(value)}, not from the output head's linear "
                        "(through views, casts, scalings and a soft-cap)")
    head = value
    if head.kwargs or not used_only_by(head, *chain):
        return Miss("the head's logits are also used outside the loss")
    x, weight, bias = (list(head.args) + [None])[:3]
    wv, xv = tensor_value(weight), tensor_value(x)
    if wv is None or xv is None or wv.dim() != 2 or tensor_value(head).shape[-1] != wv.shape[0]:
        return None
    labels = found.params["labels"]
    inputs = tuple(n for n in (x, weight, bias, labels) if isinstance(n, Node))
    return PatternMatch(anchor=anchor, chain=(head, *chain), outputs=(anchor,), inputs=inputs,
                        params={"x": x, "weight": weight, "bias": bias, "labels": labels,
                                "ignore_index": found.params["ignore_index"], "upcast": found.params["upcast"],
                                "logit_scale": scale, "softcap": softcap})


def _what(value: Any) -> str:
    target = getattr(value, "target", value)
    return str(target).removeprefix("aten.").split(".")[0] if isinstance(value, Node) else repr(value)


def _emit_cross_entropy(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import cross_entropy

    p = match.params
    logits = p["logits"]
    if p["upcast"]:  # the view of the 16-bit logits the loss reads as fp32
        view = match.anchor.args[0]
        logits = call(graph, aten.view.default, (logits, view.args[1]), view)
        logits.meta["val"] = meta_like(tensor_value(p["logits"]), tensor_value(view).shape)
    return call(graph, cross_entropy, (logits, p["labels"], p["ignore_index"], p["upcast"]), match.anchor)


def _emit_linear_cross_entropy(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels.head_loss import linear_cross_entropy

    p = match.params
    chunk_rows = graph.owning_module.meta.get(HEAD_CHUNK_ROWS_KEY)
    kwargs: dict[str, Any] = {"upcast": p["upcast"]}
    if chunk_rows:
        kwargs["chunk_rows"] = chunk_rows
    if p["logit_scale"] != 1.0:
        kwargs["logit_scale"] = p["logit_scale"]
    if p["softcap"] is not None:
        kwargs["softcap"] = p["softcap"]
    return call(graph, linear_cross_entropy, (p["x"], p["weight"], p["labels"], p["ignore_index"], p["bias"]),
                match.anchor, kwargs)


def _keeps_linear_cross_entropy(m: PatternMatch) -> FusedSave:
    """d_x, d_W (d_b): the head's inputs' sizes; no logits at all (the head's are made in chunks)."""
    head = m.chain[0].name
    return FusedSave((), tuple((head, f"input{i}") for i in range(3 if m.params["bias"] is not None else 2)),
                     made_in_chunks=(head,), gradients_in_forward=True)


_CE_PRICE = MeasuredPricing(
    traffic=FusedOpTraffic(forward_row_tensors=1, backward_row_tensors=2, forward_row_stats=5, backward_row_stats=3,
                           rows_of="input0",
                           what="read logits, labels; write max, sum-exp, target logit; "
                                "read logits, labels, lse; write d_logits"),
    copy_fraction=(1.0, 0.994), source="benchmarks/results/kernels_h200-2026-11-29-session7.json")

LINEAR_CROSS_ENTROPY = FusionEntry(
    name="linear_cross_entropy",
    # aten.linear (the output head) -> [scalings] [-> soft-cap] [-> view] [-> .to(float32)] ->
    # aten.cross_entropy_loss as below, the logits used only on the way: the loss without the
    # whole logits
    pattern=FusionPattern(anchors=(aten.cross_entropy_loss.default,), match=_match_linear_cross_entropy),
    forms=("head linear, views, Hugging Face's fp32 upcast", "logits scaled by a constant (Cohere, Granite)",
           "Gemma-2's soft-cap c * tanh(z / c)"),
    keeps=_keeps_linear_cross_entropy,
    # the head's GEMMs keep their prices (`HeadChunking` prices the chunk size); the loss part is
    # priced as cross-entropy's kernel on the logits
    pricing=_CE_PRICE,
    # PER CHUNK of rows (`HeadChunking`): statistics, combine, gradient in place; the logits, d_x and
    # d_W GEMMs. Backward: d_x and d_W scaled by the loss's gradient
    launches=Launches(forward_triton=3, forward_aten=3, backward_triton=2, backward_aten=0, forward_per_chunk=True),
    emit=_emit_linear_cross_entropy,
    lesser="cross_entropy",
)

CROSS_ENTROPY = FusionEntry(
    name="cross_entropy",
    # aten.cross_entropy_loss, mean reduction, no class weights, no label smoothing (the LM loss),
    # reading 16-bit logits' fp32 copy (Hugging Face) or the logits themselves
    pattern=FusionPattern(anchors=(aten.cross_entropy_loss.default,), match=_match_cross_entropy),
    forms=("mean cross-entropy of the logits or of their fp32 view",),
    keeps=lambda m: FusedSave((m.params["logits"].name,), ((m.params["logits"].name, "rows4"),)),  # logits, lse
    pricing=_CE_PRICE,
    # block statistics, combine, mean; backward: the gradient kernel
    launches=Launches(forward_triton=3, forward_aten=0, backward_triton=1, backward_aten=0),
    emit=_emit_cross_entropy,
)
