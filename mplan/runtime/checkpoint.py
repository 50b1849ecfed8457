"""Distributed checkpoints of a `ParallelModule`: one tensor file per rank and a JSON manifest.

Input: a `ParallelModule` and a directory. Output on save: `rank00000.pt` ... (a flat dict of
tensors per rank: `param/<fqn>` for its local shards, `optim/<key>` for its optimizer state, ZeRO
partitions included) written with `torch.save`, and `manifest.json` written by rank 0 (format,
version, world size, mesh, ZeRO level, plan hash, and every parameter's placement and whole shape).
Load validates the manifest field by field (one `CheckpointError` naming the field), refuses a
checkpoint of another plan or world, reads the rank's file with `torch.load(weights_only=True)`
(tensors only: nothing is unpickled) and checks every name and local shape before copying.

Invariants: save and load are collective (every rank calls them; save ends with a barrier so the
directory is complete when it returns); parameters keep the user's original names.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mplan.json_fields import FieldReader, load_json_file
from mplan.ir.placement import Shard, local_shape

if TYPE_CHECKING:
    from mplan.runtime.parallel_module import ParallelModule

FORMAT = "mplan.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that is malformed or was written under another plan."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def save_checkpoint(directory: str, pm: ParallelModule) -> None:
    os.makedirs(directory, exist_ok=True)
    tensors = {f"param/{name}": p.detach().contiguous() for name, p in pm.params.items()}
    tensors.update({f"optim/{key}": value for key, value in pm.optimizer.state_dict().items()})
    torch.save(tensors, os.path.join(directory, rank_file(pm.groups.rank)))
    if pm.groups.rank == 0:
        with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as handle:
            json.dump(_manifest(pm), handle, indent=1)
    if dist.is_initialized():
        dist.barrier()


def _manifest(pm: ParallelModule) -> dict[str, Any]:
    m = pm.plan.mesh_shape()
    return {
        "format": FORMAT, "version": VERSION, "world_size": m.size,
        "mesh": {"dp": m.dp, "tp": m.tp, "pp": m.pp, "ep": m.ep},
        "zero": pm.plan.zero, "sequence_parallel": pm.plan.sequence_parallel, "plan_hash": pm.digest,
        "files": [rank_file(r) for r in range(m.size)],
        "params": {name: {"placement": str(layout.placement),
                          "shape": list(pm.graph.params[name].meta.shape),
                          **({"ep": "S(0)"} if name in pm.experts.parameters else {})}
                   for name, layout in pm.layouts.items()},
    }


def read_manifest(directory: str) -> dict[str, Any]:
    """The validated manifest of a checkpoint directory."""
    path = os.path.join(directory, MANIFEST)
    r = FieldReader(load_json_file(path, CheckpointError), file=path, path="", error=CheckpointError)
    if r.string("format") != FORMAT:
        raise r.error("format", f"must be {FORMAT!r}")
    if r.integer("version") != VERSION:
        raise r.error("version", f"must be {VERSION} (this mplan's checkpoint version)")
    mesh = r.obj("mesh")
    doc = {"world_size": r.integer("world_size"), "zero": r.integer("zero", minimum=0),
           "sequence_parallel": r.boolean("sequence_parallel"), "plan_hash": r.string("plan_hash"),
           "mesh": {k: mesh.integer(k) for k in ("dp", "tp", "pp", "ep")}, "files": r.raw("files"),
           "params": r.raw("params")}
    mesh.finish()
    r.finish()
    if not isinstance(doc["files"], list) or len(doc["files"]) != doc["world_size"]:
        raise CheckpointError(f"{path}: files must list one file per rank ({doc['world_size']})")
    if not isinstance(doc["params"], dict):
        raise CheckpointError(f"{path}: params must map parameter names to placement and shape")
    return doc


def load_checkpoint(directory: str, pm: ParallelModule) -> None:
    doc = read_manifest(directory)
    path = os.path.join(directory, MANIFEST)
    m = pm.plan.mesh_shape()
    for field, want in (("world_size", m.size), ("mesh", {"dp": m.dp, "tp": m.tp, "pp": m.pp, "ep": m.ep}),
                        ("zero", pm.plan.zero), ("plan_hash", pm.digest)):
        if doc[field] != want:
            raise CheckpointError(f"{path}: {field} is {doc[field]!r} but this job runs {want!r}: "
                                  f"a checkpoint loads only under the plan that wrote it")
    state = torch.load(os.path.join(directory, doc["files"][pm.groups.rank]), map_location=pm.device,
                       weights_only=True)
    with torch.no_grad():
        for name, param in pm.params.items():
            key = f"param/{name}"
            want = local_shape(pm.graph.params[name].meta.shape, pm.layouts[name].placement, m.tp)
            if name in pm.experts.parameters:  # this EP rank's experts (dim 0)
                want = local_shape(want, Shard(0), m.ep)
            if key not in state or tuple(state[key].shape) != tuple(want):
                found = tuple(state[key].shape) if key in state else "missing"
                raise CheckpointError(f"{directory}: {key} is {found}, expected local shape {tuple(want)}")
            param.copy_(state[key])
    pm.optimizer.load_state_dict({k[len("optim/"):]: v for k, v in state.items() if k.startswith("optim/")})
