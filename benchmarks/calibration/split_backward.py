"""What the zero-bubble split of a stage's backward costs on one GPU, against the whole backward.

mplan's pipeline executor runs a stage's backward whole (`B`, `split_backward.backward_full`) or
split (`I` = `backward_input`, then `W` = its `WeightGradients.run()`), and the planner prices
ZB-H1 assuming that I + W costs what B costs and that W's share of B is the units'
`weight_backward_s / backward_s` (planner/unit_costs.py). This case measures both assumptions.

A stage is every decoder block of a 4-layer model (Llama: hidden 2048, 16 heads, 8 key/value
heads, SwiGLU 5632; GPT: hidden 2048, 16 heads, MLP 8192), bf16, run as the executor runs a
stage: on a received hidden-state leaf that requires grad (and, for Llama, the RoPE tables the
model computes once for all its blocks), its output's gradient a fixed random tensor, its
parameters' `.grad` allocated once and accumulated into (the runtime keeps them as bucket views).
Micro-batches 1 x 2048 and 4 x 2048 tokens. The phases timed:
    forward    the blocks' forward, building the autograd graph
    B          backward_full after a forward
    I, W       backward_input after a forward; WeightGradients.run() after a forward and an I
    I+W        both back to back after a forward
    torch_*    the same three with torch's own split (torch.distributed.pipelining._backward's
               stage_backward_input and stage_backward_weight), the baseline a user has without
               mplan; skipped with the reason where that private module is missing or fails
Two clocks, each a median:
    wall    CUDA events (perf_counter on the CPU) around the phase alone, started with the GPU
            idle (synchronized after its set-up), so the host's own work, such as I's Python walk
            over the autograd graph, shows where it leaves the GPU waiting; --rounds interleaved
            rounds, the phases' order rotating each round
    kernel  the GPU time of the kernels the phase launches (benchmarks/gpu_time.py's profiler
            clock, interleaved): what it costs a GPU whose host runs ahead, as a pipeline's does
            once its GEMMs are long. A phase needs its set-up first, so each is measured with its
            set-up and the set-up alone is subtracted (W: forward + I + W less forward + I). On the
            CPU smoke run the same subtraction runs on perf_counter wall times.
Memory per phase, in MiB (None on the CPU): peak_mib, torch.cuda.max_memory_allocated during it
(reset at its start); start_mib, what was allocated when it started (its set-up's activations
included); held_mib, what it left allocated less start_mib (B frees the saved activations, I keeps
them for W). Each the largest over the timed samples.

Correctness in the same run, from the same input, output gradient and zeroed `.grad`: the input
gradient and every parameter gradient of mplan's I+W and of torch's, each against B's, as
max |split - B| / max |B| per tensor (the largest over tensors reported, with its name); B run
twice gives the floor (a GPU's attention backward need not be bitwise repeatable). Tolerance: 2e-2 in
bf16 (a few roundings of 2^-8 where several contributions to one gradient are summed in another
order), 1e-4 in float32.

Reported per shape: each phase's times and memory; (I+W)/B, I/B, W/B, torch's (I+W)/B and B/forward
on both clocks; the planner's forward, backward and weight-gradient ms for the same blocks
(`Planner(capture_for_planning(spec), ClusterSpec.preset(CLUSTER)).units(tp=1, sp=False, mbs)`, --cluster)
and its W share; the correctness figures; with the GPU name, torch and Triton versions and the date.

Run on the GPU (from the repository root; estimated at 2-3 minutes before its first run, most
of it CUDA start-up, the models' CPU-side initialization and the profiler's passes; no shape is
started after --budget-s, so the report is written within the device tool's 600 s):
    PYTHONPATH=. python -m benchmarks.calibration split-backward --out $OUT/split_backward.json
Smoke test of the same code paths on a CPU (float32, a 2-layer Llama and GPT of hidden 64, no
CUDA events or profiler; a few seconds):
    PYTHONPATH=. python -m benchmarks.calibration split-backward --device cpu --out /tmp/split_backward.json
(split_backward_h200-2026-12-02.json was made by the old `benchmarks/split_backward_time.py -o FILE`; its
smoke flag `--smoke` is now `--device cpu`. The report is written after each shape, so a run cut short
keeps the shapes it finished, without the harness's `harness` and `command` keys until the end.)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks import harness
from benchmarks.calibration.gpu import device_of
from benchmarks.gpu_time import interleaved_kernel_ms
from benchmarks.models.timing import start_timer
from benchmarks.report import Clock, run_header, write_report
from mplan.cost_models.cluster import ClusterSpec
from mplan.models import build_model, resolve_model
from mplan.planner.planning import capture_for_planning
from mplan.planner.search import Planner
from mplan.runtime.split_backward import WeightGradients, backward_full, backward_input

MiB = 2**20
CLUSTER = "h200"
"""--cluster's default, the preset the W share is predicted on (mplan/cost_models/presets.py: one
H200 of this workplace, measured 2026-11-29, the card of the cited run)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """What one run measures: the models, the micro-batches and how many samples of each."""

    specs: tuple[str, ...]
    micro_batches: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    rounds: int  # wall-clock samples per phase
    warmup: int  # untimed rounds of every phase first (cuBLAS heuristics, the allocator's pools)
    kernel_rounds: int  # profiler samples per phase (gpu_time.interleaved_kernel_ms)
    kernel_iters: int  # calls per profiler sample
    tolerance: float  # max |split - B| / max |B| per gradient tensor


