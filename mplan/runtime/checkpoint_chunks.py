"""One rank's pieces of a global tensor, as torch.distributed.checkpoint (DCP) reads and writes them.

Input: a global shape and this rank's rectangular pieces of it (offsets + a local tensor each);
or a flat element range of a row-major tensor (a ZeRO-1 shard's share of one parameter).
Output: `ChunkedTensor`, which implements DCP's checkpointable protocol (`__create_write_items__`,
`__create_chunk_list__`, `__get_tensor_shard__`), so DCP writes each piece once (replicas of a
piece, same offsets, are deduplicated by DCP's save planner) and, on load, copies into each
piece the overlap of every saved chunk: resharding between any two layouts of the same global
tensor is DCP's own overlap arithmetic. `ChunkSavePlanner` / `ChunkLoadPlanner` are DCP's
default planners taught to find a piece of a `ChunkedTensor` by its offsets. `SnapshotStager`
is the staging step of `dcp.async_save`: a copy of every piece, after which training may change
the originals.

Why not DTensor: a DTensor has one piece per rank on one DeviceMesh. mplan's state also has
pieces no mesh describes: a ZeRO-1 shard owns a flat range of each bucket, which is several
rectangles of a parameter (`flat_range_rectangles`), and a pipeline stage holds its parameters
on a subset of the ranks. Describing every piece by its offsets covers them all with one type.

Invariants: pieces of one rank never overlap; every piece is a view into the live tensor it
describes (a load writes through it), or for staging an independent copy.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Offsets = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Piece:
    """A rectangle of a global tensor: where it starts and its data (a view of live state)."""

    offsets: Offsets
    tensor: torch.Tensor


class ChunkedTensor:
    """A global tensor of `size` of which this rank holds `pieces` (DCP checkpointable)."""

    def __init__(self, size: Sequence[int], pieces: Sequence[Piece]) -> None:
        self.shape = torch.Size(size)
        self.pieces = list(pieces)
        for piece in self.pieces:
            ends = [o + s for o, s in zip(piece.offsets, piece.tensor.shape)]
            if len(piece.offsets) != len(self.shape) or any(e > n for e, n in zip(ends, self.shape)):
                raise ValueError(f"piece at {piece.offsets} of shape {tuple(piece.tensor.shape)} "
                                 f"lies outside {tuple(self.shape)}")

    def size(self) -> torch.Size:
        """The global shape (a method, as DCP's planner calls it on tensors)."""
        return self.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].tensor.dtype

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, p.offsets, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=_chunk(p), size=self.shape,
                                                      properties=TensorProperties(dtype=p.tensor.dtype)))
                for i, p in enumerate(self.pieces)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(p) for p in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        hint = index.index
        if hint is not None and hint < len(self.pieces) and torch.Size(self.pieces[hint].offsets) == index.offset:
            return self.pieces[hint].tensor
        for piece in self.pieces:
            if torch.Size(piece.offsets) == index.offset:
                return piece.tensor
        raise KeyError(f"{index.fqn}: no piece at {tuple(index.offset or ())} on this rank")

    def staged(self) -> ChunkedTensor:
        """An independent CPU copy of every piece (what an asynchronous save writes)."""
        return ChunkedTensor(self.shape, [Piece(p.offsets, p.tensor.detach().to("cpu", copy=True)) for p in self.pieces])


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.tensor.shape)


def flat_range_rectangles(shape: Sequence[int], start: int, stop: int) -> list[tuple[Offsets, tuple[int, ...], int]]:
    """Elements [start, stop) of a row-major tensor of `shape` as rectangles, in order:
    (offsets, sizes, flat start of the rectangle). Each rectangle is a contiguous run of the
    flat range (a partial row, whole rows, a partial row, recursively), so it is a view of it.
    At most 2 * ndim - 1 rectangles."""
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) outside a tensor of shape {shape}")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (stop - start,) if shape else (), start)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # within one row: recurse into it
        return [((first, *o), (1, *s), first * inner + f)
                for o, s, f in flat_range_rectangles(shape[1:], start - first * inner, stop - first * inner)]
    out = []
    if start % inner:  # the partial row it starts in
        out += flat_range_rectangles(shape, start, (first + 1) * inner)
        first += 1
    whole_end = stop // inner
    if whole_end > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (whole_end - first, *shape[1:]), first * inner))
    if stop % inner:  # the partial row it ends in
        out += flat_range_rectangles(shape, whole_end * inner, stop)
    return out


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, finding pieces of `ChunkedTensor`s by offsets. The state dict
    is flat already (keys are mplan's names), so it is not flattened again."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, writing into pieces of `ChunkedTensor`s by offsets."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up walks the state dict to materialize meta tensors and returns None for any
        # type it does not know (torch 2.13 `_iterate_state_dict`): the pieces go around it.
        chunked = {k: v for k, v in state_dict.items() if isinstance(v, ChunkedTensor)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in chunked}, metadata, is_coordinator)
        self.state_dict.update(chunked)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ChunkedTensor):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


class SnapshotStager:
    """DCP's `AsyncStager` for mplan's state: copies every piece to the CPU on the caller's
    thread (the stall of a background save), so training may go on while the copy is written."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v.staged() if isinstance(v, ChunkedTensor) else v.detach().to("cpu", copy=True)
                for k, v in state_dict.items()}

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Holds no resources."""

