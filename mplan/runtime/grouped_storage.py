"""Each grouped projection's weights end to end in one storage, so its GEMM reads them in place.

Input: the local program (after `fuse_kernels`) and this rank's parameters by name. Output: the
same parameter tensors, those a `grouped_linear` (or `joined_weights`) reads (q/k/v, gate/up, and their biases)
moved, group by group, into one new storage each, in the order the kernel concatenates them.

Why: `kernels.grouped_linear` runs a group of linears on one input as one GEMM on the
concatenation of their weights. Separate parameters make it copy them, in every forward and
again in every backward, for every micro-batch: 96 copies and 3.2 ms a micro-batch on
SmolLM2-1.7B's shape (one H100, 2026-12-06), 25.6 ms of its 390 ms step at micro-batch 1. Laid
end to end, the concatenation is a view (`grouped_linear.joined`) and the copies are gone.

The tensors keep their identity: each is pointed at its slice of the group's storage
(`tensor.data = slice`), so a parameter of the model passed to `autoparallel` that trains as it
is stays the model's own tensor, and what else holds it (placements, the optimizer, the
model) sees the same object. Values are copied bit for bit. Nothing downstream depends on the
layout: updates are in place (the optimizers, checkpoint loads), DCP clones a view before saving
it, the Hugging Face export copies into its own buffers; where something does give a parameter
new storage, the kernel finds its weights apart and concatenates them as before (slower, never
different).

Left out: a group whose weights differ in dtype, device or trailing shape, or share a parameter
with another group or with itself (a tied weight); zero=3, whose gathers give each unit's
parameters storage of their own, in the unit's order: the program's, in which a model declares a
group's members one after another, so they lie end to end there too (tests/test_grouped_storage.py).
Autocast's compute copies of weights that lie end to end are made end to end too
(`compute_copies.py`). Under a zero-bubble schedule or FP8 the group is ATen's `linear` on
`joined_weights`, the same view where the weights lie end to end (docs/kernels.md).

The planner prices a grouped GEMM as its parts (`fused_pricing.py`), no copy.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx

from mplan.passes.insert_collectives import INPUTS


def weight_groups(program: fx.GraphModule) -> list[tuple[str, ...]]:
    """The parameter names each `grouped_linear` (or `joined_weights`, its ATen form) of
    `program` concatenates (weights, then biases as a group of their own), in the kernel's
    order; groups of fewer than two or reading anything but parameters are left out."""
    from mplan.kernels.grouped_linear import grouped_linear, joined_weights  # loads Triton: not at `import mplan`

    parameters = {spec.placeholder: spec.name for spec in program.meta.get(INPUTS, ()) if spec.kind == "PARAMETER"}
    groups = []
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target not in (grouped_linear, joined_weights):
            continue
        for members in (node.args[1], node.args[2]) if node.target is grouped_linear else (node.args[0],):
            names = [parameters.get(m.name) if isinstance(m, fx.Node) and m.op == "placeholder" else None
                     for m in members]
            if len(names) > 1 and None not in names:
                groups.append(tuple(names))  # type: ignore[arg-type]
    return groups


def place_end_to_end(groups: list[tuple[str, ...]], tensors: Mapping[str, torch.Tensor],
                     model: Mapping[str, torch.Tensor] | None = None) -> int:
    """Moves each group's tensors (by name in `tensors`) into one new storage, end to end in the
    group's order, and any of `model`'s parameters (by the same names) that those tensors alias
    whole (not a TP shard's slice of it), so the model passed in keeps training; returns how many
    groups moved. A group that cannot be (the module docstring says which), one with a name this
    rank does not hold, or one with a tensor whose storage another name also uses (a tie), stays."""
    holders: dict[tuple[torch.device, int], set[str]] = {}
    for name, t in tensors.items():
        holders.setdefault(_storage(t), set()).add(name)
    seen: set[str] = set()
    moved = 0
    for names in groups:
        overlaps = bool(seen & set(names))
        seen.update(names)
        if overlaps or len(set(names)) != len(names) or not all(n in tensors for n in names):
            continue
        members = [tensors[n] for n in names]
        first = members[0]
        if any(t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]
               or holders[_storage(t)] != {n} for n, t in zip(names, members)):
            continue
        storage = torch.empty((sum(t.shape[0] for t in members), *first.shape[1:]), dtype=first.dtype,
                              device=first.device)
        row = 0
        for name, t in zip(names, members):
            piece = storage[row:row + t.shape[0]]
            piece.copy_(t.detach())
            own = (model or {}).get(name)
            if own is not None and _same_tensor(own, t):  # not a TP shard of it: that one keeps its values
                own.data = piece
            t.data = piece
            row += t.shape[0]
        moved += 1
    return moved


def _storage(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` are the same elements of the same storage (one an alias of the other)."""
    return (_storage(a) == _storage(b) and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype)
