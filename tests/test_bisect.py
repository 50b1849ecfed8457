"""`mplan verify --bisect` (runtime/bisect.py) names the op where a plan parts from one device.

On 2 gloo ranks in float64, tiny GPT under tp=2 and tiny Llama under tp=2,sp=1: as shipped,
bisect compares every value and gradient of one micro-batch and finds none beyond 1e-9. Then one
fault is planted per check, by patching the pass or editing the built program from this test
(never in library code), and bisect must name exactly that op with its placement:

    model       plan        planted fault                                          bisect names
    tiny-gpt    tp=2        the all-reduce after o_proj's linear_3 doubles its sum  linear_3, reshard P->R
    tiny-gpt    tp=2        reshape_local splits head_dim instead of heads (every   view, S(2), wrong piece
                            heads view: the program runs, the loss is wrong)
    tiny-gpt    tp=2        the program's first view edited to split head_dim       view (and where it raised)
    tiny-gpt    tp=2        the copy into attention keeps its gradient partial      gradient of layer_norm
                            (its backward all-reduce skipped; forward untouched)
    tiny-llama  tp=2,sp=1   q_proj's shard cut along dim 1 (transposed) not dim 0   the parameter, S(0)

Every faulted run's loss (or gradient) differs from one device, so the fault is real. The last
test runs the command itself (`mplan verify ... --bisect --json`).
A pipeline plan is refused, saying why. One gloo group runs every check; captures are shared per
model (tests/capture_cache.py).
"""
from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from capture_cache import captured, reused_captures
from distributed import run_checks

ROWS = 2


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(0, 64, (ROWS, 16), generator=generator),
            torch.randint(0, 64, (ROWS, 16), generator=generator))


def _built(spec: str, plan: str, edit: Any = None) -> Any:
    """The bisect report of `spec` under `plan` on the 2 ranks, after `edit(pm)` (a planted fault).
    The reference weights are the model's own, so a parameter sharded wrongly shows too."""
    import mplan
    from mplan.models import build_model
    from mplan.runtime.bisect import bisect
    from mplan.verify import perturbed

    ids, labels = _data()
    key = ("family", spec)
    model = perturbed(build_model(spec, device="cpu", dtype=torch.float64, seed=0))
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    graph = captured(key, model, (ids,))
    with reused_captures(key):
        pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=ROWS, plan=plan, progress="quiet")
    if edit is not None:
        edit(pm)
    return bisect(pm, ids, labels, captured=graph, weights=weights)


def _reshard_after(pm: Any, value: str) -> Any:
    from mplan.passes.insert_collectives import Redistribute

    found = [m for _, m in pm.program.named_children() if isinstance(m, Redistribute) and m.value == value]
    assert len(found) == 1, f"expected one reshard of {value}, found {found}"
    return found[0]


# -- the checks (each runs on both ranks) -------------------------------------------------------
def check_tp_gpt_agrees() -> dict:
    report = _built("tiny-gpt", "tp=2")
    assert report.agrees, report.describe()
    assert report.num_values > 90 and report.num_gradients > 90, report.describe()
    assert report.not_compared == () and not report.raised
    assert abs(report.loss - report.reference_loss) <= 1e-12 * report.reference_loss
    return report.to_dict()


def check_sp_llama_agrees() -> dict:
    report = _built("tiny-llama", "tp=2,sp=1")
    assert report.agrees, report.describe()
    assert report.num_values > 100 and report.num_gradients > 100, report.describe()
    return report.to_dict()


def check_scaled_all_reduce_is_named() -> str:
    def doubled(pm: Any) -> None:
        module = _reshard_after(pm, "linear_3")  # layer 0's attention output projection, row-parallel
        assert (str(module.src), str(module.dst)) == ("P", "R")
        plain = module.forward
        module.forward = lambda x: 2 * plain(x)

    report = _built("tiny-gpt", "tp=2", doubled)
    first = report.first
    assert first is not None, report.describe()
    assert report.loss != pytest.approx(report.reference_loss, rel=1e-6)  # the fault is real
    assert (first.phase, first.node, first.op) == ("forward", "linear_3", "aten.linear.default"), report.describe()
    assert first.computed_by.startswith("reshard_linear_3") and first.collective.startswith("all_reduce P->R")
    assert first.placements == (("tp", "P->R"),) and first.module_path == "layers.0.attn.o_proj"
    assert first.strategy.startswith("row:row_bias[")
    assert first.rel_err == pytest.approx(1.0, rel=1e-9)  # twice the value: off by the value itself
    assert first.actual == pytest.approx(2 * first.expected, rel=1e-9)
    return report.describe()


