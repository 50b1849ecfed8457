"""Hugging Face directories in and out (issue 31): HF Llama under TP2 x PP2 and HF Mixtral under
EP2 loaded with `pm.load(hf_dir)`, trained 3 steps, saved with `pm.save(d, format="hf")` and read
back by `transformers`; mplan's own families exported as Llama, Mixtral and GPT-2; conversion
between mplan checkpoints and HF directories; bad directories (gloo, float64).

The sources are written by `save_pretrained(max_shard_size="20KB")`, so the sharded index path
runs (and Mixtral's experts are stored as transformers stores them, `block_sparse_moe.experts.{e}.w1`).
The reference is the same HF model trained 3 steps on one process with the same optimizer,
clipping and micro-batches; HF's float32 RMSNorm, router softmax and loss are made float64
(test_equivalence.py's "faithful" variants), so 1e-9 is the bar for the logits of the model
transformers reads back. Import then export with no training is exact per tensor and keeps the
source's files. One gloo group per world size (4: the Llama; 2: the rest); captures are reused
per rank (tests/capture_cache.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import types
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from capture_cache import reused_captures
from distributed import rel_err, run_checks
from test_equivalence import MAX_NORM, OPTIMIZER, _causal_lm_loss_float64, batches
from test_expert_parallel import float64_faithful, hf_moe

TOL = 1e-9
STEPS = 3
IDS = torch.arange(2 * 16).reshape(2, 16) * 7 % 64  # the logits' inputs
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, use_cache=False)


# -- models -----------------------------------------------------------------------------------------
def faithful(model: nn.Module) -> nn.Module:
    """HF's float32 RMSNorm, router softmax and loss made float64 (the same functions otherwise)."""
    return float64_faithful(model, _causal_lm_loss_float64)


def rope_float64(model: nn.Module) -> nn.Module:
    """HF's RoPE tables (computed in float32 whatever the model's dtype) computed in float64, as
    mplan's families compute them: for comparing with those at float64 precision."""
    def forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dim = 2 * self.inv_freq.shape[0]
        theta = self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return ((angles.cos() * self.attention_scaling).to(x.dtype),
                (angles.sin() * self.attention_scaling).to(x.dtype))
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(forward, module)
    return model


def hf_llama_tied() -> nn.Module:
    """A tied HF Llama (the head reads the embedding: stored once, on both pipeline ends)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mplan.verify import perturbed

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=True)).to(torch.float64)
    return perturbed(faithful(model))


hf_llama_tied.capture_key = ("hf_llama_tied",)


def from_hf(directory: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager")
    return faithful(model)


def scrambled(model: nn.Module) -> nn.Module:
    """Other weights than the directory's, so that only the load can make the runs agree."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-0.5)
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return (out if isinstance(out, torch.Tensor) else out.logits).detach()


def trained_reference(directory: str, data: list, micro_batch: int) -> tuple[list[float], torch.Tensor]:
    """The HF model of `directory` trained on one process as mplan trains it: gradients accumulated
    over micro-batches, clipped, one optimizer step per global batch. Its losses and logits."""
    model = from_hf(directory)
    optimizer = OPTIMIZER(model.parameters())
    losses = []
    for ids, labels in data:
        optimizer.zero_grad()
        chunks = list(zip(ids.split(micro_batch), labels.split(micro_batch)))
        total = 0.0
        for chunk_ids, chunk_labels in chunks:
            loss = model(chunk_ids, labels=chunk_labels).loss / len(chunks)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        losses.append(total)
    return losses, logits(model)


def tensors(directory: str) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor of an HF directory: its file and value."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update({k: (name, v) for k, v in load_file(os.path.join(directory, name)).items()})
    return out


def same_files(a: str, b: str) -> dict[str, Any]:
    """Whether two HF directories hold the same tensors (torch.equal) in the same files (and the
    number of files of the second)."""
    x, y = tensors(a), tensors(b)
    index = "model.safetensors.index.json"
    maps = [json.load(open(os.path.join(d, index)))["weight_map"] if os.path.exists(os.path.join(d, index))
            else None for d in (a, b)]
    return {"keys": set(x) == set(y), "files": all(x[k][0] == y[k][0] for k in x if k in y),
            "exact": all(k in y and x[k][1].dtype == y[k][1].dtype and torch.equal(x[k][1], y[k][1]) for k in x),
            "index": maps[0] == maps[1], "num_files": len({f for f, _ in y.values()})}


