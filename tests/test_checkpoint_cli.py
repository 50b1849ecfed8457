"""`mplan checkpoint inspect` and `mplan checkpoint convert` (issue 31, item 4).

Input: checkpoints written by `pm.save` (a tiny GPT in float64: one process with two steps saved,
and one under tp=2 on two gloo ranks, whose sharded parameters are saved as two chunks), and
Hugging Face directories written by `transformers`' `save_pretrained` (one file, and sharded
with an index).
Asserted: inspect's figures against the live model and optimizer that wrote the checkpoint (every
tensor's name, dtype, shape, bytes and chunks; the totals; plan spec, step, extras), and a Hugging
Face directory's against safetensors' own reader; inspect reads metadata only (the same document
with every data byte zeroed); `--json` prints one JSON document and nothing else; a directory
that holds no checkpoint is refused in one line with exit status 2; convert
(`mplan.runtime.hf_checkpoint.convert_checkpoint`) takes a tiny Llama's checkpoint to a Hugging
Face directory and back, each result as inspect shows it, and its refusals are one line.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
from typing import Any

import pytest
import torch

import mplan
from mplan.cli import main
from mplan.models import build_model

from distributed import run_checks

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 64


def _build(plan: str, spec: str = "tiny-gpt") -> tuple[Any, torch.Tensor]:
    model = build_model(spec, device="cpu", dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                            global_batch=GLOBAL_BATCH, plan=plan, progress="quiet")
    return pm, ids


class _Position:
    """An extra saved beside the model (what a data loader's position would be)."""

    def __init__(self) -> None:
        self.sequences = 0

    def state_dict(self) -> dict[str, Any]:
        return {"sequences": self.sequences}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sequences = state["sequences"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A root holding steps 1 and 2 of a one-process run, and what the live run held at step 2."""
    root = str(tmp_path_factory.mktemp("checkpoints") / "run")
    pm, ids = _build("dp=1")
    position = _Position()
    for _ in range(2):
        pm.train_step(ids, ids)
        position.sequences += GLOBAL_BATCH
        pm.save(root, extras={"data": position})
    state = pm.optimizer.optimizer.state
    optimizer_bytes = sum(v.numel() * v.element_size() for s in state.values() for v in s.values())
    params = {name: (tuple(p.shape), p.dtype) for name, p in pm.full_state_dict().items()}
    return {"root": root, "spec": pm.plan.spec(), "params": params, "optimizer_bytes": optimizer_bytes,
            "optimizer_keys": sorted({k for s in state.values() for k in s})}


def _inspect_json(path: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["checkpoint", "inspect", path, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return json.loads(captured.out)  # one document and nothing else, or this raises


def test_inspect_json_matches_the_model_that_saved_it(saved: dict[str, Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    doc = _inspect_json(saved["root"], capsys)
    assert doc["format"] == "mplan.checkpoint" and doc["version"] == 2
    assert doc["step"] == 2 and doc["path"] == os.path.join(saved["root"], "step-00000002")
    assert doc["model"] == "GPTModel" and doc["world_size"] == 1 and not doc["converted"]
    assert doc["plan"]["spec"] == saved["spec"] and doc["plan"]["mesh"]["dp"] == 1
    assert doc["optimizer"]["class"] == "AdamW" and doc["optimizer"]["param_groups"][0]["lr"] == 1e-2
    assert doc["extras"] == ["data"]
    assert doc["committed_steps"] == [1, 2] and doc["latest"] == "step-00000002"

    model = {t["name"].removeprefix("model/"): t for t in doc["tensors"] if t["kind"] == "model"}
    assert set(model) == set(saved["params"])
    for name, (shape, dtype) in saved["params"].items():
        t = model[name]
        assert (tuple(t["shape"]), t["dtype"], t["chunks"]) == (shape, str(dtype).removeprefix("torch."), 1), name
        assert t["bytes"] == math.prod(shape) * dtype.itemsize and t["stored_bytes"] >= t["bytes"]
    optimizer = [t for t in doc["tensors"] if t["kind"] == "optimizer"]
    assert {t["name"].rsplit("/", 1)[1] for t in optimizer} == set(saved["optimizer_keys"])
    assert len(optimizer) == len(saved["params"]) * len(saved["optimizer_keys"])
    totals = doc["totals"]
    assert totals["num_parameters"] == sum(math.prod(s) for s, _ in saved["params"].values())
    assert totals["parameter_bytes"] == sum(math.prod(s) * d.itemsize for s, d in saved["params"].values())
    assert totals["optimizer_state_bytes"] == saved["optimizer_bytes"]
    assert totals["num_tensors"] == len(doc["tensors"])
    files = os.listdir(doc["path"])
    assert [f["name"] for f in doc["files"]] == [n for n in sorted(files) if n.endswith(".distcp")]
    assert totals["stored_bytes"] == sum(os.path.getsize(os.path.join(doc["path"], f["name"])) for f in doc["files"])


def test_inspect_text_says_plan_step_optimizer_and_every_tensor(saved: dict[str, Any],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "inspect", saved["root"]]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out and saved["spec"] in out and "GPTModel" in out
    assert "optimizer AdamW: lr=0.01" in out and "extras: data" in out
    assert "committed steps under" in out and "1, 2 (latest: step-00000002)" in out
    for name in saved["params"]:
        assert f"model/{name} " in out and f"optim/{name}/exp_avg_sq" in out, name


def test_a_root_with_several_steps_an_older_step_and_no_latest(saved: dict[str, Any], tmp_path,  # noqa: ANN001
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    older = _inspect_json(os.path.join(saved["root"], "step-00000001"), capsys)
    assert older["step"] == 1 and older["committed_steps"] == [1, 2] and older["extras"] == ["data"]
    copy = str(tmp_path / "copy")
    shutil.copytree(saved["root"], copy)
    os.remove(os.path.join(copy, "latest"))  # the newest committed step, then
    assert _inspect_json(copy, capsys)["step"] == 2
    shutil.copytree(os.path.join(copy, "step-00000001"), os.path.join(copy, ".step-00000003.partial"))
    newest = _inspect_json(copy, capsys)  # an unfinished save is no committed step
    assert newest["step"] == 2 and newest["committed_steps"] == [1, 2]


def test_inspect_reads_metadata_only(saved: dict[str, Any], tmp_path,  # noqa: ANN001
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Every data byte zeroed (same lengths): the same document, so no tensor data was read."""
    expected = _inspect_json(saved["root"], capsys)
    copy = str(tmp_path / "zeroed")
    shutil.copytree(saved["root"], copy)
    step = os.path.join(copy, "step-00000002")
    for name in os.listdir(step):
        if name.endswith(".distcp"):
            size = os.path.getsize(os.path.join(step, name))
            with open(os.path.join(step, name), "wb") as handle:
                handle.write(bytes(size))
    got = _inspect_json(copy, capsys)
    assert {**got, "path": None, "root": None} == {**expected, "path": None, "root": None}


@pytest.mark.parametrize("make,named", [
    (lambda d: None, "holds no mplan checkpoint"),
    (lambda d: open(os.path.join(d, "notes.txt"), "w").write("hello"), "holds no mplan checkpoint"),
    (lambda d: open(os.path.join(d, "latest"), "w").write("step-00000009\n"), "names step-00000009"),
    (lambda d: open(os.path.join(d, "latest"), "w").write("../../etc\n"), "must name a checkpoint directory"),
    (lambda d: (open(os.path.join(d, "config.json"), "w").write("{}"),
                open(os.path.join(d, "pytorch_model.bin"), "wb").write(b"\x80\x04N.")), "as a pickle"),
], ids=["empty", "other-files", "latest-names-a-missing-step", "latest-names-a-path", "hf-pickle-weights"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_directory_without_a_checkpoint_is_refused_in_one_line(make, named: str, as_json: bool,  # noqa: ANN001
                                                                  tmp_path,  # noqa: ANN001
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "not-a-checkpoint"
    directory.mkdir()
    make(str(directory))
    assert main(["checkpoint", "inspect", str(directory)] + (["--json"] if as_json else [])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("mplan checkpoint: error: ")
    assert named in captured.err and str(directory) in captured.err and "Traceback" not in captured.err


def test_a_missing_path_and_a_file_are_refused(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    assert main(["checkpoint", "inspect", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"mplan checkpoint: error: {tmp_path / 'nowhere'}: no such directory\n"
    (tmp_path / "file.json").write_text("{}")
    assert main(["checkpoint", "inspect", str(tmp_path / "file.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no mplan checkpoint" in err


def test_a_broken_manifest_is_refused_naming_the_field(saved: dict[str, Any], tmp_path,  # noqa: ANN001
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    step = str(tmp_path / "step-00000002")
    shutil.copytree(os.path.join(saved["root"], "step-00000002"), step)
    manifest = json.loads(open(os.path.join(step, "mplan.json")).read())
    manifest["step"] = -3
    with open(os.path.join(step, "mplan.json"), "w") as handle:
        json.dump(manifest, handle)
    assert main(["checkpoint", "inspect", step]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mplan.json: step must be an integer >= 0, got -3" in err


def _sizes_disagree(saved: dict[str, Any], directory: str) -> str:
    """A copy of the newest step whose dcp.json gives norm.weight a size mplan.json does not."""
    shutil.copytree(os.path.join(saved["root"], "step-00000002"), directory)
    path = os.path.join(directory, "dcp.json")
    with open(path) as handle:
        doc = json.load(handle)
    doc["tensors"]["model/norm.weight"].update(size=[2 ** 62], chunks=[[[0], [2 ** 62]]])
    with open(path, "w") as handle:
        json.dump(doc, handle)
    return directory


def test_inspect_refuses_shapes_the_two_files_disagree_on(saved: dict[str, Any], tmp_path,  # noqa: ANN001
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    directory = _sizes_disagree(saved, str(tmp_path / "step-00000002"))
    assert main(["checkpoint", "inspect", directory]) == 2
    err = capsys.readouterr().err  # dcp.json's own bytes cannot hold such a tensor: refused before mplan.json
    assert err.startswith(f"mplan checkpoint: error: {directory}/dcp.json: chunk [0] of model/norm.weight needs "
                          f"{2 ** 62 * 8} bytes, its storage entry holds ") and err.count("\n") == 1, err


def test_convert_refuses_shapes_the_two_files_disagree_on(saved: dict[str, Any], tmp_path,  # noqa: ANN001
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    directory = _sizes_disagree(saved, str(tmp_path / "step-00000002"))
    assert main(["checkpoint", "convert", "-q", directory, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "norm.weight" in err


# -- a sharded checkpoint: two ranks under tp=2 -----------------------------------------------------
def _shared_directory() -> str:
    """A fresh directory, made by rank 0, named to every rank."""
    import tempfile

    import torch.distributed as dist

    name = torch.zeros(256, dtype=torch.uint8)
    if dist.get_rank() == 0:
        path = tempfile.mkdtemp(prefix="mplan-inspect-").encode()
        name[:len(path)] = torch.tensor(list(path), dtype=torch.uint8)
    dist.broadcast(name, 0)
    return bytes(name.tolist()).rstrip(b"\0").decode()


def check_save_under_tp2() -> dict[str, Any]:
    pm, ids = _build("tp=2")
    pm.train_step(ids, ids)
    root = _shared_directory()
    pm.save(root)
    sharded = sorted(name for name, layout in pm.layouts.items() if "S(" in str(layout.placement))
    return {"root": root, "sharded": sharded, "spec": pm.plan.spec()}


@pytest.fixture(scope="module")
def tp2() -> Any:
    outcomes = run_checks(2, [check_save_under_tp2])
    value = outcomes.assert_passed(check_save_under_tp2)[0]
    yield value
    shutil.rmtree(value["root"], ignore_errors=True)


def test_inspect_counts_the_chunks_of_a_sharded_checkpoint(tp2: dict[str, Any],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    doc = _inspect_json(tp2["root"], capsys)
    assert doc["world_size"] == 2 and doc["plan"]["spec"] == tp2["spec"] and doc["plan"]["mesh"]["tp"] == 2
    assert tp2["sharded"], "tp=2 shards no parameter of the tiny GPT"
    model = {t["name"].removeprefix("model/"): t for t in doc["tensors"] if t["kind"] == "model"}
    for name, t in model.items():
        assert t["chunks"] == (2 if name in tp2["sharded"] else 1), (name, t["chunks"])
    assert len(doc["files"]) == 2  # each rank wrote its own pieces
    assert doc["totals"]["num_parameters"] == sum(math.prod(t["shape"]) for t in model.values())


# -- Hugging Face directories ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    base = tmp_path_factory.mktemp("hf")
    model.save_pretrained(base / "single")
    model.save_pretrained(base / "sharded", max_shard_size="20KB")
    return {"single": str(base / "single"), "sharded": str(base / "sharded")}


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_inspect_a_hugging_face_directory(layout: str, hf_dirs: dict[str, str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors import safe_open

    directory = hf_dirs[layout]
    doc = _inspect_json(directory, capsys)
    assert doc["format"] == "huggingface" and doc["architectures"] == ["LlamaForCausalLM"]
    assert doc["model_type"] == "llama" and doc["sharded"] == (layout == "sharded")
    theirs = {}
    for f in doc["files"]:
        with safe_open(os.path.join(directory, f["name"]), "pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                theirs[name] = (piece.get_shape(), f["name"])
    assert {t["name"]: (t["shape"], t["file"]) for t in doc["tensors"]} == theirs
    assert all(t["dtype"] == "float64" and t["bytes"] == 8 * math.prod(t["shape"]) for t in doc["tensors"])
    assert doc["totals"]["num_parameters"] == sum(math.prod(s) for s, _ in theirs.values())
    assert (len(doc["files"]) > 1) == (layout == "sharded")
    assert main(["checkpoint", "inspect", directory]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and f"{doc['totals']['num_parameters']:,} parameters" in out
    assert all(t["name"] in out for t in doc["tensors"])


def test_a_truncated_safetensors_file_is_refused_naming_it(hf_dirs: dict[str, str], tmp_path,  # noqa: ANN001
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    directory = str(tmp_path / "hf")
    shutil.copytree(hf_dirs["single"], directory)
    path = os.path.join(directory, "model.safetensors")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 100)
    assert main(["checkpoint", "inspect", directory]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: truncated" in err


# -- convert ----------------------------------------------------------------------------------------
def test_convert_to_hugging_face_and_back(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """`convert` runs `mplan.runtime.hf_checkpoint.convert_checkpoint(src, dst)` both ways; inspect
    shows each result: the Hugging Face architecture, then a converted checkpoint (no plan, no
    optimizer state) of the same tensors."""
    from mplan.models.hf_names import hf_config
    from mplan.models.spec import resolve_model

    pm, ids = _build("dp=1", spec="tiny-llama")
    pm.hf_config = hf_config(resolve_model("tiny-llama").config)  # what export writes as config.json
    pm.train_step(ids, ids)
    root, hf, back = str(tmp_path / "run"), str(tmp_path / "hf"), str(tmp_path / "back")
    pm.save(root)
    original = _inspect_json(root, capsys)

    assert main(["checkpoint", "convert", "-q", root, hf]) == 0
    assert capsys.readouterr().out == f"converted {root} -> {hf}\n"
    exported = _inspect_json(hf, capsys)
    assert exported["format"] == "huggingface" and exported["architectures"] == ["LlamaForCausalLM"]
    assert exported["totals"]["num_parameters"] == original["totals"]["num_parameters"]

    assert main(["checkpoint", "convert", "-q", hf, back]) == 0
    assert capsys.readouterr().out == f"converted {hf} -> {back}\n"
    imported = _inspect_json(back, capsys)
    assert imported["converted"] and imported["plan"] is None and imported["optimizer"] is None
    assert imported["root"] is None and imported["committed_steps"] == []
    files = {t["name"]: t["shape"] for t in exported["tensors"]}  # under the Hugging Face names
    assert {t["name"].removeprefix("model/"): t["shape"] for t in imported["tensors"] if t["kind"] == "model"} == files
    assert main(["checkpoint", "inspect", back]) == 0
    out = capsys.readouterr().out
    assert "plan: converted (no plan)" in out and "none saved (weights only)" in out and "committed steps" not in out


def test_convert_refuses_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    """What the bridge refuses (no checkpoint there, no such path) is one line."""
    (tmp_path / "empty").mkdir()
    for src in (str(tmp_path / "empty"), str(tmp_path / "nowhere")):
        assert main(["checkpoint", "convert", "-q", src, str(tmp_path / "out")]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert captured.err.startswith(f"mplan checkpoint: error: {src}")
