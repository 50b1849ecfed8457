"""Hugging Face model directories in and out of a `ParallelModule`, and conversion between them
and mplan checkpoints.

Input: a local Hugging Face directory (config.json, then model.safetensors, or shards
`model-0000k-of-0000n.safetensors` listed by model.safetensors.index.json), or a ParallelModule
under any plan. Output of `load_hf`: the module's parameters, each rank having read only its own
slices (`safe_open(...).get_slice(key)[...]` at the offsets `param_region` gives); of `save_hf`:
a directory `transformers.AutoModelForCausalLM.from_pretrained` loads; of `convert_checkpoint`:
either format from the other, in one process.

Where each parameter sits in the files is `mplan.models.hf_names.hf_layout`'s answer: the
transformers model's own names (through transformers' conversion mapping, so Mixtral's experts
are read from and written as `block_sparse_moe.experts.{e}.w1.weight`, as `save_pretrained`
writes them), or for mplan's families the matching architecture (llama -> Llama, moe -> Mixtral,
gpt -> GPT-2). A tied parameter is stored once, under the name transformers keeps, and is found
under any of its names.

Load: every rank reads config.json, the index and every file's safetensors header, and checks
them before any byte of a tensor is read: the index (JSON, every file it names present and a
safetensors file holding what it says), every tensor the model needs present with its shape and
a floating dtype, no tensor the model does not have (another model's weights); safetensors
parses headers itself, so nothing is ever unpickled (a pickle where a shard belongs is named as
one). The verdicts are exchanged (`agree`): a bad directory is one `CheckpointError` naming the
file, on every rank at once. Weights are cast to each parameter's dtype (published weights are
often bfloat16; a float64 model then holds bfloat16 values exactly). Only parameters come in:
the optimizer state starts fresh (emptied, as right after `autoparallel`; the step count is left
as it is), ZeRO-1's masters and compute copies are re-derived from the loaded weights
(`params_loaded`). The names are those of the module's own config (`pm.hf_config`; the
directory's for one of mplan's families that has none), so another model's tensors are named as
such; the model types must agree. The directory's config and file split are then remembered on
the module (`pm.hf_config`, `pm.hf_file_split`) for `save_hf`.

Save (collective): every parameter is gathered whole in turn (its TP and EP pieces, sent from the
pipeline stage that owns it); each file is written by one rank (files spread over the ranks by
size), which keeps only its own files' tensors: peak memory one parameter plus that rank's files.
The source's file split is kept when the module was loaded from a Hugging Face directory with
the same tensors, else one file, or shards of at most `max_shard_bytes`. Atomic as mplan's own
format: written into `.NAME.partial` beside the directory and renamed into place once every rank
is done; files of an existing directory that are not weights or config (a tokenizer) are kept.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mplan.json_fields import load_json_file
from mplan.models.hf_names import FAMILY_ARCHITECTURES, HfLayout, Link, NotMappable, hf_layout, hf_parameters
from mplan.runtime.checkpoint import FORMAT, MANIFEST, VERSION, agree, is_hf_directory, one_process_quietly, \
    read_manifest, read_tensors, replace_directory, resolve_checkpoint
from mplan.runtime.checkpoint_chunks import ChunkSavePlanner
from mplan.runtime.checkpoint_state import MODEL, param_region
from mplan.runtime.checkpoint_storage import CheckpointError, JsonMetadataWriter, read_dcp_metadata

if TYPE_CHECKING:
    from mplan.runtime.parallel_module import ParallelModule

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""safetensors' dtype names"""
Shape = tuple[int, ...]


# -- reading a directory ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class HfDirectory:
    """A Hugging Face model directory's config and tensors, its headers read and checked."""

    path: str
    config: dict[str, Any]
    split: dict[str, str]
    """tensor -> the file holding it (a name in `path`)"""
    shapes: dict[str, Shape]
    dtypes: dict[str, str]
    """tensor -> safetensors dtype (`BF16`)"""
    listing: str
    """the file that lists the tensors (the index, or the single file): what a missing one is reported against"""


