"""Autograd-aware collectives: Megatron's conjugate pairs, each taking an explicit group.

Input: a local tensor and a process group (one axis of the mesh, from `ProcessGroups`).
Output: the tensor after the collective; its backward runs the conjugate collective, so a
rewritten graph differentiates to the gradients of the single-device model.

    function                  forward                      backward
    copy_to_region            identity                     all-reduce (sum)
    reduce_from_region        all-reduce (sum)             identity
    scatter_to_region(dim)    keep this rank's chunk       all-gather along dim
    gather_from_region(dim)   all-gather along dim         keep this rank's chunk
    gather_sequence(dim)      all-gather along dim         reduce-scatter (sum) along dim
    reduce_scatter_sequence   reduce-scatter (sum) on dim  all-gather along dim
    all_to_all(split, concat) split -> exchange -> concat  the inverse all-to-all

The first four are tensor parallelism (column-parallel input, row-parallel output); the two
`*_sequence` functions are sequence parallelism, which replaces TP's all-reduce by an
all-gather before and a reduce-scatter after the parallel region; `all_to_all` dispatches
tokens to experts (expert parallelism) and back.

Invariants:
- A group of one rank (or `None`, see `process_groups.py`) is the identity, with no
  collective and no autograd node.
- Chunks along `dim` are equal: a size not divisible by the group size is an error showing
  the arithmetic. Chunk `i` belongs to the group's rank `i`.
- Every collective runs on a flat, contiguous 1-D buffer and returns a fresh tensor, so any
  input layout (non-contiguous, transposed) works and inputs are never modified. Flat buffers
  are also what gloo needs: its reduce-scatter and all-gather check dim 0 (`out.shape[0] *
  n == in.shape[0]`) where NCCL checks only the element count. Gloo has had a reduce-scatter
  since torch 2.2 (pytorch#112144, itself an all-reduce followed by a chunk, pytorch#118911),
  so with torch >= 2.6 no fallback of our own is needed.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mplan.runtime.process_groups import ProcessGroup, group_size

# torch 2.13 renamed the flat-buffer collectives and deprecates the old names; pyproject
# admits torch >= 2.6, which has only the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""`all_gather_flat(out, x, group=...)`: out (n * x.numel(),) <- every rank's `x`, in rank order."""
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""`reduce_scatter_flat(out, x, group=...)`: out <- chunk `rank` of the sum over ranks of `x`."""


def _chunk_size(x: torch.Tensor, dim: int, n: int, what: str) -> int:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: size {x.shape[dim]} of dim {dim} is not divisible by the group size {n} "
            f"({x.shape[dim]} % {n} = {x.shape[dim] % n})"
        )
    return x.shape[dim] // n


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    n = group.size()
    flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_flat(flat, x.contiguous().reshape(-1), group=group)
    # flat holds the n inputs one after another; put the rank index next to `dim` and merge.
    return flat.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def _split(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    size = _chunk_size(x, dim, group.size(), "split")
    return x.narrow(dim, group.rank() * size, size).contiguous()


def _ranks_first(x: torch.Tensor, dim: int, n: int, what: str) -> torch.Tensor:
    """`x` viewed as n equal chunks along `dim`, chunk index moved to dim 0, contiguous."""
    size = _chunk_size(x, dim, n, what)
    return x.unflatten(dim, (n, size)).movedim(dim, 0).contiguous()


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    chunks = _ranks_first(x, dim, group.size(), "reduce-scatter")
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out.view(-1), chunks.view(-1), group=group)
    return out


def _all_to_all(
    x: torch.Tensor, group: ProcessGroup, split_dim: int, concat_dim: int
) -> torch.Tensor:
    chunks = _ranks_first(x, split_dim, group.size(), "all-to-all")
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received.view(-1), chunks.view(-1), group=group)
    # received[j] is the chunk rank j sent to us; concatenate them along concat_dim in rank order.
    return received.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.group, ctx.dim), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, split_dim: int, concat_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.split_dim, ctx.concat_dim = group, split_dim, concat_dim
        return _all_to_all(x, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The exchange is a permutation of chunks; its inverse swaps the roles of the dims.
        return _all_to_all(grad, ctx.group, ctx.concat_dim, ctx.split_dim), None, None, None


def copy_to_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Leave a TP region holding partial sums: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor along `dim`; all-gather backward."""
    if group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group, dim % x.dim())


def gather_from_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """All-gather TP chunks along `dim` into a replicated tensor; split backward."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group, dim % x.dim())


def gather_sequence(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Enter a TP region from sequence-sharded activations: all-gather, reduce-scatter backward."""
    if group_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, dim % x.dim())


def reduce_scatter_sequence(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 0
) -> torch.Tensor:
    """Leave a TP region into sequence-sharded activations: reduce-scatter, all-gather backward."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterSequence.apply(x, group, dim % x.dim())


def all_to_all(
    x: torch.Tensor, group: ProcessGroup | None, split_dim: int, concat_dim: int
) -> torch.Tensor:
    """Send chunk i of `x` along `split_dim` to rank i; concatenate what arrives along
    `concat_dim`, in rank order."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, split_dim % x.dim(), concat_dim % x.dim())

