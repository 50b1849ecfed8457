"""Attention as models write it, found in a local program and its mask read as a position rule,
so that `split_context` can put context-parallel attention in its place.

    find_attention(program) -> [AttentionForm]   every attention of the program, in graph order
    read_mask(program, form, ...) -> AttentionMask   the rule its mask tensor implements, or a
                                                  refusal naming the node

Two forms (anything else that mixes tokens is refused by `split_context`, never run locally):

    sdpa       aten.scaled_dot_product_attention(q, k, v, attn_mask=m?, is_causal=c, scale=s)
    eager      matmul(q, transpose(k, -2, -1)) [* s | / s] [/ c, tanh, * c] [+ m | masked_fill(m, -inf)]
               [-> cast] -> softmax(-1) [-> cast] [-> dropout(p=0)] -> matmul(., v)
               (nanoGPT's manual attention; Hugging Face's eager_attention_forward, Gemma 2's logit
               soft-capping c * tanh(x / c) included)

Each form carries the dtype its softmax runs in (`upcast`): the eager softmax's own output dtype
(float32 where Hugging Face writes softmax(..., dtype=torch.float32) in a bfloat16 model), and
float32 for SDPA, whose kernels accumulate in float32 whatever the inputs; the lowered attention
computes in the wider of it and the inputs' dtype, never less precisely than the model.

Why read masks by evaluation: a model builds its mask from its positions (Hugging Face's
masking_utils: causal by position ids, a sliding window, packed-sequence detection from position
jumps; nanoGPT: rows of a registered lower-triangular buffer), in ops whose values are those of
the rank's captured slice, S / cp tokens. Under context parallelism a rank's queries meet keys of
other ranks, so the mask has to be known as a rule of global positions (`ir.attention_mask`).
`read_mask` runs the mask's own subgraph with the positions a rank would hold (each arange(0, L)
of the slice and each table row slice [:L] read at the probe positions, as `split_context` reads
RoPE's tables), at contiguous runs of L positions starting at 0, mid-sequence and at S - L, and
fits the one rule of the form {causal or not, window W or none} that gives every probe's mask
exactly; a mask no such rule gives (ALiBi-like float biases, chunked attention, padding read
from an input's values, masks that differ per batch row or head) is refused, naming the node.

What a probe of L contiguous positions cannot see: pairs further apart than L - 1. A sliding
window of L tokens or more looks causal there; `api.autoparallel` refuses such a window where the
model's config declares one (`sliding_window` between L and S), and chunked attention
(`attention_chunk_size`) alike, so neither is dropped silently. Where the subgraph indexes the
slice's own tensors by position (transformers 5 reads position_ids[b, cache_position]), probes
past the first L positions index out of range: only the first slice is read then. Masks are evaluated on the CPU at [rows, heads, L, L], as the model itself builds them
every forward.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from mplan.ir.attention_mask import AttentionMask, visible
from mplan.ir.sharding import UnexecutableStrategy
from mplan.passes.local_ops import normalized_kwargs

__all__ = ["AttentionForm", "find_attention", "is_position_arange", "is_table_slice", "read_mask"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_SOFTMAX = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default, aten.clone.default,
          aten.contiguous.default)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class AttentionForm:
    """One attention of a program: its inputs, how scores are formed, its mask, and the node
    whose value is its output [B, Hq, L, Dv]."""

    q: fx.Node
    k: fx.Node  # [B, Hkv, L, D], before any transpose
    v: fx.Node
    output: fx.Node
    scale: float | None  # None: SDPA's default, head_dim ** -0.5
    softcap: float | None
    causal: bool  # SDPA's is_causal (no mask tensor then)
    mask: fx.Node | None
    mask_kind: str  # "visible" (bool, True = attend), "additive" (float, 0 = attend), "hidden" (bool, True = masked)
    chain: tuple[fx.Node, ...]  # the nodes the form replaces, output last
    upcast: torch.dtype | None  # the softmax's dtype (module docstring); None: not known


def find_attention(program: fx.GraphModule) -> list[AttentionForm]:
    """Every SDPA call and every eager attention chain of `program` (module docstring)."""
    forms = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _SDPA:
            forms.append(_sdpa(node))
        elif node.target in _SOFTMAX:
            form = _eager(node)
            if form is not None:
                forms.append(form)
    return forms


def _sdpa(node: fx.Node) -> AttentionForm:
    call = normalized_kwargs(node.target, node.args, node.kwargs)
    if call.get("dropout_p", 0.0):
        raise UnexecutableStrategy(f"node {node.name} (scaled_dot_product_attention): attention dropout "
                                   f"p={call['dropout_p']} under context parallelism is not lowered")
    mask = call.get("attn_mask")
    kind = "visible" if mask is None or _dtype(mask) == torch.bool else "additive"
    return AttentionForm(q=node.args[0], k=node.args[1], v=node.args[2], output=node, scale=call.get("scale"),
                         softcap=None, causal=bool(call.get("is_causal")), mask=mask, mask_kind=kind, chain=(node,),
                         upcast=torch.float32)


def _dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(val, "dtype", None)


def _users(node: fx.Node) -> list[fx.Node]:
    """Who reads `node`, less the dtype assertions export adds beside a cast (`.to(q.dtype)`
    after Hugging Face's float32 softmax has one on the softmax)."""
    return [user for user in node.users if user.target is not aten._assert_tensor_metadata.default]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = _users(node)
    return users[0] if len(users) == 1 else None


def _scalar(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _eager(softmax: fx.Node) -> AttentionForm | None:
    """The eager chain through `softmax`, or None when the softmax is not one (not over the last
    dim, or no matmul of scores on either side)."""
    dim = softmax.args[1]
    rank = len(softmax.meta["val"].shape) if "val" in softmax.meta else 4
    if dim not in (-1, rank - 1):
        return None
    chain = [softmax]
    # forward: casts, a dropout of p = 0, then the matmul with v
    after = _only_user(softmax)
    while after is not None and after.op == "call_function" and (
            after.target in _CASTS or (after.target is aten.dropout.default and _scalar(after.args[1]) == 0.0)):
        chain.append(after)
        after = _only_user(after)
    if after is None or after.target is not aten.matmul.default or after.args[0] is not chain[-1]:
        return None
    v = after.args[1]
    # backward: a cast, the mask, the soft-cap, the scale, the scores' matmul
    x = softmax.args[0]
    while x.op == "call_function" and x.target in _CASTS:
        chain.append(x)
        x = x.args[0]
    mask, kind = None, "visible"
    if x.target is aten.add.Tensor and all(isinstance(a, fx.Node) for a in x.args):
        chain.append(x)
        x, mask = (x.args[0], x.args[1]) if _leads_to_scores(x.args[0]) else (x.args[1], x.args[0])
        kind = "additive"
    elif x.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and _scalar(x.args[2]) == -math.inf:
        chain.append(x)
        x, mask, kind = x.args[0], x.args[1], "hidden"
    softcap = None
    if (x.target is aten.mul.Tensor and _scalar(x.args[1]) is not None and x.args[0].target is aten.tanh.default
            and x.args[0].args[0].target is aten.div.Tensor and _scalar(x.args[0].args[0].args[1]) == _scalar(x.args[1])):
        softcap = _scalar(x.args[1])
        chain += [x, x.args[0], x.args[0].args[0]]
        x = x.args[0].args[0].args[0]
    scale = 1.0
    if x.target in (aten.mul.Tensor, aten.div.Tensor) and _scalar(x.args[1]) is not None:
        scale = _scalar(x.args[1]) if x.target is aten.mul.Tensor else 1.0 / _scalar(x.args[1])
        chain.append(x)
        x = x.args[0]
    if x.target is not aten.matmul.default:
        return None
    transposed = x.args[1]
    if transposed.target is not aten.transpose.int or {d % 4 for d in transposed.args[1:]} != {2, 3}:
        return None
    chain += [x, transposed]
    if any(len(_users(n)) != 1 for n in chain):
        raise UnexecutableStrategy(f"node {softmax.name}: the attention weights are read outside attention "
                                   f"(output_attentions?) under context parallelism; a rank holds only its rows")
    chain.reverse()
    return AttentionForm(q=x.args[0], k=transposed.args[0], v=v, output=after, scale=scale, softcap=softcap,
                         causal=False, mask=mask, mask_kind=kind, chain=(*chain, after),
                         upcast=_dtype(softmax))


def _leads_to_scores(node: fx.Node) -> bool:
    """Whether `node` is computed from a matmul within a few ops (the scores, not the mask)."""
    for _ in range(5):
        if node.target is aten.matmul.default:
            return True
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        if not inputs:
            return False
        node = inputs[0]
    return False


# -- reading a mask ---------------------------------------------------------------------------------
def is_position_arange(node: fx.Node, local_len: int) -> bool:
    """arange(0, L) (HF's cache_position and mask indices): the slice's positions."""
    if node.op != "call_function" or node.target not in _ARANGES:
        return False
    call = normalized_kwargs(node.target, node.args, node.kwargs)
    return (call.get("start", 0), call.get("end"), call.get("step", 1)) == (0, local_len, 1)


def is_table_slice(node: fx.Node, rows_of: Any, local_len: int, seq_len: int) -> int | None:
    """The dim of slice(table, d, 0, L) of a buffer or constant with at least S rows along d (RoPE's
    cos[:L], nanoGPT's bias[:, :, :T, :T]); None when `node` is not one. `rows_of(node, d)`: the
    table's rows, None when `node` is not a table."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return None
    call = normalized_kwargs(node.target, node.args, node.kwargs)
    dim, start, end, step = call["dim"], call["start"], call["end"], call["step"]
    source = node.args[0]
    while isinstance(source, fx.Node) and source.target is aten.slice.Tensor:  # bias[:, :, :T][..., :T]
        inner = normalized_kwargs(source.target, source.args, source.kwargs)
        if (inner["start"], inner["end"]) not in ((0, None), (None, None), (0, 2 ** 63 - 1)) and inner["end"] != local_len:
            return None
        source = source.args[0]
    rows = rows_of(source, dim) if isinstance(source, fx.Node) else None
    ok = start in (0, None) and end == local_len and step == 1 and rows is not None and rows >= seq_len
    return dim if ok else None


def read_mask(program: fx.GraphModule, form: AttentionForm, *, local_len: int, seq_len: int,
              tables: Mapping[str, torch.Tensor], rows_of: Any) -> AttentionMask:
    """The rule of `form`'s mask tensor (module docstring), or `UnexecutableStrategy` naming why not."""
    name = form.output.name
    if form.mask is None:
        return AttentionMask(causal=form.causal)
    needed = _ancestors(form.mask)
    half = max(0, (seq_len - local_len) // 2)
    seen = []
    for offset in sorted({0, half, seq_len - local_len}):
        positions = torch.arange(offset, offset + local_len)
        try:
            shown = _visible_at(program, form, needed, positions, local_len, seq_len, tables, rows_of)
        except IndexError:
            if offset == 0:
                raise
            break  # the subgraph indexes the slice's own tensors by position (module docstring)
        seen.append((positions, shown))
    first = seen[0][1]
    distance = seen[0][0][:, None] - seen[0][0][None, :]
    if not bool(first.diagonal().all()):
        raise UnexecutableStrategy(f"node {name}: its mask hides a token from itself, which no position rule does")
    causal = not bool((first & (distance < 0)).any())
    reach = int((distance if causal else distance.abs())[first].max())
    rule = AttentionMask(causal=causal, window=reach + 1 if reach < local_len - 1 else None)
    for positions, got in seen:
        want = visible(rule, positions, positions)[0]
        if not torch.equal(got, want):
            q, k = (int(i) for i in (got != want).nonzero()[0])
            raise UnexecutableStrategy(
                f"node {name}: its mask is no causal or sliding-window rule of positions (at positions "
                f"{int(positions[q])}, {int(positions[k])} it {'shows' if bool(got[q, k]) else 'hides'} what "
                f"'{rule}' would not); context parallelism cannot split it")
    return rule


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += [a for a in n.all_input_nodes]
    return seen


def _visible_at(program: fx.GraphModule, form: AttentionForm, needed: set[fx.Node], positions: torch.Tensor,
                local_len: int, seq_len: int, tables: Mapping[str, torch.Tensor], rows_of: Any) -> torch.Tensor:
    """Bool [L, L]: the mask evaluated with the slice's positions at `positions`."""
    name = form.output.name
    values: dict[fx.Node, Any] = {}
    for node in program.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            values[node] = _placeholder_value(node, needed, tables, name)
        elif node.op == "get_attr":
            values[node] = getattr(program, node.target)  # type: ignore[arg-type]
        elif node.op != "call_function":
            raise UnexecutableStrategy(f"node {name}: its mask is computed through {node.name} ({node.op}), "
                                       f"which cannot be evaluated at other positions")
        elif is_position_arange(node, local_len):
            values[node] = positions.to(node.meta["val"].dtype if "val" in node.meta else torch.int64)
        elif (dim := is_table_slice(node, rows_of, local_len, seq_len)) is not None:
            whole = values[node.args[0]]
            values[node] = whole.index_select(dim, positions.to(whole.device))
        else:
            args = fx.node.map_arg(node.args, lambda a: values[a])
            kwargs = fx.node.map_arg(node.kwargs, lambda a: values[a])
            values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    mask = values[form.mask]
    if form.mask_kind == "additive":
        if not mask.is_floating_point():
            raise UnexecutableStrategy(f"node {name}: an additive attention mask of {mask.dtype}")
        hidden = mask != 0
        if bool((mask[hidden] > torch.finfo(mask.dtype).min / 2).any()):
            raise UnexecutableStrategy(f"node {name}: its float mask adds values other than 0 and -inf (a "
                                       f"position bias such as ALiBi), which context parallelism does not lower")
        shown = ~hidden
    else:
        shown = mask.bool() if form.mask_kind == "visible" else ~mask.bool()
    shown = shown.reshape(-1, *shown.shape[-2:]) if shown.dim() > 2 else shown.unsqueeze(0)
    if shown.shape[-2:] != (local_len, local_len):
        raise UnexecutableStrategy(f"node {name}: a mask of {list(mask.shape)} for {local_len} tokens")
    if not bool((shown == shown[:1]).all()):
        raise UnexecutableStrategy(f"node {name}: its mask differs between batch rows or heads (padding or "
                                   f"packed documents read from an input), which context parallelism does not lower")
    return shown[0]


def _placeholder_value(node: fx.Node, needed: set[fx.Node], tables: Mapping[str, torch.Tensor], name: str) -> Any:
    """A table's value, or for an input whose shape alone the mask reads, zeros of its shape (a
    symbolic batch as 1)."""
    if node.name in tables:
        return tables[node.name]
    if any(user in needed and user.target not in (aten.sym_size.int, operator.getitem) for user in node.users):
        raise UnexecutableStrategy(f"node {name}: its mask reads the values of input {node.name} (a padding mask "
                                   f"or position ids), which context parallelism does not lower")
    shape = [d if isinstance(d, int) else 1 for d in node.meta["val"].shape]
    return torch.zeros(shape, dtype=node.meta["val"].dtype)
