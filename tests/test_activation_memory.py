"""What one block keeps for backward, measured on gloo CPU ranks, against the planner's count.

Role: holds the planner's activation counting (`ir/op_table.py`'s saved tensors,
`sharding_ilp._saved_bytes`, `unit_costs`) to what mplan's runtime really keeps, under tensor
parallelism and sequence parallelism, with and without selective recomputation.
Input: three small models of 2 layers, hidden 64, sequence 32, in float64 (mplan's Llama and
GPT families and a Hugging Face `LlamaForCausalLM`), each built by `mplan.autoparallel` under
the plans of LAYOUTS x RECOMPUTE on ONE gloo group of 2 ranks for the whole module; micro-batch 2.
Each model is captured once per rank (tests/capture_cache.py; torch.export took ~3/4 of the
module's time, 13 captures of the same model at the same inputs): the planner and every
`autoparallel` call get their own deep copy of that capture, so no plan's passes see another's graph.
Measured: one micro-batch's forward of the local program (`pm.program`, a torch.fx GraphModule)
run node by node through a `torch.fx.Interpreter`, with `torch.autograd.graph.saved_tensors_hooks`
active only while the nodes of the first block instance run (the nodes of its IR segment, the
reshards the passes put in front of its ops, or the checkpointed unit `passes/recompute.py` made
of them), plus, under selective recomputation, the outputs that unit's checkpoint policy caches:
every storage counted once (`untyped_storage().data_ptr()`), parameters and buffers left out.
Predicted: `Planner(...).units(tp, sp, mbs)` on the same captured graph, under the layout the
resolved plan names: the block's `saved_bytes` (recompute none) or `selective_bytes`.
Invariant asserted: they are equal, byte for byte, on every rank (the README claims "equal in
all 18 cases"; a tolerance of 3% stood here until 2026-12-05, when every case was already exact).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

import mplan
from mplan.cost_models.presets import local_cluster
from mplan.models import build_model
from mplan.passes import recompute
from mplan.planner.search import Planner

from capture_cache import captured, reused_captures
from distributed import run_checks

MODELS = {"llama": "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,seq=32,vocab=64",
          "gpt": "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=64",
          "hf": "Hugging Face LlamaForCausalLM: 2 layers, hidden 64, 8 heads, 4 KV heads, ffn 128, vocab 64"}
LAYOUTS = ("dp=2", "tp=2", "tp=2,sp=1")
RECOMPUTE = ("none", "selective")
MBS, SEQ, VOCAB = 2, 32, 64


def _model(name: str) -> tuple[torch.nn.Module, str]:
    """The model and the IR name of its first block instance."""
    if name == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        # two KV heads per rank at tp=2: with one, repeat_kv's expand-and-reshape is a view on each
        # rank while the capture (all heads) sees a copy, which this test does not hold the planner to
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)
        return LlamaForCausalLM(config).to(torch.float64), "model.layers.0"
    return build_model(MODELS[name], device="cpu", dtype=torch.float64), "layers.0"


def _labels(pm: Any) -> dict[str, str | None]:
    """The IR segment each op node of the local program runs: its own (IR nodes keep their names),
    the node's a lowered op's module is named after (`vocab_embedding_embedding`), the segment a
    checkpointed unit was made of; other nodes (reshards) join the next op's, as the passes emit
    them in front of the op that reads them and `passes/recompute.py` assigns them."""
    segment_of = {name: seg.name for seg in pm.graph.segments for name in seg.nodes}
    unit_of = {seg.name.replace(".", "_"): seg.name for seg in pm.graph.segments}
    labels: dict[str, str | None] = {}
    following = None
    for node in reversed([n for n in pm.program.graph.nodes if n.op in ("call_function", "call_module")]):
        label = segment_of.get(node.name)
        target = str(node.target)
        if label is None and node.op == "call_module" and not target.startswith("reshard_"):
            if isinstance(pm.program.get_submodule(target), recompute.CheckpointedUnit):
                label = unit_of[target.split("_", 2)[2]]  # recompute_{k}_{segment}
            else:
                label = next((segment_of[target[i + 1:]] for i, c in enumerate(target)
                              if c == "_" and target[i + 1:] in segment_of), None)
        labels[node.name] = following = label or following
    return labels


class _BlockProbe(fx.Interpreter):
    """Runs a local program node by node, recording the storages autograd saves while the nodes of
    one segment run (`kept`: data pointer -> bytes)."""

    def __init__(self, pm: Any, segment: str) -> None:
        super().__init__(pm.program)
        self.labels, self.segment = _labels(pm), segment
        self.skip = {t.untyped_storage().data_ptr() for t in (*pm.params.values(), *pm.statics.values())}
        self.kept: dict[int, int] = {}
        self.active = False

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    def run_node(self, n: fx.Node) -> Any:
        if self.labels.get(n.name) != self.segment:
            return super().run_node(n)
        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.keep, lambda t: t):
                return super().run_node(n)
        finally:
            self.active = False


@contextmanager
def _cached_by_selective_checkpoints(probe: _BlockProbe) -> Iterator[list[dict]]:
    """The caches of the selective checkpoints opened while `probe` is active: what their policy
    keeps instead of recomputing (the checkpoint's own saved tensors are placeholders that no hook
    outside it sees; its inputs it saves through the probe's hook)."""
    caches: list[dict] = []
    make = recompute._selective_contexts

    def recording() -> tuple[Any, Any]:
        contexts = make()
        if probe.active:
            caches.append(contexts[0].storage)
        return contexts

    recompute._selective_contexts = recording
    try:
        yield caches
    finally:
        recompute._selective_contexts = make


def _measure(pm: Any, ids: torch.Tensor, labels: torch.Tensor, block: str) -> int:
    """Bytes `block` keeps for backward during one micro-batch's forward on this rank."""
    probe = _BlockProbe(pm, block)
    with _cached_by_selective_checkpoints(probe) as caches:
        loss = probe.run(*pm._feed(pm.program, (ids, labels)))
    for cache in caches:
        for entry in tree_leaves([list(per.values()) for per in cache.values()]):
            if isinstance(getattr(entry, "val", None), torch.Tensor):
                probe.keep(entry.val)
    del loss
    return sum(probe.kept.values())


def _check(model_name: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Measured and predicted bytes of the first block under every plan, on this rank."""
    model, block = _model(model_name)
    gen = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, VOCAB, (2 * MBS, SEQ), generator=gen) for _ in range(2))
    key = ("activation_memory", model_name)
    with reused_captures(key):
        planner = Planner(captured(key, model, (ids[:MBS],)),
                          local_cluster({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}), runtime="mplan",
                          tp_layout="megatron")
        return _measure_plans(model, block, planner, ids, labels)


def _measure_plans(model: torch.nn.Module, block: str, planner: Planner, ids: torch.Tensor,
                   labels: torch.Tensor) -> dict[tuple[str, str], dict[str, Any]]:
    import torch.distributed as dist

    out = {}
    for layout in LAYOUTS:
        for mode in RECOMPUTE:
            dp = 2 if layout == "dp=2" else 1
            pm = mplan.autoparallel(model, example_inputs=(ids[:MBS],), global_batch=MBS * dp,
                                    micro_batch_size=MBS, plan=f"{layout},recompute={mode}", device="cpu")
            plan = pm.plan
            assert (plan.tp_layout, plan.micro_batch_size, plan.recompute) == ("megatron", MBS, mode)
            rows = slice(dist.get_rank() * MBS, (dist.get_rank() + 1) * MBS) if dp > 1 else slice(0, MBS)
            pm.train_step(ids[:MBS * dp], labels[:MBS * dp])  # one step first: one-time work out of the count
            # the micro-batch's own tensors: a slice would keep (and count) the caller's whole batch
            measured = _measure(pm, ids[rows].clone(), labels[rows].clone(), block)
            units = planner.units(plan.mesh.tp, plan.sequence_parallel, MBS)
            solved = planner.sharded(plan.mesh.tp, plan.sequence_parallel).shardings[MBS].choice
            segment = next(s for s in pm.graph.segments if s.name == block)
            assert all(str(pm.choice[n]) == str(solved[n]) for n in segment.nodes), "another layout than the plan's"
            unit = next(u for u in units if u.name == block)
            out[(layout, mode)] = {"plan": plan.spec(), "measured": measured,
                                   "predicted": unit.saved_bytes if mode == "none" else unit.selective_bytes}
    return out


def check_llama() -> dict[tuple[str, str], dict[str, Any]]:
    return _check("llama")


def check_gpt() -> dict[tuple[str, str], dict[str, Any]]:
    return _check("gpt")


def check_hf_llama() -> dict[tuple[str, str], dict[str, Any]]:
    return _check("hf")


CHECKS: dict[str, Callable[[], Any]] = {"llama": check_llama, "gpt": check_gpt, "hf": check_hf_llama}

CASES = [pytest.param(model, layout, mode, id=f"{model}-{layout}-{mode}")
         for model in CHECKS for layout in LAYOUTS for mode in RECOMPUTE]


@pytest.fixture(scope="module")
def outcomes() -> Any:
    return run_checks(2, list(CHECKS.values()), timeout_s=300)


@pytest.mark.parametrize("model, layout, mode", CASES)
def test_the_planner_counts_what_one_block_keeps_for_backward(outcomes: Any, model: str, layout: str,
                                                              mode: str) -> None:
    for rank, cases in enumerate(outcomes.assert_passed(CHECKS[model])):
        case = cases[(layout, mode)]
        error = case["predicted"] / case["measured"] - 1
        assert case["predicted"] == case["measured"], \
            f"rank {rank}, plan {case['plan']}: measured {case['measured']} bytes, predicted {case['predicted']} ({error:+.3%})"
