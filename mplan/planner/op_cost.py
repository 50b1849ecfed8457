"""Prices of one op under one sharding strategy, and of the resharding between two ops.

Input: typed `OpNode`s from the IR, `Strategy`s from strategies.py, a `ClusterSpec` and the
size and link shape of the tensor-parallel axis. Output: seconds (forward and backward
separately) from the cost models: GEMMs and attention on their local shapes through
`ComputeCostModel`, every other op as memory-bound work on its local bytes (or, for a chain
that runs as one fused kernel, that kernel's bytes at its measured bandwidth: fused_pricing.py),
collectives through `collective_time`. Backward costs follow the op's kind: a GEMM's backward
is two GEMMs (input and weight gradients), attention's is the profiled backward, memory-bound
ops move about twice their forward bytes (read the output gradient and a saved input, write
the input gradient).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import GroupShape, collective_time
from mplan.cost_models.compute_cost import ComputeCostModel
from mplan.cost_models.dtypes import canonical_dtype
from mplan.cost_models.moe_cost import experts_layer, experts_time
from mplan.cost_models.profile import HostTiming
from mplan.ir.graph import OpNode, TensorMeta, dtype_bytes
from mplan.ir.op_table import op_packet
from mplan.ir.placement import Partial, Placement, R, can_transition, local_shape, transition
from mplan.ir.strategy import Strategy
from mplan.planner.host_cost import host_timing
from mplan.fusion.entry import FusedSave
from mplan.planner.fused_pricing import FusedChain, fp8_linear_time, fused_bytes

MEMORY_BOUND_BACKWARD_FACTOR = 2.0  # backward bytes / forward bytes of elementwise and norm ops
IMPOSSIBLE_S = 1.0e3  # price of a transition no pass can emit; far above any real block time


@dataclass(frozen=True, slots=True, kw_only=True)
class Cost:
    forward_s: float
    backward_s: float


class OpCoster:
    """Seconds for ops and reshardings on one tensor-parallel axis of a cluster."""

    def __init__(self, cluster: ClusterSpec, axis_size: int, group: GroupShape,
                 fused: Mapping[str, FusedChain] | None = None, fp8_linears: frozenset[str] = frozenset(),
                 saves: Mapping[str, FusedSave] | None = None, host: HostTiming | None = None) -> None:
        self.cluster = cluster
        self.host = host if host is not None else host_timing(cluster)
        """host seconds per launch the program pays (`host_cost.runtime_host`; default: the bare ops')"""
        self.n = axis_size
        self.group = group
        self.fused = fused or {}
        """memory-bound chains that run as one fused kernel (fused_pricing.find_fused_chains)"""
        self.saves = saves or {}
        """what each fused chain keeps for backward (fused_pricing.find_fused_saves)"""
        self.causal_attention = frozenset(name for name, save in self.saves.items() if save.causal)
        """attention nodes that run causally though captured with a mask (proven causal)"""
        self.fp8_linears = fp8_linears
        """linears that run as FP8 GEMMs (fused_pricing.find_fp8_linears)"""
        self.compute = ComputeCostModel(cluster)
        self._collective = lru_cache(maxsize=None)(self._collective_uncached)

    def _collective_uncached(self, kind: str, nbytes: int) -> float:
        return collective_time(self.cluster, kind, float(nbytes), self.group)

    def collective(self, kind: str | None, nbytes: int) -> float:
        return 0.0 if kind is None or nbytes == 0 or self.n == 1 else self._collective(kind, nbytes)

    def reshard(self, meta: TensorMeta, src: Placement, dst: Placement) -> float:
        """Seconds to move a tensor (full-size `meta`) from placement `src` to `dst`."""
        if not can_transition(src, dst):
            return IMPOSSIBLE_S
        kind = transition(src, dst)
        # nccl-tests sizes: the full tensor for all-gather (output), reduce-scatter and all-reduce
        # (input); one rank's buffer, a 1/n shard, for all-to-all.
        return self.collective(kind, meta.nbytes // self.n if kind == "all_to_all" else meta.nbytes)

    def op_comm(self, strategy: Strategy) -> float:
        """Seconds of the collectives an op issues itself (vocabulary-parallel loss), per pass."""
        return sum(self.collective(kind, nbytes) for kind, nbytes in strategy.comm)

    def op(self, node: OpNode, strategy: Strategy) -> Cost:
        """Compute time of the op on its local shapes, plus collectives the op issues itself."""
        comm_f = self.op_comm(strategy)
        fwd, bwd = self._compute(node, strategy)
        return Cost(forward_s=fwd + comm_f, backward_s=bwd + comm_f)

    def _attention_chain(self, save: FusedSave, locals_: list[tuple[int, ...]], dtype: object) -> tuple[float, float]:
        """A node of attention's fused chain other than an SDPA call (`fuse_kernels` makes the chain
        one): attention written out as ATen ops (Gemma-2's eager attention: q @ k^T, scale, mask
        add, fp32 softmax, cast, dropout, @ v) is charged on its last matmul (probabilities [b, h,
        sq, skv] @ v [b, h, skv, d]) as that SDPA call, and its other ops, like the keys and
        values repeated over the query heads (read unrepeated), nothing. Op by op, the eager form
        cost Gemma-2 on the H100 its two GEMMs plus five memory-bound passes over scores the kernel
        never makes: 21 ms of an 89 ms step whose attention kernels measured 3.7 ms
        (benchmarks/results/graph_price-cpu-2026-12-06.json)."""
        if save.inside:
            return 0.0, 0.0
        (batch, heads, seq_q, seq_kv), head_dim = locals_[0], locals_[1][-1]
        args = (batch, heads, seq_q, seq_kv, head_dim, dtype, save.causal)
        return (self.compute.attention_time(*args, backward=False),
                self.compute.attention_time(*args, backward=True))

    def _compute(self, node: OpNode, strategy: Strategy) -> tuple[float, float]:
        if node.kind in ("view", "getitem", "scalar") or not node.outputs:
            return 0.0, 0.0
        n = self.n if strategy.split else 1
        dtype = node.output.dtype
        locals_ = [local_shape(m.shape, p, self.n) for m, p in zip(node.input_metas, strategy.inputs)]
        packet = op_packet(node.op)
        save = self.saves.get(node.name)
        if save is not None and save.kernel == "attention" and node.kind != "attention":
            return self._attention_chain(save, locals_, dtype)
        if packet == "moe_experts":  # every expert local here: `evaluate` re-prices it at the plan's ep
            t = experts_time(self.compute, experts_layer(locals_, canonical_dtype(dtype)), ep=1, load=1.0)
            return t.forward_s, t.backward_s
        if packet == "einsum" and len(locals_) == 2:
            m, cols, k, batch = _einsum_gemm(str(node.args[0]), locals_)
            fwd = self.compute.matmul_time(m, cols, k, dtype, batch=batch)
            return fwd, self.compute.matmul_time(m, k, cols, dtype, batch=batch) + \
                self.compute.matmul_time(cols, k, m, dtype, batch=batch)
        if node.kind == "matmul" and len(locals_) >= 2:
            # addmm(bias, a, b) and baddbmm(c, a, b) multiply their second and third operands
            a, b = (locals_[1], locals_[2]) if packet in ("addmm", "baddbmm") and len(locals_) >= 3 else locals_[:2]
            if packet == "linear":
                m, k, cols = math.prod(a[:-1]), a[-1], b[0]
                batch = 1
                fp8 = fp8_linear_time(self.compute, m, cols, k) if node.name in self.fp8_linears else None
                if fp8 is not None:
                    return fp8
            else:
                batch = math.prod(a[:-2]) if len(a) > 2 else 1
                m, k, cols = a[-2], a[-1], b[-1]
            fwd = self.compute.matmul_time(m, cols, k, dtype, batch=batch)
            weight_grad = self.compute.matmul_time(cols, k, m, dtype, batch=batch) if node.params or \
                packet != "linear" else 0.0
            return fwd, self.compute.matmul_time(m, k, cols, dtype, batch=batch) + weight_grad
        if node.kind == "attention":
            q, kv = locals_[0], locals_[1]
            causal = bool(node.args[5]) if len(node.args) > 5 else bool(dict(node.kwargs).get("is_causal"))
            causal = causal or node.name in self.causal_attention
            args = (q[0], q[1], q[2], kv[2], q[3], dtype, causal)
            return (self.compute.attention_time(*args, backward=False),
                    self.compute.attention_time(*args, backward=True))
        chain = self.fused.get(node.name)
        if chain is not None:
            if chain.anchor != node.name:
                return 0.0, 0.0  # the anchor is charged the whole kernel
            forward_share, backward_share = chain.pricing.copy_fraction
            return (self.compute.memory_bound_time(fused_bytes(chain, node, backward=False) / n / forward_share),
                    self.compute.memory_bound_time(fused_bytes(chain, node, backward=True) / n / backward_share))
        moved = (node.bytes_read + node.bytes_written) / n
        fwd = self.compute.memory_bound_time(moved)
        return fwd, MEMORY_BOUND_BACKWARD_FACTOR * fwd


def _einsum_gemm(equation: str, shapes: list[tuple[int, ...]]) -> tuple[int, int, int, int]:
    """A two-operand einsum as the batched GEMM it runs: (rows, columns, contracted, batch) sizes,
    letters of both operands and the output being the batch, of one operand and the output its
    rows or columns, of both operands only the contraction."""
    lhs, _, out = equation.replace(" ", "").partition("->")
    a, b = lhs.split(",")
    size = {c: d for spec, shape in zip((a, b), shapes) for c, d in zip(spec, shape)}

    def product(letters: set[str]) -> int:
        return math.prod(size[c] for c in letters)
    sa, sb, so = set(a), set(b), set(out)
    return product((sa & so) - sb), product((sb & so) - sa), product((sa & sb) - so), product(sa & sb & so)


def partial_param_grad_bytes(node: OpNode, strategy: Strategy, metas: dict[str, TensorMeta]) -> int:
    """Bytes of replicated parameters that a split op leaves with partial gradients (SP norm weights).

    They need one TP all-reduce per step, after the last micro-batch, bucketed with the
    rest; the planner charges it to the step, not to every micro-batch."""
    return sum(metas[name].nbytes for _, name in node.params
               if isinstance(strategy.input_grads[node.inputs.index(name)], Partial))
