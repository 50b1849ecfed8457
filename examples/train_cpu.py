"""Train a small Llama with tensor, sequence, pipeline and data parallelism and ZeRO-1 on 4 CPU ranks.

    torchrun --nproc-per-node 4 examples/train_cpu.py
    torchrun --nproc-per-node 4 examples/train_cpu.py --plan tp=4,sp=1 --steps 10
    torchrun --nproc-per-node 4 examples/train_cpu.py --plan tp=2,pp=2,schedule=zb-h1 --micro-batch 1
    python examples/train_cpu.py --plan dp=1        # one process, no torchrun

Every rank builds the same model (on the meta device: each rank initializes only its shards),
`mplan.autoparallel` joins the torchrun job (gloo on CPUs), shards it under the plan and returns
a ParallelModule; `train_step` takes the whole global batch and each data-parallel replica uses
its own rows. Rank 0 prints the loss, which is the same on every rank. `--check` also trains the
model on one process and prints the largest relative difference of the losses.
"""
from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist

import mplan
from mplan.models import build_model, resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama:layers=2,hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=128",
                        help="model spec: a preset, family:key=value,..., or a Hugging Face config.json path")
    parser.add_argument("--plan", default="tp=2,dp=2,sp=1,zero=1", help="plan spec string or plan.json")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--check", action="store_true", help="compare with one process (float64)")
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
    losses = []
    for step, (ids, labels) in enumerate(data):
        losses.append(pm.train_step(ids, labels))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}  grad norm {pm.last_grad_norm:.4f}")
    if args.check and rank == 0:
        reference = build_model(args.model, device="cpu", dtype=torch.float64, seed=0)
        ref_opt = optimizer(reference.parameters())
        worst = 0.0
        for (ids, labels), loss in zip(data, losses):
            ref_opt.zero_grad()
            ref_loss = reference(ids, labels=labels)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            worst = max(worst, abs(loss - ref_loss.item()) / ref_loss.item())
        print(f"largest relative loss difference from one process: {worst:.2e}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
