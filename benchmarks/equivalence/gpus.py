"""Parallel plans against one GPU in the training dtype, on several GPUs of one host (issue 7, item 2).

Under torchrun, every rank builds the same seed-0 Llama. Rank 0 first trains the plain model
alone on its GPU (fused AdamW, global-norm clipping at 1.0) for --steps steps over a cycle of
four fixed batches, so the loss falls measurably without collapsing; its losses and final
parameters are the reference (or one of two, below). Then all ranks train the same model under
each plan of --plans through `mplan.autoparallel` on the same batches. Reported per plan: the
loss curves, the largest loss difference as a fraction of the first loss, and the largest
relative difference of any parameter after the last step (gathered with `full_state_dict`),
against the tolerance of the dtype: bf16 rounds each product to 8 bits of mantissa, and
different reduction orders (TP partial sums, reduce-scatters) drift apart over steps, so bf16 is
held to BF16_TOLERANCE while float64 (the CPU smoke test) must match to FLOAT64_TOLERANCE.

Two references: a zero=1 plan is a different optimizer in bf16. mplan's ZeRO-1 (like Megatron's
distributed optimizer) keeps fp32 master weights and rounds them into the bf16 parameters,
whereas AdamW on bf16 parameters loses every update under half an ulp of the weight (at lr 1e-4,
many): on 2 H200s dp=2,zero=1 ran steadily below the plain reference (4.23 against 4.53 at step
20). So when a plan has zero=1 and the dtype is narrower than float32, rank 0 also trains the
"fp32_masters" reference: the same model, forward and backward in the training dtype, AdamW
updating a float32 copy of every parameter (clipped on the float32 gradients' global norm), the
copy rounded back into the model after each step. zero=0 plans are held to the "plain"
reference, zero=1 plans to "fp32_masters": each plan's row names its "reference", and
"reference_losses" holds each reference's curve by name. In float64 the masters are float64
themselves, the same arithmetic as the plain run, which is then every plan's reference. A plan
that leaves zero to the search is held to the plain reference.

On the GPUs (NVLink multicast off, as the device README requires):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 8 -m benchmarks.equivalence gpus \\
        --plans "tp=8;tp=4,dp=2,sp=1,zero=1;dp=8,zero=1" --out $OUT/equivalence-x8.json
Smoke test on CPU ranks (gloo, float64, a tiny model; --dtype bfloat16 exercises the
fp32_masters reference on the CPU):
    torchrun --nproc-per-node 4 -m benchmarks.equivalence gpus --device cpu --small \\
        --plans "tp=2,dp=2,sp=1,zero=1;dp=4,zero=1" --out /tmp/equivalence.json
(the committed results made before the harness, by `torchrun ... benchmarks/equivalence_gpus.py` with the same flags)
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import mplan
from benchmarks.report import run_header
from mplan.models import LlamaConfig, build_model
from mplan.planner.parallel_config import parse_plan_spec
from mplan.runtime.launch import init_distributed_from_env

LR = 1e-4
MAX_GRAD_NORM = 1.0
BF16_TOLERANCE = {"loss": 2e-2, "param": 5e-2}
"""bf16: loss curves within 2% of the first loss, every parameter within 5% (relative, in norm)"""
FLOAT64_TOLERANCE = {"loss": 1e-9, "param": 1e-9}
"""float64: the project's bar for a plan against one process (docs/execution.md)"""

MODEL = LlamaConfig(name="llama-1b-equivalence", num_layers=16, hidden=2048, num_heads=16, num_kv_heads=8,
                    ffn_hidden=5632, seq_len=2048, vocab=32000)
SMALL = LlamaConfig(name="llama-tiny-equivalence", num_layers=2, hidden=64, num_heads=8, num_kv_heads=4,
                    ffn_hidden=96, seq_len=32, vocab=128)


def batches(config: LlamaConfig, global_batch: int, steps: int, device: torch.device) -> list[tuple[Any, Any]]:
    """A cycle of four fixed batches, the same on every rank (seeded on the CPU)."""
    generator = torch.Generator().manual_seed(0)
    cycle = []
    for _ in range(4):
        ids = torch.randint(0, config.vocab, (global_batch, config.seq_len), generator=generator)
        cycle.append((ids.to(device), torch.roll(ids, -1, dims=1).to(device)))
    return [cycle[step % 4] for step in range(steps)]


