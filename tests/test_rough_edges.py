"""Issue 20, item 9: rough edges of what mplan prints. Each test reproduces one message as it
read before (in its docstring) and holds the new wording."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mplan.bench import bench_plans
from mplan.cli import _bench_cells
from mplan.cost_models.rates import flops_rate, percent
from mplan.cost_models.cluster import ClusterSpec
from mplan.planner.evaluate import NO_CUT_IN_MEMORY, gib_versus
from mplan.planner.parallel_config import ModelLimits, ParallelConfig, parse_plan_spec
from mplan.planner.search import _no_config_reason, _ranks, _refusal

GiB = 2**30


def _hf_config(tmp_path: Path, architectures: list[str] | None) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     vocab_size=64, max_position_embeddings=16, architectures=architectures)
    folder = tmp_path / ("-".join(architectures) if architectures else "none")
    config.save_pretrained(folder)
    return str(folder)


def test_a_config_json_builds_the_class_it_names_or_refuses_it(tmp_path):
    """Was: a BertForMaskedLM config.json built (and was planned as) BertLMHeadModel, silently."""
    from mplan.models import build_model, resolve_model

    assert type(build_model(_hf_config(tmp_path, ["BertForMaskedLM"]))).__name__ == "BertForMaskedLM"
    # a config that names no class: AutoModelForCausalLM's, as before
    assert type(build_model(_hf_config(tmp_path, None))).__name__ == "BertLMHeadModel"
    with pytest.raises(ValueError) as err:  # labels of another shape: refused up front, naming the class
        resolve_model(_hf_config(tmp_path, ["BertForSequenceClassification"]))
    message = str(err.value)
    assert "\n" not in message
    assert "architecture BertForSequenceClassification, which mplan cannot train" in message
    assert "*ForCausalLM" in message and "*ForMaskedLM" in message and '["BertLMHeadModel"]' in message


def test_a_plan_spec_prints_as_written_not_as_a_repr():
    assert str(parse_plan_spec("tp=8,pp=4")) == "tp=8,pp=4"
    assert str(parse_plan_spec("auto")) == "auto"
    assert str(parse_plan_spec("dp=2,sp=1,recompute=full,capacity=1.25")) == "dp=2,sp=1,recompute=full,capacity=1.25"


def test_a_spec_larger_than_the_cluster_says_the_arithmetic():
    """Was: 'no split of 4 ranks fits the request (..., spec PlanSpec(dp=None, tp=4, pp=2, ...))'."""
    limits = ModelLimits(num_layers=32, num_heads=32, num_kv_heads=8, num_experts=0, seq_len=2048)
    reason = _no_config_reason(8, 8, 16, limits, parse_plan_spec("tp=8,pp=4"))
    assert reason.startswith("plan spec 'tp=8,pp=4': tp x pp = 8 x 4 = 32 > 8 GPUs")
    assert "PlanSpec(" not in reason
    reason = _no_config_reason(4, 4, 16, limits, parse_plan_spec("tp=3"), ranks="CPU ranks")
    assert "tp=3 does not divide the model's 32 attention heads" in reason
    reason = _no_config_reason(4, 4, 16, limits, parse_plan_spec("dp=3"), ranks="CPU ranks")
    assert "dp = 3 does not divide the cluster's 4 CPU ranks" in reason
    assert _ranks(ClusterSpec.preset("cpu", gpus_per_node=4)) == "CPU ranks"
    assert _ranks(ClusterSpec.preset("dgx-h100")) == "GPUs"


@pytest.fixture(scope="module")
def tiny_bench():
    """One bench of tiny-llama (4 heads, 2 layers) on 4 H100s: a spec larger than the cluster, and auto."""
    cluster = ClusterSpec.preset("dgx-h100", gpus_per_node=4)
    return bench_plans("tiny-llama", cluster, 16, ["tp=4,pp=2", "auto"])


def test_bench_notes_quote_the_spec_and_the_arithmetic(tiny_bench):
    too_big, auto = tiny_bench
    assert too_big["error"].startswith("plan spec 'tp=4,pp=2': tp x pp = 4 x 2 = 8 > 4 GPUs"), too_big["error"]
    assert auto["error"] is None and auto["fits"]


def test_small_flop_rates_and_shares_show_in_a_unit_that_shows_them(tiny_bench):
    """Was: '0.0' TFLOP/s per GPU and MFU '0.0%' for a tiny model."""
    _, auto = tiny_bench
    cells = _bench_cells(auto)
    rate, mfu = cells[3], cells[4]
    assert rate.endswith(("GFLOP/s", "MFLOP/s", "kFLOP/s")) and not rate.startswith("0.0 "), rate
    assert mfu != "0.0%" and mfu.endswith("%"), mfu
    assert flops_rate(312e12) == "312.0 TFLOP/s" and flops_rate(3.2e8) == "320.0 MFLOP/s"
    assert percent(0.472) == "47.2%" and percent(2.4e-5) == "0.0024%" and percent(0.0) == "0.0%"


def test_memory_short_by_less_than_the_rounding_still_reads_as_short():
    """Was: 'needs 80.0 GiB per GPU, has 80.0'."""
    assert gib_versus(80.03 * GiB, 80 * GiB) == "80.03 GiB per GPU, has 80.00"
    assert gib_versus(93.6 * GiB, 80 * GiB) == "93.6 GiB per GPU, has 80.0"
    assert gib_versus(80 * GiB + 0.4 * 2**20, 80 * GiB, per="CPU rank") == "81,920.4 MiB per CPU rank, has 81,920.0"


def test_a_refusal_says_what_does_not_fit_and_what_to_change():
    """Was: '...: the leanest plan (dp1-tp8-pp2-...) has no stage cut that fits in memory. ...'."""
    cluster = ClusterSpec.preset("dgx-h100")
    config = ParallelConfig(dp=1, tp=8, pp=2, mbs=1, num_micro_batches=8, recompute="full")
    cut = SimpleNamespace(config=config, reason=NO_CUT_IN_MEMORY, short_of_memory=True, peak_memory_bytes=79.5 * GiB)
    message = _refusal("big", cluster, 8, cut)
    assert ("even the leanest plan (dp1-tp8-pp2-mbs1-rc-full) cannot be cut into pipeline stages that each fit "
            "in a device's memory. Its busiest GPU would hold 79.50 GiB of the 80.00 GiB it has") in message
    assert "try more GPUs (--nodes 2) or a smaller --global-batch." in message
    over = dataclasses.replace(config, pp=1, recompute="selective")
    whole = SimpleNamespace(config=over, reason="needs " + gib_versus(300 * GiB, 80 * GiB), short_of_memory=True,
                            peak_memory_bytes=300 * GiB)
    message = _refusal("big", cluster, 8, whole)
    assert "even the leanest plan (dp1-tp8-pp1-mbs1-rc-selective) needs 300.0 GiB per GPU, has 80.0." in message
    assert message.endswith("About 4x the GPUs would hold it: try --nodes 4 or a smaller --global-batch, "
                            "or --spec recompute=full.")


def test_the_demo_says_what_it_left_in_out():
    """Was: 'plans, explanation and Gantt chart are in out/' while the explanation went to /dev/null."""
    last = Path(__file__).resolve().parents[1].joinpath("scripts", "demo.sh").read_text().rstrip().splitlines()[-1]
    assert last.startswith("echo ") and "$(ls out" in last  # what it names is what is there
    shell = subprocess.run(["bash", "-n", "-c", last], capture_output=True, text=True)
    assert shell.returncode == 0, shell.stderr
