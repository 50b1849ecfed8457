"""What a context-parallel plan costs, stage 1 of issue 34: priced from the models that exist,
never from invented figures.

Input: a `ParallelConfig` with cp > 1, the graph as one rank captures it (each sequence's S / cp
tokens: `api.autoparallel` captures that slice, so every op already has the rank's local shape),
the cluster, and the `Estimate` of the same config seen as its replicas (`MeshShape.replicas()`:
dp * cp data-parallel ranks on the S / cp graph, the same rank layout, so gradient reduction and
ZeRO sharding are priced over dp x cp, as the runtime runs them). Output: that Estimate plus the
attention's key/value exchange, with the config put back.

    t_cp = passes * m * sum over attention ops of
           [ all_gather(K_local + V_local bytes * cp) + reduce_scatter(dK + dV, the same bytes) ]
    passes: forward once, backward once (the reduce-scatter is backward's, the gather recomputed
    only under full recomputation: counted then), over the cp group's `GroupShape`;
    m micro-batches; every term from `collective_time` on the cluster's link profile.

What is priced: each rank's ops at its local shapes (the graph), the all-gather of K and V in
forward and the reduce-scatter of their gradients in backward (exposed: the all_gather method does
not overlap them), gradient reduction and optimizer sharding over dp x cp.
What is not priced yet (stage 2): the attention FLOPs of a slice's queries against the other
ranks' keys (the graph's attention sees S / cp keys: the cp share of attention is under-counted
by a factor cp), the gathered K and V in memory, the ring method's overlap and Ulysses' all-to-all.
`explain` says so beside the figures.
"""
from __future__ import annotations

import dataclasses

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.collective_cost import collective_time
from mplan.ir.graph import Graph
from mplan.planner.evaluate import Estimate
from mplan.planner.parallel_config import ParallelConfig

ATTENTION_OPS = ("aten.scaled_dot_product_attention.default",)
"""The attention the runtime turns into context attention (`passes/split_context.py`)."""


def replica_config(config: ParallelConfig) -> ParallelConfig:
    """`config` as data parallelism over dp * cp ranks (the same layout: `MeshShape.replicas`)."""
    return dataclasses.replace(config, dp=config.dp * config.cp, cp=1)


def kv_exchange_s(config: ParallelConfig, graph: Graph, cluster: ClusterSpec) -> float:
    """Seconds a step spends gathering keys and values and reducing their gradients over the cp
    group (module docstring), `graph` at the config's micro-batch."""
    group = config.mesh.group_shape("cp", cluster.gpus_per_node)
    passes = 3 if config.recompute == "full" else 2  # a fully recomputed forward gathers again
    seconds = 0.0
    for node in graph.nodes:
        if node.op not in ATTENTION_OPS:
            continue
        k, v = node.input_metas[1], node.input_metas[2]
        # heads split over tp where they divide (Megatron's layout); else every tp rank holds them all
        local = sum(m.nbytes / (config.tp if m.shape[1] % config.tp == 0 else 1) for m in (k, v))
        kinds = ("all_gather", "reduce_scatter", "all_gather")[:passes]
        seconds += sum(collective_time(cluster, kind, local * config.cp, group) for kind in kinds)
    return seconds * config.num_micro_batches


def with_context_parallel(config: ParallelConfig, replica: Estimate, exchange_s: float) -> Estimate:
    """The replica Estimate of `config` with the K/V exchange added to the step, on the critical path."""
    step = replica.step_time_s + exchange_s
    slower = replica.step_time_s / step
    return dataclasses.replace(replica, config=config, step_time_s=step, comm_s=replica.comm_s + exchange_s,
                               tflops_per_gpu=replica.tflops_per_gpu * slower, mfu=replica.mfu * slower,
                               tokens_per_s=replica.tokens_per_s * slower)
