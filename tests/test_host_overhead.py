"""Host time per launch: the queue model, the profile's host table, and its price in a plan (issue 30).

A small micro-batch leaves the GPU waiting on the host (an H100 step at micro-batch 1 measured
2.96x its micro-batch-8 step for the same tokens); these check that the planner now sees it.
"""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.host_queue import HostQueue, queued_makespan
from mplan.cost_models.measure_device import measure_host
from mplan.cost_models.profile import (NOMINAL_CPU_HOST, NOMINAL_HOST, ClusterProfile, DeviceProfile, HostTiming,
                                       ProfileError)
from mplan.fusion import FUSIONS
from mplan.models import LlamaConfig, LlamaModel
from mplan.planner.parallel_config import ParallelConfig
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner

FREE_HOST = HostTiming(aten_op_s=0.0, view_op_s=0.0, launch_s=0.0, backward_node_s=0.0, triton_launch_s=0.0,
                       adamw_foreach_tensor_s=0.0, adamw_fused_tensor_s=0.0, source="test: a free host")


# -- the queue ------------------------------------------------------------------------------------
def _simulate(ops: list[tuple[float, float]]) -> float:
    """The queue op by op: the host issues back to back, a kernel starts when issued and the device is free."""
    issued = end = 0.0
    for host, device in ops:
        issued += host
        end = max(end, issued) + device
    return end


def test_queue_is_the_larger_of_host_and_device_in_the_limits():
    device_bound = HostQueue.sequence(HostQueue.op(1e-9, 1e-3) for _ in range(100))
    host_bound = HostQueue.sequence(HostQueue.op(1e-3, 1e-9) for _ in range(100))
    assert device_bound.makespan() == pytest.approx(0.1, rel=1e-5)
    assert host_bound.makespan() == pytest.approx(0.1, rel=1e-5)
    # on a CPU rank the kernels run on the host thread: nothing overlaps
    assert HostQueue.sequence(HostQueue.op(1e-3, 2e-3) for _ in range(10)).makespan(serial=True) == pytest.approx(3e-2)


def test_queue_composes_exactly_and_associatively():
    rng = random.Random(30)
    for _ in range(200):
        ops = [(rng.uniform(0, 2e-5), rng.choice((0.0, rng.uniform(0, 1e-5), rng.uniform(0, 1e-3))))
               for _ in range(rng.randint(1, 40))]
        queues = [HostQueue.op(h, d) for h, d in ops]
        cut = rng.randint(0, len(ops))
        whole = HostQueue.sequence(queues)
        halves = HostQueue.sequence(queues[:cut]).then(HostQueue.sequence(queues[cut:]))
        assert whole.makespan() == pytest.approx(_simulate(ops), rel=1e-12, abs=1e-15)
        assert halves.makespan() == pytest.approx(whole.makespan(), rel=1e-12, abs=1e-15)
        assert max(whole.host_s, whole.device_s) <= whole.makespan() + 1e-15 <= whole.host_s + whole.device_s + 2e-15


def test_the_searchs_float_fold_is_the_queue_composition_bit_for_bit():
    """`queued_makespan`, which prices the search's pipeline chunks without a HostQueue per op, is
    the very float HostQueue's own composition gives: device time added or taken off each queue,
    host time issued before it (recomputation's re-run), on a GPU and on a CPU rank."""
    rng = random.Random(31)
    for _ in range(300):
        queues = [HostQueue.sequence(HostQueue.op(rng.uniform(0, 2e-5), rng.uniform(0, 1e-3))
                                     for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 30))]
        device = [rng.choice((0.0, q.device_s, rng.uniform(0, 2e-3))) for q in queues]
        before = [rng.choice((0.0, rng.uniform(0, 1e-4))) for _ in queues]
        for serial in (False, True):
            plain = HostQueue.sequence(q.with_device(d) for q, d in zip(queues, device))
            rerun = HostQueue.sequence(q.with_device(d).with_host(h) for q, d, h in zip(queues, device, before))
            assert queued_makespan(queues, device, serial=serial) == plain.makespan(serial)
            assert queued_makespan(queues, device, before, serial=serial) == rerun.makespan(serial)


def test_a_host_bound_prefix_delays_the_device_work_behind_it():
    # 50 tiny ops the host takes 10 us each to issue, then one 1 ms GEMM: the GEMM waits for the
    # host (0.5 ms), so the stream takes 1.5 ms, neither max(host, device) = 1 ms nor their sum
    ops = [(10e-6, 1e-6)] * 50 + [(10e-6, 1e-3)]
    assert HostQueue.sequence(HostQueue.op(h, d) for h, d in ops).makespan() == pytest.approx(_simulate(ops))
    assert _simulate(ops) == pytest.approx(1.51e-3, rel=1e-3)