def read_hf_directory(path: str) -> HfDirectory:
    """config.json, the index and every safetensors header of `path`, validated (`CheckpointError`
    naming the file); no tensor data is read."""
    config_path = os.path.join(path, CONFIG)
    config = load_json_file(config_path, CheckpointError)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CheckpointError(f"{config_path}: must be a JSON object with a \"model_type\" (a Hugging Face config)")
    single, index = os.path.join(path, SINGLE), os.path.join(path, INDEX)
    if os.path.isfile(single):
        listing, wanted = single, None
    elif os.path.isfile(index):
        listing, wanted = index, _read_index(index)
    else:
        raise CheckpointError(f"{path}: holds neither {SINGLE} nor {INDEX}")
    files = sorted(set(wanted.values())) if wanted is not None else [SINGLE]
    split: dict[str, str] = {}
    shapes: dict[str, Shape] = {}
    dtypes: dict[str, str] = {}
    for name in files:
        for key, (shape, dtype) in _read_header(os.path.join(path, name)).items():
            if wanted is not None and wanted.get(key) != name:
                continue  # transformers reads what the index places there, nothing else
            split[key], shapes[key], dtypes[key] = name, shape, dtype
    for key, name in (wanted or {}).items():
        if key not in split:
            raise CheckpointError(f"{listing}: places {key} in {name}, which does not hold it")
    order = sorted(split)
    return HfDirectory(path=path, config=config, split={k: split[k] for k in order}, shapes=shapes, dtypes=dtypes,
                       listing=listing)


def _read_index(index: str) -> dict[str, str]:
    doc = load_json_file(index, CheckpointError)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: must be a JSON object whose \"weight_map\" maps tensor names to files")
    if "metadata" in doc and not isinstance(doc["metadata"], dict):
        raise CheckpointError(f"{index}: \"metadata\" must be an object")
    directory = os.path.dirname(index)
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name.endswith(".safetensors") or os.path.basename(name) != name \
                or name.startswith("."):
            raise CheckpointError(f"{index}: weight_map.{key} must name a .safetensors file in the directory, "
                                  f"got {str(name)[:60]!r}")
        if not os.path.isfile(os.path.join(directory, name)):
            raise CheckpointError(f"{index}: names {name} (for {key}), which does not exist")
    return weight_map


def _read_header(path: str) -> dict[str, tuple[Shape, str]]:
    """Every tensor's shape and dtype in a safetensors file (its header only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            out = {}
            for key in handle.keys():
                piece = handle.get_slice(key)
                out[key] = (tuple(piece.get_shape()), piece.get_dtype())
            return out
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: {_not_safetensors(path, exc)}") from None


def _not_safetensors(path: str, exc: Exception) -> str:
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError:
        head = b""
    if head[:2] == b"PK" or head[:1] == b"\x80":
        return ("is a pickle (torch.save), not safetensors: mplan never unpickles; convert it with the tool "
                "that wrote it")
    text = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
    return f"is not a readable safetensors file, truncated or corrupt ({text})"


# -- matching a directory with a model --------------------------------------------------------------
def _choose_forms(source: HfDirectory, layout: HfLayout, model_name: str) -> dict[str, tuple[Link, ...]]:
    """For every parameter, the form the directory holds it in (checked: shapes, dtypes), and no
    tensor the model does not have."""
    chosen = {}
    for name, forms in layout.accepted.items():
        form = next((f for f in forms if all(link.key in source.shapes for link in f)), None)
        if form is None:
            missing = next(link.key for link in forms[0] if link.key not in source.shapes)
            raise CheckpointError(f"{source.listing}: has no tensor {missing} (parameter {name} of this model)")
        for link in form:
            expected = layout.shapes.get(link.key)
            found = source.shapes[link.key]
            if expected is not None and found != expected:
                raise CheckpointError(f"{os.path.join(source.path, source.split[link.key])}: {link.key} has shape "
                                      f"{list(found)}, this model's {name} needs {list(expected)}")
            kind = source.dtypes[link.key]
            if kind not in DTYPES or not DTYPES[kind].is_floating_point:
                what = "not a floating-point tensor" if kind in DTYPES else "a dtype mplan does not read"
                raise CheckpointError(f"{os.path.join(source.path, source.split[link.key])}: {link.key} is "
                                      f"{kind}, {what}")
        chosen[name] = form
    known = {link.key for forms in layout.accepted.values() for form in forms for link in form}
    for key in source.split:
        if key not in known and not any(re.search(p, key) for p in layout.ignored):
            raise CheckpointError(f"{os.path.join(source.path, source.split[key])}: holds {key}, which this model "
                                  f"({model_name}) does not have: another model's weights?")
    return chosen


def _layout(model_name: str, params: Mapping[str, Shape], aliases: Mapping[str, Sequence[str]],
            config: Mapping[str, Any] | None, where: str) -> HfLayout:
    if config is None:
        family = FAMILY_ARCHITECTURES.get(model_name)
        hint = (f"; mplan's {model_name} exports as {family} once its config is recorded: pm.hf_config = "
                f"mplan.models.hf_names.hf_config(model.config), which says why where there is no equivalent"
                if family else "")
        raise CheckpointError(f"{where}: this model ({model_name}) has no Hugging Face config to write{hint}")
    try:
        return hf_layout(model_name, params, aliases, config)
    except NotMappable as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - transformers refusing the config: its words, one line
        raise CheckpointError(f"{where}: transformers cannot build the model this config describes "
                              f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None


def _pm_layout(pm: ParallelModule, config: Mapping[str, Any] | None, where: str) -> HfLayout:
    params = {name: tuple(pm.graph.params[name].meta.shape) for name in pm.layouts}
    aliases = {name: pm.graph.names_of(name)[1:] for name in pm.layouts}
    return _layout(pm.graph.model_name, params, aliases, config, where)


# -- rectangles ------------------------------------------------------------------------------------
def _overlap(link: Link, at: Sequence[int], size: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """The part of `link`'s parameter rectangle inside the rectangle (`at`, `size`): (start, stop) per dim."""
    lo = [max(a, b) for a, b in zip(link.at, at)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(link.at, link.size, at, size)]
    return None if any(h <= low for low, h in zip(lo, hi)) else (lo, hi)