def reference(config: LlamaConfig, data: list[tuple[Any, Any]], dtype: torch.dtype, device: torch.device,
              *, fp32_masters: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain model trained alone on this rank's device; with `fp32_masters`, AdamW updates a
    float32 copy of each parameter that is rounded back into the model after every step (zero=1's
    arithmetic, see the module docstring)."""
    model = build_model(config, device=device, dtype=dtype, seed=0)
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().float()) for p in params] if fp32_masters else params
    optimizer = torch.optim.AdamW(masters, lr=LR, fused=device.type == "cuda")
    losses = []
    for ids, labels in data:
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels)
        loss.backward()
        if fp32_masters:
            for param, master in zip(params, masters):
                master.grad, param.grad = param.grad.float(), None
        torch.nn.utils.clip_grad_norm_(masters, MAX_GRAD_NORM)
        optimizer.step()
        if fp32_masters:
            with torch.no_grad():
                for param, master in zip(params, masters):
                    param.copy_(master)
        losses.append(loss.item())
    return losses, {name: p.detach().cpu() for name, p in model.named_parameters()}


def run_plan(config: LlamaConfig, plan: str, data: list[tuple[Any, Any]], global_batch: int, dtype: torch.dtype,
             device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(config, device="meta", dtype=dtype)
    optimizer = functools.partial(torch.optim.AdamW, lr=LR, fused=device.type == "cuda")
    pm = mplan.autoparallel(model, example_inputs=(data[0][0],), global_batch=global_batch, plan=plan,
                            optimizer=optimizer, max_grad_norm=MAX_GRAD_NORM, dtype=dtype, seed=0, device=device)
    losses = [pm.train_step(ids, labels) for ids, labels in data]
    return losses, {name: t.cpu() for name, t in pm.full_state_dict().items()}


def compare(losses: list[float], ref_losses: list[float], state: dict[str, torch.Tensor],
            ref_state: dict[str, torch.Tensor], tolerance: dict[str, float]) -> dict[str, Any]:
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses)) / abs(ref_losses[0])
    param_diffs = {name: ((state[name].double() - want.double()).norm() / want.double().norm()).item()
                   for name, want in ref_state.items()}
    worst = max(param_diffs, key=param_diffs.__getitem__)
    return {"losses": losses, "max_loss_diff_over_first_loss": loss_diff, "max_param_rel_diff": param_diffs[worst],
            "worst_param": worst, "tolerance": tolerance,
            "passed": loss_diff <= tolerance["loss"] and param_diffs[worst] <= tolerance["param"]}


def reference_for(plan: str, dtype: torch.dtype) -> str:
    """Which reference does `plan`'s arithmetic: fp32 masters for zero=1 below float32, else plain."""
    return "fp32_masters" if parse_plan_spec(plan).zero == 1 and torch.finfo(dtype).bits < 32 else "plain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plans", required=True, help="plan specs separated by ';'")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", choices=["bfloat16", "float64"], default=None,
                        help="training dtype (default: bfloat16 on cuda, float64 on cpu)")
    parser.add_argument("--small", action="store_true", help="the tiny model (with --device cpu: the smoke test)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Rank 0's report; None on the other ranks."""
    world = init_distributed_from_env()
    if world is None:
        raise SystemExit("run under torchrun: the plans need the job's ranks")
    rank = dist.get_rank()
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float64"))
    tolerance = FLOAT64_TOLERANCE if dtype == torch.float64 else BF16_TOLERANCE
    config = SMALL if args.small else MODEL
    data = batches(config, args.global_batch, args.steps, device)
    plans = {plan: reference_for(plan, dtype) for plan in args.plans.split(";")}
    began = time.perf_counter()
    shared: list[Any] = [None]
    if rank == 0:
        kinds = ["plain"] + (["fp32_masters"] if "fp32_masters" in plans.values() else [])
        shared[0] = {kind: reference(config, data, dtype, device, fp32_masters=kind == "fp32_masters")
                     for kind in kinds}
        for kind, (losses, _) in shared[0].items():
            print(f"[{time.perf_counter() - began:6.1f}s] one device ({kind}): losses {[round(x, 4) for x in losses]}",
                  file=sys.stderr, flush=True)
    dist.broadcast_object_list(shared, src=0)  # rank 0's references, to every rank (only rank 0 reports)
    references: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = shared[0]
    report: dict[str, Any] = {**run_header(device), "world_size": dist.get_world_size(),
                              "dtype": str(dtype).removeprefix("torch."),
                              "model": config.name, "global_batch": args.global_batch, "steps": args.steps,
                              "reference_losses": {kind: losses for kind, (losses, _) in references.items()},
                              "plans": {}}
    for plan, kind in plans.items():
        losses, state = run_plan(config, plan, data, args.global_batch, dtype, device)
        ref_losses, ref_state = references[kind]
        row = report["plans"][plan] = {"reference": kind, **compare(losses, ref_losses, state, ref_state, tolerance)}
        if rank == 0:
            print(f"[{time.perf_counter() - began:6.1f}s] {plan} (against {kind}): loss diff "
                  f"{row['max_loss_diff_over_first_loss']:.2e} of the first loss, worst parameter "
                  f"{row['worst_param']} {row['max_param_rel_diff']:.2e}, passed {row['passed']}",
                  file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return report if rank == 0 else None