# -- the profile's host table ---------------------------------------------------------------------
def _device(host: HostTiming | None) -> DeviceProfile:
    return DeviceProfile(name="NVIDIA H100 80GB HBM3", torch_version="2.13", measured_on="2026-12-05", host=host)


def test_measured_host_round_trips_through_the_profile_file(tmp_path):
    host = HostTiming(aten_op_s=9.1e-6, view_op_s=3.2e-6, launch_s=2.5e-6, backward_node_s=11.7e-6,
                      triton_launch_s=14.0e-6, adamw_foreach_tensor_s=5.5e-6, adamw_fused_tensor_s=1.2e-6,
                      source="measured by test on 2026-12-05")
    path = tmp_path / "profile.json"
    ClusterProfile(note="t", device=_device(host)).to_json(str(path))
    loaded = ClusterProfile.from_json(str(path))
    assert loaded.device.host == host and loaded.device.host_timing == host


def test_a_profile_without_host_figures_loads_with_the_nominal_ones_marked_so(tmp_path):
    obj = ClusterProfile(note="old", device=_device(None)).to_dict()
    assert "host" not in obj["device"]  # as profiles written before host time was measured
    loaded = ClusterProfile.from_dict(obj)
    assert loaded.device.host is None and loaded.device.host_timing == NOMINAL_HOST
    assert NOMINAL_HOST.source.startswith("nominal, not measured")
    packaged = ClusterSpec.preset("h200").profile
    assert packaged is not None and packaged.device.host_timing.source.startswith(("nominal, not measured",
                                                                                   "measured"))
    cpu = dataclasses.replace(_device(None), name="cpu")
    assert cpu.host_timing == NOMINAL_CPU_HOST and not NOMINAL_CPU_HOST.overlaps


def test_a_bad_host_field_is_refused_naming_it(tmp_path):
    obj = ClusterProfile(note="t", device=_device(NOMINAL_HOST)).to_dict()
    obj["device"]["host"]["backward_node_s"] = -1.0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ProfileError, match=r"device\.host\.backward_node_s"):
        ClusterProfile.from_json(str(path))


def test_measure_host_on_this_cpu_gives_positive_figures_that_round_trip():
    host = measure_host("cpu", quick=True)
    assert min(host.aten_op_s, host.view_op_s, host.backward_node_s, host.adamw_foreach_tensor_s) > 0
    assert host.aten_op_s < 1e-3 and not host.overlaps and host.source.startswith("measured")
    assert ClusterProfile.from_dict(ClusterProfile(device=_device(host)).to_dict()).device.host == host


def test_every_fused_kernel_has_its_launches_counted():
    assert all(e.launches.forward_triton + e.launches.forward_aten > 0 for e in FUSIONS)


# -- the price of a plan --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_graph():
    config = LlamaConfig(num_layers=2, hidden=512, num_heads=8, num_kv_heads=4, ffn_hidden=1536, seq_len=512, vocab=8192)
    model = LlamaModel(config, device="meta", dtype=torch.bfloat16)
    return capture_for_planning(model, (torch.zeros(1, config.seq_len, dtype=torch.long),))


def _cluster(host: HostTiming) -> ClusterSpec:
    """An H100 (the GPU of the issue's measurement) priced on its datasheet roofline, whose
    profile holds host figures only: no launch hides in a measured kernel floor."""
    device = DeviceProfile(name="NVIDIA H100 80GB HBM3", torch_version="2.13", measured_on="2026-12-05", host=host)
    return ClusterSpec.preset("dgx-h100", gpus_per_node=1, measured=False).with_profile(ClusterProfile(device=device))


def _step(graph, host: HostTiming, mbs: int, m: int, cuda_graphs: bool | None = False) -> float:  # noqa: ANN001
    """One rank's step, eager unless asked (the host terms below are what an eager step pays)."""
    config = ParallelConfig(dp=1, tp=1, pp=1, mbs=mbs, num_micro_batches=m)
    return Planner(graph, _cluster(host), cuda_graphs=cuda_graphs).evaluate(config).step_time_s


