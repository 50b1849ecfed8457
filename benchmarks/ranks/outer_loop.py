"""Convergence of the outer loop across sites against synchronous DP on the same tokens.

    PYTHONPATH=. python -m benchmarks.ranks outer-loop -o benchmarks/results/outer_loop-cpu-2026-12-06.json
(that result made before the harness, by `python benchmarks/outer_loop_cpu.py` with the same flags)

4 gloo CPU ranks, 2 sites of 2, mplan's tiny Llama in float32, inner AdamW (lr 3e-3), one global
batch of 16 sequences a step (4 a rank), the same batches in the same order for both runs:
- `sync`: gradients averaged over all 4 ranks every step (synchronous DP);
- `outer_h8`: gradients averaged inside each site only; every 8 steps `runtime/outer_loop.py`'s
  outer step (Nesterov SGD, lr 0.7, momentum 0.9) over the 2 sites.
Tokens follow a fixed rule (each the previous times 5 plus 3, mod the vocabulary, from a random
first token, one token in eight replaced at random), so the loss has somewhere to go. Recorded:
each step's training loss (the mean over the 4 ranks' rows, each on its own site's parameters),
and the loss of the final parameters (step 64 ends an outer step: all sites hold the same) on 8
held-out batches. Measured figures, no bound tuned to them. `--steps` (a multiple of 8, so the last
step ends an outer step) shortens the run; the losses are the same step for step.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.ranks.launch import header, start_ranks

WORLD, ROWS, STEPS, EVERY = 4, 4, 64, 8
SITE_RANKS, CROSS_RANKS = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
"""Each site's ranks, and the ranks that hold the same shard of work in each site (the outer step's group)."""


def tokens(seed: int, rows: int, vocab: int, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(rows, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab, (rows,), generator=g)
    for t in range(1, seq.shape[1]):
        seq[:, t] = (seq[:, t - 1] * 5 + 3) % vocab
    noise = torch.rand(seq.shape, generator=g) < 0.125
    return torch.where(noise, torch.randint(vocab, seq.shape, generator=g), seq)


def train(mode: str, steps: int, site: dist.ProcessGroup, cross: dist.ProcessGroup) -> dict[str, Any]:
    """One run on this rank: `sync` or `outer_h8`, its per-step losses and held-out loss."""
    from mplan.models.llama import LlamaModel
    from mplan.models.presets import PRESETS
    from mplan.runtime.outer_loop import OuterLoop, OuterOptimizer

    config = PRESETS["tiny-llama"]
    rank = dist.get_rank()
    model = LlamaModel(config, dtype=torch.float32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loop = OuterLoop(model.parameters(), cross, EVERY, OuterOptimizer()) if mode == "outer_h8" else None
    group = None if loop is None else site
    losses = []
    for step in range(steps):
        mine = tokens(step, ROWS * WORLD, config.vocab, config.seq_len)[rank * ROWS:(rank + 1) * ROWS]
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
        held = [model(b[:, :-1].contiguous(), b[:, 1:].contiguous()).item()
                for b in (tokens(10_000 + i, 16, config.vocab, config.seq_len) for i in range(8))]
    return {"train_loss": losses, "held_out_loss": sum(held) / len(held),
            "cross_site_all_reduces": loop.outer_steps if loop else steps * len(list(model.parameters()))}


def both_runs(steps: int) -> dict[str, dict[str, Any]]:
    """On every rank of the group of `WORLD`: its site and cross-site groups, then both runs."""
    made = {}
    for name, lists in (("site", SITE_RANKS), ("cross", CROSS_RANKS)):
        for ranks in lists:
            group = dist.new_group(ranks)  # every rank makes every group, in the same order
            if dist.get_rank() in ranks:
                made[name] = group
    return {mode: train(mode, steps, made["site"], made["cross"]) for mode in ("sync", "outer_h8")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=STEPS, help=f"inner steps, a multiple of {EVERY}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.steps <= 0 or args.steps % EVERY:
        raise SystemExit(f"--steps must be a positive multiple of {EVERY}: the last step must end an outer step")
    runs = start_ranks(WORLD, both_runs, args.steps, timeout_s=1800)[0]  # rank 0's, as the script wrote
    half = args.steps // 2
    for mode, r in runs.items():
        print(f"{mode:9s} first {r['train_loss'][0]:.4f}  step {half} {r['train_loss'][half - 1]:.4f}  "
              f"last {r['train_loss'][-1]:.4f}  held-out {r['held_out_loss']:.4f}")
    return {"what": f"tiny-llama float32, 4 gloo ranks = 2 sites x 2, inner AdamW lr 3e-3, {args.steps} steps, "
                    "same tokens",
            "outer": {"every": EVERY, "lr": 0.7, "momentum": 0.9, "nesterov": True},
            **header(torch.device("cpu")), "runs": runs}
