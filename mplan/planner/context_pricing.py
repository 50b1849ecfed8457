"""What a context-parallel plan costs, stage 1 of issue 34: priced from the models that exist,
never from invented figures.

Input: a `ParallelConfig` with cp > 1, the graph as one rank captures it (each sequence's S / cp
tokens: `api.autoparallel` captures that slice, so every op already has the rank's local shape),
the cluster, and the `Estimate` of the same config seen as its replicas (`MeshShape.replicas()`:
dp * cp data-parallel ranks on the S / cp graph, the same rank layout, so gradient reduction and
ZeRO sharding are priced over dp x cp, as the runtime runs them). Output: that Estimate plus the
attention's key/value exchange, with the config put back.

    t_cp = m * sum over attention ops of the method's exchanges, kv = K_local + V_local bytes:
      all_gather  forward all_gather(kv * cp), backward reduce_scatter(kv * cp) of dK, dV
      ring        forward (cp - 1) send_recv(kv), backward (cp - 1) send_recv(kv) + cp send_recv(kv)
                  of the travelling dK, dV accumulators
      all_to_all  forward all_to_all of q, k, v and out, backward the four inverse ones
    a forward's exchanges twice under full recomputation; m micro-batches; over the cp group's
    `GroupShape`; every term from `collective_time` on the cluster's link profile.

What is priced: each rank's ops at its local shapes (the graph), the method's exchanges,
exposed (no overlap with the attention's math: the runtime's ring does post each hop before its
block's math, but how much that hides is not measured yet), gradient reduction and optimizer
sharding over dp x cp.
What is not priced yet (stage 2): the attention FLOPs of a slice's queries against the other
ranks' keys (the graph's attention sees S / cp keys: the cp share of attention is under-counted
by a factor cp), the exchanged blocks in memory, the ring's overlap. `explain` says so beside
the figures.
"""
from __future__ import annotations

import dataclasses

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import collective_time
from mplan.ir.graph import Graph, OpNode, TensorMeta
from mplan.planner.evaluate import Estimate
from mplan.planner.parallel_config import ParallelConfig

ATTENTION_OPS = ("aten.scaled_dot_product_attention.default",)
"""The attention the runtime turns into context attention (`passes/split_context.py`)."""


def replica_config(config: ParallelConfig) -> ParallelConfig:
    """`config` as data parallelism over dp * cp ranks (the same layout: `MeshShape.replicas`)."""
    return dataclasses.replace(config, dp=config.dp * config.cp, cp=1)


def kv_exchange_s(config: ParallelConfig, graph: Graph, cluster: ClusterSpec,
                  stage_bounds: tuple[tuple[int, int], ...] | None = None) -> float:
    """Seconds a step spends in the cp method's exchanges (module docstring) on the busiest
    pipeline rank, `graph` at the config's micro-batch; `stage_bounds` (the Estimate's unit
    ranges per chunk, units in `graph.segments` order) say which attention layers each pipeline
    rank holds (None: all of them, one stage)."""
    per_segment: dict[str, float] = {}
    for segment in graph.segments:
        per_segment[segment.name] = _exchange_s(config, [graph.node(n) for n in segment.nodes], cluster)
    names = [segment.name for segment in graph.segments]
    if stage_bounds is None or config.pp == 1:
        return sum(per_segment.values())
    k = len(stage_bounds)
    return max(sum(per_segment[names[u]] for c in range(rank, k, config.pp) for u in range(*stage_bounds[c]))
               for rank in range(config.pp))


def _exchange_s(config: ParallelConfig, nodes: list[OpNode], cluster: ClusterSpec) -> float:
    group = config.mesh.group_shape("cp", cluster.gpus_per_node)
    forwards = 2 if config.recompute == "full" else 1  # a fully recomputed forward exchanges again
    cp = config.cp

    def local(meta: TensorMeta) -> float:
        # heads split over tp where they divide (Megatron's layout); else every tp rank holds them all
        return meta.nbytes / (config.tp if meta.shape[1] % config.tp == 0 else 1)

    def time(kind: str, nbytes: float) -> float:
        return collective_time(cluster, kind, nbytes, group)

    seconds = 0.0
    for node in nodes:
        if node.op not in ATTENTION_OPS:
            continue
        q, k, v, out = node.input_metas[0], node.input_metas[1], node.input_metas[2], node.outputs[0]
        kv = local(k) + local(v)
        if config.cp_method == "all_gather":
            forward, backward = time("all_gather", kv * cp), time("reduce_scatter", kv * cp)
        elif config.cp_method == "ring":
            forward = (cp - 1) * time("send_recv", kv)
            backward = (2 * cp - 1) * time("send_recv", kv)
        else:
            forward = sum(time("all_to_all", local(m)) for m in (q, k, v, out))
            backward = forward
        seconds += forwards * forward + backward
    return seconds * config.num_micro_batches


def with_context_parallel(config: ParallelConfig, replica: Estimate, exchange_s: float) -> Estimate:
    """The replica Estimate of `config` with the K/V exchange added to the step, on the critical path."""
    step = replica.step_time_s + exchange_s
    slower = replica.step_time_s / step
    return dataclasses.replace(replica, config=config, step_time_s=step, comm_s=replica.comm_s + exchange_s,
                               tflops_per_gpu=replica.tflops_per_gpu * slower, mfu=replica.mfu * slower,
                               tokens_per_s=replica.tokens_per_s * slower)
