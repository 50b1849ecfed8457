"""The passes in one process: layouts, shards, local programs checked on meta tensors, errors.

`insert_collectives` output is verified between passes by `check_local_graph` (every node's
shape equals the global shape divided on its sharded dim) for every TP rank, Megatron and
ILP-chosen strategies, with and without sequence parallelism, on mplan's families and Hugging
Face Llama. Numerical equivalence on real ranks is in test_equivalence*.py.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
from torch import nn

from mplan.collectives.redistribute import AxisGroup as TensorParallelAxis
from mplan.collectives.redistribute import apply_transition
from mplan.ir.placement import P, R, S
from mplan.ir.sharding import (ParameterPlacementConflict, UnexecutableStrategy, check_sharding, parameter_layouts,
                               tp_reduced_parameters)
from mplan.ir.strategy import Strategy
from mplan.ir.trace import capture
from mplan.models import build_model
from mplan.passes.insert_collectives import insert_collectives
from mplan.passes.shard_parameters import shard_parameters, shard_tensor
from mplan.passes.verifier import LocalGraphMismatch, check_local_graph
from mplan.planner.op_registry import replicated
from mplan.planner.tp_layout import solve_tp_layout


@functools.lru_cache(maxsize=None)
def graph_of(spec: str, batch: int = 2):
    model = build_model(spec, device="meta", dtype=torch.float64)
    ids = torch.zeros(batch, 16, dtype=torch.int64, device="meta")
    return capture(model, (ids,), labels=ids.clone())


def _coster(n: int):
    from mplan.cost_models.presets import local_cluster
    from mplan.ir.mesh import GroupShape
    from mplan.planner.op_cost import OpCoster

    return OpCoster(local_cluster({"WORLD_SIZE": str(n)}), n, GroupShape(size=n, ranks_per_node=n))


def layout_of(graph, tp: int, sp: bool, strategies: str = "megatron"):
    return solve_tp_layout(graph, _coster(tp), sp=sp, layout=strategies).choice


@functools.lru_cache(maxsize=None)
def choice_of(spec: str, tp: int, sp: bool, strategies: str = "megatron"):
    return layout_of(graph_of(spec), tp, sp, strategies)


CASES = [("tiny-llama", 2, False, "megatron"), ("tiny-llama", 2, True, "megatron"),
         ("tiny-llama", 4, True, "megatron"), ("tiny-gpt", 4, False, "megatron"),
         ("tiny-gpt", 2, True, "megatron"), ("tiny-llama", 2, True, "ilp"), ("tiny-gpt", 2, False, "ilp")]


@pytest.mark.parametrize("spec,tp,sp,strategies", CASES, ids=lambda v: str(v))
def test_local_program_shapes_on_every_rank(spec, tp, sp, strategies) -> None:
    graph, choice = graph_of(spec), choice_of(spec, tp, sp, strategies)
    check_sharding(graph, choice)
    for rank in range(tp):
        program = insert_collectives(graph, choice, TensorParallelAxis(group=None, size=tp, rank=rank), device="meta")
        out = check_local_graph(program, graph)
        assert out.shape == ()  # the loss, replicated


def test_megatron_layout_of_llama_under_sp() -> None:
    layouts = parameter_layouts(graph_of("tiny-llama"), choice_of("tiny-llama", 2, True))
    assert layouts["layers.0.attn.q_proj.weight"].placement == S(0)  # column
    assert layouts["layers.0.attn.o_proj.weight"].placement == S(1)  # row
    assert layouts["layers.0.mlp.down_proj.weight"].placement == S(1)
    assert layouts["embed.weight"].placement == S(0) and layouts["lm_head.weight"].placement == S(0)
    # the final norm runs on sequence shards: replicated weight, partial gradient
    assert "norm.weight" in tp_reduced_parameters(layouts)
    assert not any(layouts[name].tp_sharded for name in tp_reduced_parameters(layouts))


def test_megatron_layout_takes_a_hugging_face_head_by_vocabulary() -> None:
    """Megatron's layout runs the head by vocabulary, as the fused head + loss needs. On this HF
    Llama (RMSNorm in float64 ops, sequence parallel) the head by rows, its logits all-reduced,
    costs as many collectives and 6 KB more: with the 1e-12-per-byte tie-breaker summed into one
    objective with the counts it sat under HiGHS's tolerances, and the solver returned the rows.
    The ILP minimizes the counts, then the tie-breakers (`sharding_ilp`, "Tiers")."""
    pytest.importorskip("transformers")
    from test_equivalence import batches
    from test_vocab_parallel_head_loss import BATCH, SEQ, VOCAB, hf_llama

    from mplan.ir.trace import capture_for_training

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as on the ranks (tests/distributed.py)
    try:
        graph = capture_for_training(hf_llama(), (batches(BATCH, steps=1, vocab=VOCAB, seq=SEQ)[0][0],))
    finally:
        torch.set_default_dtype(default)
    for sp in (False, True):
        layouts = parameter_layouts(graph, layout_of(graph, 2, sp))
        assert layouts["lm_head.weight"].placement == S(0), (sp, layouts["lm_head.weight"])


def test_kv_heads_fewer_than_tp_replicate_kv() -> None:
    """tiny-llama has 4 query and 2 key/value heads: at tp=4 each rank takes one query head and
    reads the kv head of its group from whole k and v."""
    graph, choice = graph_of("tiny-llama"), choice_of("tiny-llama", 4, True)
    attention = [n for n in graph.nodes if n.kind == "attention"]
    assert all(choice[n.name].name == "heads_kv_replicated" for n in attention)
    program = insert_collectives(graph, choice, TensorParallelAxis(group=None, size=4, rank=3), device="meta")
    modules = [m for m in program.modules() if type(m).__name__ == "KVReplicatedAttention"]
    assert [(m.start, m.count) for m in modules] == [(1, 1)] * len(attention)  # q head 3 -> kv head 1


def test_row_parallel_bias_is_reduced_once_per_step() -> None:
    graph, choice = graph_of("tiny-gpt"), choice_of("tiny-gpt", 2, False)
    layouts = parameter_layouts(graph, choice)
    biases = [n.inputs[2] for n in graph.nodes if choice[n.name].name == "row" and len(n.inputs) == 3]
    assert "layers.0.mlp.fc_out.bias" in biases
    assert all(layouts[b].grad_partial and layouts[b].placement == R for b in biases)
    assert layouts["layers.0.mlp.fc_in.bias"].placement == S(0)


def test_consumers_disagreeing_on_a_parameter_fail_clearly() -> None:
    graph = graph_of("gpt:layers=1,hidden=32,heads=4,seq=16,vocab=64,tie=1")
    choice = dict(layout_of(graph, 2, False))
    head = next(n for n in graph.nodes if n.op.startswith("aten.linear") and "embed.weight" in n.inputs)
    choice[head.name] = replicated(head)  # the tied embedding is S(0) for its lookup
    with pytest.raises(ParameterPlacementConflict, match="embed.weight"):
        parameter_layouts(graph, choice)


def test_tied_embedding_gets_one_placement() -> None:
    """The ILP prices ops alone; solve_graph_sharding re-solves with the tied weight pinned (found by the
    hypothesis test: vocabulary-parallel lookup and a row-parallel head on one tensor)."""
    spec = "llama:layers=2,hidden=8,heads=2,kv_heads=1,ffn=16,seq=16,vocab=64,tie=1"
    graph, choice = graph_of(spec), choice_of(spec, 2, False)
    layout = parameter_layouts(graph, choice)["embed.weight"]
    assert layout.placement == S(0) and len(layout.consumers) == 2
    check_sharding(graph, choice)


def test_unexecutable_strategy_names_node_and_strategy() -> None:
    graph = graph_of("tiny-gpt")
    choice = dict(choice_of("tiny-gpt", 2, False))
    arange = next(n for n in graph.nodes if n.op.startswith("aten.arange"))
    choice[arange.name] = Strategy(name="invented", inputs=(), output=S(0), input_grads=(), split=True,
                                   lowering="sharded_arange")
    with pytest.raises(UnexecutableStrategy, match=f"node {arange.name}.*invented.*sharded_arange"):
        check_sharding(graph, choice)


def test_impossible_edge_is_refused() -> None:
    graph = graph_of("tiny-llama")
    choice = dict(choice_of("tiny-llama", 2, False))
    node = next(n for n in graph.nodes if n.op.startswith("aten.silu")
                and choice[n.inputs[0]].output != P)  # its input is not a partial sum
    choice[node.name] = Strategy(name="partial", inputs=(P,), output=P, input_grads=(R,), split=False)
    with pytest.raises(UnexecutableStrategy, match="no collective turns"):
        check_sharding(graph, choice)


def test_verifier_catches_a_wrong_local_size() -> None:
    graph, choice = graph_of("tiny-llama"), choice_of("tiny-llama", 2, False)
    program = insert_collectives(graph, choice, TensorParallelAxis(group=None, size=2, rank=0), device="meta")
    reshape = next(n for n in program.graph.nodes if n.target is torch.ops.aten.reshape.default)
    reshape.args = (reshape.args[0], [*reshape.args[1][:-2], reshape.args[1][-2] * 2, reshape.args[1][-1] // 2])
    program.recompile()
    with pytest.raises(LocalGraphMismatch, match=reshape.name):
        check_local_graph(program, graph)


def test_hugging_face_llama_local_program() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.zeros(2, 8, dtype=torch.int64)
    graph = capture(model, (ids,), labels=ids.clone())
    choice = layout_of(graph, 2, True)
    check_sharding(graph, choice)
    program = insert_collectives(graph, choice, TensorParallelAxis(group=None, size=2, rank=1), device="meta")
    check_local_graph(program, graph)
    # HF's assertions about captured tensors are dropped; its logits output is not returned
    assert not any("assert" in str(n.target) for n in program.graph.nodes)


def test_assertions_emit_no_collective_in_any_layout() -> None:
    """An assertion reads its input as it arrives (`op_registry._assertion`): the passes drop it
    and reshard nothing for it, under the ILP's layout and Megatron's, with sequence parallelism
    (HF's RMSNorm asserts before its float32 upcast, on sequence shards). Every copy in the local
    program feeds an op that runs, and reads its value as that op's strategy asks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mplan.ir.op_table import op_packet
    from mplan.passes.insert_collectives import Redistribute

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(2, 8, dtype=torch.int64)
    graph = capture(model, (ids,), labels=ids.clone())
    asserts = {n.name for n in graph.nodes if op_packet(n.op) == "_assert_tensor_metadata"}
    for strategies in ("ilp", "megatron"):
        choice = layout_of(graph, 2, True, strategies)
        assert any(choice[a].inputs[0] != R for a in asserts)  # some read shards: a gather would be priced
        check_sharding(graph, choice)
        reads = {(value, choice[v.name].inputs[slot], choice[v.name].input_grads[slot])
                 for v in graph.nodes if v.name not in asserts for slot, value in enumerate(v.inputs)}
        for rank in range(2):
            program = insert_collectives(graph, choice, TensorParallelAxis(group=None, size=2, rank=rank), device="meta")
            check_local_graph(program, graph)
            assert not any("assert" in str(n.target) for n in program.graph.nodes)
            for node in program.graph.nodes:
                module = program.get_submodule(node.target) if node.op == "call_module" else None
                if isinstance(module, Redistribute):
                    assert node.users and (module.value, module.dst, module.grad_src) in reads, (strategies, module)


def test_one_rank_program_is_the_model() -> None:
    torch.manual_seed(0)
    model = build_model("tiny-gpt", device="cpu", dtype=torch.float64, seed=3)
    ids, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    graph = capture(model, (ids,), labels=labels)
    choice = {n.name: replicated(n) for n in graph.nodes}
    program = insert_collectives(graph, choice, TensorParallelAxis(group=None, size=1, rank=0))
    params = {k: nn.Parameter(v) for k, v in shard_parameters(graph, choice, 0, 1, model).items()}
    feed = {"input_ids": ids, "labels": labels}
    loss = program(*[params[s.name] if s.kind == "PARAMETER" else feed[s.name] for s in program.meta["mplan_inputs"]])
    loss.backward()
    expected = model(ids, labels=labels)
    expected.backward()
    assert torch.equal(loss.detach(), expected.detach())
    for name, p in model.named_parameters():
        assert torch.equal(params[name].grad, p.grad), name


def test_meta_shards_equal_slices_of_the_seeded_model() -> None:
    graph, choice = graph_of("tiny-llama"), choice_of("tiny-llama", 2, True)
    layouts = parameter_layouts(graph, choice)
    full = build_model("tiny-llama", device="cpu", dtype=torch.float64, seed=5)
    meta = build_model("tiny-llama", device="meta", dtype=torch.float64)
    for rank in range(2):
        from_meta = shard_parameters(graph, choice, rank, 2, meta, seed=5, device="cpu")
        from_state = shard_parameters(graph, choice, rank, 2, full.state_dict())
        for name, tensor in from_meta.items():
            expected = shard_tensor(dict(full.named_parameters())[name].detach(), layouts[name].placement, rank, 2)
            assert torch.equal(tensor, expected) and torch.equal(from_state[name], expected), name


def test_generic_meta_module_uses_its_own_reset() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return ((self.proj(x) - labels) ** 2).mean()

    x = torch.zeros(2, 8)
    graph = capture(Tiny(), (x,), labels=x.clone())
    choice = {n.name: replicated(n) for n in graph.nodes}
    with torch.device("meta"):
        meta = Tiny()
    a = shard_parameters(graph, choice, 0, 1, meta, seed=1)
    b = shard_parameters(graph, choice, 0, 1, meta, seed=1)
    assert all(torch.equal(a[k], b[k]) and a[k].abs().sum() > 0 for k in a)


@pytest.mark.parametrize("src,dst,shape,expected", [
    (S(1), R, (2, 4), (2, 8)), (P, S(0), (4, 3), (2, 3)), (R, S(2), (1, 2, 8), (1, 2, 4)),
    (S(0), S(1), (2, 8), (4, 4)), (P, R, (3,), (3,)),
])
def test_reshard_shapes_on_meta(src, dst, shape, expected) -> None:
    x = torch.empty(shape, device="meta")
    assert tuple(apply_transition(x, src, dst, TensorParallelAxis(group=None, size=2, rank=1)).shape) == expected


def test_real_tensors_need_a_group() -> None:
    with pytest.raises(RuntimeError, match="needs a process group"):
        apply_transition(torch.ones(4), P, R, TensorParallelAxis(group=None, size=2, rank=0))


def test_program_inputs_are_recorded_in_order() -> None:
    graph, choice = graph_of("tiny-llama"), choice_of("tiny-llama", 2, False)
    program = insert_collectives(graph, choice, TensorParallelAxis(group=None, size=2, rank=0), device="meta")
    placeholders = [n.name for n in program.graph.nodes if n.op == "placeholder"]
    specs = program.meta["mplan_inputs"]
    assert [s.placeholder for s in specs] == placeholders
    assert [s.name for s in specs if s.kind == "USER_INPUT"] == ["input_ids", "labels"]
    assert isinstance(program, fx.GraphModule)
