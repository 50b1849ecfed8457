"""Train a model you wrote in plain PyTorch, with your own DataLoader, on every rank of a torchrun job.

    torchrun --nproc-per-node 4 examples/train_your_model.py                 # plan=None: mplan searches
    torchrun --nproc-per-node 4 examples/train_your_model.py --plan tp=2,dp=2,sp=1,zero=1
    python examples/train_your_model.py                                      # one process, no torchrun

Nothing here is mplan's but the three marked lines: the model is an ordinary `nn.Module` (causal
attention through `F.scaled_dot_product_attention`, a weight tied between the embedding and the
head), the loss is the user's own function of the logits, and the data come through a
`DataLoader` with a `DistributedSampler`. mplan tells the sampler how many data-parallel replicas
the plan has and which one this rank is (`pm.dp_size`, `pm.dp_rank`): ranks that differ only in
tensor or pipeline position read the same rows, and `train_step(..., local=True)` takes each
replica's own slice (`pm.local_batch_size` rows). `--check` trains the same model on one process
from the same batches and prints the largest relative difference of the losses (float64).
"""
from __future__ import annotations

import argparse
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mplan
from mplan.refusal import run


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: it stays one parameter under every plan
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=None, help="a plan spec such as tp=2,dp=2 (default: mplan searches)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--check", action="store_true", help="compare the losses with one process (float64)")
    args = parser.parse_args()

    torch.set_default_dtype(torch.float64 if args.check else torch.float32)
    torch.manual_seed(0)  # every rank builds the same model and the same data
    model = TinyGPT()
    reference = copy.deepcopy(model) if args.check else None
    tokens = torch.randint(0, 96, (args.global_batch * args.steps, 33))
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)

    pm = mplan.autoparallel(model, example_inputs=(tokens[: args.global_batch, :-1],), loss_fn=loss_fn,  # mplan
                            optimizer=optimizer, global_batch=args.global_batch, plan=args.plan)
    sampler = DistributedSampler(dataset, num_replicas=pm.dp_size, rank=pm.dp_rank, shuffle=True, seed=0)  # mplan
    loader = DataLoader(dataset, batch_size=pm.local_batch_size, sampler=sampler, drop_last=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for ids, labels in loader:
        losses.append(pm.train_step(ids, labels, local=True))  # mplan
        if rank == 0:
            print(f"step {len(losses)} | loss {losses[-1]:.4f} | {pm.last_metrics.step_time_s * 1e3:.0f} ms")
    if reference is not None and rank == 0:
        print(f"largest relative loss difference from one process: {_check(reference, dataset, args, losses):.2e}")
    if dist.is_initialized():
        dist.destroy_process_group()


def _check(reference: nn.Module, dataset: TensorDataset, args: argparse.Namespace, losses: list[float]) -> float:
    """The same steps on one process: each step's global batch is every replica's rows together."""
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    worst = 0.0
    for step, loss in enumerate(losses):
        rows = _global_rows(len(dataset), args.global_batch, step)
        ids, labels = dataset[rows]
        opt.zero_grad()
        ref = loss_fn(reference(ids), labels)
        ref.backward()
        opt.step()
        worst = max(worst, abs(loss - ref.item()) / ref.item())
    return worst


def _global_rows(length: int, global_batch: int, step: int) -> list[int]:
    """The rows every replica's sampler hands out at `step`, together: DistributedSampler deals
    the shuffled order round-robin, so the replicas' slices of one step are a block of it."""
    order = torch.randperm(length, generator=torch.Generator().manual_seed(0)).tolist()
    return order[step * global_batch:(step + 1) * global_batch]


if __name__ == "__main__":
    run(main)
