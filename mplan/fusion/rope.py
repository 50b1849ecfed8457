"""Fused rotary embeddings: RoPE on one tensor, and on q and k in one launch.

Entries: ROPE (mplan.kernels.rope) matches x * cos + rotate_half(x) * sin; ROPE_QK
(mplan.kernels.rope_qk) is two RoPE chains with the same tables that feed one attention call as
its q and k, each used only there: the pass pairs them once every chain is fused
(`pair_fused_ropes`), and the planner's and `mplan inspect`'s dry runs pair the matches alike
(`pair_rope_matches`). Phi-3 writes RoPE on `x[..., :rotary_dim]` and concatenates the rest
(`x[..., rotary_dim:]`) back; the chain takes the slice, the rest and the concatenation too. At a
full rotary_dim that rest is empty and the chain is RoPE on x; at a partial one (GPT-NeoX, Phi,
StableLM's `partial_rotary_factor`) the match carries `rot_dim` and the kernels rotate the first
rot_dim of each head vector and copy the rest through (`mplan.kernels.rotary.rope_qk`), so the
pair still runs in one launch. A rotation concatenated some other way is reported as missed.

Two more forms, both Hugging Face's (Cohere, OLMo-2, GPT-J, Ernie 4.5):
- interleaved RoPE: the pairs rotated together are (2i, 2i + 1), the rotation written
  `stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)` and the tables repeat_interleave'd; the
  match carries `interleaved` and the kernels address the pairs so (`mplan.kernels.rotary`);
- casts around the rotation: `q.float()` before it and `.to(q.dtype)` after it (Cohere's both,
  OLMo-2's the second), each used only by the chain, are taken into it as `upcast` and `dtype`:
  the kernels load in fp32 and store in the result's dtype anyway, and attention then reads the
  fused op's result, so RoPE on q and k still pairs into one rope_qk launch. Ernie 4.5 casts each
  product's operand instead, `q.float() * cos + rotate(q).float() * sin`: the same `upcast`, as a
  rotation moves values without arithmetic (casting after it is casting before it). The forward is
  the chain's bit for bit; the backward sums q's two gradient parts in fp32 and rounds once, where
  the chain rounds each to q's dtype and sums there (in bf16 the kernel is the more accurate).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from mplan.fusion.entry import (FusedOpTraffic, FusedSave, FusionEntry, FusionPattern, Launches, MeasuredPricing,
                                Miss, PairedPattern, PatternMatch, call)
from mplan.fusion.graph_match import (VIEW_OPS, cast, full_slice, is_call, is_last_dim, other, tensor_value,
                                      used_only_by, uses)

__all__ = ["ROPE", "ROPE_QK", "pair_fused_ropes", "pair_rope_matches"]

aten = torch.ops.aten


_OPTIONS = ("rot_dim", "interleaved", "upcast", "dtype")
"""The params of a ROPE match that are the kernels' keyword arguments (each present only when set)."""


def _options(params: Any) -> dict[str, Any]:
    """The keyword arguments of `rope` / `rope_qk` a match's params give."""
    return {key: params[key] for key in _OPTIONS if key in params}


def _match_rope(anchor: Node) -> PatternMatch | None:
    """params: x, cos, sin, and where the form has them rot_dim (partial rotary), interleaved,
    upcast (x's cast before the rotation), dtype (the result's cast after it)."""
    match = _match_rotation(anchor)
    return None if match is None else _with_casts(match)


def _match_rotation(anchor: Node) -> PatternMatch | None:
    """The rotation alone, params x, cos, sin [, rot_dim] [, interleaved]."""
    if len(anchor.args) != 2 or anchor.kwargs:
        return None
    for plain, rotated in (anchor.args, anchor.args[::-1]):
        if not (is_call(plain, aten.mul.Tensor) and is_call(rotated, aten.mul.Tensor)):
            continue
        if not (used_only_by(plain, anchor) and used_only_by(rotated, anchor)):
            continue
        for cat, sin in (rotated.args, rotated.args[::-1]):
            found, layout = _rotation_input(cat, rotated)
            if found is None:
                continue
            x, chain = found
            x_read = x
            if "upcast" in layout:  # the products read rotate(x).to(upcast) and x.to(upcast) (or x of that dtype)
                casts = [a for a in plain.args if cast(a) == (x, layout["upcast"]) and used_only_by(a, plain)]
                if casts:
                    chain, x_read = (casts[0], *chain), casts[0]
                elif getattr(tensor_value(x), "dtype", None) != layout["upcast"]:
                    continue
            if x_read not in plain.args or not isinstance(sin, Node):
                continue
            cos = other(plain.args, x_read)
            if not isinstance(cos, Node) or x in (cos, sin) or x_read in (cos, sin):
                continue
            core = (*chain, rotated, plain, anchor)
            if "upcast" in layout:  # the whole head vector rotates (no partial rotary with this form)
                return PatternMatch(anchor=anchor, chain=core, outputs=(anchor,), inputs=(x, cos, sin),
                                    params={"x": x, "cos": cos, "sin": sin, **layout})
            whole = _with_rest(x, anchor, core)
            if whole is not None:
                source, extra, output, rot_dim = whole
                params = {"x": source, "cos": cos, "sin": sin, **layout}
                if rot_dim is not None:
                    params["rot_dim"] = rot_dim
                return PatternMatch(anchor=anchor, chain=(*extra[:1], *core, *extra[1:]), outputs=(output,),
                                    inputs=(source, cos, sin), params=params)
            return PatternMatch(anchor=anchor, chain=core, outputs=(anchor,),
                                inputs=(x, cos, sin), params={"x": x, "cos": cos, "sin": sin, **layout})
    return None


