"""Is an SDPA attention mask the causal mask? `is_causal_mask(mask, q, k)`, decided by evaluation.

Input: the `attn_mask` node of an ATen-level `torch.fx` graph (nodes carry `meta["val"]` fake
tensors) and SDPA's query and key nodes. Output: True when the mask is computed from constants
and shapes alone and equals "key <= query position" (bool True, or additive 0) with every other
entry masked (bool False, or additive -inf or below half the dtype's lowest value: exp then gives
exactly 0 there, as a causal kernel's skip does). torch.export cannot take transformers' eager
shortcut to `is_causal`, so a Hugging Face trace builds the mask and passes it; fusion
(`fusion_patterns._match_attention`) turns a mask proven causal back into `is_causal=True`.

Why the evaluation is done at a short sequence: the mask is [batch, 1, seq, seq]. Computed at
the program's own length it cost 17 s of CPU and several GiB at 32k tokens (planning an 8B
config at 32768 took 3x as long as at 4096) and cannot be held at 128k. So a mask whose graph
holds no integer but the sequence length itself and numbers under half of `SHORT_SEQ` (dims,
0, 1, -1, head counts, slice ends at "to the end") is computed with the sequence length
replaced by `SHORT_SEQ`: such a computation is the same function of positions at any length
(arange, compare, cumsum, broadcast), so it is causal at `SHORT_SEQ` exactly when it is at the
program's length; a window or chunk of any size up to SHORT_SEQ / 2 shows within it. A mask with
another integer in it (a sliding window of 4096, `seq - 1`) is computed at the program's own length
when that is at most `EXACT_LIMIT` entries, and is not proven causal otherwise (it then runs and
is priced with its mask: slower, never wrong).

Lifted constants: torch.export turns a tensor the model creates from a Python number
(transformers 5.17 writes the mask's 0 as `torch.tensor(0.0)`) into a constant placeholder; the
capture keeps its value on the node (`CONSTANT_META`), and the evaluation reads it as it reads a
literal: a one-element float, or a one-element integer under SHORT_SEQ / 2, at any length; any
other constant only at the program's own length.

Invariants: no value of any placeholder is read but the lifted constants (an input's size may be); what a meta-device
capture creates on the meta device is computed on the CPU; at most `EVALUATION_LIMIT` nodes are
evaluated; the decision is cached on the mask node (`meta["mplan_causal_mask"]`).
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch.fx import Node

__all__ = ["CONSTANT_META", "EVALUATION_LIMIT", "EXACT_LIMIT", "SHORT_SEQ", "example_int", "is_causal_mask"]

aten = torch.ops.aten

SHORT_SEQ = 256
"""The sequence length a shape-generic mask is evaluated at (a [2, 1, 256, 256] mask)."""
EXACT_LIMIT = 1 << 26
"""Most entries (batch x seq x seq) of a mask evaluated at the program's own length: 64 MiB of
bool per intermediate, seq 5792 at the planner's example batch of 2."""
EVALUATION_LIMIT = 256
"""At most this many nodes are evaluated to decide a mask (transformers' mask takes ~40)."""
CONSTANT_META = "mplan_constant"
"""The node meta key under which the capture keeps a lifted constant placeholder's value."""
_END = (sys.maxsize, -sys.maxsize - 1)  # slice ends meaning "to the end", as export writes them


