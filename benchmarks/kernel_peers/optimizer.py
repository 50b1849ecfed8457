"""AdamW on one GPU: mplan's multi-tensor Triton step (mplan/kernels/adamw.py) against torch's fused AdamW.

For the parameters of GPT-1.3B and Llama-1.1B (benchmarks/models/workloads.py, shapes taken
from the models built on the meta device), in bf16 and in fp32, AdamW(lr=1e-3, weight_decay=0.1):
1. check: 3 steps, each from the same state (torch's params, moments and steps copied into an
   identical optimizer that `adamw.step` drives), the last with a grad_scale; per tensor the
   largest |mplan - torch| over the largest |torch|, for params, both moments and the scaled
   gradients. Passes within two units in the last place of that largest element (2 x the
   dtype's eps). The reference is torch's fused AdamW for 16-bit parameters (both round one fp32
   value) and torch's for-each AdamW for fp32: torch's fused CUDA kernel rounds beta1 and beta2
   to fp32 before taking 1 - beta (1 - fp32(0.999) is 1.3e-5 off 0.001), which showed on the
   H200 as exactly that 1.3e-5 relative difference in exp_avg_sq (and 2.4e-7 in exp_avg, from
   0.9) against mplan, whose 1 - beta comes from the float64 betas as in torch's for-loop and
   for-each paths. Both state layouts run: `fused=True` (steps on the GPU, read by the kernel through their addresses)
   and torch's default (steps on the CPU, their values written into the kernel's table).
2. time: GPU kernel time (benchmarks/gpu_time.kernel_ms: every kernel and copy a call issues)
   of torch's fused step and of mplan's in both layouts, without and with a grad_scale; the
   bytes moved (read p, g, m, v, write p, m, v, and g again with a grad_scale), TB/s, the
   fraction of the device-to-device copy bandwidth measured in the same run, torch / mplan, and
   the host's milliseconds per call.
3. sweep (GPT-1.3B): mplan's launch shapes (bytes of each stream per block, blocks per program,
   warps), each checked for one step and timed with a grad_scale, fastest first: the data for
   `adamw.default_config`.

A check that fails is listed in the report's `check_failed`.

Run on the GPU (from the repository root; a few minutes, most of it Triton compiling the sweep):
    PYTHONPATH=. python -m benchmarks.kernel_peers optimizer --out $OUT/optimizer.json
Smoke mode on a CPU (tiny models, the PyTorch reference path, no timing):
    PYTHONPATH=. python -m benchmarks.kernel_peers optimizer --device cpu --small --out /tmp/optimizer.json
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import harness
from benchmarks.gpu_time import kernel_ms
from benchmarks.kernel_peers import engine
from benchmarks.models.workloads import FULL, SMALL, Workload
from benchmarks.report import Clock
from mplan.kernels import adamw
from mplan.models import build_model

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LR, WEIGHT_DECAY = 1e-3, 0.1
CHECK_STEPS = 3
GRAD_SCALE = 1.25
"""The last checked step's grad_scale (a clip coefficient's reciprocal would be >= 1)."""
TIMING_ITERS = 10
SWEEP = [(block_bytes, blocks, warps)
         for block_bytes, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (8192, 16),
                                    (16384, 8), (16384, 16))
         for blocks in (1, 4, 16)]
"""(bytes of each stream per block, blocks per program, warps): one to four 16-byte vectors per
thread and stream."""


def parameter_shapes(workload: Workload) -> list[torch.Size]:
    with torch.device("meta"):
        return [p.shape for p in build_model(workload.config).parameters()]


class Pair:
    """A torch AdamW (fused, or for-each with `torch_fused=False`) and an identical AdamW stepped
    by `adamw.step`, on equal parameters."""

    def __init__(self, shapes: list[torch.Size], dtype: torch.dtype, device: torch.device, *,
                 mplan_fused: bool, torch_fused: bool = True) -> None:
        gen = torch.Generator(device).manual_seed(0)
        self.torch_params = [(0.02 * torch.randn(s, device=device, generator=gen)).to(dtype).requires_grad_()
                             for s in shapes]
        self.mplan_params = [p.detach().clone().requires_grad_() for p in self.torch_params]
        self.torch = torch.optim.AdamW(self.torch_params, lr=LR, weight_decay=WEIGHT_DECAY,
                                       **({"fused": True} if torch_fused else {"foreach": True}))
        self.mplan = torch.optim.AdamW(self.mplan_params, lr=LR, weight_decay=WEIGHT_DECAY,
                                       fused=mplan_fused or None)

    def set_grads(self, seed: int) -> None:
        gen = torch.Generator(self.torch_params[0].device).manual_seed(seed)
        for p, q in zip(self.torch_params, self.mplan_params):
            p.grad = torch.randn(p.shape, device=p.device, generator=gen).to(p.dtype)
            q.grad = p.grad.clone()

    @torch.no_grad()
    def copy_torch_state(self) -> None:
        """mplan's params, moments and steps := torch's (so the next step starts from one state)."""
        for p, q in zip(self.torch_params, self.mplan_params):
            q.copy_(p)
            for key, value in self.torch.state[p].items():
                if key not in self.mplan.state[q]:
                    self.mplan.state[q][key] = value.clone().to(self.mplan_step_device if key == "step"
                                                                else q.device)
                else:
                    self.mplan.state[q][key].copy_(value)

    @property
    def mplan_step_device(self) -> torch.device:
        """Where torch puts a step for this optimizer's groups (the parameters' device when fused)."""
        return self.mplan_params[0].device if self.mplan.param_groups[0]["fused"] else torch.device("cpu")

    def step_both(self, grad_scale: torch.Tensor | None, config: adamw.LaunchConfig | None = None) -> None:
        """One step of each; torch's for-each AdamW takes no grad_scale: its grads are divided first."""
        fused = self.torch.param_groups[0]["fused"]
        if grad_scale is not None and fused:
            self.torch.grad_scale = grad_scale
        elif grad_scale is not None:
            with torch.no_grad():
                torch._foreach_div_([p.grad for p in self.torch_params], grad_scale)
        self.torch.step()
        if grad_scale is not None and fused:
            del self.torch.grad_scale
        adamw.step(self.mplan, grad_scale, config=config)

    @torch.no_grad()
    def max_rel_diffs(self, with_grads: bool) -> dict[str, float]:
        """Over tensors: max |mplan - torch| / max |torch|, per kind of value."""
        worst = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, **({"grad": 0.0} if with_grads else {})}
        for p, q in zip(self.torch_params, self.mplan_params):
            pairs = {"param": (p, q), "exp_avg": (self.torch.state[p]["exp_avg"], self.mplan.state[q]["exp_avg"]),
                     "exp_avg_sq": (self.torch.state[p]["exp_avg_sq"], self.mplan.state[q]["exp_avg_sq"])}
            if with_grads:
                pairs["grad"] = (p.grad, q.grad)
            for kind, (want, got) in pairs.items():
                scale = want.abs().max().float().item()
                diff = (got.float() - want.float()).abs().max().item()
                worst[kind] = max(worst[kind], diff / scale if scale else diff)
        return worst


