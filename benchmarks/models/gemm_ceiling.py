"""How fast can a training step of the end-to-end models get without faster GEMMs and attention?

Every system of the `e2e` case (eager, torch.compile, mplan) runs the same cuBLAS GEMMs
and the same cuDNN/flash attention; the fused kernels can only shrink the rest. This case
times, alone on the GPU, every GEMM one training step issues (per nn.Linear: the forward
x W^T (+ bias), the input gradient dy W and the weight gradient dy^T x, as autograd issues
them, the output head included) and causal attention's forward and backward at the model's
shape, by GPU kernel time (benchmarks/gpu_time.py). Their sum is a floor for the step of any
system built on these kernels. Given an e2e result (--e2e), it reports per model:
    fixed_ms          GEMMs + attention per step
    bound_vs_eager    eager's measured step / fixed_ms: the speedup over eager if everything
                      else (norms, activations, losses, optimizer) took no time at all
    budget_ms         eager / 1.15 - fixed_ms: what everything else may take for the issue's
                      1.15x target
    rest_floor_ms     the rest's fewest bytes at the copy bandwidth measured here (norms,
                      activations, residual adds, cross-entropy, AdamW), from the fusion registry's
                      traffic (mplan.fusion) where it prices the op and counted in this docstring's
                      terms otherwise

Run on the GPU (from the repository root; about half a minute):
    PYTHONPATH=. python -m benchmarks.models gemm-ceiling --e2e benchmarks/results/e2e_h200-2026-11-29.json \
        --out $OUT/gemm_ceiling.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.gpu_time import copy_tbps, kernel_ms
from benchmarks.models.workloads import FULL, TARGET_VS_EAGER, Workload
from mplan.models import GPTConfig, build_model

DTYPE = torch.bfloat16
ITEM = 2
"""bytes per bf16 element"""


def linear_shapes(workload: Workload) -> Counter[tuple[int, int, bool]]:
    """(in, out, has bias) of every linear one step runs, with its count; the tied head included."""
    with torch.device("meta"):
        model = build_model(workload.config)
    shapes: Counter[tuple[int, int, bool]] = Counter(
        (m.in_features, m.out_features, m.bias is not None) for m in model.modules() if isinstance(m, nn.Linear))
    if workload.config.tie_embeddings:
        shapes[(workload.config.hidden, workload.config.vocab, False)] += 1
    return shapes


def time_linear(tokens: int, n_in: int, n_out: int, bias: bool, device: torch.device) -> dict[str, float]:
    x = torch.randn(tokens, n_in, device=device, dtype=DTYPE)
    w = torch.randn(n_out, n_in, device=device, dtype=DTYPE) / n_in**0.5
    b = torch.randn(n_out, device=device, dtype=DTYPE) if bias else None
    dy = torch.randn(tokens, n_out, device=device, dtype=DTYPE)
    times = {"forward": kernel_ms(lambda: F.linear(x, w, b), iters=10),
             "input_grad": kernel_ms(lambda: dy.mm(w), iters=10),
             "weight_grad": kernel_ms(lambda: dy.t().mm(x), iters=10)}
    flops = 2 * tokens * n_in * n_out
    return {**{k: round(v, 4) for k, v in times.items()},
            "tflops": {k: round(flops / v / 1e9, 1) for k, v in times.items()}}


def time_attention(workload: Workload, device: torch.device) -> float:
    c = workload.config
    kv_heads = c.kv_heads
    q = torch.randn(workload.batch, c.num_heads, c.seq_len, c.head_dim, device=device, dtype=DTYPE,
                    requires_grad=True)
    k = torch.randn(workload.batch, kv_heads, c.seq_len, c.head_dim, device=device, dtype=DTYPE, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != c.num_heads)
        torch.autograd.grad(out, (q, k, v), do)

    return kernel_ms(step, iters=10)


def rest_bytes(workload: Workload, num_params: int) -> int:
    """Fewest bytes of everything but GEMMs and attention in one step, with every chain fused:
    per layer two norm+residual forwards (read x and the branch, write the sum and the normed) and
    backwards (read d_normed, d_sum, the sum; write dx), the activation forward (read the
    pre-activation, write the output; SwiGLU reads two halves) and backward (read d_out and the
    pre-activation, write its gradient); the cross-entropy (read logits; read them and write
    their gradient); AdamW on bf16 parameters (read param, grad, two moments; write param and
    moments). Bias gradients and RoPE, left out, only raise it."""
    c, tokens = workload.config, workload.batch * workload.config.seq_len
    act = tokens * c.hidden * ITEM
    ffn = tokens * c.ffn * ITEM
    norms = 2 * (4 * act + 4 * act)
    mlp = (2 * ffn + 3 * ffn) if isinstance(c, GPTConfig) else (3 * ffn + 5 * ffn)
    logits = tokens * c.vocab * ITEM
    return c.num_layers * (norms + mlp) + 3 * logits + 7 * num_params * ITEM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--e2e", help="an e2e result, for the bounds against its eager step")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda")
    e2e = json.load(open(args.e2e, encoding="utf-8"))["models"] if args.e2e else {}
    bandwidth = copy_tbps() * 1e9  # bytes per ms
    report: dict[str, Any] = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                              "torch": torch.__version__, "dtype": "bf16", "copy_TBps": round(bandwidth / 1e9, 3),
                              "e2e": args.e2e, "models": {}}
    for workload in FULL:
        tokens = workload.batch * workload.config.seq_len
        row: dict[str, Any] = {"tokens": tokens, "linears": []}
        gemm_ms = 0.0
        for (n_in, n_out, bias), count in sorted(linear_shapes(workload).items()):
            timed = time_linear(tokens, n_in, n_out, bias, device)
            per_step = count * (timed["forward"] + timed["input_grad"] + timed["weight_grad"])
            gemm_ms += per_step
            row["linears"].append({"in": n_in, "out": n_out, "bias": bias, "count": count, **timed,
                                   "ms_per_step": round(per_step, 3)})
            print(f"{workload.name} {n_in}->{n_out} x{count}: {timed}", file=sys.stderr, flush=True)
        attention_ms = workload.config.num_layers * time_attention(workload, device)
        with torch.device("meta"):
            num_params = sum(p.numel() for p in build_model(workload.config).parameters())
        fixed = gemm_ms + attention_ms
        row.update(gemm_ms=round(gemm_ms, 2), attention_ms=round(attention_ms, 2), fixed_ms=round(fixed, 2),
                   rest_floor_ms=round(rest_bytes(workload, num_params) / bandwidth, 2))
        if workload.name in e2e:
            eager = 1e3 * e2e[workload.name]["systems"]["eager"]["step_s"]
            row.update(eager_ms=round(eager, 2), bound_vs_eager=round(eager / fixed, 3),
                       bound_with_rest_floor=round(eager / (fixed + row["rest_floor_ms"]), 3),
                       budget_ms=round(eager / TARGET_VS_EAGER - fixed, 2))
        print(f"{workload.name}: {row}", file=sys.stderr, flush=True)
        report["models"][workload.name] = row
    return report
