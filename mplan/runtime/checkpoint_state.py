"""A ParallelModule's training state as global tensors under the model's own names.

Input: a `ParallelModule` (any plan: TP, SP, pipeline stages, DP with zero=0 or ZeRO-1, EP).
Output: `saved_state(pm)`: a flat dict of `ChunkedTensor`s (this rank's pieces, views of live
state) and scalars, keyed

    model/<param>           the parameter, global shape
    optim/<param>/<state>   its optimizer state in parameter shape (`exp_avg`, ...), or a scalar
                            (`step`); `master` for ZeRO-1's wider master weights
    rng/rank<r>/<device>    rank r's random generator state

never by stage-local or integer indices, so any plan of the same model reads it. `LoadTargets`
is the same dict built for a load (optimizer state allocated in the shapes the checkpoint holds)
plus `finish()`, which hands the loaded optimizer state to the torch optimizer.

Where a piece sits: a parameter's local tensor is chunk `tp_rank` of its TP-sharded dim and,
for experts, chunk `ep_rank` of dim 0 of that (`shard_parameters`); optimizer state is kept where
`DistributedOptimizer.state_ranges` says: the whole local parameter (zero=0), or a flat range of
it (ZeRO-1), cut into rectangles (`flat_range_rectangles`). zero=3 keeps the parameters so too
(`DistributedOptimizer.sharded_params`): their pieces are such rectangles of its shards.

Invariants: replicas of a piece (DP, TP-replicated parameters, a tied parameter's pipeline
copies) give the same offsets, so DCP stores one; a load fills every local element or refuses
(`CheckpointError`) naming what is missing or of another shape.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mplan.ir.placement import Shard
from mplan.runtime.checkpoint_chunks import ChunkedTensor, Piece, flat_range_rectangles
from mplan.runtime.checkpoint_storage import CheckpointError, dtype_name
from mplan.runtime.optimizer_state import StateRange

if TYPE_CHECKING:
    from mplan.runtime.parallel_module import ParallelModule

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"
MASTER = "master"
Entry = ChunkedTensor | torch.Tensor


def param_region(pm: ParallelModule, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, offsets of this rank's local tensor) of parameter `name`."""
    shape = tuple(pm.graph.params[name].meta.shape)
    local = list(pm.params[name].shape)
    offsets = [0] * len(shape)
    placement = pm.layouts[name].placement
    if isinstance(placement, Shard):
        tp_local = -(-shape[placement.dim] // pm.axis.size)
        offsets[placement.dim] = pm.axis.rank * tp_local
    if name in pm.experts.parameters:
        offsets[0] += pm.experts.ep.rank * local[0]
    return shape, tuple(offsets)


def saved_state(pm: ParallelModule) -> dict[str, Entry]:
    """This rank's share of the training state, as views of the live tensors."""
    state: dict[str, Entry] = dict(_model_entries(pm))
    pieces, scalars = _optimizer_pieces(pm, _live_state(pm))
    state.update(scalars)
    state.update({key: ChunkedTensor(size, parts) for key, (size, parts) in pieces.items()})
    state.update(_rng_entries(pm.groups.rank, pm.device))
    return state


def _model_entries(pm: ParallelModule) -> dict[str, ChunkedTensor]:
    out = {}
    sharded = _sharded_params(pm)
    for name, param in pm.params.items():
        shape, offsets = param_region(pm, name)
        pieces = sharded.get(name, [Piece(offsets, param.detach())])
        if pieces:  # none: a zero=3 rank that keeps no element of it
            out[MODEL + name] = ChunkedTensor(shape, pieces)
    return out


def _sharded_params(pm: ParallelModule) -> dict[str, list[Piece]]:
    """zero=3: the pieces of each parameter this rank keeps in its flat shards (possibly none), by
    name; empty where parameters are held whole."""
    names = {id(p): n for n, p in pm.params.items()}
    out: dict[str, list[Piece]] = {}
    for r in pm.optimizer.sharded_params() or ():
        name = names[id(r.param)]
        _, offsets = param_region(pm, name)
        parts = out.setdefault(name, [])
        for at, sizes, first in flat_range_rectangles(r.param.shape, r.start, r.stop):
            begin = r.at + first - r.start
            data = r.holder.detach()[begin:begin + math.prod(sizes)].view(sizes)
            parts.append(Piece(tuple(o + a for o, a in zip(offsets, at)), data))
    return out


def _live_state(pm: ParallelModule) -> Callable[[StateRange, str], dict[str, torch.Tensor]]:
    def of(r: StateRange, name: str) -> dict[str, torch.Tensor]:
        entries = dict(pm.optimizer.optimizer.state.get(r.holder, {}))
        for key, value in entries.items():
            if not torch.is_tensor(value):
                raise CheckpointError(f"optimizer state {key!r} of {name} is a {type(value).__name__}, "
                                      f"not a tensor: mplan checkpoints hold tensors only")
        if entries and r.holder.dtype != r.param.dtype:  # ZeRO-1's wider masters carry the weights' low bits
            entries[MASTER] = r.holder.detach()
        return entries
    return of


def _optimizer_pieces(pm: ParallelModule, state_of: Callable[[StateRange, str], Mapping[str, torch.Tensor]],
                      stored: Mapping[str, str] | None = None
                      ) -> tuple[dict[str, tuple[tuple[int, ...], list[Piece]]], dict[str, torch.Tensor]]:
    """Every optimizer-state tensor this rank keeps, as pieces of its parameter-shaped global
    tensor, and its scalars; keyed by each parameter's name, or the name `stored` maps it to (the
    tied alias a checkpoint holds it under)."""
    names = {id(p): n for n, p in pm.params.items()}
    pieces: dict[str, tuple[tuple[int, ...], list[Piece]]] = {}
    scalars: dict[str, torch.Tensor] = {}
    for r in pm.optimizer.state_ranges():
        name = names[id(r.param)]
        shape, offsets = param_region(pm, name)
        for key, value in state_of(r, name).items():
            fqn = f"{OPTIM}{stored[name] if stored else name}/{key}"
            if value.dim() == 0:
                scalars[fqn] = value
                continue
            if value.numel() != r.holder.numel() or not value.is_contiguous():
                raise CheckpointError(f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, neither "
                                      f"its parameter's {tuple(r.param.shape)} nor a scalar: mplan cannot "
                                      f"place it in a checkpoint")
            flat = value.view(-1)
            parts = pieces.setdefault(fqn, (shape, []))[1]
            for at, sizes, first in flat_range_rectangles(r.param.shape, r.start, r.stop):
                begin = r.at + first - r.start
                data = flat[begin:begin + math.prod(sizes)].view(sizes)
                parts.append(Piece(tuple(o + a for o, a in zip(offsets, at)), data))
    return pieces, scalars


def _rng_entries(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    out = {f"{RNG}rank{rank}/cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out[f"{RNG}rank{rank}/cuda"] = torch.cuda.get_rng_state(device)
    return out


def stored_name(name: str, aliases: tuple[str, ...], metadata: Metadata) -> str | None:
    """The name under which a checkpoint holds parameter `name` (its own or a tied alias)."""
    return next((n for n in aliases if MODEL + n in metadata.state_dict_metadata), None)


@dataclass
class LoadTargets:
    """Where a load writes: DCP's state dict of destinations, then `finish()`."""

    state: dict[str, Entry]
    rng: dict[str, torch.Tensor]
    finish: Callable[[], None] = field(repr=False)


def load_targets(pm: ParallelModule, metadata: Metadata, directory: str) -> LoadTargets:
    """Destinations for every tensor this rank needs from a checkpoint, checked against its
    metadata: each parameter present under its name (or a tied alias) with its global shape and
    dtype, optimizer state for all or none of the parameters."""
    saved = metadata.state_dict_metadata
    stored = {}
    for name in pm.params:
        found = stored_name(name, pm.graph.names_of(name), metadata)
        if found is None:
            raise CheckpointError(f"{directory}: has no parameter {name}")
        stored[name] = found
    state: dict[str, Entry] = {}
    # DCP reads into copies, moved into the live tensors only once every read succeeded: a load
    # refused midway (a corrupt file) leaves the model as it was.
    moves: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, entry in _model_entries(pm).items():
        key = MODEL + stored[name.removeprefix(MODEL)]
        _check(directory, key, saved[key], entry.shape, entry.dtype)
        staged = [Piece(p.offsets, torch.empty_like(p.tensor)) for p in entry.pieces]
        moves += [(s.tensor, p.tensor) for s, p in zip(staged, entry.pieces)]
        state[key] = ChunkedTensor(entry.shape, staged)

    optimizer_keys = [k for k in saved if k.startswith(OPTIM)]
    buffers: dict[tuple[int, str], torch.Tensor] = {}
    scalars: dict[tuple[int, str], list[torch.Tensor]] = defaultdict(list)
    names = {id(p): n for n, p in pm.params.items()}
    masters: list[bool] = []  # per range keeping wider masters: whether the checkpoint has them

    def saved_keys(name: str) -> set[str]:
        prefix = f"{OPTIM}{stored[name]}/"
        return {k[len(prefix):] for k in optimizer_keys if k.startswith(prefix)}

    def allocate(r: StateRange, name: str) -> dict[str, torch.Tensor]:
        keys, out = saved_keys(name), {}
        if r.holder.dtype != r.param.dtype and keys:
            masters.append(MASTER in keys)
        for key in sorted(keys):
            md = saved[f"{OPTIM}{stored[name]}/{key}"]
            if key == MASTER:
                if r.holder.dtype != r.param.dtype:  # else the parameter itself is the weight
                    if (id(r.holder), key) not in buffers:
                        buffers[(id(r.holder), key)] = torch.empty_like(r.holder.detach().view(-1))
                        moves.append((buffers[(id(r.holder), key)], r.holder.detach().view(-1)))
                    out[key] = buffers[(id(r.holder), key)]
            elif len(md.size) == 0:
                out[key] = torch.zeros((), dtype=md.properties.dtype)
                scalars[(id(r.holder), key)].append(out[key])
            else:
                out[key] = buffers.setdefault((id(r.holder), key), torch.zeros(
                    r.holder.numel(), dtype=md.properties.dtype, device=r.holder.device))
        return out

    if optimizer_keys:
        stepped_with: dict[int, tuple[str, set[str]]] = {}
        for r in pm.optimizer.state_ranges():
            name = names[id(r.param)]
            if not r.param.requires_grad:
                continue
            mine = saved_keys(name) - {MASTER}
            if not mine:
                raise CheckpointError(f"{directory}: holds optimizer state for some parameters but none for {name}")
            first, theirs = stepped_with.setdefault(id(r.holder), (name, mine))
            if theirs != mine:
                raise CheckpointError(f"{directory}: the optimizer state of {name} ({sorted(mine)}) differs from "
                                      f"that of {first} ({sorted(theirs)}), which this plan steps with it")
        pieces, plain = _optimizer_pieces(pm, allocate, stored)
        if any(masters) and not all(masters):
            raise CheckpointError(f"{directory}: holds master weights for some parameters but not all")
        for key, (size, parts) in pieces.items():
            entry = ChunkedTensor(size, parts)
            _check(directory, key, saved[key], entry.shape, entry.dtype)
            state[key] = entry
        for key, value in plain.items():
            _check(directory, key, saved[key], value.shape, value.dtype)
        state.update(plain)

    rng = {}
    for key, live in _rng_entries(pm.groups.rank, pm.device).items():
        if key in saved:
            _check(directory, key, saved[key], live.shape, live.dtype)
            rng[key] = torch.empty_like(live)
    state.update(rng)

    def finish() -> None:
        with torch.no_grad():
            for staged, live in moves:
                live.copy_(staged)
        state_buffers = {k: v for k, v in buffers.items() if k[1] != MASTER}
        if state_buffers or scalars:
            _install(pm, state_buffers, scalars, directory)
        if not any(masters):  # masters (if this optimizer keeps any) from the loaded weights
            pm.optimizer.params_loaded()
    return LoadTargets(state=state, rng=rng, finish=finish)


def _check(directory: str, key: str, md: Any, size: Any, dtype: torch.dtype) -> None:
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"{directory}: {key} is not a tensor")
    if tuple(md.size) != tuple(size):
        raise CheckpointError(f"{directory}: {key} has shape {tuple(md.size)}, this model's is {tuple(size)}")
    if md.properties.dtype != dtype:
        raise CheckpointError(f"{directory}: {key} is {dtype_name(md.properties.dtype)}, this model's is "
                              f"{dtype_name(dtype)}: build the model in the checkpoint's dtype")


def _install(pm: ParallelModule, buffers: Mapping[tuple[int, str], torch.Tensor],
             scalars: Mapping[tuple[int, str], list[torch.Tensor]], directory: str) -> None:
    """Hand the loaded state to the torch optimizer (its `load_state_dict` applies torch's own
    dtype and device rules, e.g. `step` stays where the optimizer keeps it)."""
    opt = pm.optimizer.optimizer
    order = [p for group in opt.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(order)}
    state: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for (holder, key), flat in buffers.items():
        param = order[index[holder]]
        state[index[holder]][key] = flat.view(param.shape)
    for (holder, key), values in scalars.items():
        if any(not torch.equal(v, values[0]) for v in values[1:]):
            raise CheckpointError(f"{directory}: {key} differs between parameters stepped together "
                                  f"({sorted({float(v) for v in values})})")
        state[index[holder]][key] = values[0]
    live = opt.state_dict()
    opt.load_state_dict({"state": dict(state), "param_groups": live["param_groups"]})