FULL = Settings(specs=("llama:layers=4,hidden=2048,heads=16,kv_heads=8,ffn=5632,seq=2048,vocab=32000",
                       "gpt:layers=4,hidden=2048,heads=16,seq=2048,vocab=32000"),
                micro_batches=(1, 4), device=torch.device("cuda"), dtype=torch.bfloat16, rounds=9, warmup=2,
                kernel_rounds=3, kernel_iters=5, tolerance=2e-2)
SMOKE = Settings(specs=("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,seq=32,vocab=128",
                        "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"),
                 micro_batches=(1, 4), device=torch.device("cpu"), dtype=torch.float32, rounds=3, warmup=1,
                 kernel_rounds=2, kernel_iters=2, tolerance=1e-4)

try:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    TORCH_SPLIT_MISSING: str | None = None
except ImportError as error:  # a private module: it may move or vanish between releases
    TORCH_SPLIT_MISSING = (f"torch {torch.__version__} has no torch.distributed.pipelining._backward."
                           f"stage_backward_input/stage_backward_weight ({error}): torch's split is not measured")


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """A model's decoder blocks as one pipeline stage, with one micro-batch's tensors."""

    blocks: Callable[[torch.Tensor], torch.Tensor]
    params: list[nn.Parameter]
    names: list[str]  # the parameters' names, for the correctness report
    received: torch.Tensor  # the hidden states the previous stage sent (no grad)
    output_grad: torch.Tensor  # the gradient the next stage sends back


@dataclass(slots=True, kw_only=True)
class Pass:
    """One micro-batch in flight through a stage: what each phase leaves for the next."""

    x: torch.Tensor  # the received activations as a leaf that requires grad
    y: torch.Tensor  # the stage's output
    input_grad: torch.Tensor | None = None
    weight: WeightGradients | None = None  # mplan's pending W
    groups: list[dict[str, Any]] | None = None  # torch's pending W (its parameter groups)


def make_stage(model: nn.Module, micro_batch: int, device: torch.device, dtype: torch.dtype) -> Stage:
    config = model.config
    # Llama's blocks take the RoPE tables DecoderLM.forward computes once for all of them; GPT's
    # take the hidden states alone (its positions were added by the embedding, before the blocks)
    rope = model.rope(config.seq_len) if hasattr(model, "rope") else None
    layers = list(model.layers)

    def blocks(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x) if rope is None else layer(x, rope)
        return x

    generator = torch.Generator(device="cpu").manual_seed(0)
    shape = (micro_batch, config.seq_len, config.hidden)
    received = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    output_grad = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    named = list(model.layers.named_parameters())
    for _, param in named:
        param.grad = torch.zeros_like(param)
    return Stage(blocks=blocks, params=[p for _, p in named], names=[n for n, _ in named], received=received,
                 output_grad=output_grad)


def forward(stage: Stage, _: None) -> Pass:
    x = stage.received.detach().requires_grad_()
    return Pass(x=x, y=stage.blocks(x))


def full(stage: Stage, p: Pass) -> Pass:
    (p.input_grad,) = backward_full([p.y], [stage.output_grad], [p.x], stage.params)
    return p


def split_input(stage: Stage, p: Pass) -> Pass:
    (p.input_grad,), p.weight = backward_input([p.y], [stage.output_grad], [p.x], stage.params)
    return p


def split_weight(_: Stage, p: Pass) -> Pass:
    assert p.weight is not None, "W runs after I"
    p.weight.run()
    return p