def _key_slices(link: Link, lo: Sequence[int], hi: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(link.key_at[j] + lo[d] - link.at[d], link.key_at[j] + hi[d] - link.at[d])
                 for j, d in enumerate(link.dims))


def _order(link: Link) -> list[int]:
    """Parameter dims with the file tensor's first (in its order), then the dims it drops."""
    return [*link.dims, *(d for d in range(len(link.at)) if d not in link.dims)]


def _read_slice(handles: dict[str, Any], stack: contextlib.ExitStack, path: str, link: Link, lo: Sequence[int],
                hi: Sequence[int]) -> torch.Tensor:
    """The part [lo, hi) of `link`'s parameter rectangle, read from its file tensor alone (the
    file opened once per `handles`); a file safetensors cannot read is one CheckpointError."""
    from safetensors import SafetensorError, safe_open

    try:
        if path not in handles:
            handles[path] = stack.enter_context(safe_open(path, framework="pt"))
        return handles[path].get_slice(link.key)[_key_slices(link, lo, hi)]
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: {_not_safetensors(path, exc)}") from None


def _to_param(piece: torch.Tensor, link: Link, extent: Sequence[int]) -> torch.Tensor:
    """A file tensor's rectangle laid out as the parameter's rectangle of `extent`."""
    order = _order(link)
    moved = piece.reshape([extent[d] for d in order])
    return moved.permute([order.index(d) for d in range(len(order))])


def _to_key(whole: torch.Tensor, link: Link) -> torch.Tensor:
    """Link's rectangle of the parameter `whole`, laid out as the file tensor's rectangle."""
    rect = whole[tuple(slice(a, a + n) for a, n in zip(link.at, link.size))]
    return rect.permute(_order(link)).reshape(link.key_size)


# -- load ------------------------------------------------------------------------------------------
def load_hf(directory: str, pm: ParallelModule) -> None:
    """Load a Hugging Face directory's weights into `pm` (collective: every rank calls it), each
    rank reading its own slices."""
    world = dist.group.WORLD if dist.is_initialized() else None
    error, source, chosen = None, None, None
    try:
        source = read_hf_directory(directory)
        _same_model_type(pm.hf_config, source)
        # the names this model's weights go by: its own config's, else (one of mplan's families
        # without one) the directory's
        layout = _pm_layout(pm, pm.hf_config or source.config, os.path.join(directory, CONFIG))
        chosen = _choose_forms(source, layout, pm.graph.model_name)
    except CheckpointError as exc:
        error = str(exc)
    agree(error, world)
    assert source is not None and chosen is not None
    try:
        _read_slices(pm, source, chosen)
    except CheckpointError as exc:
        error = str(exc)
    agree(error, world)
    pm.optimizer.optimizer.state.clear()  # moments of other weights: a pretrained model starts fresh
    pm.optimizer.params_loaded()
    pm.hf_config = source.config
    setattr(pm, "hf_file_split", dict(source.split))  # noqa: B010 - save_hf keeps it; not a ParallelModule field


