"""Check and time mplan's fused Triton kernels against torch eager and torch.compile on one GPU.

For each kernel (RMSNorm+residual, LayerNorm+residual, SwiGLU, SwiGLU on one GEMM's packed
halves, bias+GELU, RoPE, cross-entropy):
  1. correctness in bf16 on random data: outputs and every gradient of the fused op, and of
     the eager reference, against the reference run in fp32 on the same (upcast) inputs; the
     fused op passes when its relative error (in norm) is under max(1e-2, 2x eager's);
     checked at the timing shape and at an odd shape (no dimension a power of two);
  2. timing of forward and forward+backward, for the fused op, the eager reference and
     torch.compile of the reference (one compile per kernel: the forward and forward+backward
     timings share it), two ways: the GPU's kernel time from the profiler (benchmarks/gpu_time.py,
     the figures judged: in a GPU-bound training step the host runs ahead, so kernel time is
     what the step pays) and CUDA events around the call (triton.testing.do_bench, medians, L2
     flushed; reported as event_*), which for a ~0.1 ms kernel mostly measure the host's
     autograd and launch overhead;
  3. achieved TB/s counting the fewest bytes (mplan.fusion.fused_op_bytes: every input read
     once, every output written once) and its fraction of the device-to-device copy bandwidth
     measured in the same run (read + written bytes of a 1 GiB copy).
Shapes are those of mplan/cost_models/reference/h200-kernels-2026-11-29.json: 16384 tokens x hidden 4096
(norms), 14336 (SwiGLU), 16384 (bias+GELU); RoPE on [4, 32, 4096, 128]; cross-entropy on
4096 x 128256 logits. --all-shapes also times the rest of the training range (each Case's
`more_shapes`: hidden 2048 and 8192, FFN 5632 and 8192, RoPE as the end-to-end Llama runs it (a
transposed projection), cross-entropy on 16384 tokens x 32000 and 128256); its first H200 run
(2026-11-29, 119 s) is kept in results/kernels_h200-2026-11-29-all-shapes-first.json.
Target: >= 80% of copy bandwidth and no slower than torch.compile.
The wider autotune lists (5-7 configurations a kernel, each compiled once per shape) keep a run
under 2 minutes; kernels not started within BUDGET_S are skipped so the run ends within 4 minutes.

Run on the GPU (from the repository root):
    PYTHONPATH=. python3 benchmarks/fused_kernels.py --out $OUT/kernels.json
Smoke test of the script's logic on a CPU (Triton interpreter, tiny shapes, no compile, fp16):
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/fused_kernels.py --smoke --out /tmp/kernels.json
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import triton_version, write_report  # noqa: E402
from mplan.fusion import fused_op_bytes  # noqa: E402
from mplan.kernels import (  # noqa: E402
    bias_gelu,
    bias_gelu_reference,
    cross_entropy,
    cross_entropy_loss,
    cross_entropy_reference,
    gelu,
    glu,
    layer_norm_residual,
    layer_norm_residual_reference,
    layernorm,
    rms_norm_residual,
    rms_norm_residual_reference,
    rmsnorm,
    rope,
    rope_reference,
    rotary,
    swiglu,
    swiglu_packed,
    swiglu_packed_reference,
    swiglu_reference,
    use_triton,
)
from benchmarks.gpu_time import interleaved_kernel_ms  # noqa: E402
from mplan.models.layers import rope_tables  # noqa: E402

COPY_TARGET = 0.8
"""fraction of copy bandwidth each memory-bound kernel should reach (issue 6)"""
BUDGET_S = 170.0
"""kernels not started by then are skipped: one kernel with its compile and autotuning takes
up to ~40 s, and the whole run must end within 4 minutes"""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One kernel: how to make its inputs at a size, the fused op, its reference, its bytes."""

    name: str
    """key in mplan/cost_models/reference/h200-kernels-2026-11-29.json"""
    fused: Callable[..., Any]
    reference: Callable[..., Any]
    make: Callable[[dict[str, int], torch.device, torch.dtype], list[Any]]
    """inputs: floating tensors that require grad are differentiated; others are constants"""
    shape: dict[str, int]
    odd_shape: dict[str, int]
    bytes: Callable[[dict[str, int], int], tuple[int, int]]
    """(forward bytes, backward bytes) at a shape and itemsize"""
    kernels: tuple[Any, ...]
    """the Triton autotuners behind the op, whose chosen configs are reported"""
    more_shapes: tuple[dict[str, int], ...] = ()
    """further training shapes timed with --all-shapes (16k tokens, hidden 2048-8192, vocab 32k-128k)"""


