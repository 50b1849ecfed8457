"""Distributed checkpoints of a `ParallelModule` that load under any plan and any world size.

Input: a `ParallelModule` and a checkpoint root directory. Output of `save_checkpoint`:

    ROOT/step-00000006/           one checkpoint, committed by renaming it into place
        mplan.json                manifest: format, step, plan, parameter names and shapes,
                                  optimizer hyperparameters, extras (e.g. a learning-rate schedule)
        dcp.json                  DCP's metadata as JSON (`checkpoint_storage.py`)
        __<rank>_0.distcp         each rank's pieces, written in parallel by torch.distributed.checkpoint
    ROOT/latest                   the name of the newest committed checkpoint

The training state (`checkpoint_state.py`) is keyed by the model's own parameter names, with
every piece described by its offsets in the global tensor, so DCP's load reads into any other
layout: another TP, PP (interleaved too), DP, ZeRO level or EP, another world size, one process.

Atomic: ranks write into `ROOT/.step-N.partial`; after every rank's bytes and the metadata are
written, rank 0 renames it to `ROOT/step-N` and then updates `latest` (write + rename). A crash
at any point leaves the previous checkpoint whole and `latest` naming it; a leftover partial
directory is ignored by loads and removed by the next save of that step. `keep_latest=k` removes
older committed checkpoints after the commit. `background=True` copies the state to CPU memory
on the caller's thread (the stall), then writes and commits on a thread of DCP's async save,
over a gloo group of its own so its collectives never interleave with training's.

Load validates the manifest and the metadata field by field, checks that every data file exists
and is long enough, and checks every tensor's name, shape and dtype against the model before DCP
reads a byte; every rank then exchanges its verdict, so a bad checkpoint is one `CheckpointError`
on every rank at once (none trains on alone). Data files are read with
`torch.load(weights_only=True)`: a pickle where a tensor belongs is refused, never run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import warnings
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from mplan.json_fields import FieldReader, is_finite_number, load_json_file
from mplan.planner.plan import Plan, PlanError
from mplan.runtime.checkpoint_chunks import ChunkLoadPlanner, ChunkSavePlanner, SnapshotStager
from mplan.runtime.checkpoint_state import MODEL, load_targets, saved_state
from mplan.runtime.checkpoint_storage import (
    CheckpointError,
    JsonMetadataReader,
    JsonMetadataWriter,
    check_data_files,
    read_dcp_metadata,
    verify_items,
)
from mplan.runtime.launch import collective_device

if TYPE_CHECKING:
    from mplan.runtime.parallel_module import ParallelModule

FORMAT = "mplan.checkpoint"
VERSION = 2
MANIFEST = "mplan.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d{8,})")
_MESSAGE_BYTES = 1024


class Stateful(Protocol):
    """What `extras` holds: an object with a JSON-serializable state (a learning-rate scheduler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


# -- save ------------------------------------------------------------------------------------------
def save_checkpoint(root: str, pm: ParallelModule, *, background: bool = False, keep_latest: int | None = None,
                    extras: Mapping[str, Stateful] | None = None) -> Future[str]:
    """Save `pm`'s training state as `root/step-<pm.step>` (collective: every rank calls it).
    Returns a future of the committed directory: done on return unless `background`."""
    if keep_latest is not None and keep_latest < 1:
        raise ValueError(f"keep_latest must be at least 1, got {keep_latest}")
    world = dist.group.WORLD if dist.is_initialized() else None
    final = step_dir(root, pm.step)
    partial = os.path.join(root, f".step-{pm.step:08d}.partial")
    error = None
    if pm.groups.rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            _write_json(os.path.join(partial, MANIFEST), _manifest(pm, extras or {}))
        except (OSError, TypeError, ValueError) as exc:
            error = f"{root}: cannot write a checkpoint there ({exc})"
    agree(error, world)  # the directory exists before any rank writes into it
    state = saved_state(pm)
    writer, planner = JsonMetadataWriter(partial, sync_files=True), ChunkSavePlanner()

    def commit() -> str:
        if pm.groups.rank == 0:
            _commit(root, partial, final, keep_latest)
        return final

    if not background:
        with one_process_quietly():
            dcp.save(state, storage_writer=writer, planner=planner, process_group=world, no_dist=world is None)
        commit()
        agree(None, world)  # committed everywhere when save returns
        return _done(final)
    group = pm.checkpoint_group()
    with one_process_quietly():
        upload = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=group,
                                no_dist=world is None, async_stager=SnapshotStager())
    result: Future[str] = Future()

    def finished(done: Future[Any]) -> None:
        try:
            done.result()
            result.set_result(commit())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the save
            result.set_exception(exc)
    upload.add_done_callback(finished)
    return result


