"""The planner: op strategies, the sharding ILP, stage cuts, the outer search and the Plan file."""
from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.nn as nn

from mplan.cli import main as cli_main
from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import GroupShape
from mplan.ir import capture
from mplan.models import GPTConfig, LlamaConfig, build_model
from mplan.planner.op_cost import OpCoster
from mplan.planner.parallel_config import PlanSpecError, enumerate_configs, parse_plan_spec
from mplan.ir.placement import P, R, S, parse_placement, transition
from mplan.planner.plan import Plan, PlanError
from mplan.planner.plan_builder import build_plan
from mplan.planner.planning import capture_for_planning, plan
from mplan.planner.search import Planner, PlanningError
from mplan.planner.op_registry import megatron_style, strategies_for, view_dim_map
from mplan.planner.sharding_ilp import _price, _problem, solve_block_sharding, solve_segment_sharding
from mplan.planner.stage_partition import partition, partition_exhaustive


def gpt(layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 51200) -> GPTConfig:
    return GPTConfig(num_layers=layers, hidden=hidden, num_heads=heads, seq_len=seq, vocab=vocab, tie_embeddings=True)


def planning_graph(config):  # noqa: ANN001, ANN201
    # a module is priced in its own dtype, as autoparallel would train it: bf16 here
    model = build_model(config, device="meta", dtype=torch.bfloat16)
    return capture_for_planning(model, (torch.zeros(1, config.seq_len, dtype=torch.long),))


# --- placements and strategies ---------------------------------------------------------------

def test_placements_print_short_and_parse_back():
    assert [str(p) for p in (S(0), R, P)] == ["S(0)", "R", "P"]
    assert all(parse_placement(str(p)) == p for p in (S(2), R, P))
    assert transition(S(1), R) == "all_gather" and transition(P, R) == "all_reduce"
    assert transition(P, S(1)) == "reduce_scatter" and transition(S(1), S(2)) == "all_to_all"
    assert transition(R, S(0)) is None
    with pytest.raises(ValueError):
        transition(R, P)


def test_reshape_dim_mapping_keeps_only_outer_factors():
    assert view_dim_map((2, 16, 64), (2, 16, 4, 16)) == {0: 0, 1: 1, 2: 2}
    assert view_dim_map((2, 16, 4, 16), (2, 16, 64)) == {0: 0, 1: 1, 2: 2}
    assert view_dim_map((32, 64), (2, 16, 64)) == {0: 0, 1: 2}


