"""Save and load times of mplan checkpoints, and how long a background save stalls training.

On gloo CPU ranks this process starts (`--ranks N`, one thread each), on the ranks of a torchrun
job (NCCL on its GPUs: benchmarks/multi_gpu_h200.sh runs it so on N GPUs), or as one process (one GPU):

    PYTHONPATH=. python -m benchmarks.ranks checkpoint --ranks 2 --plan tp=2 --other pp=2 --dtype bfloat16 \\
        -o benchmarks/results/checkpoint_time-cpu-2026-12-05.json   # bf16: a background save's CPU copy fits 24 GiB
    PYTHONPATH=. python -m benchmarks.ranks checkpoint --plan dp=1 --other dp=1,recompute=full --dtype bfloat16 \\
        --model "llama:layers=24,hidden=2048,heads=16,kv_heads=8,ffn=5632,seq=2048,vocab=32000" --batch 4 \\
        --dir /tmp/g/ckpt-time -o "$out/checkpoint_time.json"      # one GPU: step 4 of benchmarks/train_gpu.sh
(those results made before the harness, by `benchmarks/checkpoint_time.py` with the same flags, the
first under `torchrun --nproc-per-node 2` in place of `--ranks 2`: two gloo ranks of one thread each
either way; the second is within train_gpu-2026-12-06.json)

One optimizer step creates the AdamW state; then, timed between barriers on every rank:
a blocking save; a background save (the call's return is the stall, then a training step runs
while it writes, against a step without a save); a load under the same plan; a load under
`--other` (a fresh job: the first one is deleted first). Bytes are what the checkpoint holds on
disk. Every figure is measured here; nothing is predicted.
"""
from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.ranks.launch import barrier, header, join_job, rank, start_ranks, timed

DEFAULT_MODEL = "llama:layers=18,hidden=2048,heads=16,kv_heads=8,seq=128,vocab=32000,ffn=5632"


def _build(spec: str, plan: str, dtype: torch.dtype, batch: int, device: str) -> tuple[Any, torch.Tensor]:
    import mplan
    from mplan.models import build_model

    model = build_model(spec, device=device, dtype=dtype, seed=0)
    ids = torch.randint(0, model.config.vocab, (batch, model.config.seq_len))
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                            global_batch=batch, plan=plan, progress="quiet")
    del model
    gc.collect()
    return pm, ids


def _bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def measure(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """On every rank (of the group, if there is one): its row of figures, times on its own clock."""
    dtype = getattr(torch, args.dtype)
    root = [args.dir or (tempfile.mkdtemp(prefix="mplan_ckpt_time_") if rank() == 0 else None)]
    if dist.is_initialized():
        dist.broadcast_object_list(root)
    pm, ids = _build(args.model, args.plan, dtype, args.batch, device)
    parameters = sum(math.prod(p.meta.shape) for p in pm.graph.params.values())
    step_s, _ = timed(lambda: pm.train_step(ids, ids))
    plain_step_s, _ = timed(lambda: pm.train_step(ids, ids))
    save_s, path = timed(lambda: pm.save(os.path.join(root[0], "blocking")))
    stall_s, _ = timed(lambda: pm.save(os.path.join(root[0], "background"), background=True))
    overlapped_step_s, _ = timed(lambda: pm.train_step(ids, ids))
    wait_s, _ = timed(pm.wait_for_save)
    load_s, _ = timed(lambda: pm.load(path))
    first_plan = pm.plan.spec()
    del pm
    gc.collect()
    other, _ = _build(args.model, args.other, dtype, args.batch, device)
    reshard_s, _ = timed(lambda: other.load(path))
    size = _bytes(path)
    barrier()  # every rank has read the checkpoints before rank 0 deletes them
    if args.dir is None and rank() == 0:
        shutil.rmtree(root[0], ignore_errors=True)
    return {"model": args.model, "parameters": parameters, "dtype": args.dtype, "plan": first_plan,
            "other_plan": other.plan.spec(), "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "checkpoint_bytes": size, "first_step_s": step_s, "step_s": plain_step_s,
            "save_blocking_s": save_s, "save_gb_per_s": size / save_s / 1e9,
            "background_stall_s": stall_s, "step_during_background_save_s": overlapped_step_s,
            "background_rest_s": wait_s, "load_same_plan_s": load_s, "load_other_plan_s": reshard_s,
            "load_gb_per_s": size / load_s / 1e9}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=None,
                        help="start this many gloo CPU ranks here (else: the torchrun job's ranks, or one process)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--plan", default="tp=2")
    parser.add_argument("--other", default="pp=2", help="the plan the second load reshards to")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Rank 0's report; None on a torchrun job's other ranks."""
    if args.ranks:
        device = torch.device("cpu")
        row = start_ranks(args.ranks, measure, args, "cpu", timeout_s=3600)[0]
    else:
        join_job()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        row = measure(args, device.type)
        if rank() != 0:
            return None
    print(", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_s")), flush=True)
    note = "measured; times between barriers on every rank; disk is the machine's local disk"
    return {**header(device), "note": note,
            "rows": [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}]}