def _same_model_type(ours: Mapping[str, Any] | None, source: HfDirectory) -> None:
    if ours is not None and ours.get("model_type") != source.config["model_type"]:
        raise CheckpointError(f"{os.path.join(source.path, CONFIG)}: describes a {source.config['model_type']} "
                              f"model, this one is a {ours.get('model_type')}")


@torch.no_grad()
def _read_slices(pm: ParallelModule, source: HfDirectory, chosen: Mapping[str, tuple[Link, ...]]) -> None:
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for name, param in pm.params.items():
            shape, offsets = param_region(pm, name)
            local = tuple(param.shape)
            filled = 0
            for link in chosen[name]:
                inside = _overlap(link, offsets, local)
                if inside is None:
                    continue
                lo, hi = inside
                piece = _read_slice(handles, stack, os.path.join(source.path, source.split[link.key]), link, lo, hi)
                extent = [h - low for low, h in zip(lo, hi)]
                target = param[tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))]
                target.copy_(_to_param(piece, link, extent))
                filled += target.numel()
            if filled != param.numel():
                raise CheckpointError(f"{source.path}: filled {filled} of the {param.numel()} elements of this "
                                      f"rank's {name} (global {list(shape)})")


# -- save ------------------------------------------------------------------------------------------
def save_hf(directory: str, pm: ParallelModule, *, max_shard_bytes: int | None = None) -> None:
    """Write `pm`'s parameters as a Hugging Face directory (collective: every rank calls it;
    when it returns on any rank the directory is complete)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    rank, size = (dist.get_rank(), dist.get_world_size()) if world is not None else (0, 1)
    partial = _partial(directory)
    error, layout, files, nbytes = None, None, None, {}
    try:
        _check_shard_bytes(max_shard_bytes)
        layout = _pm_layout(pm, pm.hf_config, directory)
        # sizes from the capture's dtypes: the same on every rank, which must agree on the split
        dtype = {link.key: pm.graph.params[name].meta.dtype for name, links in layout.stored.items() for link in links}
        nbytes = {key: math.prod(layout.shapes[key]) * _itemsize(dtype[key]) for key in dtype}
        files = _file_split(layout, getattr(pm, "hf_file_split", None), max_shard_bytes, nbytes)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
    except (CheckpointError, OSError) as exc:
        error = str(exc) if isinstance(exc, CheckpointError) else f"{directory}: cannot write there ({exc})"
    agree(error, world)
    assert layout is not None and files is not None
    owners = _spread([sum(nbytes[k] for k in keys) for _, keys in files], size)
    writer = _Writer(layout, files, partial, mine={f for (f, _), r in zip(files, owners) if r == rank})
    for name in writer.order():
        whole = pm.whole_parameter(name)  # collective: a rank that failed to write still takes part
        if error is None:
            try:
                writer.add(name, whole)
            except (CheckpointError, OSError) as exc:
                error = str(exc) if isinstance(exc, CheckpointError) else f"{partial}: cannot write there ({exc})"
    if error is None:
        try:
            writer.check_done()
        except CheckpointError as exc:
            error = str(exc)
    agree(error, world)
    if rank == 0:
        try:
            _write_metadata(partial, layout, files, writer.dtype_name())
            _commit(partial, directory)
        except OSError as exc:
            error = f"{directory}: cannot write there ({exc})"
    agree(error, world)  # complete everywhere when save_hf returns


def _check_shard_bytes(max_shard_bytes: int | None) -> None:
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1):
        raise CheckpointError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")


def _file_split(layout: HfLayout, source: Mapping[str, str] | None, max_shard_bytes: int | None,
                nbytes: Mapping[str, int]) -> list[tuple[str, list[str]]]:
    """(file name, its tensors) of the directory to write: the source's split where it holds these
    tensors, else one file, or shards of at most `max_shard_bytes` (a larger tensor alone)."""
    keys = list(dict.fromkeys(link.key for links in layout.stored.values() for link in links))
    if source is not None and set(source) == set(keys):
        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(source[key], []).append(key)
        return sorted(by_file.items())
    if max_shard_bytes is None:
        return [(SINGLE, keys)]
    shards: list[list[str]] = [[]]
    used = 0
    for key in keys:
        if shards[-1] and used + nbytes[key] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += nbytes[key]
    if len(shards) == 1:
        return [(SINGLE, keys)]
    return [(f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors", shard) for k, shard in enumerate(shards)]


def _spread(sizes: Sequence[int], ranks: int) -> list[int]:
    """A rank per file: largest first, each to the least loaded rank (the lowest on ties)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        owner[k] = min(range(ranks), key=lambda r: (load[r], r))
        load[owner[k]] += sizes[k]
    return owner