def test_linear_and_attention_strategies_come_from_their_einsums():
    graph = capture(build_model("tiny-gpt", device="meta"), (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    q = next(n for n in graph.nodes if n.op == "aten.linear.default")
    names = {s.name for s in strategies_for(q, 2)}
    assert names == {"replicate", "batch", "column", "row"}
    column = next(s for s in strategies_for(q, 2) if s.name == "column")
    assert (column.inputs, column.output, column.input_grads) == ((R, S(0), S(0)), S(2), (P, S(0), S(0)))
    attn = next(n for n in graph.nodes if n.kind == "attention")
    assert {s.name for s in strategies_for(attn, 2)} == {"replicate", "batch", "heads"}
    assert {s.name for s in strategies_for(attn, 8)} == {"replicate"}  # 4 heads, batch 2: nothing divides


def test_an_op_without_a_rule_is_only_replicated():
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.special.erfcx(x)

    graph = capture(Odd(), (torch.randn(4, 8),))
    (node,) = [n for n in graph.nodes if not n.known]
    assert [s.name for s in strategies_for(node, 4)] == ["replicate"]


# --- the sharding ILP --------------------------------------------------------------------------

def test_ilp_rediscovers_megatron_tensor_parallelism_on_a_large_block():
    """Restricted to weight-splitting strategies the solver finds Megatron's plan exactly; free, it
    may do better (e.g. the output projection on sequence shards after an all-to-all), never worse."""
    graph = planning_graph(gpt(2, 4096, 32))
    block = graph.block_types[0]
    coster = OpCoster(ClusterSpec.preset("dgx-h100"), 8, GroupShape(size=8, ranks_per_node=8))
    megatron = solve_block_sharding(graph, block, coster, R, allow=megatron_style)
    linears = [megatron.choice[n].name for n in block.template if graph.node(n).op == "aten.linear.default"]
    # q, k, v and the MLP's first GEMM split by columns, its second by rows; the output projection
    # by rows (one all-reduce) or columns (two all-gathers): the same bytes, priced within a hair.
    assert linears[:3] == ["column"] * 3 and linears[3] in ("row", "column") and linears[4:] == ["column", "row"]
    attn = next(n for n in block.template if graph.node(n).kind == "attention")
    assert megatron.choice[attn].name == "heads"
    assert megatron.param_bytes == pytest.approx(block.num_params * 2 / 8, rel=0.01)
    free = solve_block_sharding(graph, block, coster, R)
    assert free.objective_s <= megatron.objective_s * (1 + 1e-9)
    assert free.choice[attn].name == "heads"
    assert all(free.choice[n].split for n in block.template if graph.node(n).kind == "matmul")
    one_sequence_stream = 2048 * 4096 * 2
    assert free.comm_forward_s < 4 * coster.collective("all_reduce", one_sequence_stream)


def test_ilp_with_sequence_parallel_boundary_shards_norms_along_the_sequence():
    graph = planning_graph(gpt(2, 4096, 32))
    coster = OpCoster(ClusterSpec.preset("dgx-h100"), 8, GroupShape(size=8, ranks_per_node=8))
    solved = solve_block_sharding(graph, graph.block_types[0], coster, S(1))
    norms = [solved.choice[n] for n in graph.block_types[0].template if graph.node(n).kind == "norm"]
    assert all(s.inputs[0] == S(1) for s in norms)
    plain = solve_block_sharding(graph, graph.block_types[0], coster, R)
    assert solved.saved_bytes < plain.saved_bytes * 1.2


def _mlp_graph(hidden: int = 1024):
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    with torch.device("meta"):
        model = MLP()
    return capture(model, (torch.zeros(4, 512, hidden, device="meta"),), dtype=torch.bfloat16)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ilp_optimum_equals_brute_force_over_every_assignment(n):
    graph = _mlp_graph()
    names = [v.name for v in graph.nodes]
    coster = OpCoster(ClusterSpec.preset("dgx-a100"), n, GroupShape(size=n, ranks_per_node=n))
    solved = solve_segment_sharding(graph, "mlp", names, coster, R)
    problem = _problem(graph, "mlp", names, n, R)
    options = [problem.strategies[v] for v in names]
    assert 50 < len(list(itertools.product(*options))) < 20000
    best = min(_price(problem, dict(zip(names, combo)), coster, R, 1.0).objective_s
               for combo in itertools.product(*options))
    assert solved.objective_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("boundary", [R, S(1)])
def test_the_ilp_op_prices_add_up_to_the_segment_it_solved(boundary):
    """`SegmentSharding.op_prices` splits the objective of the chosen assignment by op: compute,
    own collectives, resharding; summed, they are the segment's forward + backward."""
    graph = planning_graph(gpt(2, 1024, 16, seq=512))
    block = graph.block_types[0]
    coster = OpCoster(ClusterSpec.preset("dgx-a100"), 4, GroupShape(size=4, ranks_per_node=4))
    solved = solve_block_sharding(graph, block, coster, boundary)
    prices = solved.op_prices
    assert set(prices) == set(block.template)
    assert sum(p.compute_s + p.comm_s + p.reshard_s for p in prices.values()) == \
        pytest.approx(solved.forward_s + solved.backward_s, rel=1e-12)
    assert sum(p.comm_s + p.reshard_s for p in prices.values()) == \
        pytest.approx(solved.comm_forward_s + solved.comm_backward_s, rel=1e-12)
    assert all(min(p.compute_s, p.comm_s, p.reshard_s) >= 0 for p in prices.values())
    for name in block.template:
        node = graph.node(name)
        if node.kind in ("matmul", "attention"):
            assert prices[name].compute_s > 0
        elif node.kind in ("view", "getitem"):
            assert prices[name].compute_s == 0
    assert sum(p.reshard_s for p in prices.values()) > 0  # a tensor-parallel block reshards somewhere


@pytest.mark.slow
def test_the_ilp_solves_the_same_where_highs_first_ran_on_more_threads(tmp_path):
    """HiGHS sizes one thread scheduler per thread on its first run there. On a thread where it
    first ran on two threads, the planner's one-thread solves are refused unsolved and solved again
    under that scheduler (`sharding_ilp._SOLVERS`), to the strategies one thread finds."""
    model, out = "gpt:layers=2,hidden=512,heads=8,seq=256,vocab=4096", tmp_path / "choice.json"
    script = f"""
import json, pulp
first = pulp.LpProblem("first", pulp.LpMinimize)
x = pulp.LpVariable("x", cat="Binary")
first += x
assert first.solve(pulp.HiGHS(msg=False, threads=2)) == pulp.LpStatusOptimal
statuses, solve = [], pulp.LpProblem.solve
def recorded(problem, solver=None, **options):
    statuses.append(solve(problem, solver, **options))
    return statuses[-1]
pulp.LpProblem.solve = recorded
from mplan.cost_models.cluster import ClusterSpec
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner
sharded = Planner(capture_for_planning({model!r}), ClusterSpec.preset("dgx-h100")).sharded(4, True)
json.dump({{"choice": {{n: str(s) for n, s in sharded.sharding.choice.items()}}, "statuses": statuses}},
          open({str(out)!r}, "w"))
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    from mplan.planner.sharding_ilp import pulp  # imported as the planner imports it (sharding_ilp._load_pulp)

    there = json.loads(out.read_text())
    assert there["statuses"][:2] == [pulp.LpStatusNotSolved, pulp.LpStatusOptimal]
    here = Planner(capture_for_planning(model), ClusterSpec.preset("dgx-h100")).sharded(4, True)
    assert there["choice"] == {n: str(s) for n, s in here.sharding.choice.items()}


# --- stage cuts ---------------------------------------------------------------------------------

def test_stage_cuts_match_exhaustive_search_with_memory_caps():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        times = [rng.uniform(0.1, 3) for _ in range(n)]
        mem = [rng.uniform(0, 2) for _ in range(n)]
        cap = rng.choice([float("inf"), 3.0, 5.0])

        def memory(u: int, c: int) -> float:
            return mem[u] * (1 + 0.1 * c)

        fast, exact = partition(times, k, memory=memory, cap=cap), partition_exhaustive(times, k, memory=memory, cap=cap)
        assert (fast is None) == (exact is None)
        if exact is not None:
            assert fast.bottleneck_s == pytest.approx(exact.bottleneck_s, rel=1e-3)


def test_embedding_and_head_stages_get_fewer_layers():
    graph = planning_graph(gpt(16, 2048, 16, vocab=256000))
    planner = Planner(graph, ClusterSpec.preset("dgx-a100", nodes=1))
    best = planner.search(64, parse_plan_spec("tp=1,pp=4,dp=2,schedule=1f1b,mbs=1")).best
    sizes = [b - a for a, b in best.stage_bounds]
    assert sizes[-1] < max(sizes)  # the 256k-vocabulary head is heavy: its stage holds fewer blocks


# --- the outer search ---------------------------------------------------------------------------

def test_search_is_optimal_against_simulating_every_config():
    graph = planning_graph(gpt(4, 1024, 16, seq=1024, vocab=32000))
    cluster = ClusterSpec.preset("dgx-a100", nodes=1)
    planner = Planner(graph, cluster)
    best = planner.search(32).best
    everything = [planner.evaluate(c, fast=False) for c in enumerate_configs(
        world_size=8, gpus_per_node=8, global_batch=32, limits=planner.limits, spec=parse_plan_spec("auto"))]
    fastest = min(e.step_time_s for e in everything if e.fits)
    assert best.step_time_s <= fastest * (1 + 1e-9)
    assert len(everything) > 100


def test_small_model_with_plenty_of_memory_gets_pure_data_parallelism():
    graph = planning_graph(gpt(12, 768, 12, seq=1024, vocab=50304))
    best = Planner(graph, ClusterSpec.preset("dgx-a100", nodes=1)).search(256).best
    assert (best.config.dp, best.config.tp, best.config.pp) == (8, 1, 1)


def test_model_whose_replicas_do_not_fit_gets_its_weights_split():
    """A replica of a 70B model (8 bytes a parameter: 560 GB) fits no GPU: the plan splits the
    weights by tensor or pipeline parallelism, or shards them over data parallelism (zero=3)."""
    graph = capture_for_planning("llama3-70b")
    planner = Planner(graph, ClusterSpec.preset("dgx-h100", nodes=4))
    best = planner.search(64).best
    assert best.fits and (best.config.tp * best.config.pp >= 4 or best.config.zero == 3)
    assert best.config.tp <= 8


def test_larger_global_batch_never_makes_a_sample_slower():
    graph = planning_graph(gpt(8, 2048, 16))
    planner = Planner(graph, ClusterSpec.preset("dgx-a100", nodes=2))
    per_sample = [planner.search(b).best.step_time_s / b for b in (32, 64, 128, 256)]
    assert all(later <= earlier * (1 + 1e-6) for earlier, later in zip(per_sample, per_sample[1:]))


def test_tensor_parallel_degree_grows_with_hidden_size():
    chosen = []
    for hidden, heads in ((1024, 16), (4096, 32), (12288, 96)):
        graph = planning_graph(gpt(8, hidden, heads))
        best = Planner(graph, ClusterSpec.preset("dgx-a100", nodes=4)).search(64).best
        chosen.append(best.config.tp)
    assert chosen == sorted(chosen) and chosen[-1] > chosen[0]


def test_tensor_parallelism_never_crosses_nodes_unless_allowed():
    limits = Planner(planning_graph(gpt(8, 4096, 32)), ClusterSpec.preset("dgx-a100", nodes=4)).limits
    configs = list(enumerate_configs(world_size=32, gpus_per_node=8, global_batch=64, limits=limits,
                                     spec=parse_plan_spec("auto")))
    assert max(c.tp for c in configs) == 8
    wide = enumerate_configs(world_size=32, gpus_per_node=8, global_batch=64, limits=limits,
                             spec=parse_plan_spec("auto"), allow_cross_node_tp=True)
    assert max(c.tp for c in wide) == 32


def _yardstick_cpu_s() -> float:
    """CPU seconds of a fixed pure-Python loop of dict reads and float arithmetic, the planner's own
    kind of work, that no change to mplan can speed up or slow down: how fast this machine runs it."""
    start = time.process_time()
    table: dict[tuple[int, int], float] = {}
    total = 0.0
    for i in range(1_500_000):
        key = (i % 977, i % 131)
        total += table.get(key, 0.5) * 1.0001
        table[key] = total % 7.0
    return time.process_time() - start


def _planning_cpu_s(model: str, cluster: str, nodes: int, seq_len: int | None,
                    global_batch: int) -> tuple[float, Any]:
    spec = ClusterSpec.preset(cluster, nodes=nodes)
    start = time.process_time()
    made = plan(model, cluster=spec, global_batch=global_batch, seq_len=seq_len, runtime="mplan")
    return time.process_time() - start, made


@pytest.fixture(scope="module")
def yardstick_s() -> float:
    """The yardstick on this machine, the fastest of three runs (start-up, imports and
    torch.export's first trace paid before, for the jobs)."""
    capture_for_planning("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128")
    return min(_yardstick_cpu_s() for _ in range(3))


@pytest.mark.slow
@pytest.mark.parametrize("model,cluster,nodes,seq_len,global_batch,bound", [
    ("gpt3-175b", "dgx-a100", 128, None, 1536, 33.0),  # 1024 GPUs: the widest search without cp
    ("llama3-8b", "dgx-h100", 8, 8192, 512, 12.5),  # long sequences: the largest block ILP
    ("llama3-405b", "dgx-h100", 2048, 8192, 2048, 42.0),  # 16384 GPUs: cp's degrees widen it most
])
def test_planning_the_issue_jobs_is_fast(yardstick_s, model, cluster, nodes, seq_len, global_batch, bound):
    """The jobs of the planning-time issue, as `mplan plan ... --runtime mplan` plans them, pipelines
    (zb-h1 included) and context parallelism in the search. The CLI must finish each in 10 s,
    start-up included, on an idle machine (python -m benchmarks.planning time measures that). Here each
    job's CPU seconds (the process's threads, the ILP's included: other processes stretch wall
    time, CPU time far less) are counted in yardsticks (`_yardstick_cpu_s`), so a slower host moves
    both alike and a slower search still shows.
    Measured (2026-12-06): on the 2-core machine of sessions 14-15, gpt3-175b 5.7-6.3 s, llama3-8b
    2.1-2.4 s, llama3-405b 7.2-7.5 s of CPU; on session 16's, ~1.5x slower throughout (a CI run there
    failed the old absolute bound of 10.5 s at the session's base commit too), 8.2-8.9 / 3.2 /
    10.7-10.8 s against a yardstick of 0.36-0.38 s: 23.1-23.7, 8.6-9.0 and 28.5-30.3 yardsticks.
    Before issue 30's fix, cp in the search had taken them to 12.9 / 3.5 / 14.3 s on the first
    machine. Each bound is about 1.4x its job's largest count: a search 1.4x slower fails."""
    seconds, made = _planning_cpu_s(model, cluster, nodes, seq_len, global_batch)
    spec = ClusterSpec.preset(cluster, nodes=nodes)
    assert seconds / yardstick_s < bound, (seconds, yardstick_s)
    assert made.mesh.dp * made.mesh.tp * made.mesh.pp * made.mesh.cp == spec.world_size
    assert made.mesh.tp <= spec.gpus_per_node and made.predicted.memory_gib <= spec.device.memory_bytes / 2**30


# --- impossible requests ------------------------------------------------------------------------

def test_a_model_that_cannot_fit_names_the_cause_and_what_would():
    with pytest.raises(PlanningError) as err:
        plan("llama3-405b", cluster=ClusterSpec.preset("dgx-h100", nodes=1), global_batch=8)
    message = str(err.value)
    assert "does not fit" in message and "llama3-405b" in message and "x the GPUs would hold it" in message


def test_a_mesh_that_does_not_divide_the_world_is_one_clear_error():
    graph = planning_graph(gpt(4, 1024, 16))
    planner = Planner(graph, ClusterSpec.preset("dgx-a100", nodes=1))
    with pytest.raises(PlanningError, match=r"'dp=3,tp=2,pp=1': dp x tp x pp = 3 x 2 x 1 = 6 does not divide the cluster's 8 GPUs"):
        planner.search(48, parse_plan_spec("dp=3,tp=2,pp=1"))
    with pytest.raises(PlanningError, match="does not divide the model's 16 attention heads"):
        planner.search(48, parse_plan_spec("tp=3"))


@pytest.mark.parametrize("text,fragment", [("tp=two", "positive integer"), ("tq=2", "bad item"),
                                           ("sp=2", "0 or 1"), ("schedule=zigzag", "one of"),
                                           ("tp=2,tp=4", "given twice")])
def test_bad_plan_specs_name_the_mistake(text, fragment):
    with pytest.raises(PlanSpecError, match=fragment):
        parse_plan_spec(text)


def test_unknown_model_on_the_command_line(capsys):
    assert cli_main(["plan", "gpt-17", "--global-batch", "8"]) == 2
    assert "gpt-17" in capsys.readouterr().err


# --- the plan file -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    made = plan("gpt:layers=4,hidden=1024,heads=16,seq=1024,vocab=32000",
                cluster=ClusterSpec.preset("dgx-a100", nodes=1), global_batch=64, spec="tp=2,pp=2")
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    made.save(str(path))
    return made, path


def test_plan_json_round_trips_and_carries_the_documented_fields(small_plan):
    made, path = small_plan
    doc = json.loads(path.read_text())
    for key in ("version", "model", "cluster", "mesh", "sequence_parallel", "zero", "micro_batch_size",
                "num_micro_batches", "global_batch", "schedule", "recompute", "stages", "sharding", "predicted",
                "alternatives"):
        assert key in doc
    for key in ("step_time_s", "tflops_per_gpu", "mfu", "tokens_per_s", "bubble_fraction", "memory_gib",
                "memory_by_stage", "compute_s", "comm_s"):
        assert key in doc["predicted"]
    assert Plan.load(str(path)).to_dict() == made.to_dict()
    assert doc["sharding"]["layers.3.attn.q_proj.weight"]["tp"] in ("S(0)", "S(1)", "R")
    assert {s["layers"][0] for s in doc["stages"] if s["layers"]} >= {"layers.0"}
    assert all(a["why"] for a in doc["alternatives"])


def _json_types_only(value) -> bool:
    """Whether `value` is in the JSON data model: dicts with string keys, lists (no tuples), scalars."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_types_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_types_only(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def test_plan_to_dict_is_json_data_that_from_dict_reads_back_equal(small_plan):
    """`from_dict(to_dict())` without a trip through JSON text: to_dict once gave tuples (stage units,
    memory by stage, alternatives), which the reader, taking arrays as lists, refused."""
    made, path = small_plan
    doc = made.to_dict()
    assert _json_types_only(doc)
    assert json.loads(json.dumps(doc)) == doc
    assert Plan.from_dict(doc) == made
    assert Plan.from_dict(Plan.load(str(path)).to_dict()) == made
    assert Plan.from_dict(doc).op_costs == made.op_costs and made.op_costs


def test_a_plans_head_loss_chunk_round_trips_and_a_file_without_it_reads_the_default(small_plan):
    import dataclasses

    made, _ = small_plan
    assert made.head_loss_chunk_rows is None  # memory to spare: the op's default
    lean = dataclasses.replace(made, head_loss_chunk_rows=512)
    assert Plan.from_dict(json.loads(json.dumps(lean.to_dict()))) == lean
    doc = made.to_dict()
    del doc["head_loss_chunk_rows"]
    assert Plan.from_dict(doc) == made


def test_explain_says_when_the_plan_shrank_the_head_and_losss_chunk(small_plan):
    import dataclasses
    import io

    from rich.console import Console

    from mplan.planner.explain import explain_data, render

    made, _ = small_plan
    lean = dataclasses.replace(made, head_loss_chunk_rows=512)
    assert explain_data(lean)["head_loss_chunk_rows"] == 512 and explain_data(made)["head_loss_chunk_rows"] is None
    texts = []
    for plan in (made, lean):
        out = io.StringIO()
        render(plan, Console(file=out, width=200))
        texts.append(out.getvalue())
    assert "rows a chunk" not in texts[0]
    assert "fused head + loss: 512 rows a chunk" in texts[1]


def test_a_plan_without_op_costs_loads_and_keeps_none(small_plan):
    made, path = small_plan
    doc = json.loads(path.read_text())
    assert set(doc["op_costs"]) <= set(doc["ops"])
    del doc["op_costs"]
    old = Plan.from_dict(doc)
    assert old.op_costs == {} and "op_costs" not in old.to_dict()
    assert Plan.from_dict(old.to_dict()) == old


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d["mesh"].update(tp="eight"), "mesh.tp must be an integer"),
    (lambda d: d.update(schedule="zigzag"), "schedule must be one of"),
    (lambda d: d["predicted"].pop("step_time_s"), "predicted.step_time_s is missing"),
    (lambda d: d.update(extra_field=1), "extra_field is not a known field"),
    (lambda d: d["mesh"].update(dp=3), "does not equal cluster.world_size"),
    (lambda d: d.update(version=7), "version 7 is not supported"),
    (lambda d: next(iter(next(iter(d["op_costs"].values())).values())).update(comm_ms=-1.0),
     "comm_ms must be a non-negative number"),
    (lambda d: next(iter(d["op_costs"].values())).update({"nosuch:op#0": {"compute_ms": 1.0, "comm_ms": 0.0,
                                                                         "reshard_ms": 0.0}}),
     "nosuch:op#0 is not an op of ops"),
    (lambda d: d["op_costs"].update(nosuch={}), "op_costs.nosuch is not a segment of ops"),
    (lambda d: d.update(head_loss_chunk_rows=0), "head_loss_chunk_rows must be an integer >= 1"),
    (lambda d: d.update(head_loss_chunk_rows="many"), "head_loss_chunk_rows must be an integer"),
])
def test_corrupt_plan_files_get_one_clear_error_naming_the_field(small_plan, tmp_path, mutate, fragment):
    _, path = small_plan
    doc = json.loads(path.read_text())
    mutate(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=fragment):
        Plan.load(str(bad))


def test_a_plan_for_another_world_size_or_model_is_refused(small_plan):
    made, _ = small_plan
    with pytest.raises(PlanError, match="made for 8 ranks"):
        made.check_runs_on(world_size=4)
    with pytest.raises(PlanError, match="stale"):
        made.check_runs_on(world_size=8, graph_hash="0" * 64)
    made.check_runs_on(world_size=8, graph_hash=made.model.graph_hash)


def test_graph_hash_is_the_same_for_shallow_full_and_any_batch_captures():
    from mplan.ir.graph_hash import graph_hash

    model = build_model(LlamaConfig(num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=96,
                                    seq_len=16, vocab=64), device="meta")
    a = capture(model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),), shallow=True)
    b = capture(model, (torch.zeros(3, 16, dtype=torch.long, device="meta"),))
    assert graph_hash(a) == graph_hash(b)
    other = build_model(LlamaConfig(num_layers=5, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=96,
                                    seq_len=16, vocab=64), device="meta")
    assert graph_hash(capture(other, (torch.zeros(1, 16, dtype=torch.long, device="meta"),))) != graph_hash(a)


# --- the command line ------------------------------------------------------------------------------

def test_explain_draws_a_gantt_and_prints_text_without_a_display(small_plan, tmp_path, capsys):
    _, path = small_plan
    png = tmp_path / "schedule.png"
    assert cli_main(["explain", str(path), "--gantt", str(png)]) == 0
    out = capsys.readouterr().out
    assert "stages" in out and "why the alternatives lost" in out and "predicted" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_explain_names_ops_explains_the_notation_once_and_reconciles_the_bubble(small_plan):
    import dataclasses
    import io

    from rich.console import Console

    from mplan.planner.explain import NOTATION, explain_data, render

    made, _ = small_plan
    # the planner's order scrambled: explain sorts the losers by their gap, closest first, misfits last
    shuffled = dataclasses.replace(made, alternatives=tuple(reversed(made.alternatives)))
    buf = io.StringIO()
    render(shuffled, Console(file=buf, width=400))
    out = buf.getvalue()
    first_line = NOTATION.splitlines()[0]
    assert out.count(first_line) == 1 and out.count("R replicated") == 1
    assert "attn.q_proj" in out or "q_proj" in out  # op rows carry their module path
    d = explain_data(shuffled)
    gaps = [a["delta_ms"] for a in d["alternatives"]]
    fitting = [g for g in gaps if g is not None]
    assert fitting == sorted(fitting) and gaps[:len(fitting)] == fitting
    if len(fitting) > 1:
        order = [a["spec"] for a in d["alternatives"] if a["delta_ms"] is not None]
        assert out.index(order[0]) < out.index(order[-1])
    # the headline bubble is the busiest rank's idle share of the pipeline time, which the rank table shows
    p = d["predicted"]
    busiest = d["ranks"][p["bubble_rank"]]
    assert busiest["critical"] and busiest["idle_fraction"] == pytest.approx(p["bubble_fraction"], rel=1e-9)
    assert all(r["idle_fraction"] >= p["bubble_fraction"] - 1e-12 for r in d["ranks"])
    for r in d["ranks"]:
        assert r["warmup_ms"] + r["between_ms"] + r["cooldown_ms"] == pytest.approx(r["idle_ms"], abs=1e-6)
    assert p["step_time_ms"] == pytest.approx(p["pipeline_ms"] + p["exposed_grad_sync_ms"] + p["optimizer_ms"],
                                              rel=1e-9)
    assert f"bubble {p['bubble_fraction']:.1%} (idle share of the pipeline time on rank {p['bubble_rank']}" in out
    assert "how the step adds up" in out and f"busiest rank (*, rank {p['bubble_rank']})" in out


def test_explain_json_keeps_its_keys(small_plan):
    from mplan.planner.explain import explain_data

    d = json.loads(json.dumps(explain_data(small_plan[0])))
    for key in ("model", "cluster", "world_size", "spec", "fp8", "runtime", "fused_kernels_priced", "fused_kernels",
                "mesh", "predicted", "schedule", "stages", "ranks", "block_type", "block_ops", "block_time",
                "experts", "alternatives", "notation"):
        assert key in d
    assert {"step_time_ms", "tflops_per_gpu", "mfu", "tokens_per_s", "bubble_fraction", "memory_gib",
            "simulated_step_ms"} <= set(d["predicted"])
    assert {"rank", "busy_ms", "idle_ms", "grad_sync_ms"} <= set(d["ranks"][0])
    assert {"index", "op", "strategy", "module", "op_name"} <= set(d["block_ops"][0])
    assert d["block_ops"][0]["op"] == (f"{d['block_ops'][0]['module']}:{d['block_ops'][0]['op_name']}")
    if d["alternatives"]:
        assert {"spec", "step_ms", "delta_ms", "memory_gib", "why"} <= set(d["alternatives"][0])


@pytest.fixture(scope="module")
def costed_plan(tmp_path_factory):
    """Tensor- and pipeline-parallel without recomputation (the stages are the units' priced ops added
    up), made as `mplan.plan` makes it, with the search result whose unit prices it was built from."""
    from mplan.planner.planning import search_plans

    graph = capture_for_planning("gpt:layers=4,hidden=1024,heads=16,seq=1024,vocab=32000")
    cluster = ClusterSpec.preset("dgx-a100", nodes=1)
    _, result = search_plans(graph, cluster, 64, "tp=2,pp=2,sp=0,recompute=none,schedule=1f1b", kernels=True)
    made = build_plan(result, graph, cluster, 64)
    path = tmp_path_factory.mktemp("costed") / "plan.json"
    made.save(str(path))
    return made, path, result


def test_explain_prices_every_op_of_the_block_and_adds_them_up_to_the_layer(costed_plan, capsys):
    from mplan.planner.explain import explain_data

    made, path, result = costed_plan
    assert cli_main(["explain", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d == json.loads(json.dumps(explain_data(made)))  # --json is explain_data
    ops, total = d["block_ops"], d["block_time"]
    assert len(ops) == len(made.ops[d["block_type"]]) == total["num_ops"]
    for o in ops:
        assert min(o["compute_ms"], o["comm_ms"], o["reshard_ms"]) >= 0
        if o["op_name"].startswith(("linear", "scaled_dot_product_attention", "layer_norm", "gelu")):
            assert o["compute_ms"] > 0, o  # an op that does work
        if o["op_name"].startswith(("view", "transpose", "reshape")):
            assert o["compute_ms"] == 0, o
    for key in ("compute_ms", "comm_ms", "reshard_ms"):
        assert total[key] == pytest.approx(sum(o[key] for o in ops), rel=1e-12)
    assert total["reshard_ms"] > 0  # tp=2 without SP: the row-parallel outputs are all-reduced
    assert total["total_ms"] == pytest.approx(total["compute_ms"] + total["comm_ms"] + total["reshard_ms"])
    # without recomputation a stage's time is its units' priced ops queued behind the host's issue
    # of each op (planner/host_cost.py): the layers' share of the stages, over the layers, is the
    # block's total plus at most the host time of the stages' ops (glue included), per layer
    units = result.sharded[(2, False)].units[made.micro_batch_size]
    layers = sum(len(s.layers) for s in made.stages)
    host_ms = sum(u.host_forward.host_s + u.host_backward.host_s for u in units) * 1e3 / layers
    assert total["total_ms"] * (1 - 1e-9) <= total["stage_per_layer_ms"] <= total["total_ms"] + host_ms
    assert total["why"].startswith("the host issues every op")
    # and it is the price the search gave each layer
    layer = next(u for u in units if u.block_type == d["block_type"])
    assert total["total_ms"] == pytest.approx((layer.forward_s + layer.backward_s) * 1e3, rel=1e-12)


def test_explain_table_shows_cost_columns_and_a_total_row(costed_plan, capsys):
    _, path, _ = costed_plan
    assert cli_main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "own collectives" in line)
    assert "compute ms" in header and "comm ms" in header and "reshard ms" in header
    assert "replicated ops" in out and "total" in out
    assert "per layer priced by the ILP" in out and "the host issues every op" in out


def test_explain_of_a_plan_without_op_costs_shows_dashes(costed_plan, tmp_path, capsys):
    _, path, _ = costed_plan
    doc = json.loads(path.read_text())
    del doc["op_costs"]  # as a plan written before plans recorded them
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    assert cli_main(["explain", str(old), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["block_time"] is None
    assert all(o["compute_ms"] is None and o["comm_ms"] is None and o["reshard_ms"] is None for o in d["block_ops"])
    assert cli_main(["explain", str(old)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "q_proj" in line)
    assert row.replace("│", " ").split()[-3:] == ["-", "-", "-"]
    assert "per-op costs are not in this plan" in out


def test_gantt_of_many_micro_batches_is_aggregated_and_quick(small_plan, tmp_path):
    """512 micro-batches on 2 ranks: over two thousand bars. One patch and label per bar took
    tens of seconds; bars per (rank, kind) and time bins above GANTT_MAX_BARS take about one."""
    import dataclasses

    from mplan.planner.explain import simulate_plan
    from mplan.planner.gantt import GANTT_MAX_BARS, draw_gantt

    made, _ = small_plan
    many = dataclasses.replace(made, num_micro_batches=512, global_batch=made.global_batch // made.num_micro_batches * 512)
    assert sum(e.stream == "compute" for e in simulate_plan(many).timeline) > 2 * GANTT_MAX_BARS
    png = tmp_path / "many.png"
    t0 = time.perf_counter()
    draw_gantt(many, str(png))
    assert time.perf_counter() - t0 < 10.0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_plan_json_on_stdout_is_only_json():
    """Checked on the process's real stdout: the solver's C library must not print there."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mplan", "plan", "tiny-llama", "--cluster", "cpu",
                          "--gpus-per-node", "4", "--global-batch", "8", "--json"],
                         check=True, capture_output=True, text=True).stdout
    doc = json.loads(out)
    assert doc["version"] == 1 and doc["cluster"]["world_size"] == 4


