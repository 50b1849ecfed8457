"""How many rows the fused LM head + loss should take per chunk: time and memory against chunk size.

`mplan.kernels.linear_cross_entropy` runs the head GEMM and the loss in chunks of rows. Every
chunk reads and writes the whole d_W (vocab x hidden) once, so its fixed cost shrinks as chunks
grow while the chunk's logits (rows x vocab) grow: the speed/memory trade this case measures.
For each shape (16384 tokens, bf16; the Hugging Face models of models/hf_models.py, mplan's GPT-1.3B
and a Llama-3-8B head), forward+backward of:
    mplan chunk=R    linear_cross_entropy(..., chunk_rows=R) for R in --rows, and its default
    mplan unfused    F.linear + mplan.kernels.cross_entropy (whole logits)
    mplan at liger's chunk   chunk_rows = Liger's chunk (the same logits memory), with a
                     per-kernel profile of it and of Liger: where the time goes at equal memory
    liger            LigerFusedLinearCrossEntropyLoss (its own chunk rule)
By the engine (engine.py): each system on its own inputs (x, W, labels with the last token of
every 2048 ignored), its gradients left in .grad as a training step leaves them; the loss and
the gradients' norms (and the loss against the default's), the errors against F.linear +
F.cross_entropy in fp32; GPU kernel time of forward+backward (medians of --rounds interleaved
rounds of --iters calls) and peak memory above the inputs and their previous gradients
(max_memory_allocated from a reset, MB). Written per shape with the model `d_w_share` = the
predicted share of the fixed per-chunk d_W traffic in the op's time (2 V H s bytes per chunk at
--tbps, against 6 N V H flops at --tflops), to check the rule the planner uses to pick chunk rows.
The errors against fp32 (passed: within max(1e-2, 2x mplan unfused's)) came with the kernels harness.

Run on the GPU (Liger from the carried wheels):
    pip install --no-index --find-links .device_wheels --no-deps liger-kernel
    PYTHONPATH=. python -m benchmarks.kernel_peers head-loss --out $OUT/head_loss_chunks.json
Smoke mode on a CPU (tiny shapes, fp32, no Liger, references only):
    PYTHONPATH=. python -m benchmarks.kernel_peers head-loss --device cpu --small --out /tmp/hlc.json
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.kernel_peers import engine
from benchmarks.report import Clock

SHAPES = {  # name: (tokens, hidden, vocab)
    "llama-tinyllama": (16384, 2048, 32000),
    "mistral-1b": (16384, 2048, 32768),
    "gpt-1.3b": (16384, 2048, 50304),
    "qwen2-1.5b": (16384, 1536, 151936),
    "llama3-8b-head": (16384, 4096, 128256),
}
SMALL = {"tiny": (256, 64, 1000)}
SMALL_ROWS = "64,128"
PROFILED = ("mplan at liger's chunk", "liger")


def make_inputs(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """x, W (both requiring grad), labels with the last token of every 2048 ignored (HF's shift)."""
    n, h, v = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(n, h, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * h ** -0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    labels[2047::2048] = -100
    return [x, w, labels]


def liger_chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """The chunk Liger's fused linear cross-entropy takes (liger_kernel/ops/fused_linear_cross_entropy.py,
    0.8.x): the power of two nearest above tokens / ceil(vocab / hidden), so that a chunk's logits
    hold about as many elements as x."""
    per = -(-tokens // -(-vocab // hidden))
    return 1 << (per - 1).bit_length()


def systems(rows: list[int], shape: tuple[int, int, int]) -> dict[str, Any]:
    from mplan.kernels import cross_entropy, linear_cross_entropy

    def chunked(r: int | None) -> Any:
        return lambda: lambda x, w, y: linear_cross_entropy(x, w, y, **({"chunk_rows": r} if r else {}))

    def liger() -> Any:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda x, w, y: loss(w, x, y)

    return {"mplan default": chunked(None), "mplan unfused": lambda: lambda x, w, y: cross_entropy(F.linear(x, w), y),
            "mplan at liger's chunk": chunked(liger_chunk_rows(*shape)),
            **{f"mplan chunk={r}": chunked(r) for r in rows}, "liger": liger}


def _describe(outs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    return {"loss": float(outs[0]), "grad_x_norm": float(grads[0].float().norm()),
            "grad_w_norm": float(grads[1].float().norm())}


def measure(name: str, shape: tuple[int, int, int], rows: list[int], device: torch.device, dtype: torch.dtype,
            args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    n, h, v = shape
    op = engine.Op(name=name, make=lambda: make_inputs(shape, device, dtype), systems=systems(rows, shape),
                   reference=lambda x, w, y: F.cross_entropy(F.linear(x, w), y, ignore_index=-100),
                   baseline="mplan unfused", scalar_output=True, into_grad=True, gpu_only=("liger",),
                   describe=_describe)
    found = engine.measure(op, device, rounds=args.rounds, iters=args.iters, log=clock.log, clocks=("fwd_bwd",),
                           events=False, profile=PROFILED)
    default = found["mplan default"].get("loss")
    for row in found.values():
        if "loss" in row and default is not None:
            row["loss_vs_default"] = row["loss"] - default
    for sname, row in found.items():
        if sname.startswith("mplan chunk=") and "error" not in row:
            chunks = -(-n // int(sname.split("=")[1]))
            row["predicted_d_w_ms"] = chunks * 2 * v * h * dtype.itemsize / (args.tbps * 1e12) * 1e3
    return {"tokens": n, "hidden": h, "vocab": v, "systems": found, "liger_chunk_rows": liger_chunk_rows(*shape),
            "gemm_ms_at_tflops": 6 * n * v * h / (args.tflops * 1e12) * 1e3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)
    parser.add_argument("--rows", default="256,512,1024,2048,4096,8192", help=f"chunk rows ({SMALL_ROWS} with --small)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tflops", type=float, default=700.0, help="dense bf16 GEMM rate for the d_W share model")
    parser.add_argument("--tbps", type=float, default=4.0, help="HBM bandwidth (read + write) for the d_W share model")


def run(args: argparse.Namespace) -> dict[str, Any]:
    clock = Clock()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [int(r) for r in (SMALL_ROWS if args.small else args.rows).split(",")]
    report: dict[str, Any] = {
        **engine.header(device, "liger-kernel"), "dtype": str(dtype),
        "method": f"fwd+bwd GPU kernel time, median of {args.rounds} interleaved rounds x {args.iters} calls; "
                  "peak = max_memory_allocated above the inputs during one fwd+bwd", "shapes": {}}
    for name, shape in (SMALL if args.small else SHAPES).items():
        report["shapes"][name] = engine.guarded(name, lambda name=name, shape=shape: measure(
            name, shape, rows, device, dtype, args, clock), clock, summary=lambda done: engine.summary(done["systems"]))
        engine.save_partial(args, report)
    return report
