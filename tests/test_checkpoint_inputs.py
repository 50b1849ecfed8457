"""Bad checkpoints are refused in one line on every rank at once, and nothing is unpickled (issue 31, item 5).

Input: a tiny GPT in float64 trained one step under dp=2,zero=1 on ONE gloo group of 2 ranks and
saved (`pm.save`): two data files, each rank's optimizer shard in its own; two other models'
checkpoints (tiny-llama: other parameter names; a GPT of hidden 64: the same names, other
shapes). Each case of CASES copies the good checkpoint and breaks it one way: a truncated or
missing data file, bytes flipped in a data file (in an item's zip header; in a tensor's bytes), a
plain pickle and a `torch.save` of a Python object in place of `__0_0.distcp` (their payload
opens a marker file when unpickled), `dcp.json` and `mplan.json` malformed (not JSON; a wrong
field; a storage entry naming a file outside the directory; a tensor's chunks covering half of
it; rank 0's random generator state of another dtype or length), a parameter the model has left
out, optimizer state left out for one parameter, another model's checkpoint, a `latest` naming a
missing step, a directory holding no checkpoint, a path that does not exist.
Asserted, on both ranks and in one process: `pm.load` raises `CheckpointError` whose message is
one line naming the file or key and what is wrong (no traceback, no torch advice about
`weights_only`), the same line on every rank, within `SECONDS` (no rank trains on alone: a
rank left in a collective would wait for gloo's timeout); the marker never appears; after the
refusal the ranks still train together, and the model's parameters, optimizer state and step are
those it had before the load. A rank's own random generator state of a size no memory holds
(found on that rank alone) is refused on both ranks too, in a group of its own with a short
deadline: a rank that raised before the ranks agree would leave the other waiting in a collective.
"""
from __future__ import annotations

import builtins
import functools
import io
import json
import os
import pickle
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mplan
from mplan.models import build_model
from mplan.runtime.checkpoint import resolve_checkpoint
from mplan.runtime.checkpoint_storage import CheckpointError

from distributed import run_checks

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 64
PLAN = "dp=2,zero=1"
SECONDS = 5.0
"""Longest a refused load may take on a rank (they take ~0.01-0.1 s; gloo's timeout is 120 s)."""
MARKER = "UNPICKLED"
"""The file the pickles' payload creates when unpickled, in the directory of the good checkpoint."""

_STATE: dict[str, Any] = {}
"""This process's model and checkpoints (set by `check_save`, or by the one-process test)."""


def _build(spec: str, plan: str) -> tuple[Any, torch.Tensor]:
    model = build_model(spec, device="cpu", dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                            global_batch=GLOBAL_BATCH, plan=plan, progress="quiet")
    return pm, ids