def test_bench_compares_plans_side_by_side(tmp_path, capsys):
    csv = tmp_path / "out.csv"
    assert cli_main(["bench", "gpt:layers=4,hidden=1024,heads=16,seq=1024,vocab=32000", "--cluster", "dgx-a100",
                     "--global-batch", "64", "--plans", "auto", "tp=8", "tp=3", "--json", "--csv", str(csv)]) == 0
    rows = json.loads(capsys.readouterr().out)["plans"]
    assert [r["spec"] for r in rows] == ["auto", "tp=8", "tp=3"]
    assert rows[0]["error"] is None and rows[1]["mesh"]["tp"] == 8
    assert rows[0]["predicted"]["step_time_s"] <= rows[1]["predicted"]["step_time_s"]
    assert "attention heads" in rows[2]["error"] and rows[2]["predicted"] is None
    assert csv.read_text().count("\n") == 4


def test_a_division_by_a_symbolic_size_keeps_a_placement_per_input() -> None:
    """`x.sum(0) / x.shape[0]` in a symbolic-batch capture reads the batch as an input of the
    division; every strategy the registry offers must place it (else the plan cannot be lowered)."""
    from torch import nn

    from mplan.ir.trace import capture_for_training
    from mplan.planner.op_registry import strategies_for

    class Mean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            y = self.proj(x)
            return (y.sum(0) / y.shape[0]).pow(2).sum()

    graph = capture_for_training(Mean(), (torch.randn(4, 8),), loss_fn=lambda out, labels: out)
    divisions = [n for n in graph.nodes if n.op.startswith("aten.div")]
    assert divisions and any(len(n.input_metas) < len(n.inputs) for n in divisions)
    for node in graph.nodes:
        offered = strategies_for(node, 2)
        assert offered[0].is_replicated, (node.name, offered)  # every op can run whole
        for strategy in offered:
            assert len(strategy.inputs) == len(node.inputs), (node.name, strategy)