def test_micro_batch_1_pays_the_host_term_that_micro_batch_8_hides(llama_graph):
    free = {mbs: _step(llama_graph, FREE_HOST, mbs, 8 // mbs) for mbs in (1, 8)}
    paid = {mbs: _step(llama_graph, NOMINAL_HOST, mbs, 8 // mbs) for mbs in (1, 8)}
    host_term = {mbs: paid[mbs] - free[mbs] for mbs in (1, 8)}
    # the same 8 sequences: at micro-batch 1 the host issues every op 8 times, at 8 once
    assert host_term[1] > 4 * host_term[8] and host_term[1] > 0.05 * free[1]
    assert paid[1] / paid[8] > free[1] / free[8] * 1.05


def test_a_step_replayed_as_a_cuda_graph_pays_no_host_term_per_op(llama_graph):
    """One rank on a GPU replays its forwards and backwards as a CUDA graph by default
    (`autoparallel(cuda_graphs=None)`), and is priced so: at micro-batch 1 the step is the
    free-host one plus the optimizer's host time alone, far under the eager step's price."""
    free = _step(llama_graph, FREE_HOST, 1, 8)
    eager = _step(llama_graph, NOMINAL_HOST, 1, 8)
    graphed = _step(llama_graph, NOMINAL_HOST, 1, 8, cuda_graphs=None)
    assert graphed == _step(llama_graph, NOMINAL_HOST, 1, 8, cuda_graphs=True)
    assert free <= graphed < free * 1.02 and graphed < eager - 0.5 * (eager - free)


def test_a_host_bound_step_takes_the_host_time_of_its_ops(llama_graph):
    # a host 1000x slower than nominal: every kernel waits for its launch, and the step is the
    # host's own time (forward, backward, optimizer), however fast the device
    slow = HostTiming(**{f: getattr(NOMINAL_HOST, f) * 1000 for f in ("aten_op_s", "view_op_s", "launch_s",
                                                                       "backward_node_s", "triton_launch_s",
                                                                       "adamw_foreach_tensor_s",
                                                                       "adamw_fused_tensor_s")},
                      source="test: a slow host")
    planner_units = _units(llama_graph, slow)
    host_s = sum(u.host_forward.host_s + u.host_backward.host_s for u in planner_units)
    tensors = sum(u.num_param_tensors for u in planner_units if not u.glue_params) + len(
        {name for u in planner_units for name, _ in u.glue_params})
    expected = 2 * host_s + tensors * slow.adamw_foreach_tensor_s
    assert _step(llama_graph, slow, 1, 2) == pytest.approx(expected, rel=0.02)


def _units(graph, host: HostTiming):  # noqa: ANN001, ANN202
    return Planner(graph, _cluster(host), cuda_graphs=False).units(1, False, 1)


def test_mplans_runtime_pays_the_fitted_host_factor_on_gpus_only() -> None:
    """The factor scales every per-launch figure for mplan's runtime on a GPU; Megatron-LM's
    runtime and a CPU (kernels on the host, nominal figures) keep the bare ops' figures."""
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.planner.host_cost import MPLAN_RUNTIME_HOST_FACTOR, host_timing, runtime_host

    gpu, cpu = ClusterSpec.preset("dgx-h100"), ClusterSpec.preset("cpu")
    bare = host_timing(gpu)
    mine = runtime_host(gpu, "mplan")
    assert mine.aten_op_s == pytest.approx(bare.aten_op_s * MPLAN_RUNTIME_HOST_FACTOR)
    assert mine.triton_launch_s == pytest.approx(bare.triton_launch_s * MPLAN_RUNTIME_HOST_FACTOR)
    assert runtime_host(gpu, "megatron") == bare and runtime_host(cpu, "mplan") == host_timing(cpu)
    assert runtime_host(gpu, "mplan", 1.0) == bare


def test_the_host_factor_is_its_fit_and_holds_out_within_ten_percent() -> None:
    """MPLAN_RUNTIME_HOST_FACTOR is what `benchmarks.reprice host-fit` fitted on one H100 step, and
    the six steps it was not fitted on are predicted within 10% with it, not without it."""
    from mplan.planner.host_cost import MPLAN_RUNTIME_HOST_FACTOR

    report = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" /
                         "host_factor_fit-cpu-2026-12-05.json").read_text())
    assert MPLAN_RUNTIME_HOST_FACTOR == pytest.approx(report["factor"], abs=0.005)
    held = [row for row in report["rows"] if not row["fitted_on"]]
    assert len(held) == 6
    assert all(abs(row["error_fitted"]) <= 0.10 for row in held), held
    assert max(abs(row["error_as_measured"]) for row in held) > 0.5  # the bare ops' figures were far off


def test_a_plan_says_whether_it_was_priced_as_a_cuda_graph_replay() -> None:
    """One GPU: the plan records that its program ops were priced as a graph replays them, and
    `explain` says so in place of the per-op host time; eight GPUs: host time per op."""
    from io import StringIO

    from rich.console import Console

    from mplan.cost_models.cluster import ClusterSpec
    from mplan.planner.explain import render
    from mplan.planner.planning import plan

    spec = "llama:layers=2,hidden=64,heads=4,seq=32,vocab=128,ffn=128"
    for gpus, graphed in ((1, True), (8, False)):
        made = plan(spec, cluster=ClusterSpec.preset("dgx-h100", gpus_per_node=gpus), global_batch=8, progress="quiet")
        assert made.planner["cuda_graphs_priced"] == float(graphed)
        out = StringIO()
        render(made, Console(file=out, width=400))
        assert ("replay as one CUDA graph, no host time per op" in out.getvalue()) is graphed
        assert ("host time priced per op" in out.getvalue()) is not graphed
