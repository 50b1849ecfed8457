"""Models as users bring them, in one process: what broke on 2026-12-01 (issue "Exact on any
model", defects A-H), each held by a test that failed before its fix.

The distributed half (every zoo model under every plan against the plain loop) is
tests/test_zoo.py; this module checks the pieces in isolation, fast.
"""
from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo_models
from distributed import rel_err
from mplan.ir.placement import R, Shard
from mplan.ir.strategy import LOWERINGS, parse_strategy
from mplan.ir.trace import MissingLoss, capture_for_training
from mplan.planner.op_registry import REGISTRY, strategies_for

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def graph_of(name: str):  # noqa: ANN201 - a Graph
    zoo = zoo_models.ZOO[name]
    ids = zoo_models.batches(2, 1, zoo.vocab, zoo.seq)[0][0]
    return capture_for_training(zoo.make(), (ids,), loss_fn=zoo.loss_fn)


# -- A: default Hugging Face configs (use_cache=True) -----------------------------------------------
def test_a_shipped_config_with_its_cache_on_captures_the_training_step_only() -> None:
    """transformers 5 builds a DynamicCache in training when use_cache is on (every shipped
    config): the capture turns it off, so the graph holds the loss and the logits, no cache ops."""
    zoo = zoo_models.ZOO["llama"]
    assert zoo.make().config.use_cache  # as shipped
    graph = graph_of("llama")
    assert len(graph.program.graph_signature.output_specs) == 2  # loss, logits
    assert not any(n.op.startswith("aten.cat") and any(m.shape == (0,) for m in n.input_metas) for n in graph.nodes)


class _EmptyCacheCat(nn.Module):
    """The concatenation a fresh KV cache makes: `torch.tensor([])` joined to the new keys."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        keys = self.proj(x).view(x.shape[0], 4, 2, 4)
        joined = torch.cat([torch.tensor([], dtype=keys.dtype), keys], dim=-2)
        return (joined.sum() - labels.sum()) ** 2


def test_a_empty_tensors_join_a_sharded_concatenation() -> None:
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    graph = capture_for_training(_EmptyCacheCat().double(), (x,))
    cat = next(n for n in graph.nodes if n.op.startswith("aten.cat"))
    assert cat.input_metas[0].shape == (0,)
    split = [s for s in strategies_for(cat, 2) if s.split]
    assert split and all(s.inputs[0] == R and isinstance(s.inputs[1], Shard) for s in split)


# -- B: no clipping unless asked ----------------------------------------------------------------------
def test_b_the_default_step_does_not_clip() -> None:
    import mplan

    assert inspect.signature(mplan.autoparallel).parameters["max_grad_norm"].default is None
    zoo = zoo_models.ZOO["einsum_lm"]
    data = zoo_models.batches(4, 3, zoo.vocab, zoo.seq)
    optimizer = functools.partial(torch.optim.SGD, lr=50.0)  # a step whose gradient norm clipping would cut
    pm = mplan.autoparallel(zoo.make(), example_inputs=(data[0][0],), loss_fn=zoo.loss_fn, optimizer=optimizer,
                            global_batch=4, plan="dp=1")
    losses = [pm.train_step(x, y) for x, y in data]
    reference, _ = zoo_models.reference_training(zoo, data, optimizer)
    assert pm.last_grad_norm is None
    assert max(abs(a - b) / b for a, b in zip(losses, reference)) < 1e-12


# -- C: tied weights are one parameter ----------------------------------------------------------------
def test_c_a_tied_head_is_one_parameter_under_both_names() -> None:
    import mplan

    graph = graph_of("nanogpt")
    assert graph.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in graph.params
    zoo = zoo_models.ZOO["nanogpt"]
    data = zoo_models.batches(4, 3, zoo.vocab, zoo.seq)
    pm = mplan.autoparallel(zoo.make(), example_inputs=(data[0][0],), loss_fn=zoo.loss_fn, optimizer=OPTIMIZER,
                            global_batch=4, plan="dp=1")
    assert len(pm.params) == len(graph.params)  # the optimizer steps the shared weight once
    for x, y in data:
        pm.train_step(x, y)
    state = pm.full_state_dict()
    _, reference = zoo_models.reference_training(zoo, data, OPTIMIZER)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    assert set(state) == set(reference)
    assert max(rel_err(state[k], v) for k, v in reference.items()) < 1e-12


# -- D: split and chunk cut the dim they name ----------------------------------------------------------
@pytest.mark.parametrize("name", ["nanogpt", "einsum_lm"])
def test_d_a_split_is_never_sharded_along_the_dim_it_cuts(name: str) -> None:
    """nanoGPT's `c_attn(x).split(n_embd, dim=2)`, einsum_lm's `chunk(2, dim=-1)` (gate/up and RoPE
    halves): the dim is the call's third argument, not its second (a size or a count)."""
    graph = graph_of(name)
    splits = [n for n in graph.nodes if n.op.startswith(("aten.split", "aten.chunk"))]
    assert splits, f"{name}: no split captured"
    for node in splits:
        rank = len(node.input_metas[0].shape)
        cut = int(node.args[2]) % rank
        assert all(s.inputs[0] != Shard(cut) for s in strategies_for(node, 2)), node.name
        assert any(s.split for s in strategies_for(node, 2))  # the other dims still shard