# -- the runs, one per model (each check's directories live under the test's tmp_path) ---------------
_KEPT: dict[str, Any] = {}
"""This rank's modules, kept from one check for the next (checks run in order in one process)."""


def hf_round_trip(root: str, make: Callable[[], nn.Module], plan: str, global_batch: int,
                  micro_batch: int) -> dict[str, Any] | None:
    """Save `make()` with save_pretrained, load it into a scrambled copy under `plan`, export at
    once (exact?), train 3 steps, export again; rank 0 compares with one process."""
    import mplan

    rank = dist.get_rank()
    src, untrained, out = (os.path.join(root, name) for name in ("src", "untrained", "trained"))
    if rank == 0:
        make().save_pretrained(src, max_shard_size="20KB")
    dist.barrier()
    data = batches(global_batch, steps=STEPS)
    with reused_captures(make.capture_key):
        pm = mplan.autoparallel(scrambled(make()), example_inputs=(data[0][0],), optimizer=OPTIMIZER,
                                global_batch=global_batch, plan=plan, micro_batch_size=micro_batch,
                                max_grad_norm=MAX_NORM, progress="quiet")
    pm.load(src)
    pm.save(untrained, format="hf")
    losses = [pm.train_step(ids, labels) for ids, labels in data]
    pm.save(out, format="hf")
    _KEPT[make.capture_key[0]] = pm
    if rank != 0:
        return None
    ref_losses, ref_logits = trained_reference(src, data, micro_batch)
    return {"ran": pm.plan.describe(), "untrained": same_files(src, untrained),
            "logits": rel_err(logits(from_hf(out)), ref_logits),
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "hf_config": pm.hf_config["model_type"], "split_kept": len(pm.hf_file_split) > 0}


def llama_tp2_pp2(root: str) -> dict[str, Any] | None:
    return hf_round_trip(root, hf_llama_tied, "tp=2,pp=2", 4, 1)


def mixtral_ep2(root: str) -> dict[str, Any] | None:
    return hf_round_trip(root, hf_moe("mixtral"), "dp=2,ep=2", 4, 1)


def mplan_checkpoint_converted(root: str) -> dict[str, Any] | None:
    """The trained Mixtral saved in mplan's format, converted to HF (equal to its own HF export),
    and the HF source converted to an mplan checkpoint and back (equal to the source), which
    `pm.load` reads."""
    from mplan.runtime.checkpoint import read_tensors
    from mplan.runtime.checkpoint_storage import CheckpointError
    from mplan.runtime.hf_checkpoint import convert_checkpoint

    pm = _KEPT["hf_moe"]
    checkpoint = pm.save(os.path.join(root, "mplan"))
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        convert_checkpoint(checkpoint, os.path.join(root, "mplan_as_hf"))
        out["mplan -> hf"] = same_files(os.path.join(root, "trained"), os.path.join(root, "mplan_as_hf"))
        convert_checkpoint(os.path.join(root, "src"), os.path.join(root, "hf_as_mplan"))
        convert_checkpoint(os.path.join(root, "hf_as_mplan"), os.path.join(root, "back"), max_shard_bytes=20_000)
        out["hf -> mplan -> hf"] = same_files(os.path.join(root, "src"), os.path.join(root, "back"))
        names = sorted(read_tensors(os.path.join(root, "hf_as_mplan")))
        out["mplan names"] = [n for n in names if "experts" in n][:2]
    dist.barrier()
    pm.load(os.path.join(root, "src"))
    source = pm.full_state_dict()
    try:
        pm.load(os.path.join(root, "hf_as_mplan"))
    except CheckpointError as exc:
        out["pm.load"] = str(exc)
    else:
        loaded = pm.full_state_dict()
        out["pm.load"] = "exact" if all(torch.equal(loaded[k], source[k]) for k in source) else "differs"
    return out


