"""A grouped projection's weights lie end to end in one storage (mplan/runtime/grouped_storage.py),
so its GEMM reads them in place: no concatenation in a training step, and training exactly what
it is with the weights apart, on Hugging Face Llama as transformers ships it and on mplan's own."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import mplan
from distributed import run_ranks
from mplan.kernels.grouped_linear import end_to_end, joined
from mplan.models import LlamaConfig as OwnLlamaConfig, LlamaModel
from mplan.runtime import parallel_module
from mplan.runtime.grouped_storage import place_end_to_end

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
HF = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)
GROUPS = (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
          ("mlp.gate_proj.weight", "mlp.up_proj.weight"))


def _batches(steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(steps)]


def _hf(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(HF).to(dtype)


def _pm(model: torch.nn.Module, plan: str = "dp=1,tp=1,pp=1", **options: object) -> parallel_module.ParallelModule:
    return mplan.autoparallel(model, example_inputs=(_batches()[0],), optimizer=OPTIMIZER, global_batch=2,
                              plan=plan, kernels=True, device="cpu", **options)


def _apart(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module,
           **options: object) -> parallel_module.ParallelModule:
    with monkeypatch.context() as patch:
        patch.setattr(parallel_module, "place_end_to_end", lambda *args: 0)
        return _pm(model, **options)


class _Concatenations(TorchDispatchMode):
    """The shapes every aten.cat of the step produced."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default:
            self.shapes.append(tuple(out.shape))
        return out


def _group_shapes(pm: parallel_module.ParallelModule, tensors: dict[str, torch.Tensor]) -> set[tuple[int, ...]]:
    return {(sum(tensors[f"model.layers.{i}.{n}"].shape[0] for n in group), HF.hidden_size)
            for i in range(HF.num_hidden_layers) for group in GROUPS}


def _train(pm: parallel_module.ParallelModule) -> list[float]:
    return [float(pm.train_step(ids, ids)) for ids in _batches()]


def test_each_group_lies_end_to_end_and_the_model_passed_in_still_trains(tmp_path) -> None:  # noqa: ANN001
    """The model passed in holds the trained tensors (views of the groups' storage) and transformers
    saves and reloads it as it is (it clones tensors that share a storage without overlapping)."""
    model = _hf(torch.float64)
    pm = _pm(model)
    for i in range(HF.num_hidden_layers):
        for group in GROUPS:
            assert end_to_end([pm.params[f"model.layers.{i}.{n}"] for n in group])
    _train(pm)
    own = dict(model.named_parameters())
    assert all(torch.equal(own[name], param) and own[name].data_ptr() == param.data_ptr()
               for name, param in pm.params.items())
    model.save_pretrained(str(tmp_path / "saved"))
    saved = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"), torch_dtype=torch.float64)
    assert all(torch.equal(p, pm.params[n]) for n, p in saved.named_parameters())


def test_a_step_concatenates_no_group_and_trains_as_with_the_weights_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    pm, apart = _pm(_hf(torch.float64)), _apart(monkeypatch, _hf(torch.float64))
    seen = _Concatenations()
    with seen:
        pm.train_step(_batches()[0], _batches()[0])
    assert not _group_shapes(pm, pm.params) & set(seen.shapes)
    with _Concatenations() as before:  # the same step with the weights apart does concatenate them
        apart.train_step(_batches()[0], _batches()[0])
    assert _group_shapes(apart, apart.params) <= set(before.shapes)
    assert _train(pm) == _train(apart)
    assert all(torch.equal(param, apart.params[name]) for name, param in pm.params.items())


def test_under_autocast_the_compute_copies_lie_end_to_end_too(monkeypatch: pytest.MonkeyPatch) -> None:
    pm = _pm(_hf(torch.float32), autocast=torch.bfloat16)
    apart = _apart(monkeypatch, _hf(torch.float32), autocast=torch.bfloat16)
    assert pm.copies is not None and len(pm.copies) > 0
    copies = {name: pm.copies.of(param) for name, param in pm.params.items()}
    for i in range(HF.num_hidden_layers):
        for group in GROUPS:
            members = [copies[f"model.layers.{i}.{n}"] for n in group]
            assert all(m.dtype == torch.bfloat16 and m.is_leaf and m.requires_grad for m in members)
            assert end_to_end(members)
    with _Concatenations() as seen:
        pm.train_step(_batches()[0], _batches()[0])
    assert not _group_shapes(pm, copies) & set(seen.shapes)
    apart.train_step(_batches()[0], _batches()[0])
    assert _train(pm) == _train(apart)
    assert all(torch.equal(param, apart.params[name]) for name, param in pm.params.items())


def test_mplan_llama_groups_too_and_a_checkpoint_round_trips(tmp_path) -> None:  # noqa: ANN001 - pytest's path
    config = OwnLlamaConfig(num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, seq_len=8, vocab=32, ffn_hidden=24)
    pm = mplan.autoparallel(LlamaModel(config, device="cpu", seed=0),
                            example_inputs=(torch.zeros(2, 8, dtype=torch.long),), optimizer=OPTIMIZER,
                            global_batch=2, plan="dp=1,tp=1,pp=1", kernels=True, device="cpu")
    grouped = [p for p in pm.params.values() if p.untyped_storage().nbytes() > p.nbytes]
    assert grouped, "no parameter of mplan's Llama was placed in a group's storage"
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    pm.train_step(ids, ids)
    pm.save(str(tmp_path / "ckpt"))
    saved = {name: param.detach().clone() for name, param in pm.params.items()}
    pm.train_step(ids, ids)
    pm.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(pm.params[name], value) for name, value in saved.items())
    assert [p for p in pm.params.values() if p.untyped_storage().nbytes() > p.nbytes] == grouped  # loaded in place