def torch_input(stage: Stage, p: Pass) -> Pass:
    (p.input_grad,), p.groups = stage_backward_input([p.y], [stage.output_grad], [p.x], iter(stage.params))
    return p


def torch_weight(stage: Stage, p: Pass) -> Pass:
    stage_backward_weight(iter(stage.params), p.groups)
    return p


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    after: str | None  # the phase whose whole chain is this one's (untimed) set-up
    steps: tuple[Callable[[Stage, Any], Any], ...]  # the timed work, given what `after` left


PHASES: dict[str, Phase] = {
    "forward": Phase(after=None, steps=(forward,)),
    "B": Phase(after="forward", steps=(full,)),
    "I": Phase(after="forward", steps=(split_input,)),
    "W": Phase(after="I", steps=(split_weight,)),
    "I+W": Phase(after="forward", steps=(split_input, split_weight)),
    "torch_I": Phase(after="forward", steps=(torch_input,)),
    "torch_W": Phase(after="torch_I", steps=(torch_weight,)),
    "torch_I+W": Phase(after="forward", steps=(torch_input, torch_weight)),
}


def run_phase(stage: Stage, name: str | None, state: Any = None) -> Any:
    """The phase's set-up and its own work: one micro-batch from the forward to `name`'s end."""
    if name is None:
        return state
    phase = PHASES[name]
    state = run_phase(stage, phase.after, state)
    for step in phase.steps:
        state = step(stage, state)
    return state


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_sample(stage: Stage, name: str, device: torch.device) -> dict[str, float | None]:
    """One timed run of a phase alone, the GPU idle when it starts; its memory on a GPU."""
    phase = PHASES[name]
    state = run_phase(stage, phase.after)
    synchronize(device)
    cuda = device.type == "cuda"
    if cuda:
        start_bytes = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    elapsed = start_timer(device)
    for step in phase.steps:
        state = step(stage, state)
    seconds = elapsed()
    if not cuda:
        return {"ms": seconds * 1e3, "start_mib": None, "peak_mib": None, "held_mib": None}
    held = torch.cuda.memory_allocated(device) - start_bytes
    return {"ms": seconds * 1e3, "start_mib": start_bytes / MiB,
            "peak_mib": torch.cuda.max_memory_allocated(device) / MiB, "held_mib": held / MiB}