def families_exported(root: str) -> dict[str, Any]:
    """mplan's llama (tied), moe and gpt families under 2-rank plans, saved as HF: transformers'
    model gives their logits; a fresh model of the family loads the directory back exactly."""
    import mplan
    from mplan.models import build_model
    from mplan.models.hf_names import hf_config
    from mplan.runtime.checkpoint_storage import CheckpointError

    from test_equivalence import family

    out = {}
    ids = batches(4, steps=1)[0][0]
    for spec, plan in (("llama:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,ffn=48,tie=1", "tp=2"),
                       ("moe:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,ffn=48,experts=4,topk=2",
                        "dp=2,ep=2"),
                       ("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64", "tp=2")):
        make = family(spec)
        with reused_captures(make.capture_key):
            model = make()
            pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=4, plan=plan, progress="quiet")
            if pm.hf_config is None:  # autoparallel records a config for transformers models only
                try:
                    pm.save(os.path.join(root, "no config"), format="hf")
                except CheckpointError as exc:
                    refused = str(exc)
                pm.hf_config = hf_config(model.config)
            else:
                refused = "autoparallel recorded the family's config"
            fresh = mplan.autoparallel(build_model(spec, device="cpu", dtype=torch.float64, seed=5),
                                       example_inputs=(ids,), global_batch=4, plan=plan, progress="quiet")
        directory = os.path.join(root, spec.partition(":")[0])
        pm.save(directory, format="hf")
        fresh.load(directory)
        a, b = pm.full_state_dict(), fresh.full_state_dict()
        result = {"reloaded exact": all(torch.equal(a[k], b[k]) for k in a), "refused": refused}
        if dist.get_rank() == 0:
            hf = rope_float64(from_hf(directory))
            result.update(architecture=type(hf).__name__, logits=rel_err(logits(hf), logits(model)))
        out[spec.partition(":")[0]] = result
    return out


def bad_directories(root: str) -> dict[str, str]:
    """Each bad variant of the Mixtral source: the error on this rank (every rank must raise)."""
    from safetensors.torch import load_file, save_file
    from transformers import MixtralConfig, MixtralForCausalLM

    from mplan.runtime.checkpoint_storage import CheckpointError

    pm = _KEPT["hf_moe"]
    src = os.path.join(root, "src")
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    shard = index["weight_map"]["model.layers.0.block_sparse_moe.experts.1.w1.weight"]
    variants = ("truncated", "pickle", "missing file", "missing tensor", "malformed index", "wrong shape",
                "another model")
    if dist.get_rank() == 0:
        for variant in variants:
            bad = os.path.join(root, "bad", variant)
            shutil.copytree(src, bad)
            path = os.path.join(bad, shard)
            if variant == "truncated":
                os.truncate(path, os.path.getsize(path) - 10)
            elif variant == "pickle":  # (a copy first: load_file maps the file that torch.save overwrites)
                torch.save({k: v.clone() for k, v in load_file(path).items()}, path)
            elif variant == "missing file":
                os.remove(path)
            elif variant == "missing tensor":
                kept = {k: v.clone() for k, v in load_file(path).items()}
                del kept["model.layers.0.block_sparse_moe.experts.1.w1.weight"]
                save_file(kept, path, metadata={"format": "pt"})
                doc = dict(index, weight_map={k: v for k, v in index["weight_map"].items()
                                              if k != "model.layers.0.block_sparse_moe.experts.1.w1.weight"})
                json.dump(doc, open(os.path.join(bad, "model.safetensors.index.json"), "w"))
            elif variant == "malformed index":
                open(os.path.join(bad, "model.safetensors.index.json"), "w").write('{"weight_map": {"a": ')
            elif variant == "wrong shape":
                kept = {k: v.clone() for k, v in load_file(path).items()}
                kept["model.layers.0.block_sparse_moe.experts.1.w1.weight"] = torch.zeros(40, 32, dtype=torch.float64)
                save_file(kept, path, metadata={"format": "pt"})
            elif variant == "another model":
                shutil.rmtree(bad)
                config = MixtralConfig(**{**LLAMA, "num_hidden_layers": 3, "intermediate_size": 48},
                                       num_local_experts=4, num_experts_per_tok=2)
                MixtralForCausalLM(config).to(torch.float64).save_pretrained(bad, max_shard_size="20KB")
    dist.barrier()
    out = {}
    for variant in variants:
        try:
            pm.load(os.path.join(root, "bad", variant))
            out[variant] = "loaded"
        except CheckpointError as exc:
            out[variant] = str(exc)
    return out


@dataclasses.dataclass(frozen=True)
class InDirectory:
    """A check given its group's directory under the test's tmp_path (picklable, named as the check)."""

    check: Callable[[str], Any]
    root: str

    @property
    def __name__(self) -> str:
        return self.check.__name__

    def __call__(self) -> Any:
        return self.check(self.root)


WORLD4 = [llama_tp2_pp2]
WORLD2 = [mixtral_ep2, mplan_checkpoint_converted, bad_directories, families_exported]


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory):
    root = str(tmp_path_factory.mktemp("hf4"))
    return run_checks(4, [InDirectory(check, root) for check in WORLD4], timeout_s=300)


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory):
    root = str(tmp_path_factory.mktemp("hf2"))
    return run_checks(2, [InDirectory(check, root) for check in WORLD2], timeout_s=300)


