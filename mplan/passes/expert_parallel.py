"""The experts lowering: how a `moe_experts` node runs on one rank, and over expert-parallel ranks.

Input: the node's local operands (tokens [T, h], routing index and gate [T, k], this rank's
expert weights) and the plan's expert-parallel axis. Output: [T, h], the routed experts' sum
for this rank's tokens (a partial sum over TP when the weights are split by their FFN dim).

With an EP axis of n ranks, rank r holds experts [r*E/n, (r+1)*E/n) (dim 0 of each stacked
weight) and every rank routes its own micro-batch (EP borrows data-parallel ranks), in steps:
1. route: group this rank's T*k choices by expert, dropping past capacity when the plan or model
   sets a capacity factor (the rule of `mplan.kernels.moe`, applied to this rank's T tokens, as
   Megatron-LM drops per rank before dispatch); gather their token rows (grouped by expert, so
   the rows for each destination rank are contiguous);
2. exchange per-expert counts (an all-to-all of n x E/n integers, read on the host once);
3. dispatch: rows to the ranks owning their experts, all-to-all in uneven splits;
4. regroup the arrivals (source-major) by local expert and run the local experts (grouped GEMMs
   on a GPU, `mplan.kernels.moe_grouped`);
5. combine: rows back to their source ranks, the inverse exchange, then each token's
   gate-weighted sum over its choices in choice order.
On one rank (ep=1), dropless, a GPU runs the whole layer as `moe_experts_grouped`: routing,
grouped GEMMs, fused activation and combine, nothing read on the host.
Backward runs the same exchanges reversed (`mplan.collectives.uneven`), so each expert's weight
gradient sums the tokens every EP rank sent it: the runtime then reduces expert gradients over
expert_dp only (`runtime/param_placement.py`). Dropless routing is exact for any load: a
skewed router only makes some splits larger.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mplan.collectives.redistribute import AxisGroup
from mplan.collectives.uneven import exchange_counts, rows_all_to_all
from mplan.kernels.moe import combine, expert_capacity, expert_mlp, route
from mplan.kernels.moe_grouped import grouped_available, grouped_expert_mlp, moe_experts_grouped


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertsLowering:
    """What the plan says about experts: the EP axis, the expert parameters it shards on dim 0,
    and the capacity factor it sets (None: each node keeps the model's own)."""

    ep: AxisGroup
    parameters: frozenset[str]
    capacity_factor: float | None = None


NO_EXPERT_PARALLELISM = ExpertsLowering(ep=AxisGroup(group=None, size=1, rank=0), parameters=frozenset())


class RoutedExperts(nn.Module):
    """A `moe_experts` node on this rank (module docstring)."""

    def __init__(self, *, num_experts: int, activation: str, gated: bool, capacity_factor: float | None,
                 ep: AxisGroup, node: str) -> None:
        super().__init__()
        self.num_experts, self.activation, self.gated = num_experts, activation, gated
        self.capacity_factor, self.ep, self.node = capacity_factor, ep, node

    def forward(self, x: torch.Tensor, index: torch.Tensor, gate: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, w_up: torch.Tensor | None = None) -> torch.Tensor:
        if self.ep.size == 1 and self.capacity_factor is None and grouped_available(x, w_in):
            # one GPU, dropless: routing, grouped GEMMs and fused permute/combine, no host sync
            return moe_experts_grouped(x, index, gate, w_in, w_out, w_up, activation=self.activation,
                                       gated=self.gated)
        num_tokens, top_k = index.shape
        capacity = expert_capacity(num_tokens, top_k, self.num_experts, self.capacity_factor)
        routed = route(index, self.num_experts, capacity)
        rows = x.index_select(0, routed.tokens)
        if self.ep.size == 1:
            out = self._experts(rows, routed.counts, w_in, w_out, w_up)
        else:
            out = self._dispatched(rows, routed.counts, w_in, w_out, w_up)
        return combine(out, routed, gate).to(x.dtype)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                 w_up: torch.Tensor | None) -> torch.Tensor:
        if grouped_available(rows, w_in):
            return grouped_expert_mlp(rows, counts, w_in, w_out, w_up, activation=self.activation, gated=self.gated)
        return expert_mlp(rows, counts, w_in, w_out, w_up, activation=self.activation, gated=self.gated)

    def _dispatched(self, rows: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                    w_up: torch.Tensor | None) -> torch.Tensor:
        n = self.ep.size
        group = self.ep.require_group("expert-parallel dispatch")
        sent = counts.view(n, self.num_experts // n)  # [destination rank, its expert]
        arrived = exchange_counts(sent, group)  # [source rank, my expert]
        both = torch.stack([sent, arrived]).cpu()  # the one host read of the exchange
        send, receive = both[0].sum(1).tolist(), both[1].sum(1).tolist()
        here = rows_all_to_all(rows, send, receive, group)
        order = _expert_major(both[1]).to(rows.device)
        out = self._experts(here.index_select(0, order), both[1].sum(0).to(rows.device), w_in, w_out, w_up)
        back = out.index_select(0, torch.argsort(order))  # source-major again
        return rows_all_to_all(back, receive, send, group)

    def extra_repr(self) -> str:
        return (f"node={self.node}, experts={self.num_experts}, ep={self.ep.size}, activation={self.activation}, "
                f"capacity_factor={self.capacity_factor}")


def _expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Rows laid out source-major ([source][expert] chunks of `counts` [n, m] rows) reordered
    expert-major ([expert][source]): the gather index."""
    flat = counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view(counts.shape).t().flatten()
    lengths = counts.t().flatten()
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()))


def experts_module(*, num_experts: int, args: tuple[object, ...], lowering: ExpertsLowering,
                   node: str) -> RoutedExperts:
    """The module that runs a `moe_experts` node whose captured arguments are `args`."""
    activation, gated, capacity = args[6], args[7], args[8]
    if lowering.capacity_factor is not None:
        capacity = lowering.capacity_factor
    if num_experts % lowering.ep.size:
        raise ValueError(f"node {node}: {num_experts} experts do not divide over ep={lowering.ep.size} ranks")
    return RoutedExperts(num_experts=num_experts, activation=str(activation), gated=bool(gated),
                         capacity_factor=None if capacity is None else float(capacity),  # type: ignore[arg-type]
                         ep=lowering.ep, node=node)