def _manifest(pm: ParallelModule, extras: Mapping[str, Stateful]) -> dict[str, Any]:
    groups = []
    for group in pm.optimizer.optimizer.param_groups:
        groups.append({k: list(v) if isinstance(v, tuple) else v for k, v in group.items()
                       if k != "params" and _json_number(v)})
    return {
        "format": FORMAT, "version": VERSION, "step": pm.step, "world_size": pm.plan.mesh_shape().size,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": pm.graph.model_name,
                  "params": {name: {"shape": list(pm.graph.params[name].meta.shape),
                                    "aliases": list(pm.graph.names_of(name)[1:])} for name in pm.layouts}},
        "optimizer": {"class": type(pm.optimizer.optimizer).__name__, "param_groups": groups},
        "extras": {name: obj.state_dict() for name, obj in extras.items()},
        "plan": pm.plan.to_dict(),
        "hf_config": pm.hf_config,
    }


def _json_number(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, (tuple, list)):
        return bool(value) and all(is_finite_number(v) for v in value)
    return is_finite_number(value)


def _write_json(path: str, doc: Any) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1, allow_nan=False)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)


def _commit(root: str, partial: str, final: str, keep_latest: int | None) -> None:
    """Rename the finished partial directory into place, point `latest` at it, prune."""
    replace_directory(partial, final)  # the same step saved again: the new one replaces it
    with open(os.path.join(root, LATEST + ".tmp"), "w", encoding="utf-8") as handle:
        handle.write(os.path.basename(final) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
    if keep_latest is not None:
        for old in committed_steps(root)[:-keep_latest]:
            if step_dir(root, old) != final:
                shutil.rmtree(step_dir(root, old), ignore_errors=True)


@contextlib.contextmanager
def one_process_quietly() -> Iterator[None]:
    """DCP warns on every call without a process group that it assumes one process: that is
    what mplan asked for (`no_dist`), so the warning says nothing to the user. A background
    save warns from DCP's own thread, which a scoped filter does not reach: for that one
    message the filter is installed for the process."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    yield


def replace_directory(partial: str, final: str) -> None:
    """Put the finished directory `partial` at `final` by renames: an existing `final` is moved
    aside first and removed after, so at every moment one whole directory holds the name or none."""
    if os.path.exists(final):
        trash = final + ".replaced"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(partial, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(partial, final)


def _done(path: str) -> Future[str]:
    future: Future[str] = Future()
    future.set_result(path)
    return future


def committed_steps(root: str) -> list[int]:
    """Steps of the committed checkpoints under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.fullmatch, os.listdir(root))
                  if m and os.path.isfile(os.path.join(root, m.group(0), MANIFEST)))


# -- load ------------------------------------------------------------------------------------------
def is_hf_directory(path: str) -> bool:
    """A Hugging Face model directory (config.json and safetensors weights), not an mplan checkpoint."""
    return (os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, MANIFEST))
            and any(name.endswith(".safetensors") or name.endswith(".safetensors.index.json")
                    for name in os.listdir(path)))


def resolve_checkpoint(path: str) -> str:
    """The checkpoint directory `path` names: itself, or the one its `latest` file names (else the
    newest committed step below it)."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8", errors="replace") as handle:
            name = handle.read(256).strip()
        if not _STEP_DIR.fullmatch(name):
            raise CheckpointError(f"{latest}: must name a checkpoint directory step-<number>, got {name[:40]!r}")
        if not os.path.isfile(os.path.join(path, name, MANIFEST)):
            raise CheckpointError(f"{latest}: names {name}, which holds no {MANIFEST}")
        return os.path.join(path, name)
    steps = committed_steps(path)
    if steps:
        return step_dir(path, steps[-1])
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such directory")
    raise CheckpointError(f"{path}: holds no mplan checkpoint ({MANIFEST}, or step-N directories with one)")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The validated `mplan.json` of a checkpoint."""

    step: int
    world_size: int
    model_name: str
    params: dict[str, tuple[tuple[int, ...], tuple[str, ...]]]
    """name -> (global shape, tied aliases)"""
    optimizer: str
    param_groups: list[dict[str, Any]]
    extras: dict[str, Any]
    plan: Plan | None
    """None for a checkpoint converted from another format (no plan wrote it)"""
    saved_at: str
    hf_config: dict[str, Any] | None
    """The Hugging Face config of the model, where it has one (what `format="hf"` writes)"""


