"""What a checkpoint directory holds, read from its metadata alone: `mplan checkpoint inspect`.

Input: a path: an mplan checkpoint root (the step its `latest` names, else its newest committed
step), one step's directory (`ROOT/step-NNNNNNNN`), or a Hugging Face model directory
(config.json + safetensors, sharded with an index file or not).
Output: `describe_checkpoint(path)`, one JSON-ready document:

    mplan's format   format, version, step, saved_at, model name, plan (spec string and mesh;
                     null for a checkpoint converted from another format), world size, optimizer
                     class and hyperparameters (null: weights only), extras keys, every tensor
                     (name, kind, dtype, shape, bytes, saved chunks, bytes on disk), totals, data
                     files, and the committed steps under the root (root null for a checkpoint
                     directory that is no step of one, as `mplan checkpoint convert` writes)
    Hugging Face     architectures, model type, every tensor (name, dtype, shape, bytes, file),
                     totals and files

Invariants: no tensor's bytes are read and nothing is unpickled. mplan's `mplan.json` and
`dcp.json` are read by the checkpoint's own validating readers (`read_manifest`,
`read_dcp_metadata`: a wrong field is one `CheckpointError` naming it) and must agree on every
parameter's shape (else one line naming the tensor and both shapes), data files are only
measured (`check_data_files`: a missing or truncated one is refused, as a load would refuse it),
and a safetensors file is read up to the end of its header (8 bytes of length, then JSON),
validated field by field, and measured against the bytes that header promises.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Any

from mplan.json_fields import FieldReader, load_json_file
from mplan.runtime.checkpoint import (
    FORMAT,
    LATEST,
    MANIFEST,
    VERSION,
    committed_steps,
    is_hf_directory,
    read_manifest,
    resolve_checkpoint,
    step_dir,
)
from mplan.runtime.checkpoint_state import MODEL, OPTIM, RNG
from mplan.runtime.checkpoint_storage import (
    METADATA_FILE,
    CheckpointError,
    check_data_files,
    dtype_name,
    read_dcp_metadata,
)

HF_FORMAT = "huggingface"
SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_SAFETENSORS_HEADER = 100_000_000
"""Bytes: the largest header the safetensors library itself accepts (its `MAX_HEADER_SIZE`)."""
SAFETENSORS_DTYPES = {  # safetensors' dtype names -> (torch's name, bytes per element)
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "C64": ("complex64", 8),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1)}
_PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def describe_checkpoint(path: str) -> dict[str, Any]:
    """The document of the module docstring for `path` (`CheckpointError`: one line naming the
    file and what is wrong)."""
    if os.path.isdir(path) and is_hf_directory(path):
        return describe_hf_directory(path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
        pickled = [name for name in _PICKLED_WEIGHTS if os.path.isfile(os.path.join(path, name))]
        if pickled and os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"{os.path.join(path, pickled[0])}: Hugging Face weights as a pickle, which mplan "
                                  f"never loads: save them as safetensors (save_pretrained's default)")
    return describe_mplan_checkpoint(resolve_checkpoint(path))


# -- mplan's format --------------------------------------------------------------------------------
def describe_mplan_checkpoint(directory: str) -> dict[str, Any]:
    """One step's directory of mplan's format, from `mplan.json` and `dcp.json`."""
    manifest = read_manifest(directory)
    metadata = read_dcp_metadata(directory)
    check_data_files(directory, metadata)
    stored: dict[str, int] = {}
    files: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
        files[info.relative_path] = os.path.getsize(os.path.join(directory, info.relative_path))
    tensors = []
    for fqn, md in metadata.state_dict_metadata.items():
        listed = manifest.params.get(fqn.removeprefix(MODEL)) if fqn.startswith(MODEL) else None
        if listed is not None and tuple(md.size) != listed[0]:
            raise CheckpointError(f"{os.path.join(directory, METADATA_FILE)}: {fqn} has size {list(md.size)}, "
                                  f"but {MANIFEST} says {list(listed[0])}")
        kind = next((k for k, prefix in (("model", MODEL), ("optimizer", OPTIM), ("rng", RNG))
                     if fqn.startswith(prefix)), "other")
        entry = {"name": fqn, "kind": kind, "dtype": dtype_name(md.properties.dtype), "shape": list(md.size),
                 "bytes": math.prod(md.size) * md.properties.dtype.itemsize, "chunks": len(md.chunks),
                 "stored_bytes": stored.get(fqn, 0)}
        if kind == "model":
            entry["aliases"] = list(manifest.params.get(fqn.removeprefix(MODEL), ((), ()))[1])
        tensors.append(entry)
    model = [t for t in tensors if t["kind"] == "model"]
    plan = manifest.plan
    parent = os.path.dirname(os.path.abspath(directory))
    # a step of a root (ROOT/step-N), or a checkpoint directory of its own (what convert writes)
    root = parent if step_dir(parent, manifest.step) == os.path.abspath(directory) else None
    return {
        "path": directory,
        "format": FORMAT,
        "version": VERSION,
        "step": manifest.step,
        "saved_at": manifest.saved_at,
        "model": manifest.model_name,
        "hf_architectures": (manifest.hf_config or {}).get("architectures"),
        "plan": None if plan is None else {"spec": plan.spec(), "mesh": dataclasses.asdict(plan.mesh)},
        "converted": plan is None,
        "world_size": manifest.world_size,
        "optimizer": ({"class": manifest.optimizer, "param_groups": manifest.param_groups}
                      if manifest.optimizer or manifest.param_groups else None),  # None: weights only
        "extras": sorted(manifest.extras),
        "tensors": tensors,
        "totals": {
            "num_tensors": len(tensors),
            "num_parameters": sum(math.prod(t["shape"]) for t in model),
            "parameter_bytes": sum(t["bytes"] for t in model),
            "optimizer_state_bytes": sum(t["bytes"] for t in tensors if t["kind"] == "optimizer"),
            "stored_bytes": sum(files.values()),
        },
        "files": [{"name": name, "bytes": size} for name, size in sorted(files.items())],
        "root": root,
        "committed_steps": committed_steps(root) if root else [],
        "latest": _latest(root) if root else None,
    }


def _latest(root: str) -> str | None:
    """What the root's `latest` file names (None without one); `resolve_checkpoint` validates it
    when the root itself is what was asked for."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8", errors="replace") as handle:
            return handle.read(256).strip() or None
    except OSError:
        return None


