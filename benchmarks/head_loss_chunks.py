"""How many rows the fused LM head + loss should take per chunk: time and memory against chunk size.

`mplan.kernels.linear_cross_entropy` runs the head GEMM and the loss in chunks of rows. Every
chunk reads and writes the whole d_W (vocab x hidden) once, so its fixed cost shrinks as chunks
grow while the chunk's logits (rows x vocab) grow: the speed/memory trade this script measures.
For each shape (16384 tokens, bf16; the Hugging Face models of hf_models.py, mplan's GPT-1.3B
and a Llama-3-8B head), forward+backward of:
    mplan chunk=R    linear_cross_entropy(..., chunk_rows=R) for R in --rows, and its default
    mplan unfused    F.linear + mplan.kernels.cross_entropy (whole logits)
    mplan at liger's chunk   chunk_rows = Liger's chunk (the same logits memory), with a
                     per-kernel profile of it and of Liger: where the time goes at equal memory
    liger            LigerFusedLinearCrossEntropyLoss (its own chunk rule)
GPU time from the profiler (gpu_time.interleaved_kernel_ms, medians of interleaved rounds) and
peak memory above the inputs (max_memory_allocated from a reset, MB). Written per shape with the
model `d_w_share` = the predicted share of the fixed per-chunk d_W traffic in the op's time
(2 V H s bytes per chunk at --tbps, against 6 N V H flops at --tflops), to check the rule the
planner uses to pick chunk rows.

Run on the GPU (Liger from the carried wheels):
    PYTHONPATH=. python3 benchmarks/head_loss_chunks.py --out $OUT/head_loss_chunks.json
CPU smoke test (tiny shapes, no Liger, references only):
    PYTHONPATH=. python3 benchmarks/head_loss_chunks.py --device cpu --small --out /tmp/hlc.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from typing import Any, Callable

import torch
import torch.nn.functional as F

SHAPES = {  # name: (tokens, hidden, vocab)
    "llama-tinyllama": (16384, 2048, 32000),
    "mistral-1b": (16384, 2048, 32768),
    "gpt-1.3b": (16384, 2048, 50304),
    "qwen2-1.5b": (16384, 1536, 151936),
    "llama3-8b-head": (16384, 4096, 128256),
}
SMALL = {"tiny": (256, 64, 1000)}


def inputs(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
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


def systems(rows: list[int], device: torch.device,
            shape: tuple[int, int, int]) -> dict[str, Callable[..., torch.Tensor]]:
    from mplan.kernels import cross_entropy, linear_cross_entropy

    liger_rows = liger_chunk_rows(*shape)
    out: dict[str, Callable[..., torch.Tensor]] = {
        "mplan default": lambda x, w, y: linear_cross_entropy(x, w, y),
        "mplan unfused": lambda x, w, y: cross_entropy(F.linear(x, w), y),
        "mplan at liger's chunk": lambda x, w, y: linear_cross_entropy(x, w, y, chunk_rows=liger_rows),
    }
    for r in rows:
        out[f"mplan chunk={r}"] = (lambda r: lambda x, w, y: linear_cross_entropy(x, w, y, chunk_rows=r))(r)
    if device.type == "cuda":
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
            loss = LigerFusedLinearCrossEntropyLoss()
            out["liger"] = lambda x, w, y: loss(w, x, y)
        except ImportError as e:
            print(f"liger unavailable: {e}")
    return out


def fwd_bwd(fn: Callable[..., torch.Tensor], args: list[torch.Tensor]) -> Callable[[], None]:
    def call() -> None:
        args[0].grad = args[1].grad = None
        fn(*args).backward()
    return call


def peak_mb(call: Callable[[], None], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - held) / 2**20


def measure(name: str, shape: tuple[int, int, int], rows: list[int], device: torch.device, dtype: torch.dtype,
            rounds: int, iters: int, tflops: float, tbps: float) -> dict[str, Any]:
    n, h, v = shape
    fns = systems(rows, device, shape)
    ref = None
    result: dict[str, Any] = {"tokens": n, "hidden": h, "vocab": v, "systems": {}}
    calls = {}
    for sname, fn in fns.items():
        args = inputs(shape, device, dtype)
        loss = fn(*args)
        loss.backward()
        value = float(loss)
        ref = value if ref is None else ref
        row: dict[str, Any] = {"loss": value, "loss_vs_default": value - ref}
        for (key, a) in (("x", args[0]), ("w", args[1])):
            row[f"grad_{key}_norm"] = float(a.grad.float().norm())
        calls[sname] = fwd_bwd(fn, args)
        row["peak_mb"] = peak_mb(calls[sname], device)
        result["systems"][sname] = row
        print(f"[{name}] {sname}: loss {value:.6f}, peak {row['peak_mb']} MB", flush=True)
    if device.type == "cuda":
        from benchmarks.gpu_time import interleaved_kernel_ms
        times = interleaved_kernel_ms(calls, rounds=rounds, iters=iters)
    else:
        times = {}
        for sname, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            times[sname] = (time.perf_counter() - t0) / iters * 1e3
    for sname, ms in times.items():
        result["systems"][sname]["fwd_bwd_ms"] = ms if isinstance(ms, float) else statistics.median(ms)
    result["liger_chunk_rows"] = liger_chunk_rows(*shape)
    if device.type == "cuda":  # where the time goes at equal memory: ms per call by kernel
        from torch.profiler import ProfilerActivity, profile

        from benchmarks.gpu_time import kernel_table
        for sname in ("mplan at liger's chunk", "liger"):
            if sname in calls:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(iters):
                        calls[sname]()
                    torch.cuda.synchronize()
                table = kernel_table(prof)
                result["systems"][sname]["kernels_ms"] = {k[:80]: t / iters for k, t in list(table.items())[:12]}
                result["systems"][sname]["launches"] = sum(1 for e in prof.events()
                                                           if e.device_type == torch.autograd.DeviceType.CUDA) / iters
    gemm_ms = 6 * n * v * h / (tflops * 1e12) * 1e3
    result["gemm_ms_at_tflops"] = gemm_ms
    for sname in result["systems"]:
        if sname.startswith("mplan chunk="):
            r = int(sname.split("=")[1])
            chunks = -(-n // r)
            result["systems"][sname]["predicted_d_w_ms"] = chunks * 2 * v * h * dtype.itemsize / (tbps * 1e12) * 1e3
    for sname, row in result["systems"].items():
        print(f"[{name}] {sname}: {row.get('fwd_bwd_ms', float('nan')):.3f} ms, peak {row['peak_mb']} MB", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true")
    p.add_argument("--rows", default="256,512,1024,2048,4096,8192")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tflops", type=float, default=700.0, help="dense bf16 GEMM rate for the d_W share model")
    p.add_argument("--tbps", type=float, default=4.0, help="HBM bandwidth (read + write) for the d_W share model")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [int(r) for r in args.rows.split(",")]
    shapes = SMALL if args.small else SHAPES
    doc: dict[str, Any] = {
        "date": date.today().isoformat(), "script": "benchmarks/head_loss_chunks.py",
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype),
        "method": f"fwd+bwd GPU kernel time, median of {args.rounds} interleaved rounds x {args.iters} calls; "
                  "peak = max_memory_allocated above the inputs during one fwd+bwd",
        "shapes": {},
    }
    try:
        import triton
        doc["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version
        doc["liger-kernel"] = version("liger-kernel")
    except ImportError:
        pass
    for name, shape in shapes.items():
        doc["shapes"][name] = measure(name, shape, rows if not args.small else [64, 128], device, dtype,
                                      args.rounds, args.iters, args.tflops, args.tbps)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
