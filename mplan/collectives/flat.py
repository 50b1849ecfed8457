"""Collectives on flat, contiguous buffers along one tensor dim: all-gather, all-reduce,
reduce-scatter, all-to-all.

Input: a local tensor, a process group and a dim. Output: a fresh tensor (inputs are never
modified). Chunk i of a dim belongs to the group's rank i. Every collective runs on a flat 1-D
buffer, so any input layout (non-contiguous, transposed) works; flat buffers are also what gloo
needs: its reduce-scatter and all-gather check dim 0 (`out.shape[0] * n == in.shape[0]`) where
NCCL checks only the element count. Gloo has had a reduce-scatter since torch 2.2
(pytorch#112144, an all-reduce followed by a chunk, pytorch#118911), so with torch >= 2.6 no
fallback of our own is needed. A dim not divisible by the group size is an error showing the
arithmetic.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

# torch 2.13 renamed the flat-buffer collectives and deprecates the old names; pyproject
# admits torch >= 2.6, which has only the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""`all_gather_flat(out, x, group=...)`: out (n * x.numel(),) <- every rank's `x`, in rank order."""
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""`reduce_scatter_flat(out, x, group=...)`: out <- chunk `rank` of the sum over ranks of `x`."""


def chunk_size(x: torch.Tensor, dim: int, n: int, what: str) -> int:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: size {x.shape[dim]} of dim {dim} is not divisible by the group size {n} "
            f"({x.shape[dim]} % {n} = {x.shape[dim] % n})"
        )
    return x.shape[dim] // n


def all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def all_gather(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    n = group.size()
    flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_flat(flat, x.contiguous().reshape(-1), group=group)
    # flat holds the n inputs one after another; put the rank index next to `dim` and merge.
    return flat.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def _ranks_first(x: torch.Tensor, dim: int, n: int, what: str) -> torch.Tensor:
    """`x` viewed as n equal chunks along `dim`, chunk index moved to dim 0, contiguous."""
    size = chunk_size(x, dim, n, what)
    return x.unflatten(dim, (n, size)).movedim(dim, 0).contiguous()


def reduce_scatter(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    chunks = _ranks_first(x, dim, group.size(), "reduce-scatter")
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out.view(-1), chunks.view(-1), group=group)
    return out


def all_to_all(x: torch.Tensor, group: ProcessGroup, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Chunk i of `x` along `split_dim` to rank i; what arrives concatenated along `concat_dim`."""
    chunks = _ranks_first(x, split_dim, group.size(), "all-to-all")
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received.view(-1), chunks.view(-1), group=group)
    # received[j] is the chunk rank j sent to us; concatenate them along concat_dim in rank order.
    return received.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


_DTYPES: tuple[torch.dtype, ...] = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
"""Dtypes `broadcast_tensor` can announce, by their index."""


def broadcast_tensor(x: torch.Tensor | None, *, src: int, group: ProcessGroup | None,
                     device: torch.device) -> torch.Tensor:
    """`x` from global rank `src` to every rank of `group` (the others pass None and need not know
    its dtype or shape: a small header of both goes first). A `group` of None is one rank."""
    if group is None or group.size() == 1:
        assert x is not None
        return x
    header = torch.zeros(1 + 8, dtype=torch.int64, device=device)
    if x is not None:
        if x.dim() > 8:
            raise ValueError(f"broadcast_tensor: at most 8 dims, got {x.dim()}")
        header[0] = _DTYPES.index(x.dtype)
        header[1:1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64) + 1
    dist.broadcast(header, src=src, group=group)
    shape = tuple(int(d) - 1 for d in header[1:].tolist() if d > 0)
    out = x.contiguous() if x is not None else torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    dist.broadcast(out, src=src, group=group)
    return out