def check_wrong_view_lowering_is_named() -> str:
    """The reshape_local rule divides the innermost dim where the strategy split the heads (dim 2):
    every heads view runs with all heads of half the width; attention still runs, the loss is wrong."""
    from mplan.ir.placement import Shard
    from mplan.passes import insert_collectives

    plain = insert_collectives.local_shape

    def wrong(shape: tuple[int, ...], placement: Any, n: int) -> tuple[int, ...]:
        if len(shape) == 4 and placement == Shard(2):
            return (*shape[:3], shape[3] // n)
        return plain(shape, placement, n)

    insert_collectives.local_shape = wrong
    try:
        report = _built("tiny-gpt", "tp=2")
    finally:
        insert_collectives.local_shape = plain
    first = report.first
    assert first is not None and not report.raised, report.describe()
    assert report.loss != pytest.approx(report.reference_loss, rel=1e-6)
    assert (first.phase, first.node, first.op, first.computed_by) == ("forward", "view", "aten.view.default", "view")
    assert first.placements == (("tp", "S(2)"),) and first.local_shape == (ROWS, 16, 4, 4)
    assert "split along another dim" in first.note and math.isinf(first.rel_err)
    return report.describe()


def check_edited_view_is_named_before_the_op_that_raises() -> str:
    def edit(pm: Any) -> None:
        (view,) = [n for n in pm.program.graph.nodes if n.name == "view"]
        x, shape = view.args
        view.args = (x, [*shape[:2], shape[2] * 2, shape[3] // 2])
        pm.program.recompile()

    report = _built("tiny-gpt", "tp=2", edit)
    assert report.first is not None and report.first.node == "view", report.describe()
    assert report.raised.startswith("scaled_dot_product_attention:") and report.num_gradients == 0
    return report.describe()


def check_partial_gradient_is_named() -> str:
    """The copy of layer 0's first norm into q, k and v (R -> R, its backward the P -> R all-reduce)
    keeps the gradient partial: forward agrees everywhere, the gradient of layer_norm does not."""
    from mplan.collectives.redistribute import redistribute

    def partial(pm: Any) -> None:
        module = _reshard_after(pm, "layer_norm")
        assert (str(module.grad_src), str(module.grad_dst)) == ("P", "R")
        module.forward = lambda x: redistribute(x, module.src, module.dst, module.grad_src, module.grad_src,
                                                module.axis)

    report = _built("tiny-gpt", "tp=2", partial)
    first = report.first
    assert first is not None, report.describe()
    assert abs(report.loss - report.reference_loss) <= 1e-12 * report.reference_loss  # forward untouched
    assert (first.phase, first.node, first.computed_by) == ("backward", "layer_norm", "layer_norm"), report.describe()
    assert any(c.startswith("reshard_layer_norm") for c in first.consumers), first.consumers
    assert first.placements == (("tp", "R, gradient R"),)
    return report.describe()


def check_wrong_parameter_split_is_named() -> str:
    name = "layers.1.attn.q_proj.weight"

    def transposed(pm: Any) -> None:
        from mplan.ir.placement import Shard

        assert pm.layouts[name].placement == Shard(0)
        whole = pm.full_state_dict()[name]
        half = whole.shape[1] // pm.axis.size
        with torch.no_grad():
            pm.params[name].copy_(whole[:, pm.axis.rank * half:(pm.axis.rank + 1) * half].T)

    report = _built("tiny-llama", "tp=2,sp=1", transposed)
    first = report.first
    assert first is not None, report.describe()
    assert report.loss != pytest.approx(report.reference_loss, rel=1e-6)
    assert (first.phase, first.node, first.op) == ("forward", name, "parameter"), report.describe()
    assert first.placements == (("tp", "S(0)"),) and first.computed_by == "p_model_layers_1_attn_q_proj_weight"
    assert first.worst_rank in (0, 1) and first.rel_err > 0.1
    return report.describe()


def check_pipeline_is_refused() -> str:
    """Under a pipeline each rank holds its stages' parameters only: refused, saying so, never 'agrees'."""
    from mplan.runtime.bisect import BisectRefused

    with pytest.raises(BisectRefused, match="pipeline") as refused:
        _built("tiny-gpt", "pp=2")
    return str(refused.value)


CHECKS = [check_tp_gpt_agrees, check_sp_llama_agrees, check_scaled_all_reduce_is_named,
          check_wrong_view_lowering_is_named, check_edited_view_is_named_before_the_op_that_raises,
          check_partial_gradient_is_named, check_wrong_parameter_split_is_named, check_pipeline_is_refused]


@pytest.fixture(scope="module")
def outcomes() -> Any:
    return run_checks(2, CHECKS)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_bisect(outcomes: Any, check: Any) -> None:
    per_rank = outcomes.assert_passed(check)
    assert per_rank[0] == per_rank[1]  # every rank reports the same divergence


def test_the_command_prints_bisect(capsys: pytest.CaptureFixture[str]) -> None:
    """`mplan verify MODEL --bisect --json`: the bisect block in the document."""
    from mplan.cli import main

    assert main(["verify", "tiny-gpt", "--plan", "tp=2", "--world-size", "2", "--steps", "1", "--bisect",
                 "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] and doc["bisect"]["agrees"] and doc["bisect"]["first"] is None
    assert doc["bisect"]["num_values"] > 50 and doc["bisect"]["num_gradients"] > 50
