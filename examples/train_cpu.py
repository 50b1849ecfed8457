"""Train a small Llama with tensor, sequence, pipeline and data parallelism and ZeRO-1 on 4 CPU ranks.

    torchrun --nproc-per-node 4 examples/train_cpu.py
    torchrun --nproc-per-node 4 examples/train_cpu.py --plan tp=4,sp=1 --steps 10
    torchrun --nproc-per-node 4 examples/train_cpu.py --plan tp=2,pp=2,schedule=zb-h1 --micro-batch 1
    python examples/train_cpu.py --plan dp=1        # one process, no torchrun

Every rank builds the same model (on the meta device: each rank initializes only its shards),
`mplan.autoparallel` joins the torchrun job (gloo on CPUs), shards it under the plan and returns
a ParallelModule; `train_step` takes the whole global batch and each data-parallel replica uses
its own rows. A LambdaLR warms the learning rate up (`--warmup` steps) on `pm.optimizer.optimizer`.
Every `--log-every` steps rank 0 prints `pm.last_metrics`: the loss (the same on every rank), step
time, tokens/s, model FLOP/s per rank and lr (docs/training.md). `--check` also trains the
model on one process and prints the largest relative difference of the losses.
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

import mplan
from mplan.models import build_model, resolve_model
from mplan.refusal import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=128",
                        help="model spec: a preset, family:key=value,..., or a Hugging Face config.json path")
    parser.add_argument("--plan", default="tp=2,dp=2,sp=1,zero=1", help="plan spec string or plan.json")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--check", action="store_true", help="compare with one process (float64)")
    parser.add_argument("--log-every", type=int, default=1, help="print the step's metrics every N steps (rank 0)")
    parser.add_argument("--warmup", type=int, default=2, help="steps of linear learning-rate warmup")
    args = parser.parse_args()

    torch.set_default_dtype(torch.float64)  # float64: the parallel losses match one process to ~1e-15
    source = resolve_model(args.model)  # vocabulary and sequence length of any spec, HF configs included
    model = build_model(source, device="meta", dtype=torch.float64)
    vocab, seq_len = source.vocab, source.seq_len or 32
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, vocab, (args.global_batch, seq_len), generator=generator),
             torch.randint(0, vocab, (args.global_batch, seq_len), generator=generator))
            for _ in range(args.steps)]
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    pm = mplan.autoparallel(model, example_inputs=(data[0][0],), optimizer=optimizer,
                            global_batch=args.global_batch, micro_batch_size=args.micro_batch,
                            plan=args.plan, max_grad_norm=1.0, seed=0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(f"plan {args.plan}: {pm.plan.describe()}")
    # a learning-rate schedule drives the torch optimizer inside pm's (ZeRO-1: the one over the master shards)
    def warmup(step: int) -> float:
        return min(1.0, (step + 1) / max(args.warmup, 1))
    schedule = torch.optim.lr_scheduler.LambdaLR(pm.optimizer.optimizer, warmup)
    losses = []
    for step, (ids, labels) in enumerate(data, start=1):
        losses.append(pm.train_step(ids, labels))
        schedule.step()
        if rank == 0 and (step == 1 or step % max(args.log_every, 1) == 0 or step == args.steps):
            # the step's time, tokens/s, model FLOP/s per rank, MFU and peak memory where known, and lr
            print(f"{pm.last_metrics} | grad norm {pm.last_grad_norm:.4f}")
    if args.check and rank == 0:
        reference = build_model(args.model, device="cpu", dtype=torch.float64, seed=0)
        ref_opt = optimizer(reference.parameters())
        ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, warmup)
        worst = 0.0
        for (ids, labels), loss in zip(data, losses):
            ref_opt.zero_grad()
            ref_loss = reference(ids, labels=labels)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_schedule.step()
            worst = max(worst, abs(loss - ref_loss.item()) / ref_loss.item())
        print(f"largest relative loss difference from one process: {worst:.2e}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    # a refused input (impossible plan, bad spec) ends the job with one line from rank 0, no
    # traceback per rank; MPLAN_TRACEBACK=1 shows it (mplan/refusal.py)
    run(main)