def check(pair: Pair, dtype: torch.dtype, config: adamw.LaunchConfig | None = None,
          steps: int = CHECK_STEPS) -> dict[str, Any]:
    """`steps` steps from torch's state each, the last with a grad_scale; worst relative differences."""
    tolerance = 2 * torch.finfo(dtype).eps
    worst: dict[str, float] = {}
    for step in range(steps):
        scaled = step == steps - 1
        pair.set_grads(seed=step)
        pair.copy_torch_state()
        device = pair.torch_params[0].device
        pair.step_both(torch.tensor(GRAD_SCALE, device=device) if scaled else None, config)
        for kind, value in pair.max_rel_diffs(with_grads=scaled).items():
            worst[kind] = max(worst.get(kind, 0.0), value)
    steps_equal = all(pair.torch.state[p]["step"].item() == pair.mplan.state[q]["step"].item()
                      for p, q in zip(pair.torch_params, pair.mplan_params))
    return {"passed": steps_equal and max(worst.values()) <= tolerance, "steps_equal": steps_equal,
            "tolerance": tolerance, "max_rel_diff": {k: float(f"{v:.3g}") for k, v in worst.items()}}


def host_ms(fn: Callable[[], Any], iters: int = TIMING_ITERS) -> float:
    """Host milliseconds per call (the launches, not their GPU time)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - began
    torch.cuda.synchronize()
    return 1e3 * elapsed / iters


def timing(pairs: dict[str, Pair], num_bytes: int, copy: float) -> dict[str, Any]:
    """GPU kernel time of torch's fused step and mplan's (per state layout), with and without grad_scale."""
    device = next(iter(pairs.values())).torch_params[0].device
    fused = torch.optim.AdamW(pairs["device_steps"].torch_params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    scale = torch.tensor(1.0, device=device)  # divides by 1: the grads stay as they are over the iterations
    rows: dict[str, Any] = {}
    for scaled in (False, True):
        grad_scale = scale if scaled else None
        bytes_moved = num_bytes * (8 if scaled else 7)
        def torch_step(grad_scale: torch.Tensor | None = grad_scale) -> None:
            if grad_scale is not None:
                fused.grad_scale = grad_scale  # type: ignore[attr-defined]
            fused.step()
            if grad_scale is not None:
                del fused.grad_scale  # type: ignore[attr-defined]

        calls = {"torch_fused": torch_step}
        for layout, pair in pairs.items():
            calls[f"mplan_{layout}"] = lambda pair=pair, grad_scale=grad_scale: adamw.step(pair.mplan, grad_scale)
        entry: dict[str, Any] = {}
        for name, fn in calls.items():
            ms = kernel_ms(fn, iters=TIMING_ITERS)
            tbps = bytes_moved / ms / 1e9
            entry[name] = {"ms": round(ms, 3), "TBps": round(tbps, 3), "copy_fraction": round(tbps / copy, 3),
                           "host_ms": round(host_ms(fn), 3)}
        for name in calls:
            if name != "torch_fused":
                entry[name]["torch_over_mplan"] = round(entry["torch_fused"]["ms"] / entry[name]["ms"], 3)
        entry["fewest_bytes_ms"] = round(bytes_moved / (copy * 1e9), 3)
        rows["grad_scale" if scaled else "plain"] = entry
    return rows


def sweep(shapes: list[torch.Size], dtype: torch.dtype, device: torch.device, num_bytes: int, copy: float,
          clock: Clock) -> list[dict[str, Any]]:
    """Every launch shape in SWEEP, checked for one step and timed, both with a grad_scale (one
    compile per shape; mplan's clipped step), fastest first."""
    pair = Pair(shapes, dtype, device, mplan_fused=True, torch_fused=dtype != torch.float32)
    scale = torch.tensor(1.0, device=device)
    rows = []
    for block_bytes, blocks, warps in SWEEP:
        config = adamw.LaunchConfig(block=block_bytes // dtype.itemsize, blocks_per_chunk=blocks, num_warps=warps)
        checked = check(pair, dtype, config, steps=1)
        ms = kernel_ms(lambda config=config: adamw.step(pair.mplan, scale, config=config), iters=TIMING_ITERS)
        tbps = 8 * num_bytes / ms / 1e9
        rows.append({"block_bytes": block_bytes, "block": config.block, "blocks_per_chunk": blocks, "num_warps": warps,
                     "ms": round(ms, 3), "TBps": round(tbps, 3), "copy_fraction": round(tbps / copy, 3),
                     "passed": checked["passed"]})
        clock.log(f"sweep {dtype}: {rows[-1]}")
    return sorted(rows, key=lambda row: row["ms"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)
    parser.add_argument("--models", help="comma-separated workload names (default: all)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweep")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    clock = Clock()
    workloads = [w for w in (SMALL if args.small else FULL) if not args.models or w.name in args.models.split(",")]
    copy = engine.copy_bandwidth_tbps(device) if device.type == "cuda" else None
    report: dict[str, Any] = {**engine.header(device), "copy_TBps": copy and round(copy, 3),
                              "lr": LR, "weight_decay": WEIGHT_DECAY, "rows": [], "sweep": {}}
    for workload in workloads:
        shapes = parameter_shapes(workload)
        num_params = sum(s.numel() for s in shapes)
        for dtype_name, dtype in DTYPES.items():
            num_bytes = num_params * dtype.itemsize
            torch_fused = dtype != torch.float32  # the check's reference (module docstring)
            pairs = {"device_steps": Pair(shapes, dtype, device, mplan_fused=True, torch_fused=torch_fused),
                     "cpu_steps": Pair(shapes, dtype, device, mplan_fused=False, torch_fused=torch_fused)}
            row: dict[str, Any] = {"model": workload.name, "dtype": dtype_name, "num_params": num_params,
                                   "num_tensors": len(shapes), "applies": adamw.applies(pairs["device_steps"].mplan)}
            checks = {layout: check(pair, dtype) for layout, pair in pairs.items()}
            row["check"] = {"passed": all(c["passed"] for c in checks.values()), **checks}
            clock.log(f"{workload.name} {dtype_name}: check {row['check']}")
            if copy is not None:
                row["timing"] = timing(pairs, num_bytes, copy)
                clock.log(f"{workload.name} {dtype_name}: timing {row['timing']}")
            report["rows"].append(row)
            del pairs
            if copy is not None:
                torch.cuda.empty_cache()
                if not args.no_sweep and workload is FULL[0]:
                    report["sweep"][dtype_name] = sweep(shapes, dtype, device, num_bytes, copy, clock)
                    torch.cuda.empty_cache()
            engine.save_partial(args, report)
    report["check_failed"] = [(r["model"], r["dtype"]) for r in report["rows"] if not r["check"]["passed"]]
    if report["check_failed"]:
        clock.log(f"mplan's AdamW differs from torch's beyond the tolerance: {report['check_failed']}")
    return report