class _Writer:
    """Assembles the tensors of this rank's files from whole parameters and writes each file as
    soon as it is complete."""

    def __init__(self, layout: HfLayout, files: Sequence[tuple[str, Sequence[str]]], directory: str,
                 mine: set[str]) -> None:
        self.layout, self.files, self.directory, self.mine = layout, files, directory, mine
        self.file_of = {key: name for name, keys in files for key in keys}
        self.pending = {name: set(keys) for name, keys in files if name in mine}
        self.left = {key: math.prod(layout.shapes[key]) for name in self.pending for key in self.pending[name]}
        self.buffers: dict[str, torch.Tensor] = {}
        self.dtypes: list[torch.dtype] = []

    def order(self) -> list[str]:
        """Parameters in the order of their files (the same on every rank), so files finish early."""
        rank = {name: k for k, (name, _) in enumerate(self.files)}
        return sorted(self.layout.stored, key=lambda p: min(rank[self.file_of[link.key]]
                                                            for link in self.layout.stored[p]))

    def add(self, name: str, whole: torch.Tensor) -> None:
        for link in self.layout.stored[name]:
            file = self.file_of[link.key]
            if file not in self.pending:
                continue
            if link.key not in self.buffers:
                self.buffers[link.key] = torch.empty(self.layout.shapes[link.key], dtype=whole.dtype)
                self.dtypes.append(whole.dtype)
            block = self.buffers[link.key][tuple(slice(a, a + n) for a, n in zip(link.key_at, link.key_size))]
            block.copy_(_to_key(whole, link))
            self.left[link.key] -= block.numel()
            if self.left[link.key] == 0:
                self.pending[file].discard(link.key)
                if not self.pending[file]:
                    self._write(file)

    def _write(self, file: str) -> None:
        from safetensors.torch import save_file

        keys = [key for name, keys in self.files if name == file for key in keys]
        tensors = {key: self.buffers.pop(key) for key in keys}
        path = os.path.join(self.directory, file)
        save_file(tensors, path, metadata={"format": "pt"})
        _fsync(path)
        del self.pending[file]

    def check_done(self) -> None:
        if self.pending:
            file, keys = next(iter(self.pending.items()))
            raise CheckpointError(f"{os.path.join(self.directory, file)}: {sorted(keys)[0]} was never filled "
                                  f"(this model's parameters do not cover it)")

    def dtype_name(self) -> str | None:
        return str(self.dtypes[0]).removeprefix("torch.") if self.dtypes else None


def _write_metadata(directory: str, layout: HfLayout, files: Sequence[tuple[str, Sequence[str]]],
                    dtype: str | None) -> None:
    """config.json and (for several files) the index, with every tensor's file and the total size."""
    config = dict(layout.config)
    if dtype is not None:
        config["dtype"] = dtype
    _write_json(os.path.join(directory, CONFIG), config)
    if [name for name, _ in files] == [SINGLE]:
        return
    total_size = total_parameters = 0
    weight_map = {}
    for name, keys in files:
        path = os.path.join(directory, name)
        for key, (shape, kind) in _read_header(path).items():
            weight_map[key] = name
            total_parameters += math.prod(shape)
            total_size += math.prod(shape) * _itemsize(DTYPES[kind])
    _write_json(os.path.join(directory, INDEX), {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items()))})


def _partial(directory: str) -> str:
    path = os.path.abspath(directory)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")


def _commit(partial: str, directory: str) -> None:
    """Rename the finished directory into place; an existing one's other files (a tokenizer) move over."""
    if os.path.isdir(directory):
        for entry in os.listdir(directory):
            if entry == CONFIG or entry.endswith(".safetensors") or entry.endswith(".safetensors.index.json") \
                    or os.path.exists(os.path.join(partial, entry)):
                continue
            os.replace(os.path.join(directory, entry), os.path.join(partial, entry))
    replace_directory(partial, directory)