def _leaf(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    return (shift + scale * torch.randn(shape, device=device, dtype=torch.float32)).to(dtype).requires_grad_()


def _rows_bytes(op: str) -> Callable[[dict[str, int], int], tuple[int, int]]:
    def count(s: dict[str, int], itemsize: int) -> tuple[int, int]:
        return tuple(fused_op_bytes(op, num_rows=s["rows"], row_size=s["cols"], itemsize=itemsize, backward=b)
                     for b in (False, True))  # type: ignore[return-value]
    return count


def _rope_bytes(s: dict[str, int], itemsize: int) -> tuple[int, int]:
    rows = s["batch"] * s["heads"] * s["seq"]
    return tuple(fused_op_bytes("rope", num_rows=rows, row_size=s["head_dim"], itemsize=itemsize,
                                backward=b, table_rows=s["seq"]) for b in (False, True))  # type: ignore[return-value]


def _rope_inputs(s: dict[str, int], device: torch.device, dtype: torch.dtype) -> list[Any]:
    cos, sin = rope_tables(s["seq"], s["head_dim"], 500000.0, device=device)
    if s.get("projected"):  # as a model hands it: the [b, s, h, d] projection, transposed (a view)
        x = _leaf((s["batch"], s["seq"], s["heads"], s["head_dim"]), device, dtype).transpose(1, 2)
    else:
        x = _leaf((s["batch"], s["heads"], s["seq"], s["head_dim"]), device, dtype)
    return [x, cos.to(dtype), sin.to(dtype)]


def _ce_inputs(s: dict[str, int], device: torch.device, dtype: torch.dtype) -> list[Any]:
    labels = torch.randint(0, s["cols"], (s["rows"],), device=device)
    labels[torch.rand(s["rows"], device=device) < 0.05] = -100  # padding rows, as in packed batches
    return [_leaf((s["rows"], s["cols"]), device, dtype, scale=2.0), labels]


CASES = [
    Case(name="rmsnorm+residual", fused=rms_norm_residual, reference=rms_norm_residual_reference,
         make=lambda s, d, t: [_leaf((s["rows"], s["cols"]), d, t), _leaf((s["rows"], s["cols"]), d, t),
                               _leaf((s["cols"],), d, t, 0.1, 1.0), 1e-5],
         shape={"rows": 16384, "cols": 4096}, odd_shape={"rows": 1001, "cols": 4000},
         more_shapes=({"rows": 16384, "cols": 2048}, {"rows": 16384, "cols": 8192}),
         bytes=_rows_bytes("rms_norm_residual"), kernels=(rmsnorm._forward_kernel, rmsnorm._backward_kernel)),
    Case(name="layernorm+residual", fused=layer_norm_residual, reference=layer_norm_residual_reference,
         make=lambda s, d, t: [_leaf((s["rows"], s["cols"]), d, t), _leaf((s["rows"], s["cols"]), d, t),
                               _leaf((s["cols"],), d, t, 0.1, 1.0), _leaf((s["cols"],), d, t, 0.1), 1e-5],
         shape={"rows": 16384, "cols": 4096}, odd_shape={"rows": 1001, "cols": 4000},
         more_shapes=({"rows": 16384, "cols": 2048}, {"rows": 16384, "cols": 8192}),
         bytes=_rows_bytes("layer_norm_residual"), kernels=(layernorm._forward_kernel, layernorm._backward_kernel)),
    Case(name="swiglu", fused=swiglu, reference=swiglu_reference,
         make=lambda s, d, t: [_leaf((s["rows"], s["cols"]), d, t, 2.0), _leaf((s["rows"], s["cols"]), d, t)],
         shape={"rows": 16384, "cols": 14336}, odd_shape={"rows": 1001, "cols": 3001},
         more_shapes=({"rows": 16384, "cols": 5632},),
         bytes=_rows_bytes("swiglu"), kernels=(glu._forward_kernel, glu._backward_kernel)),
    Case(name="swiglu (packed)", fused=swiglu_packed, reference=swiglu_packed_reference,
         make=lambda s, d, t: [_leaf((s["rows"], 2 * s["cols"]), d, t, 2.0)],
         shape={"rows": 16384, "cols": 14336}, odd_shape={"rows": 1001, "cols": 3001},
         more_shapes=({"rows": 16384, "cols": 5632},),
         bytes=_rows_bytes("swiglu"), kernels=(glu._packed_forward_kernel, glu._packed_backward_kernel)),
    Case(name="bias+gelu", fused=bias_gelu, reference=bias_gelu_reference,
         make=lambda s, d, t: [_leaf((s["rows"], s["cols"]), d, t, 2.0), _leaf((s["cols"],), d, t, 0.5)],
         shape={"rows": 16384, "cols": 16384}, odd_shape={"rows": 1001, "cols": 3001},
         more_shapes=({"rows": 16384, "cols": 8192},),
         bytes=_rows_bytes("bias_gelu"), kernels=(gelu._forward_kernel, gelu._backward_kernel)),
    Case(name="rope", fused=rope, reference=rope_reference, make=_rope_inputs,
         shape={"batch": 4, "heads": 32, "seq": 4096, "head_dim": 128},
         odd_shape={"batch": 3, "heads": 5, "seq": 1001, "head_dim": 80}, bytes=_rope_bytes,
         more_shapes=({"batch": 8, "heads": 16, "seq": 2048, "head_dim": 128, "projected": 1},),
         kernels=(rotary._rope_kernel,)),
    Case(name="cross_entropy", fused=cross_entropy, reference=cross_entropy_reference, make=_ce_inputs,
         shape={"rows": 4096, "cols": 128256}, odd_shape={"rows": 1001, "cols": 50001},
         more_shapes=({"rows": 16384, "cols": 32000}, {"rows": 16384, "cols": 128256}),
         bytes=_rows_bytes("cross_entropy"),
         kernels=(cross_entropy_loss._block_stats_kernel, cross_entropy_loss._grad_kernel)),
]

SMOKE_SHAPES = {
    "rmsnorm+residual": {"rows": 7, "cols": 48}, "layernorm+residual": {"rows": 7, "cols": 48},
    "swiglu": {"rows": 7, "cols": 45}, "swiglu (packed)": {"rows": 7, "cols": 45},
    "bias+gelu": {"rows": 7, "cols": 45},
    "rope": {"batch": 2, "heads": 3, "seq": 5, "head_dim": 8}, "cross_entropy": {"rows": 9, "cols": 70},
}


def _outputs(result: Any) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _leaves(inputs: list[Any]) -> list[torch.Tensor]:
    return [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]


def _forward_backward(fn: Callable[..., Any], inputs: list[Any],
                      upstream: list[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    outputs = _outputs(fn(*inputs))
    return outputs, torch.autograd.grad(outputs, _leaves(inputs), upstream)


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().norm().item()
    error = (actual.float() - expected.float()).norm().item()
    return error / scale if scale else error


def check(case: Case, shape: dict[str, int], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Relative errors of the fused op and of the eager reference against the fp32 reference."""
    torch.manual_seed(0)
    inputs = case.make(shape, device, dtype)
    fused_out = _outputs(case.fused(*inputs))
    upstream = [torch.randn_like(out) for out in fused_out]
    fused = _forward_backward(case.fused, inputs, upstream)
    eager = _forward_backward(case.reference, inputs, upstream)
    wide = [a.detach().float().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
            and a.is_floating_point() else a for a in inputs]
    exact = _forward_backward(case.reference, wide, [u.float() for u in upstream])
    names = [f"out{i}" for i in range(len(exact[0]))] + [f"grad{i}" for i in range(len(exact[1]))]
    errors: dict[str, dict[str, float]] = {"fused": {}, "eager": {}}
    for label, (outs, grads) in (("fused", fused), ("eager", eager)):
        for name, got, want in zip(names, (*outs, *grads), (*exact[0], *exact[1])):
            errors[label][name] = _rel(got, want)
    passed = all(errors["fused"][n] <= max(1e-2, 2 * errors["eager"][n]) for n in names)
    return {"shape": shape, "passed": passed, "triton_used": use_triton(inputs[0]), "errors": errors}


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall_ms(fn: Callable[[], Any]) -> float:  # the smoke test's stand-in: no events on a CPU
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


ROUNDS = 5
"""interleaved rounds of GPU kernel timing per implementation; the medians are judged"""


def time_case(case: Case, device: torch.device, dtype: torch.dtype, shape: dict[str, int], copy_tbps: float,
              compile_reference: bool) -> dict[str, Any]:
    """Every implementation built and warmed first, then timed by GPU kernel time in ROUNDS
    interleaved rounds (`interleaved_kernel_ms`, which says why); the median of each is reported
    with the rounds' range."""
    timer = _timer(device)
    torch.manual_seed(0)
    inputs = case.make(shape, device, dtype)
    upstream = [torch.randn_like(out) for out in _outputs(case.reference(*inputs))]
    bytes_fwd, bytes_bwd = case.bytes(shape, torch.finfo(dtype).bits // 8)
    impls: dict[str, Callable[..., Any]] = {"triton": case.fused, "eager": case.reference}
    if compile_reference:
        impls["compile"] = torch.compile(case.reference, dynamic=False)
    result: dict[str, Any] = {"shape": shape, "bytes_fwd": bytes_fwd, "bytes_fwd_bwd": bytes_fwd + bytes_bwd}
    rows: dict[str, dict[str, Any]] = {}
    calls: dict[str, dict[str, Callable[[], Any]]] = {}
    for name, fn in impls.items():
        start = time.perf_counter()
        _forward_backward(fn, inputs, upstream)  # compiles (torch.compile) and autotunes (Triton)
        calls[name] = {"fwd": lambda fn=fn: fn(*inputs),
                       "fwd_bwd": lambda fn=fn: _forward_backward(fn, inputs, upstream)}
        rows[name] = {"warmup_s": time.perf_counter() - start,
                      "event_fwd_ms": timer(calls[name]["fwd"]), "event_fwd_bwd_ms": timer(calls[name]["fwd_bwd"])}
    if device.type == "cuda":  # the GPU's own time: what a GPU-bound training step pays
        samples = interleaved_kernel_ms({(name, what): call for name, by_what in calls.items()
                                         for what, call in by_what.items()}, rounds=ROUNDS, iters=20)
        for (name, what), values in samples.items():
            rows[name][f"{what}_ms"] = statistics.median(values)
            rows[name][f"{what}_range_ms"] = [round(min(values), 5), round(max(values), 5)]
    else:
        for row in rows.values():
            row["fwd_ms"], row["fwd_bwd_ms"] = row["event_fwd_ms"], row["event_fwd_bwd_ms"]
    for name, row in rows.items():
        fwd_tbps = bytes_fwd / row["fwd_ms"] / 1e9
        bwd_tbps = bytes_bwd / max(row["fwd_bwd_ms"] - row["fwd_ms"], 1e-9) / 1e9
        fwd_bwd_tbps = (bytes_fwd + bytes_bwd) / row["fwd_bwd_ms"] / 1e9
        result[name] = {**{k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()},
                        "fwd_TBps": round(fwd_tbps, 3), "bwd_TBps": round(bwd_tbps, 3),
                        "fwd_bwd_TBps": round(fwd_bwd_tbps, 3),
                        "fwd_copy_fraction": round(fwd_tbps / copy_tbps, 3),
                        "bwd_copy_fraction": round(bwd_tbps / copy_tbps, 3),
                        "fwd_bwd_copy_fraction": round(fwd_bwd_tbps / copy_tbps, 3)}
    result["triton_configs"] = {_jit_name(kernel): str(getattr(kernel, "best_config", None)) for kernel in case.kernels}
    triton_row = result["triton"]
    result["meets_copy_target"] = {"fwd": triton_row["fwd_copy_fraction"] >= COPY_TARGET,
                                   "bwd": triton_row["bwd_copy_fraction"] >= COPY_TARGET}
    if "compile" in result:
        result["not_slower_than_compile"] = {
            "fwd": triton_row["fwd_ms"] <= result["compile"]["fwd_ms"],
            "fwd_bwd": triton_row["fwd_bwd_ms"] <= result["compile"]["fwd_bwd_ms"]}
        result["triton_vs_compile"] = {  # > 1: the Triton kernel is faster
            "fwd": round(result["compile"]["fwd_ms"] / triton_row["fwd_ms"], 4),
            "fwd_bwd": round(result["compile"]["fwd_bwd_ms"] / triton_row["fwd_bwd_ms"], 4)}
    return result


def _jit_name(kernel: Any) -> str:
    """The kernel function's name under its autotune and heuristics wrappers."""
    while not hasattr(kernel, "__name__"):
        kernel = kernel.fn
    return kernel.__name__


def copy_bandwidth_tbps(device: torch.device) -> float:
    """Read + written bytes per second of a 1 GiB device-to-device copy (64 KiB in the smoke test)."""
    numel = (1 << 29) if device.type == "cuda" else (1 << 15)
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = _timer(device)(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated kernels to run")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the references")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="start no kernel after this many seconds (about 400 with --all-shapes)")
    parser.add_argument("--all-shapes", action="store_true",
                        help="also time each kernel's further training shapes (hidden 2048-8192, 16k-token vocab)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke test: tiny shapes, fp16, no compile (needs TRITON_INTERPRET=1)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float16 if args.smoke else torch.bfloat16  # the interpreter computes bf16 wrongly

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    copy_tbps = copy_bandwidth_tbps(device)
    log(f"copy bandwidth {copy_tbps:.3f} TB/s")
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke test)",
        "torch": torch.__version__, "triton": triton_version(), "dtype": str(dtype).removeprefix("torch."),
        "copy_TBps": round(copy_tbps, 3), "copy_target_fraction": COPY_TARGET, "kernels": {},
    }
    wanted = set(args.cases.split(","))
    for case in (c for c in CASES if c.name in wanted):
        shape = SMOKE_SHAPES[case.name] if args.smoke else case.shape
        entry: dict[str, Any] = {}
        if time.perf_counter() - start > args.budget_s:
            report["kernels"][case.name] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
            log(f"{case.name}: skipped (time budget)")
            continue
        try:
            entry["check"] = [check(case, shape, device, dtype)]
            if not args.smoke:
                entry["check"].append(check(case, case.odd_shape, device, dtype))
            entry["correct"] = all(c["passed"] and c["triton_used"] for c in entry["check"])
            entry["timing"] = time_case(case, device, dtype, shape, copy_tbps,
                                        compile_reference=not (args.no_compile or args.smoke))
            if args.all_shapes:  # the rest of the training-shape range, after the headline shape
                more = [SMOKE_SHAPES[case.name]] if args.smoke else list(case.more_shapes)
                entry["timing_more"] = [time_case(case, device, dtype, extra, copy_tbps,
                                                  compile_reference=not (args.no_compile or args.smoke))
                                        for extra in more]
        except Exception:  # noqa: BLE001 - one kernel's failure must not lose the others' numbers
            entry["error"] = traceback.format_exc()
        report["kernels"][case.name] = entry
        log(f"{case.name}: " + _summary(entry))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["wall_s"] = round(time.perf_counter() - start, 1)
    write_report(args.out, report)
    log(f"wrote {args.out}")


def _summary(entry: dict[str, Any]) -> str:
    if "error" in entry:
        return "ERROR " + entry["error"].strip().splitlines()[-1]
    return f"correct={entry['correct']}; " + "\n    ".join(_timing_summary(t) for t in
                                                            [entry["timing"], *entry.get("timing_more", [])])


def _timing_summary(timing: dict[str, Any]) -> str:
    parts = [str(timing["shape"])]
    for name in ("triton", "eager", "compile"):
        if name in timing:
            row = timing[name]
            parts.append(f"{name} fwd {row['fwd_ms']:.3f} ms ({row['fwd_copy_fraction']:.0%} of copy) "
                         f"fwd+bwd {row['fwd_bwd_ms']:.3f} ms (bwd {row['bwd_copy_fraction']:.0%}; "
                         f"events {row['event_fwd_ms']:.3f}/{row['event_fwd_bwd_ms']:.3f})")
    return "; ".join(parts)



if __name__ == "__main__":
    main()
