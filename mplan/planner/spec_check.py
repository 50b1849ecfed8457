"""What a plan spec asks of the cluster and the model, checked without a graph.

Input: a `PlanSpec` (or its string), the cluster's world size and GPUs per node, the global
batch, and what the model states of itself before any capture: its layers, attention heads and
experts per MoE layer (`mplan.models.spec.stated_shape`; None where it does not say). Output:
the reason the spec cannot be searched, as one sentence that quotes the spec as written and the
arithmetic that fails, or None.

Why here: a capture costs seconds (tens for a long sequence), and every refusal this module
can give is decided by numbers known before it (`tp=16` on 8 GPUs, `ep=2` on a dense model).
`check_before_capture` runs it ahead of the capture (`mplan.plan`, `mplan bench` per row); the
search (`search.Planner.search`) runs the same function on the captured graph's figures when no
config passes, so a refusal reads the same whichever finds it.

Invariant: it refuses only what `parallel_config.enumerate_configs` would admit no config for
(a superset of its checks would refuse plans that run): dp x cp x tp x pp fills the world (a cp
left out takes what the others leave), tp divides the heads and stays in a node (unless allowed),
pp at most the layers, dp divides the global batch, ep needs experts and divides them and dp x cp,
mbs divides each replica's share, zero among the levels searched (at dp=1 only when the spec names
it: the search itself tries zero > 0 only where dp > 1), sites 1 or the cluster's and dividing dp, and a flat plan (sites=1) on a cluster of
several sites without pipeline stages (its pipelines would cross sites, `MeshShape.check_sites`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from mplan.cost_models.cluster import ClusterSpec
from mplan.planner.evaluate import device_word
from mplan.planner.parallel_config import (ZERO_LEVELS, ParallelConfig, PlanSpec, PlanSpecError, carving_refusal,
                                           outer_refusal,
                                           parse_plan_spec)


def spec_refusal(spec: PlanSpec, *, world_size: int, gpus_per_node: int, global_batch: int,
                 model: str = "the model", num_layers: int | None = None, num_heads: int | None = None,
                 num_experts: int | None = None, allow_cross_node_tp: bool = False,
                 ranks: str = "GPUs", zero_levels: tuple[int, ...] = ZERO_LEVELS, num_sites: int = 1) -> str | None:
    """Why `spec` admits no config (see the module docstring), or None; `ranks` names the devices,
    `zero_levels` the ZeRO levels searched, `num_sites` the cluster's sites."""
    asked = f"plan spec {str(spec)!r}"
    if spec.zero is not None and spec.zero not in zero_levels:
        return (f"{asked}: zero={spec.zero} is not among the ZeRO levels searched here "
                f"({', '.join(map(str, zero_levels))}: those the runtime executes)")
    moe = experts_refusal(spec, asked, model, num_experts)
    if moe:
        return moe
    # cp left out is searched: it takes what dp x tp x pp leave of the world, so those three fixed
    # need only divide it
    fixed = {k: getattr(spec, k) for k in ("dp", "cp", "tp", "pp") if getattr(spec, k) is not None}
    product = math.prod(fixed.values())
    degrees = f" = {' x '.join(map(str, fixed.values()))}" if len(fixed) > 1 else ""
    expr = f"{' x '.join(fixed)}{degrees} = {product}"
    if len(fixed) == 4 and product != world_size:
        return (f"{asked}: {expr} ranks, but the cluster has {world_size} {ranks} (dp x cp x tp x pp must equal "
                f"{world_size})")
    if fixed and product > world_size:
        return f"{asked}: {expr} > {world_size} {ranks}, the whole cluster; fix fewer or smaller degrees, or add --nodes"
    heads = heads_refusal(spec, asked, num_heads)
    if heads:
        return heads
    if fixed and world_size % product:
        return (f"{asked}: {expr} does not divide the cluster's {world_size} {ranks} (dp x cp x tp x pp must equal "
                f"{world_size})")
    if spec.tp is not None and not allow_cross_node_tp and spec.tp > gpus_per_node:
        return f"{asked}: tp={spec.tp} would cross nodes ({gpus_per_node} {ranks} per node)"
    if spec.tp is not None and not allow_cross_node_tp and gpus_per_node % spec.tp:
        return (f"{asked}: tp={spec.tp} does not divide the {gpus_per_node} {ranks} of a node, so some tensor-parallel "
                f"group would straddle two nodes")
    if spec.pp is not None and num_layers is not None and spec.pp > max(1, num_layers):
        return f"{asked}: pp={spec.pp} exceeds the model's {num_layers} layers"
    dp = spec.dp if spec.dp is not None else (world_size // (spec.tp * spec.pp)
                                              if spec.tp is not None and spec.pp is not None else None)
    if dp is not None and global_batch % dp:
        return f"{asked}: global batch {global_batch} is not divisible by dp={dp}"
    sites = sites_refusal(spec, asked, dp, num_sites)
    if sites:
        return sites
    outer = outer_steps_refusal(spec, asked, num_sites)
    if outer:
        return outer
    carving = ep_refusal(spec, world_size, dp)
    if carving:
        return f"{asked}: {carving}"
    if dp is not None and spec.mbs is not None and (global_batch // dp) % spec.mbs:
        replica = global_batch // dp
        return (f"{asked}: each of dp={dp} replicas gets {replica} sequences, not a multiple of mbs={spec.mbs} "
                f"({replica} % {spec.mbs} = {replica % spec.mbs})")
    return None


def ep_refusal(spec: PlanSpec, world_size: int, dp: int | None) -> str | None:
    """Why the spec's ep cannot be carved from its dp x cp replicas (`carving_refusal`), or None;
    `dp` as `spec_refusal` reads it (world / (tp x pp) where the spec leaves dp out: the replicas).
    A cp the spec leaves out is the largest the other degrees leave: an ep that does not divide
    dp x that cp divides no dp x cp the search could try (each divides it)."""
    if spec.ep is None or dp is None:
        return None
    if spec.dp is None:  # dp is the replicas already
        cp = spec.cp if spec.cp is not None and dp % spec.cp == 0 else 1
        return carving_refusal(spec.ep, dp // cp, cp)
    cp = spec.cp if spec.cp is not None else max(1, world_size // (dp * (spec.tp or 1) * (spec.pp or 1)))
    return carving_refusal(spec.ep, dp, cp)


def sites_refusal(spec: PlanSpec, asked: str, dp: int | None, num_sites: int) -> str | None:
    """A plan's sites are 1 (flat) or the cluster's, divide dp, and a flat plan on several sites
    runs no pipeline (its stages, outermost, would cross sites)."""
    if spec.sites is not None and spec.sites > 1 and spec.sites != num_sites:
        return (f"{asked}: sites={spec.sites} but the cluster has {num_sites} site(s); a plan's sites must be 1 "
                f"(flat) or the cluster's (--sites)")
    if spec.sites is not None and dp is not None and dp % spec.sites:
        return (f"{asked}: sites={spec.sites} does not divide dp={dp} (data parallelism is what spans sites; "
                f"{dp} % {spec.sites} = {dp % spec.sites})")
    if spec.sites == 1 and num_sites > 1 and spec.pp is not None and spec.pp > 1:
        return (f"{asked}: pp={spec.pp} with sites=1 on a cluster of {num_sites} sites would run pipelines across "
                f"sites (not planned yet): use sites={num_sites}")
    return None


def heads_refusal(spec: PlanSpec, asked: str, num_heads: int | None) -> str | None:
    """A tensor-parallel degree must divide the attention heads; `num_heads` None: not stated."""
    if spec.tp is not None and num_heads is not None and num_heads % spec.tp:
        return f"{asked}: tp={spec.tp} does not divide the model's {num_heads} attention heads"
    return None


def experts_refusal(spec: PlanSpec, asked: str, model: str, num_experts: int | None) -> str | None:
    """Expert parallelism and a capacity factor need MoE layers, and ep must divide their experts;
    `asked` quotes the request, `num_experts` None: the model does not say (nothing refused). A
    capacity with cp > 1 is refused whatever the model (`resolve._check_experts` says why)."""
    if spec.capacity is not None and spec.cp is not None and spec.cp > 1:
        return context_capacity_refusal(asked, spec.cp, f"capacity={spec.capacity:g}")
    if num_experts is None:
        return None
    wants = f"ep={spec.ep}" if spec.ep is not None and spec.ep > 1 else \
        (f"capacity={spec.capacity:g}" if spec.capacity is not None else None)
    if wants and not num_experts:
        return (f"{asked} asks for {wants} but {model} has no MoE layer: expert parallelism and a capacity factor "
                f"need one; use ep=1 and no capacity")
    if spec.ep is not None and num_experts and num_experts % spec.ep:
        return (f"{asked}: ep={spec.ep} does not divide the {num_experts} experts of {model}'s MoE layers "
                f"({num_experts} % {spec.ep} = {num_experts % spec.ep}): use an ep that divides {num_experts}")
    return None


def context_capacity_refusal(asked: str, cp: int, capacity: str) -> str:
    """Why cp > 1 cannot run with a capacity factor (`capacity`: which one): the one line both the
    spec check and `resolve` give."""
    return (f"{asked}: cp={cp} with {capacity}: a capacity counts the tokens of a whole micro-batch, which cp "
            f"splits over its ranks (each would drop tokens by its own share alone): use cp=1 or a dropless plan")


@dataclass(frozen=True, slots=True, kw_only=True)
class Checked:
    """A plan request that passed the checks before the capture."""

    spec: PlanSpec
    seq_len_source: str | None
    """where the sequence length planned at comes from (`ModelSource.seq_len_source`; "example
    inputs" for a module)"""


def outer_steps_refusal(spec: PlanSpec, asked: str, num_sites: int) -> str | None:
    """Why the spec's outer loop cannot run on a cluster of `num_sites` sites, or None
    (`parallel_config.outer_refusal` for what the rest of the spec fixes)."""
    if not spec.outer_steps:
        return None
    if num_sites == 1:
        return f"{asked}: outer_steps={spec.outer_steps} averages over sites; the cluster has one site (see --sites)"
    ep = spec.ep or 1
    refused = outer_refusal(ParallelConfig(dp=num_sites * ep, tp=1, pp=1, ep=ep, sites=num_sites, zero=spec.zero or 0,
                                           outer_steps=spec.outer_steps))
    return f"{asked}: {refused}" if refused else None


def check_before_capture(spec: PlanSpec | str, *, cluster: ClusterSpec, global_batch: int,
                         model: nn.Module | str, seq_len: int | None = None,
                         allow_cross_node_tp: bool = False) -> Checked:
    """The parsed spec and the sequence length's source, or one error naming the cause: a spec's
    grammar or ranges (`parse_plan_spec`), a model spec that cannot be read or states no
    sequence length, and `spec_refusal` on what the model's config states (PlanSpecError): what
    a search would refuse after a capture, refused before it."""
    from mplan.models.spec import resolve_model, stated_shape

    parsed = parse_plan_spec(spec) if isinstance(spec, str) else spec
    if isinstance(model, str):
        source = resolve_model(model, seq_len=seq_len)
        if source.seq_len is None:
            raise PlanSpecError(f"model spec {model!r} states no sequence length (no config says it): give one "
                                f"with --seq-len (seq_len= in Python)")
        shape, seq_len_source = stated_shape(source.config, source.name), source.seq_len_source
    else:
        shape, seq_len_source = stated_shape(getattr(model, "config", None), type(model).__name__), "example inputs"
    reason = spec_refusal(parsed, world_size=cluster.world_size, gpus_per_node=cluster.gpus_per_node,
                          global_batch=global_batch, model=shape.name, num_layers=shape.num_layers,
                          num_heads=shape.num_heads, num_experts=shape.num_experts,
                          allow_cross_node_tp=allow_cross_node_tp, ranks=device_word(cluster.device.name) + "s",
                          num_sites=cluster.num_sites)
    if reason:
        raise PlanSpecError(reason)
    return Checked(spec=parsed, seq_len_source=seq_len_source)


__all__ = ["Checked", "check_before_capture", "experts_refusal", "heads_refusal", "outer_steps_refusal",
           "sites_refusal", "spec_refusal"]
