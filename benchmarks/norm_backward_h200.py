"""Three designs of the RMSNorm+residual backward, checked and timed (GPU kernel time) on one GPU.

The shipped backward (mplan.kernels.rmsnorm, "persistent"): 4 programs per SM walk the rows,
prefetching the next row and keeping an fp32 weight-gradient partial each. On 2026-11-29 it
measured 0.65 ms for 16384 x 4096 bf16 (a fifth of copy bandwidth) where the forward took 0.16
ms. The candidates:
    split     one program per row writes dx (no loop: occupancy hides latency, as in the
              forward), and a tiled column reduction re-reads dy and the residual for dw
              (1.5x the bytes of the fewest, every load independent)
    grouped   one program per GROUP consecutive rows, no prefetch, an fp32 dw partial per
              program ([rows / GROUP, hidden], summed by torch); GROUP 4, 8, 16, 32
Each is checked against the fp32 reference (dx and dw relative error under 1e-2 in bf16) and
timed by the profiler's kernel time (benchmarks/gpu_time.py), partial sums included, at the
hidden sizes the end-to-end models and the kernel benchmark use.

Run on the GPU (from the repository root; about a minute, mostly Triton autotuning):
    PYTHONPATH=. python3 benchmarks/norm_backward_h200.py --out $OUT/norm_backward.json
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import write_report  # noqa: E402
from benchmarks.gpu_time import kernel_ms  # noqa: E402
from mplan.kernels import rmsnorm  # noqa: E402
from mplan.kernels.dispatch import configs, next_power_of_2, num_row_programs  # noqa: E402

SHAPES = ((16384, 2048), (16384, 4096), (16384, 8192))


@triton.autotune(configs=configs([triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)], triton.Config({})),
                 key=["n_cols"])
@triton.jit
def _dx_kernel(dy_ptr, dsum_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dsum = tl.load(dsum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    xhat = s * rstd
    g = dy * w
    dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols)) + dsum
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=configs([triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                                  for r, c, w in ((32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 256, 8),
                                                  (64, 64, 4))],
                                 triton.Config({"BLOCK_R": 4, "BLOCK_C": 16})),
                 key=["n_rows", "n_cols"])
@triton.jit
def _dw_kernel(dy_ptr, s_ptr, rstd_ptr, dw_ptr, n_rows, n_cols, rows_per_split,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    start = split * rows_per_split
    end = tl.minimum(start + rows_per_split, n_rows)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        live = rows < end
        mask = live[:, None] & (cols < n_cols)[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=live, other=0.0)
        acc += dy * s * rstd[:, None]
    tl.store(dw_ptr + split.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=cols < n_cols)


@triton.autotune(configs=configs([triton.Config({}, num_warps=w) for w in (4, 8, 16)], triton.Config({})),
                 key=["n_cols", "GROUP"])
@triton.jit
def _grouped_kernel(dy_ptr, dsum_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols,
                    GROUP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(GROUP):
        row = pid * GROUP + i
        live = row < n_rows
        mask = cols < tl.where(live, n_cols, 0)  # all false past the last row
        offs = row.to(tl.int64) * n_cols + cols
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dsum = tl.load(dsum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=live, other=0.0)
        xhat = s * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols)) + dsum
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)


Backward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    tuple[torch.Tensor, torch.Tensor]]


def persistent(dy, dsum, s, w, rstd):  # type: ignore[no-untyped-def]
    n_rows, n_cols = s.shape
    dx = torch.empty_like(s)
    programs = num_row_programs(n_rows, s)
    dw = torch.empty(programs, n_cols, dtype=torch.float32, device=s.device)
    rmsnorm._backward_kernel[(programs,)](dy, dsum, s, w, rstd, dx, dw, n_rows, n_cols, HAS_DSUM=True,
                                          BLOCK=next_power_of_2(n_cols))
    return dx, dw.sum(0).to(w.dtype)


SPLITS = 64


def split(dy, dsum, s, w, rstd):  # type: ignore[no-untyped-def]
    n_rows, n_cols = s.shape
    dx = torch.empty_like(s)
    _dx_kernel[(n_rows,)](dy, dsum, s, w, rstd, dx, n_cols, BLOCK=next_power_of_2(n_cols))
    dw = torch.empty(SPLITS, n_cols, dtype=torch.float32, device=s.device)
    rows_per_split = triton.cdiv(n_rows, SPLITS)
    _dw_kernel[lambda meta: (triton.cdiv(n_cols, meta["BLOCK_C"]), SPLITS)](dy, s, rstd, dw, n_rows, n_cols,
                                                                            rows_per_split)
    return dx, dw.sum(0).to(w.dtype)


def grouped(group: int) -> Backward:
    def run(dy, dsum, s, w, rstd):  # type: ignore[no-untyped-def]
        n_rows, n_cols = s.shape
        dx = torch.empty_like(s)
        programs = triton.cdiv(n_rows, group)
        dw = torch.empty(programs, n_cols, dtype=torch.float32, device=s.device)
        _grouped_kernel[(programs,)](dy, dsum, s, w, rstd, dx, dw, n_rows, n_cols, GROUP=group,
                                     BLOCK=next_power_of_2(n_cols))
        return dx, dw.sum(0).to(w.dtype)
    return run


VARIANTS: dict[str, Backward] = {"persistent": persistent, "split": split,
                                 **{f"grouped{g}": grouped(g) for g in (4, 8, 16, 32)}}


def reference(dy, dsum, s, w, rstd):  # type: ignore[no-untyped-def]
    xhat = s.float() * rstd[:, None]
    g = dy.float() * w.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True)) + dsum.float()
    return dx, (dy.float() * xhat).sum(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    report: dict[str, Any] = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                              "torch": torch.__version__, "triton": triton.__version__, "dtype": "bf16",
                              "shapes": []}
    for n_rows, n_cols in SHAPES:
        torch.manual_seed(0)
        s = torch.randn(n_rows, n_cols, device=device, dtype=torch.bfloat16)
        dy, dsum = torch.randn_like(s), torch.randn_like(s)
        w = (1 + 0.1 * torch.randn(n_cols, device=device)).to(torch.bfloat16)
        rstd = torch.rsqrt(s.float().pow(2).mean(-1) + 1e-5)
        want_dx, want_dw = reference(dy, dsum, s, w, rstd)
        min_bytes = 4 * s.numel() * s.element_size()  # read dy, dsum, s; write dx
        row: dict[str, Any] = {"rows": n_rows, "cols": n_cols, "min_bytes": min_bytes, "variants": {}}
        for name, fn in VARIANTS.items():
            dx, dw = fn(dy, dsum, s, w, rstd)
            errors = {"dx": ((dx.float() - want_dx).norm() / want_dx.norm()).item(),
                      "dw": ((dw.float() - want_dw).norm() / want_dw.norm()).item()}
            ms = kernel_ms(lambda fn=fn: fn(dy, dsum, s, w, rstd), iters=20)
            row["variants"][name] = {"ms": round(ms, 4), "TBps": round(min_bytes / ms / 1e9, 3),
                                     "errors": errors, "correct": max(errors.values()) < 1e-2}
            print(f"{n_rows}x{n_cols} {name}: {ms:.4f} ms, {min_bytes / ms / 1e9:.2f} TB/s, errors {errors}",
                  file=sys.stderr, flush=True)
        report["shapes"].append(row)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
