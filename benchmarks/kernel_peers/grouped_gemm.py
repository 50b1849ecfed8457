"""The grouped q/k/v and gate/up GEMMs with their weights apart against end to end in one storage.

`kernels.grouped_linear` runs a group of linears on one input as one GEMM on the concatenation
of their weights. With each weight its own parameter, it copies them into one tensor in every
forward and again in every backward; laid end to end in one storage (what the runtime does since
2026-12-07, `mplan/runtime/grouped_storage.py`) the concatenation is a view. On an H100 the
copies were 96 a micro-batch and 3.2 ms on SmolLM2-1.7B's shape, 25.6 ms of its 390 ms step at
micro-batch 1 (benchmarks/results/hf_measure-2026-12-06-session18-smollm2.json, its profiled
rows). This times one layer's two groups both ways, forward and backward (the input's and the
weights' gradients), by GPU kernel time in interleaved rounds (benchmarks/gpu_time.py), at the
widths of three Hugging Face models and at micro-batch 1 and 8 of 2048 tokens, beside ATen's
`cat` + `linear` (the unfused program, and the zero-bubble and FP8 programs' form before
2026-12-07) and `linear` on `joined_weights` end to end (their form since); checks that both
layouts give the same bits, and both ATen forms; and gives what end to end saves a micro-batch
over the model's layers.

    PYTHONPATH=. python -m benchmarks.kernel_peers grouped-gemm --out $OUT/grouped_gemm.json
Smoke mode on a CPU (one tiny model, wall-clock time):
    PYTHONPATH=. python -m benchmarks.kernel_peers grouped-gemm --device cpu --small --out /tmp/grouped_gemm.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import harness
from benchmarks.kernel_peers import engine
from mplan.kernels.grouped_linear import end_to_end, grouped_linear, grouped_linear_reference, joined_weights

MODELS = {  # hidden, layers, the q/k/v widths, the gate/up widths (their configs: benchmarks/calibration)
    "smollm2-1.7b": (2048, 24, (2048, 2048, 2048), (8192, 8192)),
    "qwen3-1.7b": (2048, 28, (2048, 1024, 1024), (6144, 6144)),
    "gemma-2b": (2048, 18, (2048, 256, 256), (16384, 16384)),
}
SMALL = {"tiny": (64, 2, (64, 32, 32), (128, 128))}
TOKENS = (2048, 16384)
"""micro-batch 1 and 8 at 2048 tokens a sequence"""
SMALL_TOKENS = (32,)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (kernel time, GPU)")


def _weights(widths: tuple[int, ...], hidden: int, device: torch.device, dtype: torch.dtype,
             together: bool) -> list[torch.Tensor]:
    """The group's weights (seeded alike either way): apart, or views of one storage end to end."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    values = [torch.randn(n, hidden, generator=gen).mul_(hidden ** -0.5).to(device, dtype) for n in widths]
    if not together:
        return [v.requires_grad_() for v in values]
    storage = torch.cat(values)
    pieces, row = [], 0
    for n in widths:
        pieces.append(storage[row:row + n].detach().requires_grad_())
        row += n
    assert end_to_end(pieces)
    return pieces


def _step(fn: Callable[..., torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor],
          dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out = fn(x, weights, [None] * len(weights))
    return (out, *torch.autograd.grad(out, [x, *weights], dy))


def _joined_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[None]) -> torch.Tensor:
    """The ATen form a zero-bubble schedule's split backward and FP8 take (`fusion/projections.py`)."""
    return torch.nn.functional.linear(x, joined_weights(weights))


def _group(name: str, widths: tuple[int, ...], hidden: int, tokens: int, device: torch.device,
           dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(tokens, sum(widths), generator=gen).to(device, dtype)
    apart, together = (_weights(widths, hidden, device, dtype, t) for t in (False, True))
    results = {"apart": _step(grouped_linear, x, apart, dy), "end_to_end": _step(grouped_linear, x, together, dy)}
    same = all(torch.equal(a, b) for a, b in zip(results["apart"], results["end_to_end"]))
    aten = (_step(grouped_linear_reference, x, apart, dy), _step(_joined_linear, x, together, dy))
    same_aten = all(torch.equal(a, b) for a, b in zip(*aten))
    calls = {"apart": lambda: _step(grouped_linear, x, apart, dy),
             "end_to_end": lambda: _step(grouped_linear, x, together, dy),
             "aten_cat_linear": lambda: _step(grouped_linear_reference, x, apart, dy),
             "aten_joined_linear": lambda: _step(_joined_linear, x, together, dy)}
    if device.type == "cuda":
        from benchmarks.gpu_time import interleaved_kernel_ms

        samples = interleaved_kernel_ms(calls, rounds=rounds, iters=10)
        ms = {key: statistics.median(values) for key, values in samples.items()}
    else:
        samples, ms = None, {key: engine.wall_ms(call) for key, call in calls.items()}
    row = {"group": name, "widths": list(widths), "hidden": hidden, "tokens": tokens, "same_bits": same,
           "aten_same_bits": same_aten, "ms": ms, "saved_ms": ms["apart"] - ms["end_to_end"],
           "aten_saved_ms": ms["aten_cat_linear"] - ms["aten_joined_linear"], "samples_ms": samples}
    print(f"{name} {widths} x{tokens}: apart {ms['apart']:.3f} ms, end to end {ms['end_to_end']:.3f} ms, "
          f"aten cat {ms['aten_cat_linear']:.3f} ms, aten joined {ms['aten_joined_linear']:.3f} ms, "
          f"same bits {same} / {same_aten}", file=sys.stderr, flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = SMALL if args.small else MODELS
    rows, per_model = [], {}
    for model, (hidden, layers, qkv, gate_up) in models.items():
        for tokens in SMALL_TOKENS if args.small else TOKENS:
            pair = [_group(f"{model} {label}", widths, hidden, tokens, device, dtype, args.rounds)
                    for label, widths in (("q/k/v", qkv), ("gate/up", gate_up))]
            rows += pair
            per_model[f"{model} x{tokens}"] = {
                "layers": layers, "saved_ms_per_micro_batch": layers * sum(r["saved_ms"] for r in pair),
                "aten_saved_ms_per_micro_batch": layers * sum(r["aten_saved_ms"] for r in pair),
                "apart_ms_per_micro_batch": layers * sum(r["ms"]["apart"] for r in pair)}
    return {**engine.header(device), "dtype": str(dtype).removeprefix("torch."),
            "clock": "GPU kernel time, median of interleaved rounds" if device.type == "cuda" else "wall clock",
            "rows": rows, "per_model": per_model,
            "all_same_bits": all(r["same_bits"] and r["aten_same_bits"] for r in rows)}
