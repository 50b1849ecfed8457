"""Save and load times of mplan checkpoints, and how long a background save stalls training.

Run under torchrun (every rank; gloo on CPUs, NCCL on GPUs) or as one process:

    torchrun --nproc-per-node 2 benchmarks/checkpoint_time.py --plan tp=2 --other pp=2 --dtype bfloat16 \
        -o benchmarks/results/checkpoint_time-cpu-2026-12-05.json   # bf16: a background save's CPU copy fits 24 GiB
    python benchmarks/checkpoint_time.py --plan dp=1 --other dp=1,recompute=full   # one GPU

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
import json
import math
import os
import platform
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

import mplan
from mplan.models import build_model

DEFAULT_MODEL = "llama:layers=18,hidden=2048,heads=16,kv_heads=8,seq=128,vocab=32000,ffn=5632"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _timed(fn) -> tuple[float, object]:
    _barrier()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    _barrier()
    return time.perf_counter() - start, out


def _build(spec: str, plan: str, dtype: torch.dtype, batch: int, device: str):
    model = build_model(spec, device=device, dtype=dtype, seed=0)
    ids = torch.randint(0, model.config.vocab, (batch, model.config.seq_len))
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                            global_batch=batch, plan=plan, progress="quiet")
    del model
    gc.collect()
    return pm, ids


def _bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--plan", default="tp=2")
    parser.add_argument("--other", default="pp=2", help="the plan the second load reshards to")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("-o", "--output", default=None)
    args = parser.parse_args()
    from mplan.runtime.launch import init_distributed_from_env

    init_distributed_from_env()
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    root = [args.dir or (tempfile.mkdtemp(prefix="mplan_ckpt_time_") if rank == 0 else None)]
    if dist.is_initialized():
        dist.broadcast_object_list(root)
    root = root[0]

    pm, ids = _build(args.model, args.plan, dtype, args.batch, device)
    parameters = sum(math.prod(p.meta.shape) for p in pm.graph.params.values())
    step_s, _ = _timed(lambda: pm.train_step(ids, ids))
    plain_step_s, _ = _timed(lambda: pm.train_step(ids, ids))
    save_s, path = _timed(lambda: pm.save(os.path.join(root, "blocking")))
    stall_s, _ = _timed(lambda: pm.save(os.path.join(root, "background"), background=True))
    overlapped_step_s, _ = _timed(lambda: pm.train_step(ids, ids))
    wait_s, _ = _timed(pm.wait_for_save)
    load_s, _ = _timed(lambda: pm.load(path))
    first_plan = pm.plan.spec()
    del pm
    gc.collect()
    other, _ = _build(args.model, args.other, dtype, args.batch, device)
    reshard_s, _ = _timed(lambda: other.load(path))
    size = _bytes(path)
    row = {"model": args.model, "parameters": parameters, "dtype": args.dtype, "plan": first_plan,
           "other_plan": other.plan.spec(), "world_size": dist.get_world_size() if dist.is_initialized() else 1,
           "checkpoint_bytes": size, "first_step_s": step_s, "step_s": plain_step_s,
           "save_blocking_s": save_s, "save_gb_per_s": size / save_s / 1e9,
           "background_stall_s": stall_s, "step_during_background_save_s": overlapped_step_s,
           "background_rest_s": wait_s, "load_same_plan_s": load_s, "load_other_plan_s": reshard_s,
           "load_gb_per_s": size / load_s / 1e9}
    if rank == 0:
        doc = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda"
               else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
               "torch": torch.__version__, "python": platform.python_version(),
               "note": "measured; times between barriers on every rank; disk is the machine's local disk",
               "rows": [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}]}
        text = json.dumps(doc, indent=1)
        print(text)
        if args.output:
            with open(args.output, "w") as f:
                f.write(text + "\n")
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    _barrier()


if __name__ == "__main__":
    main()