def test_an_assertion_reads_its_input_as_it_arrives_at_no_price() -> None:
    """Hugging Face's RMSNorm upcasts to float32, and export asserts on the tensor it casts
    (`_assert_tensor_metadata`). The passes drop an assertion and read nothing, so the ILP may not
    price a copy for it: with the replicated strategy alone it charged a gather into R wherever
    sharding crossed one (tp=2 with sequence parallelism: the residual stream on sequence shards).
    Each assertion now reads its producer's layout as it is, and each segment costs less than
    with assertions held replicated (the old pricing, as `allow` below)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from mplan.ir.op_table import op_packet
    from mplan.planner.sharding_ilp import value_meta
    from mplan.planner.tp_layout import solve_tp_layout

    config = HFLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # the upcast in RMSNorm is real
    ids = torch.zeros(2, 8, dtype=torch.long)
    graph = capture(model, (ids,), labels=ids.clone())
    asserts = {n.name for n in graph.nodes if op_packet(n.op) == "_assert_tensor_metadata"}
    sharded = {a for a in asserts if not graph.node(a).params and value_meta(graph, graph.node(a).inputs[0])}
    assert len(sharded) >= 6  # two norms per block, the final norm, the head's upcast, ...
    coster = OpCoster(ClusterSpec.preset("dgx-h100"), 2, GroupShape(size=2, ranks_per_node=2))

    def as_before(node, strategy) -> bool:  # noqa: ANN001 - the old registry: assertions read R
        return node.name not in asserts or strategy.is_replicated

    for layout in ("ilp", "megatron"):
        now = solve_tp_layout(graph, coster, sp=True, layout=layout)
        before = solve_tp_layout(graph, coster, sp=True, layout=layout, allow=as_before)
        for segment in now.segments.values():
            assert all(segment.op_prices[a].reshard_s == 0.0 for a in asserts & set(segment.op_prices)), layout
        priced = [sum(s.op_prices[a].reshard_s for a in asserts & set(s.op_prices)) for s in before.segments.values()]
        assert sum(priced) > 0, layout  # the old pricing charged them: the test can fail
        for name, segment in now.segments.items():
            assert segment.objective_s <= before.segments[name].objective_s * (1 + 1e-12), (layout, name)
        total = [sum(s.objective_s for s in g.segments.values()) for g in (now, before)]
        assert total[0] < total[1], layout
        if layout == "megatron":  # its norms run on sequence shards: every block's assertions read S(1)
            block = graph.block_types[0].name
            assert now.segments[block].objective_s < before.segments[block].objective_s
        # what the Plan records: an assertion reads its producer's placement (one of the segment's
        # own; a value from outside it arrives in the segment's border placement)
        for segment in now.segments.values():
            for a in sharded & set(segment.choice):
                producer = graph.node(a).inputs[0]
                if producer in segment.choice:
                    assert segment.choice[a].inputs[0] == segment.choice[producer].output, (layout, a)
