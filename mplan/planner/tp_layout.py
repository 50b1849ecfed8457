"""The two TP layouts a plan can ask for (`Plan.tp_layout`): the sharding ILP's cheapest valid
mix on the cluster ("ilp"), or Megatron-LM's hand-written layout ("megatron").

`solve_tp_layout` solves either. For Megatron's, `CollectiveCountCoster` duck-types `OpCoster`:
it makes the ILP minimize the number of collectives first, then the bytes they move, then the
work left unsplit. Megatron's layout is the one with fewest collectives per block (q/k/v,
gate/up, fc_in by columns; o, down, fc_out by rows; embedding, head and loss by vocabulary), so
with the registry's Megatron filter (`op_registry.megatron_required`) it falls out of these
prices on any shape, independent of the measured cost model and of the machine that plans.
Spec strings (`plan="tp=2,dp=2"`) get this layout unless asked for the ILP's own; either way the
Plan prices it with the cluster's real costs (`sharding_ilp.reprice_graph`).
"""
from __future__ import annotations

from mplan.ir.graph import Graph, OpNode, TensorMeta
from mplan.ir.placement import Placement, R, Shard, can_transition, transition
from mplan.ir.strategy import Strategy
from mplan.planner.op_cost import Cost, OpCoster
from mplan.planner.op_registry import megatron_required
from mplan.planner.sharding_ilp import GraphSharding, StrategyFilter, reprice_graph, solve_graph_sharding, stream_shape


def solve_tp_layout(graph: Graph, coster: OpCoster, *, sp: bool, layout: str,
                    allow: StrategyFilter | None = None) -> GraphSharding:
    """The TP strategies of every node of `graph` on `coster`'s axis (SP: the residual stream on
    sequence shards between blocks), priced on `coster` (see the module docstring)."""
    boundary = Shard(1) if sp else R
    if layout == "ilp" or coster.n == 1:
        return solve_graph_sharding(graph, coster, boundary, allow=allow)
    required = megatron_required(coster.n, stream_shape(graph) if sp else None)
    both = required if allow is None else (lambda v, s: required(v, s) and allow(v, s))
    megatron = solve_graph_sharding(graph, CollectiveCountCoster(coster.n), boundary, allow=both)  # type: ignore[arg-type]
    return reprice_graph(graph, megatron, coster)


class CollectiveCountCoster:
    """See the module docstring."""

    COLLECTIVE = 1.0  # one collective
    PER_BYTE = 1e-12  # ties between equal counts: fewer bytes
    PER_UNIT = 1e-15  # ties between equal traffic: more work split (FLOPs + bytes touched)
    IMPOSSIBLE = 1e6  # a transition no pass can emit (R -> P)

    def __init__(self, n: int, *, per_collective: float = COLLECTIVE, per_byte: float = PER_BYTE,
                 per_unit: float = PER_UNIT) -> None:
        self.n = n
        self.per_collective, self.per_byte, self.per_unit = per_collective, per_byte, per_unit
        self.saves: dict[str, object] = {}  # memory as the ATen ops keep it: the layout is chosen by counts

    @property
    def tiers(self) -> tuple[CollectiveCountCoster, CollectiveCountCoster]:
        """The counts, then the tie-breakers (bytes, work) alone: the ILP minimizes them in this
        order (`sharding_ilp`, "Tiers"), since the tie-breakers' 1e-12 is under its tolerances."""
        return (CollectiveCountCoster(self.n, per_byte=0.0, per_unit=0.0),
                CollectiveCountCoster(self.n, per_collective=0.0, per_byte=self.per_byte, per_unit=self.per_unit))

    def collective(self, kind: str | None, nbytes: int) -> float:
        return 0.0 if kind is None or nbytes == 0 or self.n == 1 else self.per_collective + self.per_byte * nbytes

    def reshard(self, meta: TensorMeta, src: Placement, dst: Placement) -> float:
        if not can_transition(src, dst):
            return self.IMPOSSIBLE
        return self.collective(transition(src, dst), meta.nbytes)

    def op_comm(self, strategy: Strategy) -> float:
        return sum(self.collective(kind, nbytes) for kind, nbytes in strategy.comm)

    def op(self, node: OpNode, strategy: Strategy) -> Cost:
        work = self.per_unit * (node.flops + node.bytes_read + node.bytes_written) / (self.n if strategy.split else 1)
        comm = self.op_comm(strategy)
        return Cost(forward_s=work + comm, backward_s=2 * work + comm)
