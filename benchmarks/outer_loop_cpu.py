"""Convergence of the outer loop across sites against synchronous DP on the same tokens.

    python benchmarks/outer_loop_cpu.py -o benchmarks/results/outer_loop-cpu-2026-12-06.json

4 gloo CPU ranks, 2 sites of 2, mplan's tiny Llama in float32, inner AdamW (lr 3e-3), one global
batch of 16 sequences a step (4 a rank), the same batches in the same order for both runs:
- `sync`: gradients averaged over all 4 ranks every step (synchronous DP);
- `outer_h8`: gradients averaged inside each site only; every 8 steps `runtime/outer_loop.py`'s
  outer step (Nesterov SGD, lr 0.7, momentum 0.9) over the 2 sites.
Tokens follow a fixed rule (each the previous times 5 plus 3, mod the vocabulary, from a random
first token, one token in eight replaced at random), so the loss has somewhere to go. Recorded:
each step's training loss (the mean over the 4 ranks' rows, each on its own site's parameters),
and the loss of the final parameters (step 64 ends an outer step: all sites hold the same) on 8
held-out batches. Measured figures, no bound tuned to them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mplan.models.llama import LlamaModel
from mplan.models.presets import PRESETS
from mplan.runtime.outer_loop import OuterLoop, OuterOptimizer

WORLD, SITES, ROWS, STEPS, EVERY = 4, 2, 4, 64, 8
CONFIG = PRESETS["tiny-llama"]


def tokens(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(rows, CONFIG.seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(CONFIG.vocab, (rows,), generator=g)
    for t in range(1, seq.shape[1]):
        seq[:, t] = (seq[:, t - 1] * 5 + 3) % CONFIG.vocab
    noise = torch.rand(seq.shape, generator=g) < 0.125
    return torch.where(noise, torch.randint(CONFIG.vocab, seq.shape, generator=g), seq)


def run(mode: str, site: dist.ProcessGroup, cross: dist.ProcessGroup) -> dict:
    rank = dist.get_rank()
    model = LlamaModel(CONFIG, dtype=torch.float32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loop = OuterLoop(model.parameters(), cross, EVERY, OuterOptimizer()) if mode == "outer_h8" else None
    group = None if loop is None else site
    losses = []
    for step in range(STEPS):
        mine = tokens(step, ROWS * WORLD)[rank * ROWS:(rank + 1) * ROWS]
        opt.zero_grad()
        loss = model(mine[:, :-1].contiguous(), mine[:, 1:].contiguous())
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)
        opt.step()
        if loop:
            loop.after_inner_step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    with torch.no_grad():
        held = [model(b[:, :-1].contiguous(), b[:, 1:].contiguous()).item() for b in (tokens(10_000 + i, 16) for i in range(8))]
    return {"train_loss": losses, "held_out_loss": sum(held) / len(held),
            "cross_site_all_reduces": loop.outer_steps if loop else STEPS * len(list(model.parameters()))}


def worker(rank: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    made = {}
    for name, lists in (("site", [[0, 1], [2, 3]]), ("cross", [[0, 2], [1, 3]])):
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                made[name] = group
    results = {mode: run(mode, made["site"], made["cross"]) for mode in ("sync", "outer_h8")}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(os.path.join(tmp, "store"), raw), nprocs=WORLD)
        runs = json.loads(Path(raw).read_text())
    report = {"what": "tiny-llama float32, 4 gloo ranks = 2 sites x 2, inner AdamW lr 3e-3, 64 steps, same tokens",
              "outer": {"every": EVERY, "lr": 0.7, "momentum": 0.9, "nesterov": True},
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "runs": runs}
    for mode, r in runs.items():
        print(f"{mode:9s} first {r['train_loss'][0]:.4f}  step 32 {r['train_loss'][31]:.4f}  "
              f"last {r['train_loss'][-1]:.4f}  held-out {r['held_out_loss']:.4f}")
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