def wall_times(stage: Stage, names: list[str], settings: Settings) -> dict[str, dict[str, Any]]:
    """Each phase's median wall ms over interleaved rounds, the order rotating; its memory."""
    samples: dict[str, list[dict[str, float | None]]] = {name: [] for name in names}
    for r in range(settings.warmup + settings.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sample = wall_sample(stage, name, settings.device)
            if r >= settings.warmup:
                samples[name].append(sample)
    result = {}
    for name, runs in samples.items():
        ms = [s["ms"] for s in runs]
        memory = {key: (None if runs[0][key] is None else max(s[key] for s in runs))  # type: ignore[type-var]
                  for key in ("start_mib", "peak_mib", "held_mib")}
        result[name] = {"wall_ms": statistics.median(ms), "wall_ms_all": [round(v, 4) for v in ms], **memory}
    return result


def chain_ms(calls: Mapping[str, Callable[[], Any]], settings: Settings) -> dict[str, float]:
    """Median ms per call of each chain: GPU kernel time on CUDA (gpu_time's profiler clock),
    perf_counter wall time on the CPU, where the profiler records no kernels."""
    if settings.device.type == "cuda":
        samples = interleaved_kernel_ms(calls, rounds=settings.kernel_rounds, iters=settings.kernel_iters)
    else:
        samples = {name: [] for name in calls}
        for _ in range(settings.kernel_rounds):
            for name, call in calls.items():
                call()
                began = time.perf_counter()
                for _ in range(settings.kernel_iters):
                    call()
                samples[name].append((time.perf_counter() - began) * 1e3 / settings.kernel_iters)
    return {name: statistics.median(values) for name, values in samples.items()}


def kernel_times(stage: Stage, names: list[str], settings: Settings) -> dict[str, float]:
    """Each phase's own kernel ms: its chain less its set-up's chain."""
    chains = chain_ms({name: (lambda name=name: run_phase(stage, name)) for name in names}, settings)
    return {name: chains[name] - (chains[PHASES[name].after] if PHASES[name].after else 0.0) for name in names}


def gradients(stage: Stage, name: str) -> list[torch.Tensor | None]:
    """The input gradient and the parameters' gradients of one micro-batch run through `name`."""
    for param in stage.params:
        param.grad.zero_()
    p = run_phase(stage, name)
    return [p.input_grad] + [param.grad.clone() for param in stage.params]


def compare(found: list[torch.Tensor | None], reference: list[torch.Tensor | None], names: list[str],
            tolerance: float) -> dict[str, Any]:
    """The largest max |found - reference| / max |reference| over the gradient tensors."""
    errors = []
    for name, a, b in zip(names, found, reference, strict=True):
        if a is None or b is None:
            errors.append((0.0 if a is b else float("inf"), name))  # a gradient missing on one side only
            continue
        scale = b.float().abs().max().item()
        errors.append(((a.float() - b.float()).abs().max().item() / (scale if scale > 0 else 1.0), name))
    worst, worst_name = max(errors)
    return {"max_rel_error": worst, "worst_tensor": worst_name, "passed": worst <= tolerance}


def correctness(stage: Stage, with_torch: bool, tolerance: float) -> dict[str, Any]:
    names = ["input"] + stage.names
    reference = gradients(stage, "B")
    result = {"tolerance": tolerance,
              "repeat_full": compare(gradients(stage, "B"), reference, names, tolerance),
              "split": compare(gradients(stage, "I+W"), reference, names, tolerance)}
    if with_torch:
        result["torch_split"] = compare(gradients(stage, "torch_I+W"), reference, names, tolerance)
    return result


def planner_prediction(planner: Planner, micro_batch: int) -> dict[str, float]:
    """The planner's price of the same blocks (every block unit of the model) at this micro-batch."""
    blocks = [u for u in planner.units(tp=1, sp=False, mbs=micro_batch) if u.block_type is not None]
    forward_s = sum(u.forward_s for u in blocks)
    backward_s = sum(u.backward_s for u in blocks)
    weight_s = sum(u.weight_backward_s for u in blocks)
    return {"num_blocks": len(blocks), "forward_ms": forward_s * 1e3, "backward_ms": backward_s * 1e3,
            "weight_backward_ms": weight_s * 1e3, "weight_share": weight_s / backward_s,
            "full_over_forward": backward_s / forward_s}


def ratios(ms: Mapping[str, float | None]) -> dict[str, float | None]:
    def ratio(a: str, b: str) -> float | None:
        top, bottom = ms.get(a), ms.get(b)
        return None if top is None or bottom is None else top / bottom

    return {"split_over_full": ratio("I+W", "B"), "input_over_full": ratio("I", "B"),
            "weight_over_full": ratio("W", "B"), "torch_split_over_full": ratio("torch_I+W", "B"),
            "torch_weight_over_full": ratio("torch_W", "B"), "full_over_forward": ratio("B", "forward")}


def measure_shape(model: nn.Module, spec: str, micro_batch: int, planner: Planner, settings: Settings,
                  clock: Clock) -> dict[str, Any]:
    stage = make_stage(model, micro_batch, settings.device, settings.dtype)
    names = list(PHASES)
    row: dict[str, Any] = {"model": spec, "family": resolve_model(spec).family, "num_layers": len(model.layers),
                           "micro_batch": micro_batch, "seq_len": model.config.seq_len,
                           "tokens": micro_batch * model.config.seq_len}
    if TORCH_SPLIT_MISSING is not None:
        row["torch_split_error"] = TORCH_SPLIT_MISSING
    else:
        try:
            row["correctness"] = correctness(stage, True, settings.tolerance)
        except Exception as error:  # noqa: BLE001 - torch's private split failing must not lose mplan's numbers
            row["torch_split_error"] = f"torch's split raised {type(error).__name__}: {error}"
    if "torch_split_error" in row:
        names = [n for n in names if not n.startswith("torch_")]
        row["correctness"] = correctness(stage, False, settings.tolerance)
    clock.log(f"{spec} mbs={micro_batch}: gradients checked, timing {len(names)} phases")
    phases = wall_times(stage, names, settings)
    for name, ms in kernel_times(stage, names, settings).items():
        phases[name]["kernel_ms"] = ms
    row["phases"] = phases
    row["ratios"] = {"wall": ratios({n: p["wall_ms"] for n, p in phases.items()}),
                     "kernel": ratios({n: p["kernel_ms"] for n, p in phases.items()})}
    row["planner"] = planner_prediction(planner, micro_batch)
    for param in stage.params:
        param.grad = None
    return row


def table(shapes: Mapping[str, dict[str, Any]]) -> str:
    head = (f"{'shape':<14}{'F':>8}{'B':>8}{'I':>8}{'W':>8}{'I+W':>8}{'tI+tW':>8}  "
            f"{'(I+W)/B':>14}{'W/B':>14}{'W/B plan':>9}{'torch/B':>14}{'err':>9}{'torch err':>10}")
    lines = [head, "ms: wall clock (CUDA events on a GPU); ratios: wall / kernel clock; err: max relative error"]
    for key, row in shapes.items():
        p, wall, kernel = row["phases"], row["ratios"]["wall"], row["ratios"]["kernel"]

        def both(name: str) -> str:
            return "-" if wall[name] is None else f"{wall[name]:.3f}/{kernel[name]:.3f}"

        torch_err = row["correctness"].get("torch_split", {}).get("max_rel_error")
        lines.append(
            f"{key:<14}" + "".join(f"{p[n]['wall_ms']:>8.3f}" if n in p else f"{'-':>8}"
                                   for n in ("forward", "B", "I", "W", "I+W", "torch_I+W"))
            + f"  {both('split_over_full'):>14}{both('weight_over_full'):>14}"
            + f"{row['planner']['weight_share']:>9.3f}{both('torch_split_over_full'):>14}"
            + f"{row['correctness']['split']['max_rel_error']:>9.1e}"
            + (f"{torch_err:>10.1e}" if torch_err is not None else f"{'-':>10}"))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser, small=False)
    parser.add_argument("--cluster", default=CLUSTER,
                        help="the cluster preset the planner's W share is predicted on (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=None, help="wall-clock samples per phase (default 9; smoke 3)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no further shape after this many seconds, so that the report is written "
                             "within the device tool's 600 s per command; the report names what it skipped")


