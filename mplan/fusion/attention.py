"""Attention on the fused SDPA backend that times fastest (mplan.kernels.attention).

Entry: ATTENTION, used when the program runs on CUDA (elsewhere SDPA has one backend to choose
from). Two rewrites make what Hugging Face models trace run as the kernels they run eagerly: a
mask computed from shapes alone (no input, no parameter) that equals the causal mask at the
program's shapes becomes `is_causal=True` (torch.export cannot take transformers' eager shortcut
to is_causal, so the trace builds and passes the mask: a fused backend then reads a [batch, 1,
seq, seq] mask and skips no block); and keys and values repeated over the query heads
(`repeat_kv`) are read unrepeated with `enable_gqa=True`.

Attention written out as ATen ops (transformers' `eager_attention_forward`, the only path Gemma-2
has) is the same SDPA: matmul(q, k^T), times a constant scale (or divided by one), plus a mask
proven causal (or none), softmax over the keys (in fp32 or the scores' dtype), cast back, dropout
with p = 0, matmul with v. It becomes one call, so the [batch, heads, seq, seq] scores are never
made (nor kept, in fp32, for the backward). The fused kernel computes the softmax in fp32 from
unrounded scores, so in bf16 it differs from the chain by the chain's own roundings of the
scores. Attention logits soft-capped with tanh (Gemma-2's `attn_logit_softcapping`) stay
unfused: no SDPA backend computes tanh on the scores.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import AtenPricing, FusedSave, FusionEntry, FusionPattern, Launches, Miss, PatternMatch, call
from mplan.fusion.graph_match import (VIEW_OPS, cast, full_slice, is_call, is_last_dim, number, tensor_value,
                                      used_only_by)
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
    if not extra.get("enable_gqa") and (repeated := _repeated_kv(k, v, anchor, anchor)) is not None:
        (k, v), repeats = repeated
        chain, extra = (*repeats, anchor), {**extra, "enable_gqa": True}
    return PatternMatch(anchor=anchor, chain=chain, outputs=(anchor,), inputs=(q, k, v),
                        params={"qkv": (q, k, v), "options": {"is_causal": is_causal, **extra}})


def _match_eager_attention(anchor: Node) -> PatternMatch | Miss | None:
    """`anchor` is matmul(probs, v): walk back through dropout(p=0), the cast and the softmax to
    the mask add, the scale and matmul(q, k^T); params as `_match_attention`'s (the scale always
    given). None where `anchor` is any other matmul."""
    probs, v = anchor.args
    chain: list[Node] = [anchor]
    if is_call(probs, aten.dropout.default) and used_only_by(probs, anchor):
        if probs.args[1] != 0.0 and (len(probs.args) < 3 or probs.args[2]):
            return Miss("eager attention with dropout")
        chain.append(probs)
        probs = probs.args[0]
    if (casted := cast(probs)) is not None and used_only_by(probs, chain[-1]):
        chain.append(probs)
        probs = casted[0]
    softmax = probs
    if not (is_call(softmax, aten.softmax.int, aten._softmax.default) and used_only_by(softmax, chain[-1])):
        return None
    if not is_last_dim(softmax.args[1], softmax) or (is_call(softmax, aten._softmax.default) and softmax.args[2]):
        return None
    chain.append(softmax)
    scores, mask = softmax.args[0], None
    if is_call(scores, aten.add.Tensor) and used_only_by(scores, softmax) and len(scores.args) == 2:
        chain.append(scores)
        scores, mask = scores.args
        if is_call(mask, aten.matmul.default, aten.mul.Tensor, aten.div.Tensor):  # mask + scores
            scores, mask = mask, scores
    scale = 1.0
    if is_call(scores, aten.tanh.default) or (is_call(scores, aten.mul.Tensor, aten.div.Tensor)
                                              and any(is_call(a, aten.tanh.default) for a in scores.args)):
        return Miss("attention logits soft-capped with tanh (no SDPA backend computes it)")
    if is_call(scores, aten.mul.Tensor, aten.div.Tensor) and used_only_by(scores, chain[-1]):
        factor = number(scores.args[1])
        if factor is None or factor == 0.0:
            return None
        chain.append(scores)
        scale = factor if is_call(scores, aten.mul.Tensor) else 1.0 / factor
        scores = scores.args[0]
    if not (is_call(scores, aten.matmul.default) and used_only_by(scores, chain[-1])):
        return None
    q, k_t = scores.args
    chain.append(scores)
    if not (is_call(k_t, aten.transpose.int) and sorted(d % 4 for d in k_t.args[1:]) == [2, 3]
            and used_only_by(k_t, scores)):
        return None
    chain.append(k_t)
    k = k_t.args[0]
    values = [tensor_value(t) for t in (q, k, v, anchor)]
    if any(t is None or t.dim() != 4 for t in values):
        return None
    (b, heads, seq, _), (kb, k_heads, k_seq, _) = values[0].shape, values[1].shape
    if (kb, k_heads) != (b, heads) or values[2].shape[:3] != (b, heads, k_seq) or values[3].shape[:3] != (b, heads, seq):
        return None
    if values[0].dtype != values[3].dtype or len({t.dtype for t in values}) != 1:
        return Miss("eager attention whose q, k, v and output dtypes differ")
    is_causal = False
    if mask is not None:
        if not isinstance(mask, Node) or not is_causal_mask(mask, q, k):
            return Miss("a mask that depends on the input or is not causal (padding, sliding window, documents)")
        is_causal = True
    options: dict[str, Any] = {"is_causal": is_causal, "scale": scale}
    if (repeated := _repeated_kv(k, v, k_t, anchor)) is not None:
        (k, v), repeats = repeated
        chain, options = [*repeats, *chain], {**options, "enable_gqa": True}
    return PatternMatch(anchor=anchor, chain=tuple(chain), outputs=(anchor,), inputs=(q, k, v),
                        params={"qkv": (q, k, v), "options": options})


def _match(anchor: Node) -> PatternMatch | Miss | None:
    if is_call(anchor, aten.matmul.default):
        return _match_eager_attention(anchor)
    return _match_attention(anchor)


def _repeated_kv(k: Any, v: Any, k_user: Node, v_user: Node) -> tuple[tuple[Node, Node], tuple[Node, ...]] | None:
    """((k0, v0), chain) when k and v are k0 and v0 repeated alike over the heads, used only by
    `k_user` and `v_user`: reshape(expand(unsqueeze(x, 2), [b, kv_heads, n_rep, s, d]), [b, kv_heads *
    n_rep, s, d]) (transformers' repeat_kv; a full slice of x first counts as x). Query head h
    then reads kv head h // n_rep, as SDPA's enable_gqa does."""
    found = [_repeat_kv_source(k, k_user), _repeat_kv_source(v, v_user)]
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
    # causal (any fused SDPA backend can run it); the same written out as matmul, scale, mask add,
    # softmax, matmul (transformers' eager attention); repeated keys and values read once with enable_gqa
    pattern=FusionPattern(anchors=(aten.scaled_dot_product_attention.default, aten.matmul.default), match=_match),
    forms=("SDPA without a mask or with transformers' causal mask", "keys and values repeated by repeat_kv",
           "eager attention: matmul(q, k^T) * scale (+ causal mask), softmax (fp32), cast, dropout(p=0), "
           "matmul(., v); not with tanh soft-capped logits"),
    keeps=_keeps_attention,
    pricing=AtenPricing(why="the same SDPA, priced by the compute model's attention time (causal where proven); "
                            "the eager form keeps its ops' prices: its two GEMMs are SDPA's FLOPs, and its "
                            "elementwise ops on the scores (scale, mask add, softmax, cast) an over-estimate "
                            "of what the fused kernel spends"),
    launches=Launches(forward_triton=0, forward_aten=1, backward_triton=0, backward_aten=1),
    emit=_emit_attention,
)