def _from_rank0(texts: list[str] | None) -> list[str]:
    """Rank 0's strings on every rank (as bytes in a tensor: nothing is pickled)."""
    data = torch.zeros(4096, dtype=torch.uint8)
    if dist.get_rank() == 0:
        assert texts is not None
        encoded = "\0".join(texts).encode()
        data[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(data, 0)
    return bytes(data.tolist()).rstrip(b"\0").decode().split("\0")


def _shared_directory() -> str:
    """A fresh directory, made by rank 0 and named to every rank."""
    made = tempfile.mkdtemp(prefix="mplan-bad-checkpoints-") if dist.get_rank() == 0 else None
    return _from_rank0(None if made is None else [made])[0]


def check_save() -> str:
    """The good checkpoint and the two other models' ones; then one more step, so that the live
    state differs from every checkpoint and a load that writes anything shows."""
    root = _shared_directory()
    for spec, name in (("tiny-llama", "other-names"), ("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=64",
                                                       "other-shapes")):
        other, ids = _build(spec, PLAN)
        other.train_step(ids, ids)
        other.save(os.path.join(root, name))
    pm, ids = _build("tiny-gpt", PLAN)
    pm.train_step(ids, ids)
    pm.save(os.path.join(root, "good"))
    pm.train_step(ids, ids)
    _STATE.update(pm=pm, ids=ids, root=root, scratch=os.path.join(root, f"world{dist.get_world_size()}"))
    return root


# -- ways to break a checkpoint: (root of the good one, a fresh path) -> (path to load, what the line names)
def _copy(root: str, fresh: str) -> str:
    shutil.copytree(os.path.join(root, "good"), fresh)
    return resolve_checkpoint(fresh)


def _data_files(step: str) -> list[str]:
    return sorted(os.path.join(step, n) for n in os.listdir(step) if n.endswith(".distcp"))


def _storage(step: str) -> list[dict[str, Any]]:
    with open(os.path.join(step, "dcp.json")) as handle:
        return json.load(handle)["storage"]


def _middle_item(step: str) -> tuple[str, dict[str, Any]]:
    """The last data file and its item whose bytes hold the file's middle."""
    path = _data_files(step)[-1]
    middle = os.path.getsize(path) // 2
    item = next(e for e in _storage(step) if e["file"] == os.path.basename(path)
                and e["start"] <= middle < e["start"] + e["length"])
    return path, item


def _flip(path: str, at: int, count: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(at)
        data = handle.read(count)
        handle.seek(at)
        handle.write(bytes(b ^ 0xFF for b in data))


def truncated(root: str, fresh: str) -> tuple[str, str]:
    path = _data_files(_copy(root, fresh))[-1]
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    return fresh, path


def data_file_missing(root: str, fresh: str) -> tuple[str, str]:
    path = _data_files(_copy(root, fresh))[-1]
    os.remove(path)
    return fresh, path


def flipped_zip_header(root: str, fresh: str) -> tuple[str, str]:
    """16 bytes flipped where the item holding the file's middle begins (its zip record's header)."""
    path, item = _middle_item(_copy(root, fresh))
    _flip(path, item["start"], 16)
    return fresh, path


def flipped_tensor_bytes(root: str, fresh: str) -> tuple[str, str]:
    """16 bytes flipped in the middle of the tensor bytes of the item holding the file's middle:
    every header intact, only the values wrong."""
    path, item = _middle_item(_copy(root, fresh))
    with open(path, "rb") as handle:
        handle.seek(item["start"])
        blob = handle.read(item["length"])
    record = next(i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist() if "/data/" in i.filename)
    header = blob[record.header_offset:record.header_offset + 30]
    name_and_extra = int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    begin = record.header_offset + 30 + name_and_extra  # the local header, then the record's bytes
    _flip(path, item["start"] + begin + record.file_size // 2, 16)
    return fresh, path


class _Payload:
    """What a malicious pickle does when unpickled: here, create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return builtins.open, (self.marker, "w")


def _replace_first_data_file(root: str, fresh: str, data: bytes) -> tuple[str, str]:
    path = _data_files(_copy(root, fresh))[0]
    size = os.path.getsize(path)
    with open(path, "wb") as handle:
        handle.write(data + bytes(max(0, size - len(data))))  # as long as the real one
    return fresh, path


def plain_pickle(root: str, fresh: str) -> tuple[str, str]:
    return _replace_first_data_file(root, fresh, pickle.dumps(_Payload(os.path.join(root, MARKER))))


def torch_saved_object(root: str, fresh: str) -> tuple[str, str]:
    buffer = io.BytesIO()
    torch.save({"weights": _Payload(os.path.join(root, MARKER))}, buffer)
    return _replace_first_data_file(root, fresh, buffer.getvalue())


def _edit_json(path: str, edit: Callable[[dict[str, Any]], None]) -> None:
    with open(path) as handle:
        doc = json.load(handle)
    edit(doc)
    with open(path, "w") as handle:
        json.dump(doc, handle)


def _cut_text(path: str) -> None:
    with open(path, "rb") as handle:
        data = handle.read()
    with open(path, "wb") as handle:
        handle.write(data[:len(data) // 2])


def dcp_json_not_json(root: str, fresh: str) -> tuple[str, str]:
    step = _copy(root, fresh)
    _cut_text(os.path.join(step, "dcp.json"))
    return fresh, os.path.join(step, "dcp.json")


def dcp_json_file_outside(root: str, fresh: str) -> tuple[str, str]:
    step = _copy(root, fresh)
    _edit_json(os.path.join(step, "dcp.json"), lambda doc: doc["storage"][3].update(file="../good/__0_0.distcp"))
    return fresh, os.path.join(step, "dcp.json")


def chunks_leave_a_gap(root: str, fresh: str) -> tuple[str, str]:
    """dcp.json says the embedding was saved as its first half alone (the second half's rows are
    in no chunk): no load can fill them."""
    step = _copy(root, fresh)

    def halve(doc: dict[str, Any]) -> None:
        tensor = doc["tensors"]["model/embed.weight"]
        assert tensor["chunks"] == [[[0, 0], tensor["size"]]], tensor["chunks"]  # saved whole, by one rank
        tensor["chunks"] = [[[0, 0], [tensor["size"][0] // 2, tensor["size"][1]]]]
    _edit_json(os.path.join(step, "dcp.json"), halve)
    return fresh, "embed.weight"


RNG = "rng/rank0/cpu"


def _edit_rng(step: str, edit: Callable[[dict[str, Any]], None]) -> None:
    _edit_json(os.path.join(step, "dcp.json"), lambda doc: edit(doc["tensors"][RNG]))


def rng_state_of_another_dtype(root: str, fresh: str) -> tuple[str, str]:
    """Rank 0's random generator state said to be float64 (it is bytes)."""
    _edit_rng(_copy(root, fresh), lambda t: t.update(dtype="float64"))
    return fresh, RNG


def rng_state_cut_short(root: str, fresh: str) -> tuple[str, str]:
    """Rank 0's random generator state said to be half as long (one chunk of it)."""
    def halve(t: dict[str, Any]) -> None:
        t.update(size=[t["size"][0] // 2], chunks=[[[0], [t["size"][0] // 2]]])
    _edit_rng(_copy(root, fresh), halve)
    return fresh, RNG


def mplan_json_not_json(root: str, fresh: str) -> tuple[str, str]:
    step = _copy(root, fresh)
    _cut_text(os.path.join(step, "mplan.json"))
    return fresh, os.path.join(step, "mplan.json")


def mplan_json_wrong_field(root: str, fresh: str) -> tuple[str, str]:
    step = _copy(root, fresh)
    _edit_json(os.path.join(step, "mplan.json"), lambda doc: doc.update(world_size="two"))
    return fresh, os.path.join(step, "mplan.json")


LEFT_OUT = "layers.1.mlp.fc_out.weight"


def _drop_tensors(step: str, starts: str) -> None:
    def drop(doc: dict[str, Any]) -> None:
        doc["tensors"] = {k: v for k, v in doc["tensors"].items() if not k.startswith(starts)}
        doc["storage"] = [e for e in doc["storage"] if not e["fqn"].startswith(starts)]
    _edit_json(os.path.join(step, "dcp.json"), drop)


def parameter_missing(root: str, fresh: str) -> tuple[str, str]:
    step = _copy(root, fresh)
    _drop_tensors(step, f"model/{LEFT_OUT}")
    _edit_json(os.path.join(step, "mplan.json"), lambda doc: doc["model"]["params"].pop(LEFT_OUT))
    return fresh, LEFT_OUT


def optimizer_state_missing(root: str, fresh: str) -> tuple[str, str]:
    step = _copy(root, fresh)
    _drop_tensors(step, f"optim/{LEFT_OUT}/")
    return fresh, LEFT_OUT


def other_names(root: str, fresh: str) -> tuple[str, str]:
    return os.path.join(root, "other-names"), "GPTModel"


def other_shapes(root: str, fresh: str) -> tuple[str, str]:
    return os.path.join(root, "other-shapes"), "this model's is"


def latest_names_a_missing_step(root: str, fresh: str) -> tuple[str, str]:
    _copy(root, fresh)
    with open(os.path.join(fresh, "latest"), "w") as handle:
        handle.write("step-00000099\n")
    return fresh, os.path.join(fresh, "latest")


def no_checkpoint(root: str, fresh: str) -> tuple[str, str]:
    os.makedirs(fresh)
    with open(os.path.join(fresh, "notes.txt"), "w") as handle:
        handle.write("not a checkpoint\n")
    return fresh, fresh


def no_such_path(root: str, fresh: str) -> tuple[str, str]:
    return fresh, fresh


@dataclass(frozen=True)
class Case:
    """One way to break a checkpoint, and what the refusal's line must say besides the name."""

    make: Callable[[str, str], tuple[str, str]]
    says: str | tuple[str, ...]
    """What the line says after the name (one of these)."""
    while_reading: bool = False
    """Found while DCP reads the data (each rank its own pieces), not by the checks before it."""

    @property
    def name(self) -> str:
        return self.make.__name__.replace("_", "-")

    @property
    def __name__(self) -> str:  # what the harness calls a check
        return f"check_{self.make.__name__}"

    def __call__(self) -> dict[str, Any]:
        return attempt(self)


NOT_TENSORS = ": holds something other than the tensors mplan writes"
CHECKSUM = ": the bytes of "
"""`FILE: the bytes of T at [offsets] changed after they were written (checksum mismatch)`"""
CASES = [
    Case(truncated, ": truncated: "),
    Case(data_file_missing, ": missing (the checkpoint's metadata stores tensors in it)"),
    # no zip signature: torch reads it as a pickle of the format before zip, and refuses that
    Case(flipped_zip_header, (CHECKSUM, ": is corrupt", NOT_TENSORS), while_reading=True),
    Case(flipped_tensor_bytes, (CHECKSUM, ": is corrupt"), while_reading=True),
    Case(plain_pickle, (CHECKSUM, NOT_TENSORS), while_reading=True),
    Case(torch_saved_object, (CHECKSUM, NOT_TENSORS), while_reading=True),
    Case(dcp_json_not_json, ": not valid JSON"),
    Case(dcp_json_file_outside, ": storage[3].file must be a DCP data file name"),
    Case(chunks_leave_a_gap, ("cover", "missing")),
    Case(mplan_json_not_json, ": not valid JSON"),
    Case(mplan_json_wrong_field, ": world_size must be an integer >= 1, got \"two\""),
    Case(parameter_missing, ": has no parameter "),
    Case(optimizer_state_missing, "holds optimizer state for some parameters but none for "),
    Case(other_names, "which this model (GPTModel) does not have"),
    Case(other_shapes, " has shape "),
    Case(rng_state_of_another_dtype, ("uint8", "float64", "dtype")),
    Case(rng_state_cut_short, ("size", "shape", "long")),
    Case(latest_names_a_missing_step, ": names step-00000099, which holds no mplan.json"),
    Case(no_checkpoint, ": holds no mplan checkpoint"),
    Case(no_such_path, ": no such directory"),
]


def _snapshot(pm: Any) -> dict[str, Any]:
    optimizer = pm.optimizer.optimizer
    return {"params": {n: p.detach().clone() for n, p in pm.params.items()},
            "state": {(i, k): v.clone() for i, p in enumerate(g for group in optimizer.param_groups
                                                              for g in group["params"])
                      for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)},
            "lr": [g["lr"] for g in optimizer.param_groups], "step": pm.step}


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What a load changed: parameter names, optimizer state keys, `step`."""
    out = [n for n in before["params"] if not torch.equal(before["params"][n], after["params"][n])]
    out += [f"optimizer state {k}" for k in before["state"]
            if k not in after["state"] or not torch.equal(before["state"][k], after["state"][k])]
    return out + [k for k in ("lr", "step") if before[k] != after[k]]


def attempt(case: Case) -> dict[str, Any]:
    """Break a copy (rank 0), load it on every rank, and report what each rank saw."""
    pm, root = _STATE["pm"], _STATE["root"]
    distributed = dist.is_initialized()
    fresh = os.path.join(_STATE["scratch"], case.name)
    made = list(case.make(root, fresh)) if not distributed or dist.get_rank() == 0 else None
    if distributed:
        made = _from_rank0(made)
    before = _snapshot(pm)
    start = time.monotonic()
    try:
        pm.load(made[0])
        outcome = {"error": None, "message": None}
    except Exception as exc:  # noqa: BLE001 - any other kind of error is reported to the test
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    seconds = time.monotonic() - start
    changed = _changed(before, _snapshot(pm))
    pm.train_step(_STATE["ids"], _STATE["ids"])  # a collective step: the ranks still train together
    return {**outcome, "seconds": seconds, "changed": changed, "path": made[0], "named": made[1],
            "unpickled": os.path.exists(os.path.join(root, MARKER))}


# -- the tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def outcomes() -> Any:
    got = run_checks(2, [check_save, *CASES])
    saved = got.values.get("check_save")
    yield got
    if saved:
        shutil.rmtree(saved[0], ignore_errors=True)


@pytest.fixture(scope="module")
def single(outcomes: Any) -> dict[str, Any]:
    """A one-process job (no process group) of the same model, and the 2-rank checkpoints."""
    (root, _) = outcomes.assert_passed(check_save)
    pm, ids = _build("tiny-gpt", "dp=1")
    pm.train_step(ids, ids)
    return {"pm": pm, "ids": ids, "root": root, "scratch": os.path.join(root, "one-process")}


@pytest.fixture(scope="module")
def one_process(single: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The cases in one process: the 2-rank checkpoints, resharded."""
    _STATE.update(single)
    try:
        return {case.name: case() for case in CASES}
    finally:
        _STATE.clear()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_refused_in_one_line_on_every_rank_at_once(outcomes: Any, case: Case) -> None:
    ranks = outcomes.assert_passed(case)
    for rank, seen in enumerate(ranks):
        assert seen["error"] == "CheckpointError", (rank, seen)
        _assert_clear(seen, case)
        assert seen["seconds"] < SECONDS, f"rank {rank} took {seen['seconds']:.1f} s to refuse"
        assert not seen["unpickled"], "the pickle's payload ran"
    lines = {seen["message"].split(": ", 1)[1] if seen["message"].startswith("rank ") else seen["message"]
             for seen in ranks}
    assert len(lines) == 1, f"the ranks refused with different lines: {lines}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_refused_in_one_process(one_process: dict[str, dict[str, Any]], case: Case) -> None:
    seen = one_process[case.name]
    assert seen["error"] == "CheckpointError", seen
    _assert_clear(seen, case)
    assert not seen["unpickled"]


def _assert_clear(seen: dict[str, Any], case: Case) -> None:
    message = seen["message"]
    assert "\n" not in message and "Traceback" not in message and len(message) < 400, message
    assert "weights_only" not in message, f"torch's advice reached the user: {message}"
    says = (case.says,) if isinstance(case.says, str) else case.says
    assert seen["named"] in message and any(s in message for s in says), f"{case.name}: {message}"


READ_TIME = [c for c in CASES if c.while_reading]


@pytest.mark.parametrize("case", READ_TIME, ids=lambda c: c.name)
def test_a_file_that_fails_to_read_is_the_line_itself(outcomes: Any, case: Case) -> None:
    """What the reader said of the file, as it said it: `FILE: what is wrong`, not DCP's wrapping."""
    for seen in outcomes.assert_passed(case):
        message = seen["message"] or ""
        if message.startswith("rank "):
            message = message.split(": ", 1)[1]
        says = (case.says,) if isinstance(case.says, str) else case.says
        assert any(message.startswith(f"{seen['named']}{s}") for s in says), message


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_refused_load_changes_nothing(outcomes: Any, one_process: dict[str, dict[str, Any]], case: Case) -> None:
    for where, seen in [*enumerate(outcomes.assert_passed(case)), ("one process", one_process[case.name])]:
        assert seen["error"] == "CheckpointError" and not seen["changed"], \
            f"{where}: the refused load changed {len(seen['changed'])}: {seen['changed'][:4]}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_line_says_the_value_it_got_once(outcomes: Any, case: Case) -> None:
    message = outcomes.assert_passed(case)[0]["message"] or ""
    assert message and message.count(", got ") <= 1, message


def _rng_of_no_memory(root: str, fresh: str) -> str:
    _edit_rng(_copy(root, fresh), lambda t: t.update(size=[2 ** 62]))
    return fresh


@dataclass(frozen=True)
class LoadEverywhere:
    """A check (carrying its path to the ranks): build the model, load `path`, say what happened."""

    path: str
    __name__ = "check_load_a_state_of_no_memory"

    def __call__(self) -> dict[str, Any]:
        pm, _ = _build("tiny-gpt", PLAN)
        start = time.monotonic()
        try:
            pm.load(self.path)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
        return {"error": None, "message": None, "seconds": time.monotonic() - start}


def test_a_state_no_memory_holds_is_refused_before_allocating_it(single: dict[str, Any]) -> None:
    fresh = _rng_of_no_memory(single["root"], os.path.join(single["scratch"], "rng-state-of-no-memory"))
    with pytest.raises(CheckpointError, match=RNG):
        single["pm"].load(fresh)
    check = LoadEverywhere(_rng_of_no_memory(single["root"], os.path.join(single["root"], "rng-of-no-memory-2")))
    for rank, seen in enumerate(run_checks(2, [check], timeout_s=30).assert_passed(check)):
        assert seen["error"] == "CheckpointError" and RNG in seen["message"], (rank, seen)
        assert seen["seconds"] < SECONDS, (rank, seen)


def test_the_payload_is_live(tmp_path) -> None:  # noqa: ANN001
    """The pickles' payload does create the marker when unpickled (so its absence above means
    nothing unpickled it)."""
    marker = str(tmp_path / MARKER)
    pickle.loads(pickle.dumps(_Payload(marker))).close()
    assert os.path.exists(marker)