def test_what_cannot_be_grouped_stays_apart() -> None:
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    tied = {"a": a, "b": b, "tie": b}  # b under two names: moving it would cut the tie
    assert place_end_to_end([("a", "b")], tied) == 0 and not end_to_end([a, b])
    mixed = {"a": a, "c": torch.randn(2, 4)}  # float64 and float32
    assert place_end_to_end([("a", "c")], mixed) == 0
    narrow = {"a": a, "d": torch.randn(2, 5, dtype=torch.float64)}  # another width
    assert place_end_to_end([("a", "d")], narrow) == 0
    values = {name: t.clone() for name, t in (("a", a), ("b", b))}
    assert place_end_to_end([("a", "b"), ("b", "a")], {"a": a, "b": b}) == 1  # b already grouped: once only
    assert end_to_end([a, b]) and torch.equal(a, values["a"]) and torch.equal(b, values["b"])
    view = joined([a, b], torch.float64)
    assert view.data_ptr() == a.data_ptr() and torch.equal(view, torch.cat([values["a"], values["b"]]))
    assert joined([a, b], torch.float32).data_ptr() != a.data_ptr()  # a cast is a copy


def test_zero3_gathers_each_group_end_to_end_in_its_own_storage() -> None:
    """zero=3 re-points the parameters into its units' storage, in the program's order: a group's
    members one after another there too."""
    pm = _pm(_hf(torch.float64), plan="dp=1,tp=1,pp=1,zero=3")
    pm.train_step(_batches()[0], _batches()[0])
    for i in range(HF.num_hidden_layers):
        for group in GROUPS:
            assert end_to_end([pm.params[f"model.layers.{i}.{n}"] for n in group])


def test_a_hugging_face_export_holds_each_weight_alone_and_loads_back_in_place(tmp_path) -> None:  # noqa: ANN001
    """save(format="hf") writes each grouped weight as its own tensor of its own shape (not the
    group's storage), transformers reads the directory as the trained model, and load puts it back
    into the group's storage."""
    from safetensors import safe_open

    pm = _pm(_hf(torch.float64))
    _train(pm)
    pm.save(str(tmp_path / "hf"), format="hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}
    for name, param in pm.params.items():
        assert stored[name].shape == param.shape and torch.equal(stored[name], param), name
    trained = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float64)
    assert all(torch.equal(p, pm.params[n]) for n, p in trained.named_parameters())
    fresh = _pm(_hf(torch.float64))
    fresh.load(str(tmp_path / "hf"))
    assert all(torch.equal(fresh.params[n], p) for n, p in pm.params.items())
    assert end_to_end([fresh.params[f"model.layers.0.{n}"] for n in GROUPS[0]])


def _on_two_ranks(plan: str) -> dict[str, bool]:
    """On each rank: whether every group this rank holds lies end to end after a step, and whether
    the model passed in kept its own full tensors (a TP shard is no alias of them)."""
    model = _hf(torch.float64)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    pm = _pm(model, plan=plan)
    with _Concatenations() as seen:
        pm.train_step(_batches()[0], _batches()[0])
    held = [[f"model.layers.{i}.{n}" for n in group] for i in range(HF.num_hidden_layers) for group in GROUPS]
    held = [names for names in held if all(n in pm.params for n in names)]
    own = dict(model.named_parameters())
    return {"grouped": bool(held) and all(end_to_end([pm.params[n] for n in names]) for names in held),
            "concatenated": any((sum(pm.params[n].shape[0] for n in names), *pm.params[names[0]].shape[1:])
                                in seen.shapes for names in held),
            "model_whole": all(own[n].shape == initial[n].shape for n in initial),
            "model_untrained": all(torch.equal(own[n], initial[n]) for names in held for n in names)}


@pytest.mark.parametrize("plan", ["dp=1,tp=2,pp=1", "dp=1,tp=1,pp=2", "dp=1,tp=1,pp=2,schedule=zb-h1",
                                  "dp=2,tp=1,pp=1,zero=1"])
def test_every_rank_lays_its_groups_end_to_end_and_leaves_a_sharded_model_whole(plan: str) -> None:
    """Under TP the model passed in is not what trains (its weights are sharded): it keeps its own
    tensors, whole, rather than being pointed at a rank's shard; under a pipeline or data
    parallelism each rank's groups lie end to end like one process's, and no step concatenates
    them: under a zero-bubble schedule either, whose split backward keeps the grouped GEMMs ATen
    linears on `joined_weights`."""
    for rank in run_ranks(2, _on_two_ranks, plan, timeout_s=300):
        assert rank["grouped"] and rank["model_whole"] and not rank["concatenated"], rank
        if "tp=2" in plan:
            assert rank["model_untrained"], rank