# -- E: anything the planner can pick, a pass lowers ----------------------------------------------------
def test_e_every_lowering_the_registry_names_is_implemented() -> None:
    from mplan.passes.local_ops import ATEN_LOWERINGS, MODULE_LOWERINGS

    assert ATEN_LOWERINGS | MODULE_LOWERINGS == LOWERINGS and not ATEN_LOWERINGS & MODULE_LOWERINGS
    offered = {s.lowering for name in zoo_models.ZOO for node in graph_of(name).nodes for n in (2, 4)
               for s in strategies_for(node, n)}
    assert offered <= LOWERINGS
    assert {"local", "reshape_local", "row_bias", "vocab_embedding", "vocab_loss"} <= offered


def test_e_a_causal_mask_fill_is_lowered_where_it_is_split() -> None:
    graph = graph_of("nanogpt")
    fills = [n for n in graph.nodes if n.op.startswith("aten.masked_fill")]
    assert fills
    for node in fills:
        heads = [s for s in strategies_for(node, 2) if s.split and s.inputs[0] == Shard(1)]
        assert heads and all(s.lowering == "local" and s.inputs[1] == R for s in heads)  # the mask broadcasts
    assert all(entry.rule is not None for entry in REGISTRY.values())


def test_e_a_plan_naming_a_lowering_no_pass_has_is_refused_before_running() -> None:
    from mplan.ir.sharding import UnexecutableStrategy, check_sharding

    graph = graph_of("einsum_lm")
    choice = {n.name: strategies_for(n, 1)[0] for n in graph.nodes}
    victim = next(n for n in graph.nodes if n.op.startswith("aten.silu"))
    choice[victim.name] = parse_strategy("invented:sharded_silu[S(0)->S(0)|S(0)]*")
    with pytest.raises(UnexecutableStrategy, match="sharded_silu"):
        check_sharding(graph, choice)


# -- G: refusals name what is not supported and what to do -----------------------------------------------
def test_g_a_job_wide_error_under_torchrun_prints_one_line_on_rank_zero(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, mplan\n"
        "from mplan.refusal import install_excepthook\n"
        "install_excepthook()\n"
        "mplan.autoparallel(torch.nn.Linear(4, 4), example_inputs=(torch.zeros(2, 4),), global_batch=0)\n",
        encoding="utf-8")
    for rank, expected in (("0", 1), ("1", 0)):
        env = {**os.environ, "RANK": rank}
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert len([line for line in lines if line.startswith("mplan: error:")]) == expected, done.stderr
        if expected:
            assert "global_batch must be a positive number of sequences, got 0" in done.stderr


# -- H: a plain module, and Hugging Face's own constructor --------------------------------------------------
class _LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_h_a_module_without_a_loss_is_told_to_pass_loss_fn() -> None:
    import mplan

    ids = torch.randint(0, 64, (4, 16))
    message = r"_LogitsOnly.forward\(ids\) takes no labels.*pass loss_fn="
    with pytest.raises(MissingLoss, match=message):
        mplan.plan(_LogitsOnly(), (ids,), cluster=mplan.ClusterSpec.preset("cpu", gpus_per_node=1), global_batch=4)
    with pytest.raises(MissingLoss, match=message):
        mplan.autoparallel(_LogitsOnly(), example_inputs=(ids,), global_batch=4)
    pm = mplan.autoparallel(_LogitsOnly().double(), example_inputs=(ids,), global_batch=4,
                            loss_fn=lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
    assert pm.train_step(ids, ids) > 0 and pm(ids).shape == (4, 16, 64)


def test_h_automodel_from_config_plans_and_runs_as_written() -> None:
    import mplan
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(config).double()
    ids = torch.randint(0, 64, (4, 16))
    made = mplan.plan(model, (ids,), cluster=mplan.ClusterSpec.preset("cpu", gpus_per_node=1), global_batch=4)
    pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=4, plan=made)
    assert pm.plan.planner["unbound_ops"] == 0  # the plan was made on the very graph that runs
    assert pm.train_step(ids, ids) > 0 and pm(ids).shape == (4, 16, 64)