# -- Hugging Face ------------------------------------------------------------------------------------
def describe_hf_directory(directory: str) -> dict[str, Any]:
    """A Hugging Face model directory: its config.json and every safetensors file's header."""
    config_path = os.path.join(directory, "config.json")
    config = load_json_file(config_path, CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: must be a JSON object (a Hugging Face config)")
    names, index = _safetensors_files(directory)
    tensors, files = [], []
    for name in names:
        path = os.path.join(directory, name)
        header = read_safetensors_header(path)
        files.append({"name": name, "bytes": os.path.getsize(path)})
        for tensor, (dtype, shape, nbytes) in header.items():
            if index is not None and index.get(tensor) != name:
                raise CheckpointError(f"{os.path.join(directory, SAFETENSORS_INDEX)}: weight_map places {tensor} in "
                                      f"{index.get(tensor)}, but {name} holds it")
            tensors.append({"name": tensor, "dtype": dtype, "shape": shape, "bytes": nbytes, "file": name})
    if index is not None:
        found = {t["name"] for t in tensors}
        missing = sorted(set(index) - found)
        if missing:
            raise CheckpointError(f"{os.path.join(directory, SAFETENSORS_INDEX)}: weight_map places {missing[0]} in "
                                  f"{index[missing[0]]}, which does not hold it")
    architectures = config.get("architectures")
    return {
        "path": directory,
        "format": HF_FORMAT,
        "architectures": architectures if isinstance(architectures, list) else None,
        "model_type": config.get("model_type") if isinstance(config.get("model_type"), str) else None,
        "config_dtype": next((config[k] for k in ("dtype", "torch_dtype") if isinstance(config.get(k), str)), None),
        "sharded": index is not None,
        "tensors": tensors,
        "totals": {"num_tensors": len(tensors), "num_parameters": sum(math.prod(t["shape"]) for t in tensors),
                   "bytes": sum(t["bytes"] for t in tensors), "stored_bytes": sum(f["bytes"] for f in files)},
        "files": files,
    }


def _safetensors_files(directory: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of a directory, in order, and the index's tensor -> file map (None
    without an index: then every `*.safetensors` file of the directory)."""
    path = os.path.join(directory, SAFETENSORS_INDEX)
    if not os.path.isfile(path):
        return sorted(n for n in os.listdir(directory) if n.endswith(".safetensors")), None
    r = FieldReader(load_json_file(path, CheckpointError), file=path, path="", error=CheckpointError)
    weight_map = r.raw("weight_map")
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(f, str) and f.endswith(".safetensors") and os.path.basename(f) == f
                    for f in weight_map.values())):
        raise r.error("weight_map", "must map each tensor name to a safetensors file of this directory")
    for name in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(directory, name)):
            raise CheckpointError(f"{os.path.join(directory, name)}: missing "
                                  f"({SAFETENSORS_INDEX} places tensors in it)")
    return sorted(set(weight_map.values())), dict(weight_map)


def read_safetensors_header(path: str) -> dict[str, tuple[str, list[int], int]]:
    """name -> (dtype, shape, bytes) of every tensor a safetensors file holds, from its header
    alone, each entry validated and the file's length checked against the bytes it promises."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, not even a safetensors header's length")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file, or truncated: its header would be {length} "
                                  f"bytes, the file has {size}")
        text = handle.read(length)
    try:
        doc = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise CheckpointError(f"{path}: not a safetensors file: its header is not JSON") from None
    r = FieldReader(doc, file=path, path="header", error=CheckpointError)
    out: dict[str, tuple[str, list[int], int]] = {}
    end = 0
    for name in list(doc):
        if name == "__metadata__":
            r.raw(name)
            continue
        t = r.obj(name)
        dtype, itemsize = SAFETENSORS_DTYPES[t.string("dtype", choices=sorted(SAFETENSORS_DTYPES))]
        shape, offsets = t.raw("shape"), t.raw("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise t.error("shape", "must be a list of non-negative integers")
        nbytes = math.prod(shape) * itemsize
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                and offsets[1] - offsets[0] == nbytes):
            raise t.error("data_offsets", f"must be [begin, end] of its {nbytes} bytes")
        t.finish()
        end = max(end, offsets[1])
        out[name] = (dtype, shape, nbytes)
    if 8 + length + end > size:
        raise CheckpointError(f"{path}: truncated: {size} bytes, its tensors need {8 + length + end}")
    return out
