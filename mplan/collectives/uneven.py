"""All-to-all of rows in uneven splits, with autograd: expert parallelism's dispatch and combine.

    rows_all_to_all(x [N, ...], send, receive, group)   rank i sends x's next send[j] rows to
                                                        rank j and gets receive[j] rows from it
    exchange_counts(counts [n, m] int, group)           row j of counts goes to rank j; what
                                                        every rank sent this one, [n, m]

Backward of `rows_all_to_all` is the same exchange with `send` and `receive` swapped: each
gradient row returns to the rank its row came from. The split sizes are host integers (the
counts are read once per exchange pair: dispatch and combine reuse them), as every NCCL and gloo
all-to-all takes them. A group of one (or None) is the identity.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def _exchange(x: torch.Tensor, send: Sequence[int], receive: Sequence[int], group: ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(receive), input_split_sizes=list(send),
                           group=group)
    return out


class _RowsAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: tuple[int, ...], receive: tuple[int, ...],
                group: ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(x, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def rows_all_to_all(x: torch.Tensor, send: Sequence[int], receive: Sequence[int],
                    group: ProcessGroup | None) -> torch.Tensor:
    """Rows of `x` to the ranks of `group` in uneven splits (module docstring)."""
    if group is None or group.size() == 1:
        return x
    if sum(send) != x.shape[0] or len(send) != group.size() or len(receive) != group.size():
        raise ValueError(f"all-to-all over {group.size()} ranks: send {list(send)} does not split {x.shape[0]} "
                         f"rows, or receive {list(receive)} has another length")
    return _RowsAllToAll.apply(x, tuple(send), tuple(receive), group)


def exchange_counts(counts: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Row j of `counts` [n, m] to rank j; returns row i = what rank i sent to this one."""
    if group is None or group.size() == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