def read_manifest(directory: str) -> Manifest:
    """The manifest of a checkpoint directory, validated field by field (`CheckpointError`)."""
    path = os.path.join(directory, MANIFEST)
    r = FieldReader(load_json_file(path, CheckpointError), file=path, path="", error=CheckpointError)
    if r.string("format") != FORMAT:
        raise r.error("format", f"must be {FORMAT!r}")
    if r.integer("version") != VERSION:
        raise r.error("version", f"must be {VERSION} (this mplan's checkpoint version)")
    model, optimizer = r.obj("model"), r.obj("optimizer")
    params = {}
    listed = model.obj("params")
    raw = model.raw("params")
    for name in list(raw):
        p = listed.obj(name)
        shape, aliases = p.raw("shape"), p.raw("aliases")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise p.error("shape", "must be a list of non-negative integers")
        if not (isinstance(aliases, list) and all(isinstance(a, str) for a in aliases)):
            raise p.error("aliases", "must be a list of names")
        p.finish()
        params[name] = (tuple(shape), tuple(aliases))
    groups = optimizer.raw("param_groups")
    if not (isinstance(groups, list) and all(isinstance(g, dict) and all(_json_number(v) for v in g.values())
                                             for g in groups)):
        raise optimizer.error("param_groups", "must be a list of objects of numbers")
    extras = r.raw("extras")
    if not isinstance(extras, dict):
        raise r.error("extras", "must be an object")
    plan = None
    if r.has("plan"):
        try:
            plan = Plan.from_dict(r.raw("plan"), file=f"{path}: plan")
        except PlanError as exc:
            raise CheckpointError(str(exc)) from None
    hf_config = r.raw("hf_config") if r.has("hf_config") else None
    if hf_config is not None and not isinstance(hf_config, dict):
        raise r.error("hf_config", "must be an object (a Hugging Face config) or null")
    doc = Manifest(step=r.integer("step", minimum=0), world_size=r.integer("world_size"),
                   model_name=model.string("name"), params=params, optimizer=optimizer.string("class"),
                   param_groups=groups, extras=extras, plan=plan, saved_at=r.string("saved_at"),
                   hf_config=hf_config)
    model.finish()
    optimizer.finish()
    r.finish()
    return doc


def load_checkpoint(path: str, pm: ParallelModule, *, extras: Mapping[str, Stateful] | None = None) -> str:
    """Load the checkpoint `path` names into `pm`, resharding to its plan (collective). Returns
    the directory loaded."""
    world = dist.group.WORLD if dist.is_initialized() else None
    directory, error, targets, manifest = path, None, None, None
    try:
        directory = resolve_checkpoint(path)
        manifest = read_manifest(directory)
        metadata = read_dcp_metadata(directory)
        check_data_files(directory, metadata)
        _check_model(directory, manifest, metadata, pm)
        _check_groups(directory, manifest, pm)
        missing = sorted(set(extras or {}) - set(manifest.extras))
        if missing:
            raise CheckpointError(f"{directory}: holds no state for {missing[0]!r} (it has {sorted(manifest.extras)})")
        targets = load_targets(pm, metadata, directory)
    except CheckpointError as exc:
        error = str(exc)
    agree(error, world)
    assert targets is not None and manifest is not None
    try:
        with one_process_quietly():
            dcp.load(targets.state, storage_reader=_NamingReader(directory), planner=ChunkLoadPlanner(),
                     process_group=world, no_dist=world is None)
    except dcp.api.CheckpointException as exc:
        raise CheckpointError(_first_failure(directory, exc)) from None
    targets.finish()
    for key, value in targets.rng.items():
        if key.endswith("/cpu"):
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value, pm.device)
    for group, saved in zip(pm.optimizer.optimizer.param_groups, manifest.param_groups):
        for key, value in saved.items():
            live = group.get(key)
            group[key] = type(live)(value) if isinstance(live, tuple) else value
    for name, obj in (extras or {}).items():
        obj.load_state_dict(manifest.extras[name])
    pm.step = manifest.step
    return directory


def _check_model(directory: str, manifest: Manifest, metadata: Any, pm: ParallelModule) -> None:
    """Every saved parameter is one of this model's, under its name or a tied alias."""
    ours = {alias for name in pm.layouts for alias in pm.graph.names_of(name)}
    foreign = sorted(k.removeprefix(MODEL) for k in metadata.state_dict_metadata
                     if k.startswith(MODEL) and k.removeprefix(MODEL) not in ours)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise CheckpointError(f"{directory}: holds parameter {foreign[0]}{more}, which this model "
                              f"({pm.graph.model_name}) does not have: a checkpoint of another model?")
    for name in pm.layouts:
        shape = tuple(pm.graph.params[name].meta.shape)
        for alias in pm.graph.names_of(name):
            if alias in manifest.params and manifest.params[alias][0] != shape:
                raise CheckpointError(f"{directory}: {alias} has shape {manifest.params[alias][0]}, "
                                      f"this model's is {shape}")