def example_int(value: Any) -> Any:
    """A symbolic size (the planner's capture has a symbolic batch) as the example value it was
    traced at; anything else as it is. A mask built from shapes is decided at that batch."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if not isinstance(hint, int):
            raise ValueError("a symbolic size without an example value")
        return hint
    return value


def _value(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def is_causal_mask(mask: Node, q: Any, k: Any) -> bool:
    """Whether `mask`, an SDPA attn_mask, is the causal mask (see the module docstring). Query
    and key lengths must be equal (top-left and bottom-right alignment agree then). A mask
    depending on any input's values (padding, packed sequences given as inputs) is never causal
    here."""
    qv, kv = _value(q), _value(k)
    if qv is None or kv is None or qv.dim() != 4:
        return False
    q_shape = tuple(example_int(d) for d in qv.shape)
    if q_shape[-2] != example_int(kv.shape[-2]):
        return False
    cached = mask.meta.get("mplan_causal_mask")
    if cached is None:
        cached = mask.meta["mplan_causal_mask"] = _decide(mask, q_shape)
    return cached


def _decide(mask: Node, q_shape: tuple[int, ...]) -> bool:
    """The mask evaluated at SHORT_SEQ where its constants allow it, else at its own length
    within EXACT_LIMIT; not causal where neither is possible."""
    batch, seq = q_shape[0], q_shape[-2]
    attempts = [(seq, SHORT_SEQ)] if seq > SHORT_SEQ else []
    if batch * seq * seq <= EXACT_LIMIT:
        attempts.append((seq, seq))
    for length, at in attempts:
        try:
            value = evaluate_constant(mask, length=length, at=at)
        except (RuntimeError, TypeError, ValueError, IndexError, AttributeError):
            continue
        return _equals_causal(value, (*q_shape[:-2], at, q_shape[-1]))
    return False


def _equals_causal(value: Any, q_shape: tuple[int, ...]) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return False
    seq = q_shape[-2]
    if value.shape[-2:] != (seq, seq) or value.shape[0] not in (1, q_shape[0]) or value.shape[1] not in (1, q_shape[1]):
        return False
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=value.device).tril().expand_as(value)
    if value.dtype == torch.bool:
        return bool(torch.equal(value, allowed))
    if not value.is_floating_point():
        return False
    blocked = value.masked_select(~allowed)
    return bool((value.masked_select(allowed) == 0).all()) and bool(
        (blocked <= torch.finfo(value.dtype).min / 2).all())


def _resized(value: Any, length: int, at: int) -> Any:
    """An integer argument with the sequence length `length` replaced by `at`; raises ValueError
    for any other integer from SHORT_SEQ / 2 up (a window, `seq - 1`), which might not scale."""
    if at == length or isinstance(value, bool) or not isinstance(value, int):
        return value
    if value == length:
        return at
    if abs(value) < at // 2 or value in _END:
        return value
    raise ValueError(f"the integer {value} in a mask of length {length} may not scale to {at}")


def _constant(value: torch.Tensor, length: int | None, at: int | None) -> torch.Tensor:
    """A lifted constant's value for an evaluation at `at` instead of `length`: as it is where it
    holds no position (a one-element float, a one-element integer under at / 2); refused
    (ValueError) where it might encode one and the evaluation is resized."""
    if value.device.type == "meta":
        raise ValueError("a lifted constant on the meta device has no value")
    if length is None or at is None or at == length or value.numel() != 1 or value.dtype == torch.bool:
        return value
    if value.is_floating_point() or (not value.is_complex() and abs(int(value.item())) < at // 2):
        return value
    raise ValueError(f"the constant {value.item()} in a mask of length {length} may not scale to {at}")


def evaluate_constant(node: Node, *, length: int | None = None, at: int | None = None) -> Any:
    """The value of `node`, computed from its ancestors when they are calls of ATen ops on
    constants only (never a placeholder's values: no input, parameter or buffer, though an
    input's size may be read; what a meta-device capture creates on the meta device is created
    on the CPU), with every integer argument equal to `length` replaced by `at` (`_resized`).
    Raises ValueError when it depends on anything else or needs more than EVALUATION_LIMIT
    nodes."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        if current.op == "placeholder" and isinstance(current.meta.get(CONSTANT_META), torch.Tensor):
            seen.add(current)
            order.append(current)
            continue
        if current.op != "call_function" or not isinstance(current.target, torch._ops.OpOverload):
            raise ValueError(f"{current} is not an ATen call on constants")
        seen.add(current)
        order.append(current)
        if len(order) > EVALUATION_LIMIT:
            raise ValueError("mask computation too long to evaluate")
        if current.target is not aten.sym_size.int:  # a size reads no values: its input stays unread
            stack.extend(n for n in current.all_input_nodes if n not in seen)
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    values: dict[Node, Any] = {}
    for current in sorted(order, key=position.__getitem__):
        if current.op == "placeholder":
            values[current] = _constant(current.meta[CONSTANT_META], length, at)
            continue
        if current.target is aten.sym_size.int:  # the batch of a symbolic capture, at its example value
            values[current] = example_int(_value(current.args[0]).shape[current.args[1]])
            continue
        args, kwargs = current.args, current.kwargs
        if length is not None and at is not None:  # literals only: sizes read by sym_size are the batch, never resized
            args, kwargs = torch.utils._pytree.tree_map(lambda v: _resized(v, length, at), (args, kwargs))
        args, kwargs = torch.fx.node.map_arg((args, kwargs), values.__getitem__)
        if kwargs.get("device") == torch.device("meta"):  # a meta-device capture: the same constants on the CPU
            kwargs = {**kwargs, "device": torch.device("cpu")}
        args, kwargs = torch.utils._pytree.tree_map(example_int, (args, kwargs))
        values[current] = current.target(*args, **kwargs)
    return values[node]
