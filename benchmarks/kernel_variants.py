"""Designs of the kernels that trailed torch.compile or the 80%-of-copy bar on 2026-11-29, timed on one GPU.

On the H200 the shipped packed-SwiGLU forward took 0.335 ms against compile's 0.321 (16384 x
2 x 14336 bf16) and the RoPE forward 0.0668 ms against 0.0640 ([4, 32, 4096, 128]); both
forward+backward totals were faster; the bias+GELU backward reached 77-79% of copy bandwidth
at 16384 x 8192. The candidates, each timed by GPU kernel time (benchmarks/gpu_time.py) and
checked against the reference:
  bias + GELU (forward; backward with its d_bias partial sum, at 32-256 row slices)
    previous     the first kernels: z and dz/du term by term, tl.sigmoid / sigmoid_and_complement
    no_prefetch  the shipped math (mplan.kernels.gelu._gelu_sigmoid: exp2 of -|z|, s (1 - s)
                 without selects), a fifth fewer instructions
    shipped      the same with the next row tile's loads in flight (the backward only)
  packed SwiGLU (forward and backward)
    tiles      the first design: a 2-D grid of [rows, column] tiles, rows on grid axis 0,
               so consecutive programs start 2F elements apart
    row_walk   the same tiles on a 1-D grid whose consecutive programs walk one row's columns
               (shipped since this comparison: mplan.kernels.glu)
    flat       Inductor's shape: flat over the output with the half width a compile-time
               constant, so row and column come from a division by a constant
  SwiGLU on two tensors (forward; `swiglu_variants`), tied with compile at the DRAM limit
    shipped        mplan.kernels.glu (1024 elements on 4 warps since session 7)
    int32_even     32-bit offsets, unmasked when every block is full: ties (session 7)
    stream         inputs evicted first, output stored `.cs`: 4-5% slower (session 7)
    inductor_copy  Inductor's generated kernel statement for statement: within 0.07% (session 7)
    and, as training calls them (`ops`), mplan's op against torch.compile's training graph
  RoPE (forward), on the benchmark's contiguous [b, h, s, d] and on the two layouts the
  models hand it: the transpose of a [b, s, h, d] projection and a q slice of a grouped
  [b, s, (h + 2 kv) d] q/k/v projection
    tiles      the first design: [heads, positions, d/2] tiles on a 3-D grid
    flat       one program per BLOCK_R head vectors in the output's dense order, the position
               and the input offset from divisions by compile-time constants
    shipped    mplan.kernels.rotary since this comparison: flat, the strides at run time (any
               layout), the inner sizes compile-time constants, with and without L2 eviction hints
    half_tables  shipped, reading only the first half of each table row (exact for rotation
               tables): 0.2-1% faster (session 6), but the kernel cannot know its tables are
               rotation tables without a check, so not shipped
    int32      the kernel shipped before session 6, with 32-bit offsets (and, `stream`, evict-first stores)
    rows       Inductor's math: whole head vectors, the rotated partner as a second load
    persistent a few programs per multiprocessor striding over the tiles: 5% slower
  The RoPE rows end with a rematch of the four fastest designs and compile in 5 interleaved
  rounds of 50 calls (single samples of a 0.03 ms kernel move by ~2% from run to run), keep
  Inductor's generated source (`compile_source`), and time the shipped backward against its
  64-bit masked form (session 4's) side by side (`backward`; added after session 6's run).
Every configuration is timed; torch.compile of the reference is timed in the same run. The
shipped kernels' designs and autotune lists come from these figures.

Run on the GPU (from the repository root; about two minutes; `--only rope` about one):
    PYTHONPATH=. python3 benchmarks/kernel_variants.py --out $OUT/kernel_variants.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_time import interleaved_kernel_ms, kernel_ms  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from mplan.kernels import (gelu, glu, rope_reference, rotary, swiglu, swiglu_packed_reference,  # noqa: E402
                           swiglu_reference)
from mplan.kernels.gelu import bias_gelu_reference  # noqa: E402
from mplan.kernels.partials import sum_partials  # noqa: E402
from mplan.kernels.sigmoid import sigmoid_and_complement  # noqa: E402
from mplan.models.layers import rope_tables  # noqa: E402

SWIGLU_SHAPES = ((16384, 14336), (16384, 5632), (16384, 8192))
"""(rows, F): the kernel benchmark's Llama-8B FFN, the end-to-end Llama-1.1B's, and one more"""
TILE_CONFIGS = ((1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (4, 1024, 8), (8, 512, 8),
                (1, 2048, 4), (2, 2048, 8), (4, 512, 4), (16, 256, 8))
"""(BLOCK_M, BLOCK_N, warps) of both tile orders"""
FLAT_CONFIGS = ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))
ROPE_CONFIGS = ((1, 32, 4), (1, 64, 4), (2, 16, 4), (2, 32, 4), (4, 16, 4), (2, 64, 8), (4, 32, 8),
                (1, 128, 8), (8, 16, 4), (8, 32, 8), (16, 8, 4), (16, 16, 8), (32, 4, 4), (32, 8, 8))
"""(BLOCK_HEADS, BLOCK_S, warps) of the first design"""
ROPE_FLAT_CONFIGS = ((4, 1), (8, 1), (8, 2), (8, 4), (16, 2), (16, 4), (32, 4), (32, 8), (64, 8), (128, 8))
"""(BLOCK_R head vectors, warps), for both flat kernels"""


@triton.jit
def _tiles_forward(y_ptr, out_ptr, n_rows, half, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows) & (cols < half)
    g = tl.load(y_ptr + rows * (2 * half) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + rows * (2 * half) + half + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * half + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tiles_backward(dout_ptr, y_ptr, dy_ptr, n_rows, half, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < n_rows) & (cols < half)
    dout = tl.load(dout_ptr + rows * half + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(y_ptr + rows * (2 * half) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + rows * (2 * half) + half + cols, mask=mask, other=0.0).to(tl.float32)
    sig, one_minus_sig = sigmoid_and_complement(g)
    tl.store(dy_ptr + rows * (2 * half) + cols, (dout * u * sig * (1.0 + g * one_minus_sig)).to(dy_ptr.dtype.element_ty),
             mask=mask)
    tl.store(dy_ptr + rows * (2 * half) + half + cols, (dout * g * sig).to(dy_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flat_forward(y_ptr, out_ptr, n_out, HALF: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    src = (offs // HALF) * (2 * HALF) + offs % HALF
    g = tl.load(y_ptr + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flat_backward(dout_ptr, y_ptr, dy_ptr, n_out, HALF: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    src = (offs // HALF) * (2 * HALF) + offs % HALF
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(y_ptr + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + src + HALF, mask=mask, other=0.0).to(tl.float32)
    sig, one_minus_sig = sigmoid_and_complement(g)
    tl.store(dy_ptr + src, (dout * u * sig * (1.0 + g * one_minus_sig)).to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dy_ptr + src + HALF, (dout * g * sig).to(dy_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_tiles(x_ptr, cos_ptr, sin_ptr, y_ptr, n_heads, seq, half, x_stride_b, x_stride_h, x_stride_s,
                y_stride_b, y_stride_h, y_stride_s, table_stride, BLOCK_HEADS: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_HALF: tl.constexpr):
    pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    batch = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    table_mask = (pos < seq)[:, None] & (cols < half)[None, :]
    t_offs = pos.to(tl.int64)[:, None] * table_stride + cols[None, :]
    c1 = tl.load(cos_ptr + t_offs, mask=table_mask, other=0.0).to(tl.float32)[None, :, :]
    c2 = tl.load(cos_ptr + t_offs + half, mask=table_mask, other=0.0).to(tl.float32)[None, :, :]
    s1 = tl.load(sin_ptr + t_offs, mask=table_mask, other=0.0).to(tl.float32)[None, :, :]
    s2 = tl.load(sin_ptr + t_offs + half, mask=table_mask, other=0.0).to(tl.float32)[None, :, :]
    mask = (heads < n_heads)[:, None, None] & table_mask[None, :, :]
    head64 = heads.to(tl.int64)[:, None, None]
    pos64 = pos.to(tl.int64)[None, :, None]
    x_offs = batch * x_stride_b + head64 * x_stride_h + pos64 * x_stride_s + cols[None, None, :]
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    y_offs = batch * y_stride_b + head64 * y_stride_h + pos64 * y_stride_s + cols[None, None, :]
    tl.store(y_ptr + y_offs, (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_offs + half, (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_halves(x_ptr, x_offs, cos_ptr, sin_ptr, t_offs, half, mask):
    """Both rotated halves in fp32 of the head vectors at x_offs, with the table rows at t_offs."""
    c1 = tl.load(cos_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t_offs + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t_offs + half, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rope_flat(x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors, INNER: tl.constexpr, OUTER_STRIDE: tl.constexpr,
               POS_DIV: tl.constexpr, SEQ: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    """Vector r (of the output's dense order) reads x at (r // INNER) * OUTER_STRIDE + (r % INNER) * 2 HALF
    and its table row is (r // POS_DIV) % SEQ."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HALF)[None, :]
    mask = (r < n_vectors)[:, None]
    t_offs = ((r // POS_DIV) % SEQ)[:, None] * (2 * HALF) + cols
    x_offs = ((r // INNER) * OUTER_STRIDE + (r % INNER) * (2 * HALF))[:, None] + cols
    y1, y2 = _rotate_halves(x_ptr, x_offs, cos_ptr, sin_ptr, t_offs, HALF, mask)
    y_offs = r[:, None] * (2 * HALF) + cols
    tl.store(y_ptr + y_offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_offs + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)



@triton.jit
def _gelu_forward_previous(x_ptr, b_ptr, y_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """bias+GELU forward before `_gelu_sigmoid`: tl.sigmoid of z, z from u and u^3 term by term"""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None] * n_cols + cols[None, :]
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    z = 1.5957691216057308 * (u + 0.044715 * u * u * u)
    tl.store(y_ptr + offs, (u * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_backward_previous(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, n_cols, rows_per_split,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """bias+GELU backward before `_gelu_sigmoid` (1328 SASS instructions for an 8 x 512 tile, 1048 now)"""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    col_mask = cols < n_cols
    bias = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = split.to(tl.int64) * rows_per_split
    end = tl.minimum(first + rows_per_split, n_rows)
    for start in range(0, rows_per_split, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < end) & col_mask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        z = 1.5957691216057308 * (u + 0.044715 * u * u * u)
        sig, one_minus_sig = sigmoid_and_complement(z)
        dz_du = 1.5957691216057308 * (1.0 + 0.134145 * u * u)
        du = dy * (sig + u * sig * one_minus_sig * dz_du)
        tl.store(dx_ptr + offs, du.to(dx_ptr.dtype.element_ty), mask=mask)
        db += tl.where(mask, du, 0.0)
    tl.store(db_ptr + split.to(tl.int64) * n_cols + cols, tl.sum(db, axis=0), mask=col_mask)


@triton.jit
def _gelu_backward_no_prefetch(dy_ptr, x_ptr, b_ptr, dx_ptr, db_ptr, n_rows, n_cols, rows_per_split,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """the shipped backward's math without its prefetch: each tile's loads, then its math"""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    col_mask = cols < n_cols
    bias = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = split.to(tl.int64) * rows_per_split
    end = tl.minimum(first + rows_per_split, n_rows)
    for start in range(0, rows_per_split, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < end) & col_mask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        sig, sig_one_minus_sig = gelu._gelu_sigmoid(u)
        dz_du = 1.5957691216057308 + 0.21406444881780076 * u * u
        du = dy * (sig + u * sig_one_minus_sig * dz_du)
        tl.store(dx_ptr + offs, du.to(dx_ptr.dtype.element_ty), mask=mask)
        db += du
    tl.store(db_ptr + split.to(tl.int64) * n_cols + cols, tl.sum(db, axis=0), mask=col_mask)



@triton.jit
def _rope_half_tables(x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors, x_stride0, x_stride1, x_stride2, half, table_stride,
                      n1: tl.constexpr, n2: tl.constexpr, POS_AXIS: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_HALF: tl.constexpr):
    """the shipped forward reading only the first half of each table row: exact for rotation tables
    (both halves equal, as `rope_tables` builds them), half the table reads from L2"""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i0, i1, i2, pos = rotary._vector_index(r, n1, n2, POS_AXIS)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (r < n_vectors)[:, None] & (cols < half)
    t_offs = pos[:, None] * table_stride + cols
    x_offs = (i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2)[:, None] + cols
    c = tl.load(cos_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    y_offs = r[:, None] * (2 * half) + cols
    tl.store(y_ptr + y_offs, (x1 * c - x2 * sn).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_offs + half, (x2 * c + x1 * sn).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_vectors(r, x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors, x_stride0, x_stride1, x_stride2, half, table_stride,
                  n1: tl.constexpr, n2: tl.constexpr, POS_AXIS: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  STREAM: tl.constexpr):
    """the shipped math, masked, on the head vectors r; STREAM: evict-first output stores"""
    i0, i1, i2, pos = rotary._vector_index(r, n1, n2, POS_AXIS)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (r < n_vectors)[:, None] & (cols < half)
    t_offs = pos[:, None] * table_stride + cols
    x_offs = (i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2)[:, None] + cols
    y1, y2 = _rotate_halves(x_ptr, x_offs, cos_ptr, sin_ptr, t_offs, half, mask)
    y_offs = r[:, None] * (2 * half) + cols
    if STREAM:
        tl.store(y_ptr + y_offs, y1.to(y_ptr.dtype.element_ty), mask=mask, eviction_policy="evict_first")
        tl.store(y_ptr + y_offs + half, y2.to(y_ptr.dtype.element_ty), mask=mask, eviction_policy="evict_first")
    else:
        tl.store(y_ptr + y_offs, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + y_offs + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_int32(x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors, x_stride0, x_stride1, x_stride2, half, table_stride,
                n1: tl.constexpr, n2: tl.constexpr, POS_AXIS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_HALF: tl.constexpr, STREAM: tl.constexpr):
    """the forward shipped before session 6, with 32-bit index arithmetic (Inductor's, for tensors under 2^31
    elements), masked; STREAM marks the output stores evict-first so L2 keeps the tables"""
    _rope_vectors(tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R), x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors,
                  x_stride0, x_stride1, x_stride2, half, table_stride, n1, n2, POS_AXIS, BLOCK_HALF, STREAM)


@triton.jit
def _rope_rows(x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors, x_stride0, x_stride1, x_stride2, table_stride,
               n1: tl.constexpr, n2: tl.constexpr, POS_AXIS: tl.constexpr, BLOCK_R: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """Inductor's shape of the math on the shipped indexing: whole [BLOCK_R, head_dim] rows, the
    rotated partner x[(j + d/2) mod d] as a second load of the same row (an L1 hit), y = x cos +
    sign partner sin, 32-bit indices"""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i0, i1, i2, pos = rotary._vector_index(r, n1, n2, POS_AXIS)
    cols = tl.arange(0, HEAD_DIM)[None, :]
    partner = (cols + HEAD_DIM // 2) % HEAD_DIM
    mask = (r < n_vectors)[:, None]
    base = (i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2)[:, None]
    x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + base + partner, mask=mask, other=0.0).to(tl.float32)
    t_offs = pos[:, None] * table_stride + cols
    c = tl.load(cos_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    sign = tl.where(cols < HEAD_DIM // 2, -1.0, 1.0)
    tl.store(y_ptr + r[:, None] * HEAD_DIM + cols, (x * c + sign * xp * sn).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_persistent(x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors, x_stride0, x_stride1, x_stride2, half, table_stride,
                     n1: tl.constexpr, n2: tl.constexpr, POS_AXIS: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, STAGES: tl.constexpr):
    """the same math on a grid of a few programs per multiprocessor, each striding over the
    vector tiles (tl.range pipelining STAGES deep): fewer, longer programs"""
    n_tiles = tl.cdiv(n_vectors, BLOCK_R)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        _rope_vectors(tile * BLOCK_R + tl.arange(0, BLOCK_R), x_ptr, cos_ptr, sin_ptr, y_ptr, n_vectors,
                      x_stride0, x_stride1, x_stride2, half, table_stride, n1, n2, POS_AXIS, BLOCK_HALF, False)


@triton.jit
def _swiglu_even_forward(g_ptr, u_ptr, y_ptr, n_elements, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """the shipped SwiGLU forward with 32-bit offsets and, when every block is full, no masks
    (RoPE's two specializations, which took its forward ahead of torch.compile in session 6)"""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        g = tl.load(g_ptr + offs).to(tl.float32)
        u = tl.load(u_ptr + offs).to(tl.float32)
        tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty))
    else:
        mask = offs < n_elements
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_stream_forward(g_ptr, u_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    """the shipped SwiGLU forward with streaming cache hints: its inputs are read once (evicted
    first from L2) and its output is written around L1 and marked for early eviction (.cs), so the
    stream leaves L2 to the writes in flight"""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")


@triton.jit
def _swiglu_inductor_forward(g_ptr, u_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """Inductor's SwiGLU forward, statement for statement (its source is in the session-7
    results): the size a compile-time constant, no masks, 32-bit offsets, silu as x / (1 + exp(-x))
    with libdevice's exp and a true division, where the shipped kernel calls tl.sigmoid"""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + offs, None).to(tl.float32)
    u = tl.load(u_ptr + offs, None).to(tl.float32)
    silu = g / (libdevice.exp(-g) + 1.0)
    tl.store(y_ptr + offs, (silu * u).to(y_ptr.dtype.element_ty), None)


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _rematch(timed: dict[str, Any], variants: dict[str, Callable[[], Any]], compiled: Callable[[], Any],
             count: int) -> dict[str, dict[str, float]]:
    """The `count` fastest correct variants of `timed` (single samples) and torch.compile again,
    in 5 interleaved rounds of 50 calls: the median and range of each (a 0.03 ms kernel's single
    samples move by ~2% between runs)."""
    ranked = sorted((v["ms"], k) for k, v in timed.items() if k in variants and v["correct"])
    return _interleaved({**{k: variants[k] for _, k in ranked[:count]}, "compile": compiled})


def _interleaved(launches: dict[str, Callable[[], Any]], rounds: int = 5) -> dict[str, dict[str, float]]:
    """GPU kernel time of each launch in `rounds` interleaved rounds of 50 calls: median and range."""
    return {k: {"median_ms": round(statistics.median(v), 5), "min_ms": round(min(v), 5), "max_ms": round(max(v), 5)}
            for k, v in interleaved_kernel_ms(launches, rounds=rounds, iters=50).items()}


def _time(fn: Callable[[], Any], check: Callable[[], float]) -> dict[str, Any]:
    fn()
    error = check()
    return {"ms": round(kernel_ms(fn, iters=20), 4), "error": error, "correct": error < 1e-2}


def swiglu_packed_variants(n_rows: int, half: int, device: torch.device) -> dict[str, Any]:
    y = 2 * torch.randn(n_rows, 2 * half, device=device, dtype=torch.bfloat16)
    dout = torch.randn(n_rows, half, device=device, dtype=torch.bfloat16)
    out, dy = torch.empty_like(dout), torch.empty_like(y)
    y32 = y.float().requires_grad_()
    want = swiglu_packed_reference(y32)
    (want_dy,) = torch.autograd.grad(want, y32, dout.float())
    fwd_bytes, bwd_bytes = 3 * out.numel() * 2, 5 * out.numel() * 2
    rows: dict[str, Any] = {"rows": n_rows, "half": half, "fwd_min_bytes": fwd_bytes, "bwd_min_bytes": bwd_bytes,
                            "forward": {}, "backward": {}}

    def record(name: str, fwd: Callable[[], Any], bwd: Callable[[], Any]) -> None:
        rows["forward"][name] = _time(fwd, lambda: _rel(out, want))
        rows["backward"][name] = _time(bwd, lambda: _rel(dy, want_dy))
        print(f"swiglu packed {n_rows}x{half} {name}: fwd {rows['forward'][name]['ms']} ms, "
              f"bwd {rows['backward'][name]['ms']} ms", file=sys.stderr, flush=True)

    for m, n, w in TILE_CONFIGS:
        grid = (triton.cdiv(n_rows, m), triton.cdiv(half, n))
        record(f"tiles {m}x{n} w{w}",
               lambda: _tiles_forward[grid](y, out, n_rows, half, BLOCK_M=m, BLOCK_N=n, num_warps=w),
               lambda: _tiles_backward[grid](dout, y, dy, n_rows, half, BLOCK_M=m, BLOCK_N=n, num_warps=w))
        walk = (triton.cdiv(n_rows, m) * triton.cdiv(half, n),)
        record(f"row_walk {m}x{n} w{w}",
               lambda: glu._packed_forward_kernel.fn[walk](y, out, n_rows, half, BLOCK_M=m, BLOCK_N=n, num_warps=w),
               lambda: glu._packed_backward_kernel.fn[walk](dout, y, dy, n_rows, half, BLOCK_M=m, BLOCK_N=n,
                                                            num_warps=w))
    for block, w in FLAT_CONFIGS:
        grid = (triton.cdiv(out.numel(), block),)
        record(f"flat {block} w{w}",
               lambda: _flat_forward[grid](y, out, out.numel(), HALF=half, BLOCK=block, num_warps=w),
               lambda: _flat_backward[grid](dout, y, dy, out.numel(), HALF=half, BLOCK=block, num_warps=w))
    compiled = torch.compile(swiglu_packed_reference)
    leaf = y.detach().requires_grad_()
    with torch.no_grad():
        rows["forward"]["compile"] = _time(lambda: compiled(y), lambda: _rel(compiled(y), want))

    def compile_fwd_bwd() -> None:
        torch.autograd.grad(compiled(leaf), leaf, dout)

    rows["compile_fwd_bwd"] = _time(compile_fwd_bwd,
                                    lambda: _rel(torch.autograd.grad(compiled(leaf), leaf, dout)[0], want_dy))
    torch._dynamo.reset()
    return rows


SWIGLU_BLOCKS = ((1024, 4), (2048, 4), (4096, 8), (8192, 8), (8192, 16))
"""(BLOCK, warps): mplan.kernels.glu's backward autotune list, which the forward offered too until session 7"""
SWIGLU_STREAM_BLOCKS = ((512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8))
"""(BLOCK, warps) of the streaming-hint form: around the shipped kernel's choice, 1024 x 4 warps
(one 16-byte vector per thread and tensor), with two vectors per thread at 1024 x 2"""


def swiglu_variants(n_rows: int, n_cols: int, device: torch.device) -> dict[str, Any]:
    """SwiGLU on two tensors (forward): the shipped kernel against its 32-bit, unmasked form, its
    streaming-hint form, Inductor's kernel copied and torch.compile, every configuration once,
    then the five fastest and compile in 5 interleaved rounds of 50 calls (session 6: the shipped forward 0.02-0.13% behind
    compile, both at the DRAM limit; session 7: neither form helped, streaming hints cost 4-5%)."""
    gate = 2 * torch.randn(n_rows, n_cols, device=device, dtype=torch.bfloat16)
    up = torch.randn_like(gate)
    out = torch.empty_like(gate)
    want = swiglu_reference(gate.float(), up.float())
    n = gate.numel()
    row: dict[str, Any] = {"rows": n_rows, "cols": n_cols, "fwd_min_bytes": 3 * n * 2, "forward": {}}
    variants: dict[str, Callable[[], Any]] = {}
    for block, w in SWIGLU_BLOCKS:
        grid = (triton.cdiv(n, block),)
        variants[f"shipped {block} w{w}"] = functools.partial(glu._forward_kernel.fn[grid], gate, up, out, n,
                                                              BLOCK=block, num_warps=w)
        variants[f"int32_even {block} w{w}"] = functools.partial(_swiglu_even_forward[grid], gate, up, out, n,
                                                                 BLOCK=block, EVEN=n % block == 0, num_warps=w)
    for block, w in SWIGLU_STREAM_BLOCKS:
        grid = (triton.cdiv(n, block),)
        variants[f"stream {block} w{w}"] = functools.partial(_swiglu_stream_forward[grid], gate, up, out, n,
                                                             BLOCK=block, num_warps=w)
    if n % 1024 == 0:  # Inductor's launch: 1024 elements on 4 warps, one pipeline stage (and Triton's default 3)
        for stages in (1, 3):
            variants[f"inductor_copy 1024 w4 s{stages}"] = functools.partial(
                _swiglu_inductor_forward[(n // 1024,)], gate, up, out, N=n, BLOCK=1024, num_warps=4, num_stages=stages)
    for name, launch in variants.items():
        row["forward"][name] = _time(launch, lambda: _rel(out, want))
    compiled = torch.compile(swiglu_reference)
    with torch.no_grad():
        row["compile_source"] = run_and_get_code(compiled, gate, up)[1]  # compiles: Inductor's kernel
        row["forward"]["compile"] = _time(lambda: compiled(gate, up), lambda: _rel(compiled(gate, up), want))
        row["rematch"] = _rematch(row["forward"], variants, lambda: compiled(gate, up), count=5)
    row["ops"] = _swiglu_ops(gate, up)
    torch._dynamo.reset()
    timed_ops = {k: v for k, v in row["ops"].items() if k != "compile_train_source"}
    print(f"swiglu {n_rows}x{n_cols}: rematch {row['rematch']}; ops {timed_ops}", file=sys.stderr, flush=True)
    return row


def _swiglu_ops(gate: torch.Tensor, up: torch.Tensor) -> dict[str, Any]:
    """The forward as training calls it, each op allocating its output: mplan's `swiglu` and
    torch.compile's training graph (inputs that require grad, as fused_kernels.py times it; there
    compile's forward took 0.1267 ms at F 5632, against 0.1274 compiled for inference here), in 9
    interleaved rounds of 50 calls, with the training graph's generated source."""
    g, u = (t.detach().requires_grad_() for t in (gate, up))
    compiled = torch.compile(swiglu_reference)
    source = run_and_get_code(compiled, g, u)[1]
    ops = {"mplan": lambda: swiglu(g, u), "compile_train": lambda: compiled(g, u)}
    for op in ops.values():
        op()
    return {**_interleaved(ops, rounds=9), "compile_train_source": source}


GELU_SHAPES = ((16384, 8192), (16384, 16384))
"""(rows, features): GPT-1.3B's fc_in output at 16k tokens, and the kernel benchmark's"""
GELU_TILES = ((8, 512, 4), (16, 512, 8), (32, 256, 8), (8, 1024, 8), (4, 1024, 4), (4, 512, 2), (16, 256, 4))
"""(BLOCK_M, BLOCK_N, warps) of the forward and backward"""
GELU_SPLITS = (32, 64, 128, 256)
"""row slices of the backward (each leaves one fp32 partial row of d_bias, summed by sum_partials)"""


def bias_gelu_variants(n_rows: int, n_cols: int, device: torch.device) -> dict[str, Any]:
    x = torch.randn(n_rows, n_cols, device=device, dtype=torch.bfloat16)
    bias = torch.randn(n_cols, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    x32 = x.float().requires_grad_()
    b32 = bias.float().requires_grad_()
    want = bias_gelu_reference(x32, b32)
    want_dx, want_db = torch.autograd.grad(want, (x32, b32), dy.float())
    row: dict[str, Any] = {"rows": n_rows, "cols": n_cols, "fwd_min_bytes": 2 * x.numel() * 2,
                           "bwd_min_bytes": 3 * x.numel() * 2, "forward": {}, "backward": {}}
    for m, n, w in GELU_TILES:
        grid = (triton.cdiv(n_rows, m), triton.cdiv(n_cols, n))
        for name, kernel in (("previous", _gelu_forward_previous), ("shipped", gelu._forward_kernel.fn)):
            row["forward"][f"{name} {m}x{n} w{w}"] = _time(
                lambda: kernel[grid](x, bias, y, n_rows, n_cols, BLOCK_M=m, BLOCK_N=n, num_warps=w),
                lambda: _rel(y, want))
        for splits in GELU_SPLITS:
            rows_per_split = triton.cdiv(n_rows, splits)
            db = torch.empty(splits, n_cols, dtype=torch.float32, device=device)
            grid = (triton.cdiv(n_cols, n), splits)
            for name, kernel in (("previous", _gelu_backward_previous), ("no_prefetch", _gelu_backward_no_prefetch),
                                 ("shipped", gelu._backward_kernel.fn)):
                def backward() -> torch.Tensor:
                    kernel[grid](dy, x, bias, dx, db, n_rows, n_cols, rows_per_split, BLOCK_M=m, BLOCK_N=n,
                                 num_warps=w)
                    return sum_partials(db[None], bias.dtype)[0]

                row["backward"][f"{name} {m}x{n} w{w} splits {splits}"] = _time(
                    backward, lambda: max(_rel(dx, want_dx), _rel(backward(), want_db)))
        print(f"bias+gelu {n_rows}x{n_cols} {m}x{n} w{w} done", file=sys.stderr, flush=True)
    compiled = torch.compile(bias_gelu_reference)
    with torch.no_grad():
        row["forward"]["compile"] = _time(lambda: compiled(x, bias), lambda: _rel(compiled(x, bias), want))
    torch._dynamo.reset()
    return row


def _rope_layouts(device: torch.device) -> dict[str, tuple[torch.Tensor, dict[str, int]]]:
    """name -> (x as attention sees it [b, h, s, d], the flat kernel's constants for it)"""
    b, h, s, d = 4, 32, 4096, 128
    contiguous = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)
    b2, h2, s2, kv = 8, 16, 2048, 4
    projected = torch.randn(b2, s2, h2, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    grouped = torch.randn(b2, s2, (h2 + 2 * kv) * d, device=device, dtype=torch.bfloat16)
    q_slice = grouped[..., : h2 * d].view(b2, s2, h2, d).transpose(1, 2)
    return {
        "contiguous [4, 32, 4096, 128]": (contiguous, {"INNER": s, "OUTER_STRIDE": s * d, "POS_DIV": 1}),
        "transposed [8, 2048, 16, 128]": (projected, {"INNER": h2, "OUTER_STRIDE": h2 * d, "POS_DIV": h2}),
        "q slice of grouped q/k/v [8, 2048, 24 x 128]": (
            q_slice, {"INNER": h2, "OUTER_STRIDE": (h2 + 2 * kv) * d, "POS_DIV": h2}),
    }


ROPE_DESIGNS = ("tiles", "flat", "shipped", "half_tables", "int32", "rows", "persistent")
ROPE_PERSISTENT_CONFIGS = tuple((block, 4, per_sm, stages) for block in (8, 16) for per_sm in (8, 16)
                                for stages in (1, 3))
"""(BLOCK_R, warps, programs per multiprocessor, tl.range stages) of the persistent design"""


ROPE_BACKWARD_CONFIGS = ((8, 2), (8, 4), (16, 4))
"""(BLOCK_R, warps) the autotuner chose or nearly chose for RoPE's backward on the H200"""


def _rope_backward_forms(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, order: list[int],
                         want_upstream: torch.Tensor) -> dict[str, Any]:
    """RoPE's backward (dx from dy) in the shipped form (32-bit offsets, unmasked when every block
    is full) and in session 4's (64-bit, masked), same kernel source, in 5 interleaved rounds of 50
    calls. Why: across runs the forward gained 0.5% from the change while forward+backward
    measured 0.2-1% slower (session 6 against session 4, different machines); this times both
    forms side by side."""
    dy = want_upstream
    x32 = x.detach().float().requires_grad_()
    (want,) = torch.autograd.grad(rope_reference(x32, cos.float(), sin.float()), x32, dy.float())
    dx = rotary._dense_like(dy, dy.dtype, order)
    sizes, strides = [dy.shape[i] for i in order[:3]], [dy.stride(i) for i in order[:3]]
    n_vectors, d = dy.numel() // dy.shape[-1], dy.shape[-1]
    common = dict(n1=sizes[1], n2=sizes[2], POS_AXIS=order.index(2), BLOCK_HALF=d // 2, BACKWARD=True, EVICT=False)
    forms: dict[str, Callable[[], Any]] = {}
    for block, w in ROPE_BACKWARD_CONFIGS:
        grid = (triton.cdiv(n_vectors, block),)
        args = (dy, cos, sin, dx, n_vectors, *strides, d // 2, cos.stride(0))
        forms[f"shipped {block} w{w}"] = functools.partial(  # heuristics pick EVEN
            rotary._rope_kernel.fn[grid], *args, INDEX_64=False, BLOCK_R=block, num_warps=w, **common)
        forms[f"64-bit masked {block} w{w}"] = functools.partial(
            rotary._rope_kernel.fn.fn[grid], *args, INDEX_64=True, EVEN=False, BLOCK_R=block, num_warps=w, **common)
    errors = {}
    for name, launch in forms.items():
        launch()
        errors[name] = _rel(dx, want)
    return {k: {**timing, "error": errors[k], "correct": errors[k] < 1e-2} for k, timing in _interleaved(forms).items()}


def rope_variants(device: torch.device, designs: tuple[str, ...] = ROPE_DESIGNS) -> list[dict[str, Any]]:
    results = []
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    for name, (x, flat) in _rope_layouts(device).items():
        b, h, s, d = x.shape
        cos, sin = (t.to(torch.bfloat16) for t in rope_tables(s, d, 500000.0, device=device))
        want = rope_reference(x.float(), cos.float(), sin.float())
        order = rotary._order(x)
        y = rotary._dense_like(x, x.dtype, order)
        row: dict[str, Any] = {"layout": name, "shape": [b, h, s, d], "min_bytes": 2 * x.numel() * 2,
                               "forward": {}}
        variants: dict[str, Callable[[], Any]] = {}
        if "tiles" in designs:
            for bh, bs, w in ROPE_CONFIGS:
                grid = (triton.cdiv(s, bs), triton.cdiv(h, bh), b)
                variants[f"tiles {bh}x{bs} w{w}"] = functools.partial(
                    _rope_tiles[grid], x, cos, sin, y, h, s, d // 2, *x.stride()[:3], *y.stride()[:3],
                    cos.stride(0), BLOCK_HEADS=bh, BLOCK_S=bs, BLOCK_HALF=d // 2, num_warps=w)
        sizes, strides = [x.shape[i] for i in order[:3]], [x.stride(i) for i in order[:3]]
        n_vectors = x.numel() // d
        common = dict(n1=sizes[1], n2=sizes[2], POS_AXIS=order.index(2), BLOCK_HALF=d // 2)
        for block, w in ROPE_FLAT_CONFIGS:
            grid = (triton.cdiv(n_vectors, block),)
            for evict in (False, True) if "shipped" in designs else ():
                variants[f"shipped {block} w{w}{' evict' if evict else ''}"] = functools.partial(
                    rotary._rope_kernel.fn[grid], x, cos, sin, y, n_vectors, *strides, d // 2, cos.stride(0),
                    BACKWARD=False, INDEX_64=False, BLOCK_R=block, EVICT=evict, num_warps=w, **common)
            if "half_tables" in designs:
                variants[f"half_tables {block} w{w}"] = functools.partial(
                    _rope_half_tables[grid], x, cos, sin, y, n_vectors, *strides, d // 2, cos.stride(0),
                    BLOCK_R=block, num_warps=w, **common)
            for stream in (False, True) if "int32" in designs else ():
                variants[f"int32 {block} w{w}{' stream' if stream else ''}"] = functools.partial(
                    _rope_int32[grid], x, cos, sin, y, n_vectors, *strides, d // 2, cos.stride(0),
                    BLOCK_R=block, STREAM=stream, num_warps=w, **common)
            if "rows" in designs:
                variants[f"rows {block} w{w}"] = functools.partial(
                    _rope_rows[grid], x, cos, sin, y, n_vectors, *strides, cos.stride(0), n1=sizes[1], n2=sizes[2],
                    POS_AXIS=order.index(2), BLOCK_R=block, HEAD_DIM=d, num_warps=w)
        for block, w, per_sm, stages in ROPE_PERSISTENT_CONFIGS if "persistent" in designs else ():
            grid = (min(triton.cdiv(n_vectors, block), per_sm * n_sm),)
            variants[f"persistent {block} w{w} x{per_sm} s{stages}"] = functools.partial(
                _rope_persistent[grid], x, cos, sin, y, n_vectors, *strides, d // 2, cos.stride(0),
                BLOCK_R=block, STAGES=stages, num_warps=w, **common)
        for variant, launch in variants.items():
            row["forward"][variant] = _time(launch, lambda: _rel(y, want))
        if "flat" in designs:
            dense = torch.empty(x.shape, dtype=x.dtype, device=device)  # flat writes [b, h, s, d] order
            dense_view = dense if flat["POS_DIV"] == 1 else dense.view(b, s, h, d).transpose(1, 2)
            for block, w in ROPE_FLAT_CONFIGS:
                grid = (triton.cdiv(n_vectors, block),)
                row["forward"][f"flat {block} w{w}"] = _time(
                    lambda: _rope_flat[grid](x, cos, sin, dense, n_vectors, SEQ=s, HALF=d // 2, BLOCK_R=block,
                                             num_warps=w, **flat),
                    lambda: _rel(dense_view, want))
        compiled = torch.compile(rope_reference)
        with torch.no_grad():
            row["compile_source"] = run_and_get_code(compiled, x, cos, sin)[1]  # compiles: Inductor's kernel
            row["forward"]["compile"] = _time(lambda: compiled(x, cos, sin), lambda: _rel(compiled(x, cos, sin), want))
            row["rematch"] = _rematch(row["forward"], variants, lambda: compiled(x, cos, sin), count=4)
        torch._dynamo.reset()
        if "shipped" in designs:
            row["backward"] = _rope_backward_forms(x, cos, sin, order, want_upstream=torch.randn_like(y))
        best = min((v["ms"], k) for k, v in row["forward"].items() if k != "compile" and v["correct"])
        print(f"rope {name}: best {best}, compile {row['forward']['compile']['ms']}; rematch {row['rematch']}",
              file=sys.stderr, flush=True)
        results.append(row)
    return results


def _best(variants: dict[str, Any], prefix: str) -> dict[str, Any]:
    ms, name = min((v["ms"], k) for k, v in variants.items() if k.startswith(prefix) and v["correct"])
    return {"variant": name, "ms": ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=("bias_gelu", "swiglu", "swiglu_packed", "rope"), help="one kernel's designs")
    parser.add_argument("--rope-designs", default=",".join(ROPE_DESIGNS), help="comma-separated RoPE designs")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    report: dict[str, Any] = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                              "torch": torch.__version__, "triton": triton.__version__, "dtype": "bf16",
                              "bias_gelu": [], "swiglu": [], "swiglu_packed": [], "rope": []}
    for n_rows, n_cols in GELU_SHAPES if args.only in (None, "bias_gelu") else ():
        row = bias_gelu_variants(n_rows, n_cols, device)
        row["best"] = {direction: {design: _best(row[direction], design) for design in designs}
                       for direction, designs in (("forward", ("previous", "shipped")),
                                                  ("backward", ("previous", "no_prefetch", "shipped")))}
        report["bias_gelu"].append(row)
    for n_rows, n_cols in SWIGLU_SHAPES[:2] if args.only in (None, "swiglu") else ():
        report["swiglu"].append(swiglu_variants(n_rows, n_cols, device))
    for n_rows, half in SWIGLU_SHAPES if args.only in (None, "swiglu_packed") else ():
        row = swiglu_packed_variants(n_rows, half, device)
        row["best"] = {direction: {design: _best(row[direction], design) for design in ("tiles", "row_walk", "flat")}
                       for direction in ("forward", "backward")}
        report["swiglu_packed"].append(row)
    designs = tuple(args.rope_designs.split(","))
    for row in rope_variants(device, designs) if args.only in (None, "rope") else ():
        row["best"] = {design: _best(row["forward"], design) for design in designs}
        report["rope"].append(row)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
