"""mplan's runtime host factor, measured on this machine by `mplan profile`.

What: the seconds mplan's runtime pays per op on the host, over what `measure_host`'s streams of
bare ATen ops take, as one factor (`HostTiming.runtime_factor`), which the planner multiplies into
every host figure of a plan for mplan's runtime (`planner.host_cost.runtime_host`).

Why measured here: the factor covers what bare streams do not: fused kernels that are autograd
Functions allocating and launching from Python, the local program run as an FX module, the hooks
of each micro-batch. It was one constant fitted on one H100 step (`MPLAN_RUNTIME_HOST_FACTOR`,
6.03). On an H200 on 2026-12-06 that constant priced a host-bound step 22% low (a 1.26B Llama at
four micro-batches of 2 x 2048 tokens: 385 ms measured, 301 ms predicted, about 8 would have fit;
benchmarks/results/train_gpu-2026-12-06.json): the factor depends on the host CPU and its Python,
as the bare figures do, so it is measured with them.

How: a small Llama (CALIBRATION_MODEL), host-bound by construction (kernels of microseconds,
eight micro-batches a step), is trained through `mplan.measure.measure_plan` on this device, on the
cluster just profiled. The planner prices the same plan with every host figure scaled by f; f is
found by bisection so that the prediction equals the measured median step (the prediction grows
with f). A step that is not host-bound (its device time alone over HOST_BOUND of the measured step)
cannot pin f down: nothing is fitted and the reason is returned.

Single process: the plan runs on one device (a `mplan profile` of several ranks leaves the factor
unmeasured and says so; the figure is the device type's host, as the bare ones are).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mplan.cost_models.cluster import ClusterSpec

CALIBRATION_MODEL = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=704,seq=512,vocab=2048"
"""Small enough that every kernel takes microseconds, so the step is the host's; a Llama, so the
fused kernels (RMSNorm, RoPE, SwiGLU, head + loss) are the ones real models run."""
CALIBRATION_PLAN = "dp=1,tp=1,pp=1,mbs=1,recompute=none"
CALIBRATION_BATCH = 8
"""Eight micro-batches of one sequence: each step repeats the program eight times."""
HOST_BOUND = 0.5
"""The device-only prediction (f = 0) must stay under this share of the measured step."""
FACTOR_RANGE = (0.25, 64.0)


@dataclass(frozen=True, slots=True)
class HostCalibration:
    """One calibration: the factor (None where it could not be fitted, `why` says so), the
    measured step and the predictions it was fitted between."""

    factor: float | None
    measured_step_s: float
    device_only_s: float  # the prediction with no host time (f = 0)
    why: str


def fit_factor(predict: Callable[[float], float], measured_s: float, *, rounds: int = 16) -> HostCalibration:
    """The f in FACTOR_RANGE with predict(f) == measured_s, by bisection; `predict(f)` is the
    planner's step seconds with every host figure times f (nondecreasing in f)."""
    device_only = predict(0.0)
    if device_only > HOST_BOUND * measured_s:
        return HostCalibration(None, measured_s, device_only,
                               f"the calibration step is not host-bound here (device time alone {device_only * 1e3:.1f} ms "
                               f"of {measured_s * 1e3:.1f} ms measured): the runtime's host factor is not measured")
    low, high = FACTOR_RANGE
    if not predict(low) <= measured_s <= predict(high):
        return HostCalibration(None, measured_s, device_only,
                               f"no factor in {low:g}-{high:g} prices the measured {measured_s * 1e3:.1f} ms step")
    for _ in range(rounds):
        middle = (low * high) ** 0.5  # the factor's scale is multiplicative
        if predict(middle) < measured_s:
            low = middle
        else:
            high = middle
    factor = (low * high) ** 0.5
    return HostCalibration(factor, measured_s, device_only,
                           f"fitted: {factor:.2f} x the bare host figures prices the measured "
                           f"{measured_s * 1e3:.1f} ms calibration step")


def calibrate(cluster: ClusterSpec, *, model: str = CALIBRATION_MODEL, steps: int = 10) -> HostCalibration:
    """Train `model` on this process's device under CALIBRATION_PLAN, and fit the factor that
    makes the planner's price of that plan on `cluster` equal its measured median step."""
    import torch

    from mplan.measure import measure_plan
    from mplan.planner.parallel_config import parse_plan_spec
    from mplan.planner.planning import capture_for_planning
    from mplan.planner.search import Planner

    # eager: the factor is the host cost of launching every op from Python, which a graph replay skips
    row = measure_plan(model, CALIBRATION_PLAN, global_batch=CALIBRATION_BATCH, steps=steps, warmup=3,
                       cluster=cluster, cuda_graphs=False)
    graph = capture_for_planning(model)
    spec = parse_plan_spec(CALIBRATION_PLAN)
    kernels = torch.cuda.is_available()  # what autoparallel ran: fused kernels on CUDA

    def predict(factor: float) -> float:
        planner = Planner(graph, cluster, kernels=kernels, runtime="mplan", host_factor=factor)
        return planner.search(CALIBRATION_BATCH, spec).best.step_time_s

    return fit_factor(predict, row["step_time_s"])