def _rotation_input(operand: Any, user: Node) -> tuple[tuple[Node, tuple[Node, ...]] | None, dict[str, Any]]:
    """((x, chain), layout) when `operand` (read only by `user`) is x's rotation: rotate_half,
    the interleaved rotation (layout `interleaved`), or either cast after rotating, rotate(x).to(dtype)
    (Ernie 4.5's `rotate_half(q).float()`; layout `upcast`: a rotation moves values without
    arithmetic, so casting after it is casting before it)."""
    after = cast(operand)
    if after is not None and used_only_by(operand, user):
        found, layout = _rotation_input(after[0], operand)
        if found is None or "upcast" in layout:
            return None, {}
        x, chain = found
        return (x, (*chain, operand)), {**layout, "upcast": after[1]}
    found = _rotate_half_input(operand, user)
    if found is not None:
        return found, {}
    found = _rotate_pairs_input(operand, user)
    return (found, {"interleaved": True}) if found is not None else (None, {})


def _with_casts(match: PatternMatch) -> PatternMatch:
    """The match with the casts around it taken in (Hugging Face's `q.float()` and `.to(q.dtype)`):
    x = source.to(upcast) used only by the chain, where the whole head vector rotates (a partial
    rotary's cast stays an op), and the result's only use a cast .to(dtype)."""
    params, chain, inputs, output = dict(match.params), match.chain, match.inputs, match.outputs[0]
    before = cast(params["x"])
    if before is not None and "rot_dim" not in params and "upcast" not in params and used_only_by(params["x"], *chain):
        chain, params["x"], params["upcast"] = (params["x"], *chain), before[0], before[1]
        inputs = (before[0], *inputs[1:])
    users = uses(output)
    after = cast(users[0]) if len(users) == 1 else None
    if after is not None:
        chain, output, params["dtype"] = (*chain, users[0]), users[0], after[1]
    return PatternMatch(anchor=match.anchor, chain=chain, outputs=(output,), inputs=inputs, params=params)


def _with_rest(x: Node, anchor: Node, core: tuple[Node, ...],
               ) -> tuple[Node, tuple[Node, ...], Node, int | None] | None:
    """(source, [x, rest, cat], cat, rot_dim) when x = source[..., :rot_dim], rest =
    source[..., rot_dim:] and the anchor's only use is cat([anchor, rest], -1): RoPE on the first
    rot_dim of each head vector, the rest passed through (GPT-NeoX, Phi, StableLM's partial
    rotary). rot_dim is None where x is all of `source` (an alias or a full slice; the rest is
    empty): Phi-3's RoPE at a full rotary_dim, which is RoPE on `source`."""
    users = uses(anchor)
    if len(users) != 1 or not is_call(users[0], aten.cat.default):
        return None
    cat = users[0]
    parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    if len(parts) != 2 or parts[0] is not anchor or not is_last_dim(dim, anchor):
        return None
    rest = parts[1]
    if not (is_call(x, aten.alias.default) or is_call(x, aten.slice.Tensor)):
        return None
    source = x.args[0]
    xv, rv, sv = tensor_value(x), tensor_value(rest), tensor_value(source)
    if xv is None or rv is None or sv is None or xv.dim() != sv.dim():
        return None
    if not (is_call(rest, aten.slice.Tensor) and rest.args[0] is source and is_last_dim(rest.args[1], source)
            and used_only_by(rest, cat) and used_only_by(x, *core)):
        return None
    if is_call(x, aten.alias.default) or full_slice(x):
        return (source, (x, rest, cat), cat, None) if rv.shape[-1] == 0 else None
    rot_dim = xv.shape[-1]
    if not (is_last_dim(x.args[1], source) and _bounds(x) == (0, rot_dim) and _bounds(rest)[0] == rot_dim
            and rot_dim + rv.shape[-1] == sv.shape[-1] and xv.shape[:-1] == sv.shape[:-1]):
        return None
    return source, (x, rest, cat), cat, rot_dim


