"""Attention on the fused SDPA backend that times fastest (mplan.kernels.attention).

Entry: ATTENTION, used when the program runs on CUDA (elsewhere SDPA has one backend to choose
from). Two rewrites make what Hugging Face models trace run as the kernels they run eagerly: a
mask computed from shapes alone (no input, no parameter) that equals the causal mask at the
program's shapes becomes `is_causal=True` (torch.export cannot take transformers' eager shortcut
to is_causal, so the trace builds and passes the mask: a fused backend then reads a [batch, 1,
seq, seq] mask and skips no block); and keys and values repeated over the query heads
(`repeat_kv`) are read unrepeated with `enable_gqa=True`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import AtenPricing, FusedSave, FusionEntry, FusionPattern, Launches, Miss, PatternMatch, call
from mplan.fusion.graph_match import VIEW_OPS, full_slice, is_call, tensor_value, used_only_by
from mplan.ir.causal_mask import is_causal_mask

__all__ = ["ATTENTION"]

aten = torch.ops.aten


def _match_attention(anchor: Node) -> PatternMatch | Miss | None:
    """params: qkv (q, k, v), options (is_causal, then SDPA's scale / enable_gqa where given)."""
    names = ("attn_mask", "dropout_p", "is_causal")
    options = dict(zip(names, (None, 0.0, False)))
    options.update(zip(names, anchor.args[3:]))
    options.update((name, anchor.kwargs[name]) for name in names if name in anchor.kwargs)
    extra = {name: value for name, value in anchor.kwargs.items() if name not in names}
    if options["dropout_p"] != 0.0:
        return Miss("attention with dropout")
    if set(extra) - {"scale", "enable_gqa"}:
        return Miss(f"SDPA options {sorted(set(extra) - {'scale', 'enable_gqa'})}")
    q, k, v = anchor.args[:3]
    is_causal = options["is_causal"]
    if options["attn_mask"] is not None:
        if is_causal or not is_causal_mask(options["attn_mask"], q, k):
            return Miss("a mask that depends on the input or is not causal (padding, sliding window, documents)")
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
    if not (is_call(node, *VIEW_OPS) and used_only_by(node, user)):
        return None
    expand = node.args[0]
    if not (is_call(expand, aten.expand.default) and used_only_by(expand, node)):
        return None
    unsqueeze = expand.args[0]
    if not (is_call(unsqueeze, aten.unsqueeze.default) and unsqueeze.args[1] == 2 and used_only_by(unsqueeze, expand)):
        return None
    source, chain = unsqueeze.args[0], (unsqueeze, expand, node)
    if is_call(source, aten.slice.Tensor) and full_slice(source) and used_only_by(source, unsqueeze):
        source, chain = source.args[0], (source, *chain)
    sv, ev, out = tensor_value(source), tensor_value(expand), tensor_value(node)
    if sv is None or ev is None or out is None or sv.dim() != 4 or ev.dim() != 5:
        return None
    b, heads, s, d = sv.shape
    repeats = ev.shape[2]
    if tuple(ev.shape) != (b, heads, repeats, s, d) or tuple(out.shape) != (b, heads * repeats, s, d):
        return None
    return source, repeats, chain


def _emit_attention(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import attention

    return call(graph, attention, match.params["qkv"], match.anchor, match.params["options"])


def _keeps_attention(m: PatternMatch) -> FusedSave:
    """q, k, v (unrepeated under GQA), the output, lse."""
    return FusedSave((*(n.name for n in m.inputs), m.anchor.name), ((m.inputs[0].name, "rows4"),),
                     causal=bool(m.params["options"]["is_causal"]))


ATTENTION = FusionEntry(
    name="attention",
    # aten.scaled_dot_product_attention without dropout, and without a mask or with one proven
    # causal (any fused SDPA backend can run it); repeated keys and values read once with enable_gqa
    pattern=FusionPattern(anchors=(aten.scaled_dot_product_attention.default,), match=_match_attention),
    forms=("SDPA without a mask or with transformers' causal mask", "keys and values repeated by repeat_kv"),
    keeps=_keeps_attention,
    pricing=AtenPricing(why="the same SDPA, priced by the compute model's attention time (causal where proven)"),
    launches=Launches(forward_triton=0, forward_aten=1, backward_triton=0, backward_aten=1),
    emit=_emit_attention,
)
