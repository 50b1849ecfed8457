"""Predicates the fusion patterns share: what a node calls, what it computes, who uses it.

Input: nodes of an ATen-level `torch.fx` graph as `torch.export.export(model, ..., strict=False)
.module()` gives (nodes carry `meta["val"]` fake tensors). Nothing here rewrites a graph.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

__all__ = ["ATTENTION_OPS", "LOSS_OPS", "VIEW_OPS", "cast", "feeds_the_loss", "full_slice", "is_call",
           "is_last_dim", "number", "other", "same_shape_add", "sole_consumer", "tensor_value", "used_only_by"]

aten = torch.ops.aten

VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
"""The reshaping views a rule looks through (shape changes, no data movement)."""
LOSS_OPS: tuple[Any, ...] = (aten.cross_entropy_loss.default,)
"""The ATen ops that compute a loss (the output head is the linear feeding one)."""
ATTENTION_OPS: tuple[Any, ...] = (aten.scaled_dot_product_attention.default,)
"""The ATen ops that compute attention from q, k, v (their first three arguments)."""


def is_call(node: Any, *targets: Any) -> bool:
    """Whether `node` is a graph node calling one of `targets`."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def tensor_value(node: Any) -> torch.Tensor | None:
    """The (fake) tensor `node` computes, from `meta["val"]`; None if it has none."""
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def uses(node: Node) -> list[Node]:
    """`node`'s users but export's dtype assertions: a fused op never exposes the value they
    check, and the pass drops them (`mplan inspect`'s capture keeps them)."""
    return [u for u in node.users if not is_call(u, aten._assert_tensor_metadata.default)]


def used_only_by(node: Node, *users: Node) -> bool:
    """Every use of `node` (`uses`: dtype assertions do not count) is one of `users`."""
    return set(uses(node)) <= set(users)


def is_last_dim(dim: Any, node: Node) -> bool:
    value = tensor_value(node)
    return dim == -1 or (value is not None and dim == value.dim() - 1)


def number(value: Any) -> float | None:
    """`value` as a float when it is a Python number (not a bool), else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def same_shape_add(node: Any) -> tuple[Node, Node] | None:
    """(a, b) when `node` is a + b of two tensors of one shape and dtype (a residual add)."""
    if not is_call(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    va, vb = tensor_value(a), tensor_value(b)
    if va is None or vb is None or va.shape != vb.shape or va.dtype != vb.dtype:
        return None
    return a, b


def other(pair: tuple[Any, Any], node: Any) -> Any:
    return pair[1] if pair[0] is node else pair[0]


def cast(node: Any) -> tuple[Node, torch.dtype] | None:
    """(source, dtype) when `node` is source.to(dtype) and nothing else (no copy or layout flags)."""
    if is_call(node, aten.to.dtype) and len(node.args) == 2 and not node.kwargs and isinstance(node.args[0], Node):
        return node.args[0], node.args[1]
    return None


def full_slice(node: Node) -> bool:
    """x[a:b] over a whole dim (start 0, no end or an end past the size, step 1)."""
    value = tensor_value(node.args[0])
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    if value is None:
        return False
    return start in (0, None) and step in (1, None) and (end is None or (isinstance(end, int) and end >= value.shape[dim]))


_PASS_THROUGH = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default,
                 aten.to.dtype, aten.contiguous.default)


def feeds_the_loss(node: Node, hops: int = 4, *, losses: tuple[Any, ...] = LOSS_OPS) -> bool:
    """Whether `node`'s value reaches a loss (a call of one of `losses`) through at most `hops`
    reshapes or casts (the output head)."""
    if hops < 0:
        return False
    return any(is_call(user, *losses)
               or (is_call(user, *_PASS_THROUGH) and feeds_the_loss(user, hops - 1, losses=losses))
               for user in node.users)


def sole_consumer(value: Node, *, attention_ops: tuple[Any, ...], linear_ops: tuple[Any, ...] = ()) -> str | None:
    """"linear" when every use of `value`, through views, is a linear's input (not its weight:
    aten.linear, or one of `linear_ops`, fused ops whose first argument is a GEMM's input cast
    as F.linear casts it), "attention" when every use is q, k or v of one of `attention_ops`
    (ATTENTION_OPS, plus any fused attention op already in the graph); else None."""
    kinds = set()
    for user in value.users:
        if is_call(user, *VIEW_OPS) and user.args[0] is value:
            kinds.add(sole_consumer(user, attention_ops=attention_ops, linear_ops=linear_ops))
        elif is_call(user, aten.linear.default, *linear_ops) and user.args[0] is value and value not in user.args[1:]:
            kinds.add("linear")
        elif is_call(user, *attention_ops) and value in user.args[:3]:
            kinds.add("attention")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None
