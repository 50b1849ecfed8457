"""The last step of the kernels' split reductions: summing fp32 partial rows into a parameter gradient.

    sum_partials(partials [k, rows, cols] fp32, dtype) -> [k, cols] in dtype

The norm backwards leave one fp32 weight (and bias) gradient row per program, a few hundred
rows; bias+GELU leaves one per row slice. Summed by torch (`partials.sum(0).to(dtype)`) each
took ~15 us on the H200: 1.83 ms of a GPT-1.3B step for 120 such sums of 2-4 MB
(benchmarks/results/step_profile_h200-2026-11-29-session3.json), because a reduction over the
outer dim of a few hundred rows gives torch's kernel too few blocks. Here one launch sums all k
matrices (LayerNorm's weight and bias together), one program per column block of each, walking
the rows in [BLOCK_R, BLOCK_C] tiles, and casts to the parameter dtype in the same pass.

Invariants: fp32 accumulation in a fixed order (deterministic); devices without Triton sum with
torch, `partials.sum(1).to(dtype)`.
"""
from __future__ import annotations

import torch

from mplan.kernels.dispatch import configs, tl, triton, use_triton

# Narrow column blocks, so that even 2048 columns make 128+ programs per matrix.
_TILES = configs(
    [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=4) for r, c in ((64, 16), (32, 32), (32, 64), (16, 128))],
    triton.Config({"BLOCK_R": 4, "BLOCK_C": 8}, num_warps=1),
)


@triton.autotune(configs=_TILES, key=["n_rows", "n_cols"])
@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    matrix = tl.program_id(1).to(tl.int64)
    base = p_ptr + matrix * n_rows * n_cols
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        acc += tl.load(base + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + matrix * n_cols + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
             mask=cols < n_cols)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[k, rows, cols] fp32 partial sums -> [k, cols] in `dtype`: their sum over rows."""
    if not use_triton(partials):
        return partials.sum(1).to(dtype)
    partials = partials.contiguous()
    k, n_rows, n_cols = partials.shape
    out = torch.empty(k, n_cols, dtype=dtype, device=partials.device)
    _sum_partials_kernel[lambda meta: (triton.cdiv(n_cols, meta["BLOCK_C"]), k)](partials, out, n_rows, n_cols)
    return out