def _bounds(node: Node) -> tuple[Any, Any]:
    """(start, end) of a step-1 slice (start None read as 0), or (None, None) for another step."""
    start, end, step = (tuple(node.args[2:]) + (None,) * (5 - len(node.args)))[:3]
    return ((start or 0), end) if step in (1, None) else (None, None)


def _rotate_half_input(cat: Any, user: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """(x, chain) for cat([neg(x[..., d/2:]), x[..., :d/2]], -1) used only by `user`."""
    if not (is_call(cat, aten.cat.default) and used_only_by(cat, user)) or len(cat.args[0]) != 2:
        return None
    neg, first = cat.args[0]
    if not (is_call(neg, aten.neg.default) and used_only_by(neg, cat) and is_call(first, aten.slice.Tensor)):
        return None
    second = neg.args[0]
    if not (is_call(second, aten.slice.Tensor) and used_only_by(second, neg) and used_only_by(first, cat)):
        return None
    x = first.args[0]
    xv = tensor_value(x)
    if second.args[0] is not x or xv is None or xv.shape[-1] % 2:
        return None
    half, dim = xv.shape[-1] // 2, (cat.args[1] if len(cat.args) > 1 else 0)
    if not all(is_last_dim(d, x) for d in (dim, first.args[1], second.args[1])):
        return None
    first_bounds = tuple(first.args[2:]) + (None,) * (5 - len(first.args))  # start, end, step
    second_bounds = tuple(second.args[2:]) + (None,) * (5 - len(second.args))
    if first_bounds[0] not in (0, None) or first_bounds[1] != half or first_bounds[2] not in (1, None):
        return None
    if second_bounds[0] != half or (second_bounds[1] or 0) < xv.shape[-1] or second_bounds[2] not in (1, None):
        return None
    return x, (first, second, neg, cat)


def _rotate_pairs_input(flat: Any, user: Node) -> tuple[Node, tuple[Node, ...]] | None:
    """(x, chain) for stack([neg(x[..., 1::2]), x[..., ::2]], -1).flatten(-2) used only by `user`
    (the interleaved rotation, `mplan.kernels.rotary.rotate_pairs`; flattened by flatten or a view)."""
    if not (is_call(flat, aten.flatten.using_ints, *VIEW_OPS) and used_only_by(flat, user)):
        return None
    stack, out = flat.args[0], tensor_value(flat)
    sv = tensor_value(stack)
    if not (is_call(stack, aten.stack.default) and used_only_by(stack, flat)) or sv is None or out is None:
        return None
    if tuple(out.shape) != (*sv.shape[:-2], 2 * sv.shape[-2]) or sv.shape[-1] != 2 or len(stack.args[0]) != 2:
        return None
    if not (stack.args[1:] and stack.args[1] in (-1, sv.dim() - 1)):
        return None
    neg, even = stack.args[0]
    if not (is_call(neg, aten.neg.default) and used_only_by(neg, stack) and is_call(even, aten.slice.Tensor)
            and used_only_by(even, stack)):
        return None
    odd = neg.args[0]
    if not (is_call(odd, aten.slice.Tensor) and used_only_by(odd, neg)):
        return None
    x = even.args[0]
    xv = tensor_value(x)
    if odd.args[0] is not x or xv is None or xv.shape[-1] != out.shape[-1]:
        return None
    if not (is_last_dim(even.args[1], x) and is_last_dim(odd.args[1], x)):
        return None
    if _strided(even) != (0, 2) or _strided(odd) != (1, 2):
        return None
    return x, (even, odd, neg, stack, flat)


def _strided(node: Node) -> tuple[Any, Any]:
    """(start, step) of a slice that runs to the end of its dim (start None read as 0), else (None, None)."""
    start, end, step = (tuple(node.args[2:]) + (None,) * (5 - len(node.args)))[:3]
    size = tensor_value(node.args[0]).shape[node.args[1]]
    return ((start or 0), step) if end is None or (isinstance(end, int) and end >= size) else (None, None)


def _emit_rope(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import rope

    p = match.params
    return call(graph, rope, (p["x"], p["cos"], p["sin"]), match.anchor, _options(p) or None)


def _emit_rope_qk(graph: Graph, match: PatternMatch) -> Node:
    from mplan.kernels import rope_qk

    p = match.params
    return call(graph, rope_qk, (p["q"], p["k"], p["cos"], p["sin"]), match.anchor, dict(p.get("kwargs", {})))


def pair_rope_matches(matches: list[tuple[str, PatternMatch]]) -> tuple[list[tuple[str, PatternMatch]],
                                                                        list[tuple[Node, Miss]]]:
    """The chains as the pass leaves them: two ROPE chains that feed one attention call as its q
    and k, with the same tables, become one ROPE_QK match; and (attention, Miss) where q and k
    are RoPE's but cannot pair (a partial rotary_dim concatenates a rest between RoPE and attention)."""
    ropes = {match.outputs[0].name: match for kernel, match in matches if kernel == ROPE.name}
    paired: dict[str, PatternMatch] = {}
    missed: list[tuple[Node, Miss]] = []
    for kernel, match in matches:
        if kernel != "attention":
            continue
        q, k = (ropes.get(getattr(x, "name", "")) for x in match.params["qkv"][:2])
        if q is None or k is None:
            behind = {_rope_behind(x, ropes) for x in match.params["qkv"][:2]}
            if behind == {"concatenated"}:
                missed.append((match.anchor, Miss("q and k are RoPE of a partial rotary_dim, concatenated with "
                                                  "the unrotated rest before attention")))
            elif behind == {"permuted"}:
                missed.append((match.anchor, Miss("q and k are permuted after RoPE (RoPE on [batch, seq, heads, "
                                                  "head_dim], as GPT-J's): rope_qk pairs RoPE on attention's "
                                                  "[batch, heads, seq, head_dim] only")))
            continue
        if q is k or len(q.outputs[0].users) != 1 or len(k.outputs[0].users) != 1 or \
                (q.params["cos"], q.params["sin"]) != (k.params["cos"], k.params["sin"]):
            missed.append((match.anchor, Miss("RoPE on q and k read different tables or are used elsewhere")))
            continue
        if q.params.get("rot_dim") != k.params.get("rot_dim"):
            missed.append((match.anchor, Miss("RoPE on q and k rotate different numbers of dims")))
            continue
        kwargs = _options(q.params)
        if kwargs != _options(k.params):
            missed.append((match.anchor, Miss("RoPE on q and k differ in layout (interleaved or halves) or in the "
                                              "casts around them")))
            continue
        both = PatternMatch(anchor=q.anchor, chain=(*q.chain, *k.chain), outputs=(q.outputs[0], k.outputs[0]),
                            inputs=(q.params["x"], k.params["x"], q.params["cos"], q.params["sin"]),
                            params={"q": q.params["x"], "k": k.params["x"], "cos": q.params["cos"],
                                    "sin": q.params["sin"], "kwargs": kwargs})
        paired[q.anchor.name], paired[k.anchor.name] = both, both
    out: list[tuple[str, PatternMatch]] = []
    for kernel, match in matches:
        pair = paired.get(match.anchor.name) if kernel == ROPE.name else None
        if pair is None:
            out.append((kernel, match))
        elif pair.anchor is match.anchor:
            out.append((ROPE_QK.name, pair))
    return out, missed


_REPEAT_KV = (aten.reshape.default, aten.expand.default, aten.unsqueeze.default, aten.view.default)
_PERMUTES = (aten.permute.default, aten.transpose.int)


def _rope_behind(value: Any, ropes: dict[str, PatternMatch]) -> str | None:
    """How attention's `value` comes from a RoPE chain, looking through repeat_kv's views and
    casts: "concatenated" (cat([the chain's result, rest], -1)), "permuted" (the chain's result
    permuted or transposed), or None (neither)."""
    permuted = False
    while is_call(value, *_REPEAT_KV, *_PERMUTES) or cast(value) is not None:
        permuted |= is_call(value, *_PERMUTES)
        value = value.args[0]
    if is_call(value, aten.cat.default) and getattr(value.args[0][0], "name", None) in ropes:
        return "concatenated"
    return "permuted" if permuted and getattr(value, "name", None) in ropes else None


def pair_fused_ropes(graph: Graph, attention_ops: tuple[Any, ...]) -> int:
    """rope(q, cos, sin) and rope(k, cos, sin) that feed one call of `attention_ops` as its q and k,
    each used only there -> rope_qk(q, k, cos, sin): one launch each way, cos and sin read once (and
    Hugging Face's [batch, 1, seq, head_dim] tables taken as they are). Returns the pairs made."""
    from mplan.kernels import rope

    pairs = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in attention_ops:
            continue
        q, k = node.args[:2]
        if not (is_call(q, rope) and is_call(k, rope) and q is not k and len(q.users) == len(k.users) == 1):
            continue
        if q.args[1:3] != k.args[1:3] or q.kwargs != k.kwargs:  # consumer, rot_dim, layout, casts
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        later = k if order[k] > order[q] else q
        match = PatternMatch(anchor=q, chain=(q, k), outputs=(q, k), inputs=(q.args[0], k.args[0], *q.args[1:3]),
                             params={"q": q.args[0], "k": k.args[0], "cos": q.args[1], "sin": q.args[2],
                                     "kwargs": dict(q.kwargs)})
        with graph.inserting_after(later):
            both = ROPE_QK.emit(graph, match)
        both.meta["val"] = (q.meta.get("val"), k.meta.get("val"))
        both.meta["fusion"], both.meta["fusion_marks"] = ROPE_QK.name, ROPE_QK.marks
        for index, single in enumerate((q, k)):
            with graph.inserting_after(both):
                part = graph.call_function(operator.getitem, (both, index))
            part.meta["val"] = single.meta.get("val")
            single.replace_all_uses_with(part)
            graph.erase_node(single)
        pairs += 1
    return pairs


# partial rotary moves the same row tensors (the rest is read and written once, by a copy); its
# tables are rot_dim wide, counted here at head_dim (an over-count of seq * (head_dim - rot_dim)
# elements each, against rows * head_dim for x)
_ROPE_TRAFFIC = FusedOpTraffic(forward_row_tensors=2, backward_row_tensors=2, forward_vectors=2, backward_vectors=2,
                               table_rows_of="seq", what="read x, cos, sin; write y; read dy, cos, sin; write dx")
_ROPE_LAUNCHES = Launches(forward_triton=1, forward_aten=0, backward_triton=1, backward_aten=0)

ROPE = FusionEntry(
    name="rope",
    # x * cos + cat([-x[..., d/2:], x[..., :d/2]], -1) * sin (apply_rope on q or k)
    pattern=FusionPattern(anchors=(aten.add.Tensor,), match=_match_rope),
    forms=("rotate-half RoPE, either operand order", "Phi-3's x[..., :rotary_dim] with an empty rest concatenated",
           "partial rotary: RoPE on x[..., :rot_dim], cat with x[..., rot_dim:] (GPT-NeoX, Phi, StableLM)",
           "interleaved RoPE: stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2) (Cohere, GPT-J)",
           "x.float() before and .to(dtype) after the rotation (Cohere, OLMo-2)",
           "x.float() * cos + rotate(x).float() * sin, each operand cast (Ernie 4.5)"),
    keeps=lambda m: FusedSave(),  # its tables are buffers
    pricing=MeasuredPricing(traffic=_ROPE_TRAFFIC, copy_fraction=(1.0, 0.987),
                            source="benchmarks/results/kernels_h200-2026-11-29-session7.json"),
    launches=_ROPE_LAUNCHES,
    emit=_emit_rope,
    marks=None,
    notes={"partial rotary": "unpaired (q or k alone), rot_dim < head_dim runs `rope` on the slice and an ATen "
                             "concatenation, launches `launches` leaves out; paired, rope_qk runs it in place"},
)

ROPE_QK = FusionEntry(
    name="rope_qk",
    pattern=PairedPattern(of="rope", consumers="one attention call reading them as q and k, with the same tables"),
    forms=("RoPE on q and on k feeding one attention call",
           "partial rotary on both (one rot_dim): the rotated part in one launch, the rest copied through",
           "interleaved, or cast before and after, alike on both (Cohere, OLMo-2, Ernie 4.5)"),
    keeps=lambda m: FusedSave(),
    # two RoPEs' bytes in one launch: priced as its two rope chains (the planner prices before pairing)
    pricing=MeasuredPricing(traffic=_ROPE_TRAFFIC, copy_fraction=(1.0, 0.987),
                            source="rope's fraction: the one-launch kernel is not yet measured on the H200"),
    # the host-time model counts the two rope chains it pairs (2 x rope's launches), as priced
    launches=_ROPE_LAUNCHES,
    emit=_emit_rope_qk,
    marks="all",
    notes={"partial rotary": "rot_dim < head_dim: each of the two paired chains adds one ATen copy of its "
                             "unrotated rest each way, which `launches` (the full form's) leaves out; "
                             "not yet measured on a GPU"},
)