def run(args: argparse.Namespace) -> dict[str, Any]:
    clock = Clock()
    smoke = device_of(args, "split-backward").type == "cpu"
    settings = SMOKE if smoke else FULL
    if smoke:
        # tiny tensors gain nothing from threads, and on a busy 2-core runner OpenMP's threads
        # wait on each other: the smoke run took minutes instead of seconds
        torch.set_num_threads(1)
    if args.rounds:
        settings = dataclasses.replace(settings, rounds=args.rounds)
    report: dict[str, Any] = {
        **run_header(settings.device), "smoke": smoke, "dtype": str(settings.dtype).removeprefix("torch."),
        "planner_cluster": args.cluster,
        "kernel_clock": "cuda profiler kernel time (benchmarks/gpu_time.py)" if settings.device.type == "cuda"
        else "perf_counter wall time (CPU smoke run: no CUDA kernels to profile)",
        "settings": {"rounds": settings.rounds, "warmup": settings.warmup, "kernel_rounds": settings.kernel_rounds,
                     "kernel_iters": settings.kernel_iters, "tolerance": settings.tolerance},
        "torch_split_error": TORCH_SPLIT_MISSING,
        "shapes": {},
        "skipped": [],  # models --budget-s left out
    }
    for spec in settings.specs:
        model: nn.Module | None = None
        for micro_batch in settings.micro_batches:
            key = f"{resolve_model(spec).family} mbs={micro_batch}"
            if clock.elapsed() > args.budget_s:
                report["skipped"].append(f"{key} ({spec}): not started at {clock.elapsed():.0f} s > --budget-s")
                clock.log(report["skipped"][-1])
                continue
            if model is None:
                clock.log(f"{spec}: pricing with the planner, building on {settings.device}")
                planner = Planner(capture_for_planning(spec), ClusterSpec.preset(args.cluster))
                model = build_model(spec, device=settings.device, dtype=settings.dtype)
            report["shapes"][key] = measure_shape(model, spec, micro_batch, planner, settings, clock)
            write_report(args.out, report)  # a run cut short by the time limit keeps the shapes it finished
        del model
        gc.collect()
        if settings.device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"{report['gpu']}, torch {report['torch']}, triton {report['triton']}, {report['date']}, {report['dtype']}")
    print(table(report["shapes"]))
    failed = [f"{key}: {method} {check['max_rel_error']:.2e} > {row['correctness']['tolerance']}"
              for key, row in report["shapes"].items() for method, check in row["correctness"].items()
              if isinstance(check, dict) and not check["passed"]]
    print("gradients: " + ("; ".join(failed) if failed else "every split equals the whole backward"))
    for line in report["skipped"]:
        print(f"skipped: {line}")
    return report