def _assert_round_trip(result: dict[str, Any], plan: str) -> None:
    assert result["ran"].startswith(plan), result
    assert result["untrained"] == {"keys": True, "files": True, "exact": True, "index": True,
                                   "num_files": result["untrained"]["num_files"]}, result
    assert result["untrained"]["num_files"] > 1, result  # the index path ran
    assert result["logits"] < TOL and result["loss"] < TOL, result
    assert result["split_kept"], result


def test_llama_tp2_pp2_trains_from_hf_and_exports(world4) -> None:
    values = world4.assert_passed(llama_tp2_pp2)
    _assert_round_trip(values[0], "dp=1,tp=2,pp=2")


def test_mixtral_ep2_trains_from_hf_and_exports(world2) -> None:
    values = world2.assert_passed(mixtral_ep2)
    _assert_round_trip(values[0], "dp=2,tp=1,pp=1,vpp=1,ep=2")


def test_conversions_are_exact(world2) -> None:
    first = world2.assert_passed(mplan_checkpoint_converted)[0]
    # a conversion keeps no file split (an mplan checkpoint has none): one file, or max_shard_bytes
    assert first["mplan -> hf"]["keys"] and first["mplan -> hf"]["exact"], first
    assert first["mplan -> hf"]["num_files"] == 1, first
    assert first["hf -> mplan -> hf"]["keys"] and first["hf -> mplan -> hf"]["exact"], first
    assert first["hf -> mplan -> hf"]["num_files"] > 1, first
    # the mplan checkpoint holds transformers' own parameters (experts stacked), as pm.load wants them
    assert first["mplan names"] == ["model/model.layers.0.mlp.experts.down_proj",
                                    "model/model.layers.0.mlp.experts.gate_up_proj"], first


def test_converted_hf_directory_loads_as_mplan_checkpoint(world2) -> None:
    for result in world2.assert_passed(mplan_checkpoint_converted):
        assert result["pm.load"] == "exact", result


EXPECTED_ERRORS = {
    "truncated": "truncated or corrupt",
    "pickle": "is a pickle (torch.save), not safetensors",
    "missing file": "which does not exist",
    "missing tensor": "has no tensor model.layers.0.block_sparse_moe.experts.1.w1.weight",
    "malformed index": "not valid JSON",
    "wrong shape": "has shape [40, 32], this model's model.layers.0.mlp.experts.gate_up_proj needs [48, 32]",
    "another model": "holds model.layers.2.block_sparse_moe.experts.0.w1.weight, which this model "
                     "(MixtralForCausalLM) does not have: another model's weights?",
}


def test_bad_directories_fail_on_every_rank_naming_the_file(world2) -> None:
    per_rank = world2.assert_passed(bad_directories)
    for rank, errors in enumerate(per_rank):
        for variant, expected in EXPECTED_ERRORS.items():
            message = errors[variant]
            assert expected in message, (rank, variant, message)
            assert os.sep + "bad" + os.sep + variant in message, (rank, variant, message)  # names the file
            assert "\n" not in message, (rank, variant, message)


def test_mplan_families_export_as_hf(world2) -> None:
    per_rank = world2.assert_passed(families_exported)
    architectures = {"llama": "LlamaForCausalLM", "moe": "MixtralForCausalLM", "gpt": "GPT2LMHeadModel"}
    for family, result in per_rank[0].items():
        assert result["architecture"] == architectures[family], result
        assert result["logits"] < TOL, (family, result)
    for result in per_rank:
        assert all(r["reloaded exact"] for r in result.values()), result
        for family, r in result.items():  # without a recorded config: refused on every rank, saying how
            assert r["refused"] == "autoparallel recorded the family's config" or (
                "has no Hugging Face config to write" in r["refused"]
                and f"exports as {architectures[family]}" in r["refused"]), r


def test_family_that_has_no_hf_equivalent_is_refused() -> None:
    from mplan.models import build_model
    from mplan.models.hf_names import NotMappable, hf_config

    for spec, why in (("moe:layers=1,hidden=32,heads=4,seq=16,vocab=64,ffn=48,experts=4,shared=16", "shared expert"),
                      ("moe:layers=1,hidden=32,heads=4,seq=16,vocab=64,ffn=48,experts=4,capacity=1.0", "dropless")):
        with pytest.raises(NotMappable, match=why):
            hf_config(build_model(spec, device="meta").config)