def _check_groups(directory: str, manifest: Manifest, pm: ParallelModule) -> None:
    if not manifest.optimizer:  # weights only (converted from Hugging Face): the optimizer starts fresh
        return
    live = pm.optimizer.optimizer
    if type(live).__name__ != manifest.optimizer:
        raise CheckpointError(f"{directory}: was saved with optimizer {manifest.optimizer}, this job runs "
                              f"{type(live).__name__}")
    if len(live.param_groups) != len(manifest.param_groups):
        raise CheckpointError(f"{directory}: has {len(manifest.param_groups)} optimizer parameter groups, "
                              f"this job's optimizer {len(live.param_groups)}")


class _NamingReader(JsonMetadataReader):
    """Reads file by file, so that a file that fails (corrupt bytes, a pickle where a tensor
    belongs) is named in the error."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            one_file = dataclasses.replace(plan, items=items)
            verify_items(str(self.path), one_file, self.storage_data)  # CheckpointError naming the file
            try:
                super().read_data(one_file, planner).wait()
            except Exception as exc:  # noqa: BLE001 - any failure to read a file is that file's
                what = ("holds something other than the tensors mplan writes (torch refused to "
                        "unpickle it; mplan never unpickles)" if "weights_only" in str(exc).lower()
                        or "unpickl" in str(exc).lower() else f"is corrupt ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:120] if str(exc) else ''})")
                raise CheckpointError(f"{os.path.join(str(self.path), name)}: {what}") from None
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done  # type: ignore[return-value]


def _first_failure(directory: str, exc: Any) -> str:
    """One line for DCP's gathered failures: the first rank's own `CheckpointError`, else what it raised."""
    failures = getattr(exc, "failures", {}) or {}
    for rank in sorted(failures):
        inner = failures[rank]
        if isinstance(inner, tuple):  # torch 2.13: (exception, its stack summary)
            inner = inner[0]
        if isinstance(inner, CheckpointError):
            return str(inner)
        text = str(inner).splitlines()[0][:200] if str(inner) else ""
        return f"{directory}: rank {rank} could not read its pieces ({type(inner).__name__}: {text})"
    return f"{directory}: load failed: {exc}"


def read_tensors(directory: str, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors of a checkpoint directory (all, or those `names` lists), read in this process
    alone (no process group): what `mplan checkpoint` inspects and converts."""
    metadata = read_dcp_metadata(directory)
    check_data_files(directory, metadata)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        params = read_manifest(directory).params
        for key, md in metadata.state_dict_metadata.items():
            name = key.removeprefix(MODEL)
            if key.startswith(MODEL) and name in params and tuple(md.size) != params[name][0]:
                raise CheckpointError(f"{directory}/dcp.json: {key} has size {list(md.size)}, but {MANIFEST} "
                                      f"says {list(params[name][0])}")
    wanted = metadata.state_dict_metadata if names is None else {n: metadata.state_dict_metadata[n] for n in names}
    out = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in wanted.items()}
    try:
        with one_process_quietly():
            dcp.load(out, storage_reader=_NamingReader(directory), planner=ChunkLoadPlanner(), no_dist=True)
    except dcp.api.CheckpointException as exc:
        raise CheckpointError(_first_failure(directory, exc)) from None
    return out


# -- agreement -------------------------------------------------------------------------------------
def agree(error: str | None, world: dist.ProcessGroup | None) -> None:
    """Every rank's verdict, exchanged: raise `CheckpointError` on every rank if any rank has one
    (its own message, else the first failing rank's, named). A collective over `world`."""
    if world is None or world.size() == 1:
        if error is not None:
            raise CheckpointError(error)
        return
    text = (error or "").encode()[:_MESSAGE_BYTES]
    mine = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.uint8, device=collective_device(world))
    mine[0] = error is not None
    mine[1:1 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    every = [torch.zeros_like(mine) for _ in range(world.size())]
    dist.all_gather(every, mine, group=world)
    if error is not None:
        raise CheckpointError(error)
    for rank, reported in enumerate(every):
        if int(reported[0]):
            message = bytes(reported[1:].cpu().tolist()).rstrip(b"\0").decode(errors="replace")
            raise CheckpointError(f"rank {rank}: {message}")