# -- conversion ------------------------------------------------------------------------------------
def convert_checkpoint(src: str, dst: str, *, max_shard_bytes: int | None = None) -> str:
    """An mplan checkpoint (a step's directory or a root) as a Hugging Face directory, or a
    Hugging Face directory as an mplan checkpoint (step 0, weights only, `plan` null): one
    process, no process group; every tensor exact (same dtype, same values). Returns `dst`."""
    if os.path.exists(dst):
        raise CheckpointError(f"{dst}: exists; convert writes a new directory")
    if is_hf_directory(src):
        _hf_to_mplan(src, dst)
    else:
        _mplan_to_hf(src, dst, max_shard_bytes)
    return dst


def _mplan_to_hf(src: str, dst: str, max_shard_bytes: int | None) -> None:
    _check_shard_bytes(max_shard_bytes)
    directory = resolve_checkpoint(src)
    manifest = read_manifest(directory)
    params = {name: shape for name, (shape, _) in manifest.params.items()}
    aliases = {name: names for name, (_, names) in manifest.params.items()}
    layout = _layout(manifest.model_name, params, aliases, manifest.hf_config, directory)
    saved = read_dcp_metadata(directory).state_dict_metadata
    stored = {}  # parameter -> the name the checkpoint holds it under (its own or a tied alias)
    for name in params:
        stored[name] = next((n for n in (name, *aliases[name]) if MODEL + n in saved), None)
        if stored[name] is None:
            raise CheckpointError(f"{directory}: holds no tensor for parameter {name}")
    dtype = {link.key: saved[MODEL + stored[name]].properties.dtype
             for name, links in layout.stored.items() for link in links}
    nbytes = {key: math.prod(layout.shapes[key]) * _itemsize(dtype[key]) for key in dtype}
    files = _file_split(layout, None, max_shard_bytes, nbytes)
    partial = _partial(dst)
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    writer = _Writer(layout, files, partial, mine={name for name, _ in files})
    done: set[str] = set()
    for file, _ in files:  # one file's parameters in memory at a time (and the others they fill)
        names = [p for p in writer.order() if p not in done
                 and any(writer.file_of[link.key] == file for link in layout.stored[p])]
        tensors = read_tensors(directory, [MODEL + stored[name] for name in names])
        for name in names:
            writer.add(name, tensors[MODEL + stored[name]])
        done.update(names)
    writer.check_done()
    _write_metadata(partial, layout, files, writer.dtype_name())
    os.replace(partial, dst)


def _hf_to_mplan(src: str, dst: str) -> None:
    source = read_hf_directory(src)
    where = os.path.join(src, CONFIG)
    try:
        architecture, params, aliases = hf_parameters(source.config)
    except NotMappable as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    layout = _layout(architecture, params, aliases, source.config, where)
    chosen = _choose_forms(source, layout, architecture)
    state = {}
    for name, shape in params.items():
        first = chosen[name][0].key
        state[name] = torch.empty(shape, dtype=DTYPES[source.dtypes[first]])
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for name, tensor in state.items():
            for link in chosen[name]:
                lo, hi = list(link.at), [a + n for a, n in zip(link.at, link.size)]
                piece = _read_slice(handles, stack, os.path.join(src, source.split[link.key]), link, lo, hi)
                tensor[tuple(slice(a, b) for a, b in zip(lo, hi))].copy_(_to_param(piece, link, link.size))
    partial = _partial(dst)
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    with one_process_quietly():
        dcp.save({MODEL + name: t for name, t in state.items()}, storage_writer=JsonMetadataWriter(partial),
                 planner=ChunkSavePlanner(), no_dist=True)
    _write_json(os.path.join(partial, MANIFEST), {
        "format": FORMAT, "version": VERSION, "step": 0, "world_size": 1,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": architecture, "params": {name: {"shape": list(shape), "aliases": list(aliases[name])}
                                                   for name, shape in params.items()}},
        "optimizer": {"class": "", "param_groups": []},
        "extras": {}, "plan": None, "hf_config": source.config})
    os.replace(partial, dst)


# -- small helpers ---------------------------------------------------------------------------------
def _itemsize(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def _write_json(path: str, doc: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=2, sort_keys=True, allow_nan=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _fsync(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
