"""One point of the search space: how a training step is split, and the plan-spec grammar.

`ParallelConfig` is a complete choice (mesh degrees, micro-batching, sequence parallelism,
recomputation, optimizer sharding, schedule). `PlanSpec` is what a user writes
(`dp=2,tp=4,pp=8,vpp=2,ep=1,mbs=1,sp=1,zero=1,recompute=selective,schedule=1f1b`): keys left out
are searched, `auto` searches everything. `capacity=1.25` (never searched; `none`, the default, is
dropless) sets the experts' capacity factor of an MoE model (`mplan.kernels.moe`).
`zero` (ZERO_LEVELS): 0 replicated optimizer, 1 optimizer state sharded over DP, 2 gradients too,
3 parameters too (FSDP-style: each unit all-gathered before its forward and again before its
backward). `keep_weights=1` (zero=3 only) keeps each unit's gathered weights from its first forward
to its last backward of the step instead: one gather per step, the stage's weights whole meanwhile
(torchtitan keeps them so when pp > 1; mplan's runtime always does under a pipeline,
`ZERO3_KEEPS_UNDER_PIPELINES`). `zero_variants` says which (zero, keep_weights) pairs a config tries.
`sites=S` (a cluster of S sites): data parallelism hierarchical over the sites, the site dp's
outermost factor (`ir/mesh.py`); 1, the default, is flat. On a cluster of several sites the search
tries both where the mesh allows (`site_options`).
`outer_steps=H` (H >= 1; 0, the default, is synchronous): across sites, each site trains alone for
H steps, its gradients reduced inside the site only, then one outer step over the sites averages
their parameters' change (DiLoCo-style, `runtime/outer_loop.py`). Inexact: it is not the
single-device loop's arithmetic, so it needs sites > 1 and zero=0 and ep=1 (the outer loop reads
whole, non-expert parameters), and the search tries it only where the user allows inexact
training (`outer_variants`).
`enumerate_configs` lists every config a cluster and model admit, with the reason each excluded
degree fails kept for error messages.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterator

from mplan.cost_models.memory_model import RECOMPUTE_MODES, ZERO_LEVELS
from mplan.ir.mesh import MeshShape
from mplan.ir.schedule import SCHEDULES

RUNTIMES = ("megatron", "mplan")
"""Whose optimizer memory a plan is priced with (`ModelFacts.runtime`): Megatron-LM's or mplan's runtime's."""
DEFAULT_RUNTIME = "mplan"
"""The runtime every command and API prices for unless told otherwise: the one that executes the
plan (`autoparallel`, `bench --measure`). `mplan plan --runtime megatron` prices a plan for
Megatron-LM instead (fp32 master weights, gradients and moments at any ZeRO stage)."""
EXECUTABLE_ZERO: dict[str, tuple[int, ...]] = {"mplan": ZERO_LEVELS, "megatron": ZERO_LEVELS}
"""The ZeRO levels each runtime executes, the only ones `autoparallel` searches and accepts
(`resolve.py`). mplan's: 0-3 (`runtime/optimizer.py`: zero 2 and 3 since issue 33's runtime,
`runtime/fully_sharded.py`). Megatron-LM: 0, 1 (distributed optimizer) and 2, 3 (Megatron-FSDP's
`optim_grads` and `optim_grads_params` sharding strategies)."""
ZERO3_KEEPS_UNDER_PIPELINES: dict[str, bool] = {"mplan": True, "megatron": False}
"""Whether a runtime keeps zero=3's gathered weights through the step whenever pp > 1, whatever the
plan says. mplan's does (`runtime/parallel_module.py`: `keep_gathered` under a pipeline), so its
zero=3 pipeline plans are priced and recorded with keep_weights; Megatron-FSDP's is not known
here, so both are priced for it."""
_INT_KEYS = ("dp", "tp", "pp", "vpp", "ep", "cp", "mbs", "sp", "zero", "keep_weights", "sites", "outer_steps")
_FLAG_KEYS = ("sp", "keep_weights")
_KEYS = _INT_KEYS + ("recompute", "schedule", "capacity", "cp_method")
CP_METHODS = ("all_gather", "ring", "all_to_all")
"""How attention exchanges the sequence over cp (`collectives.context_attention.METHODS`): keys and
values all-gathered, passed around a ring, or heads redistributed all-to-all (Ulysses)."""
OUTER_STEPS_SEARCHED = (8, 32, 128)
"""The outer loop's periods (inner steps per outer step) a search tries where inexact training is
allowed. DiLoCo ("DiLoCo: Distributed Low-Communication Training of Language Models", Douillard
et al., 2023) ran H = 500 with little loss; shorter periods are tried first because the
convergence cost grows with H and is not priced (measured here on a tiny model only:
benchmarks/results/outer_loop-cpu-2026-12-06.json, held-out 1.550 synchronous, 1.666 at H=8)."""


class PlanSpecError(ValueError):
    """A plan spec string that cannot be parsed or cannot run on this cluster and model."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    dp: int  # data-parallel replicas (expert parallelism is carved out of them)
    tp: int  # tensor-parallel degree (inside a node unless allowed otherwise)
    pp: int  # pipeline stages (ranks)
    vpp: int = 1  # virtual stages per pipeline rank (interleaved schedule)
    ep: int = 1  # expert-parallel degree, dividing dp
    # context-parallel degree: each rank holds 1/cp of every sequence (head-tail chunks);
    # priced by `context_pricing`, searched over `context_degrees`
    cp: int = 1
    cp_method: str = "all_gather"  # CP_METHODS; read only when cp > 1
    mbs: int = 1  # micro-batch size (sequences)
    num_micro_batches: int = 1  # per DP replica per step
    sp: bool = False  # sequence parallelism on the TP axis
    zero: int = 0  # ZERO_LEVELS: 1 optimizer state sharded over DP, 2 gradients too, 3 parameters too
    # zero=3 only: each unit's gathered weights kept from its first forward to its last backward of
    # the step (one gather per step) rather than gathered before every forward and backward and freed
    keep_weights: bool = False
    recompute: str = "none"
    schedule: str = "1f1b"
    capacity_factor: float | None = None  # experts' capacity factor; None: dropless (not searched)
    sites: int = 1  # sites dp spans hierarchically (the mesh's outermost factor of dp); 1: flat
    # inner steps per outer step of the outer loop across sites (`runtime/outer_loop.py`); 0: synchronous
    outer_steps: int = 0

    @property
    def inexact(self) -> bool:
        """Whether this config changes the single-device loop's arithmetic (an outer loop)."""
        return self.outer_steps > 0

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def mesh(self) -> MeshShape:
        return MeshShape(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, sites=self.sites)

    def spec(self) -> str:
        """The manual spec string that reproduces this config."""
        return (f"dp={self.dp},tp={self.tp},pp={self.pp},vpp={self.vpp},ep={self.ep},mbs={self.mbs},"
                f"sp={int(self.sp)},zero={self.zero},recompute={self.recompute},schedule={self.schedule}"
                + (f",cp={self.cp}" if self.cp > 1 else "")
                + (f",cp_method={self.cp_method}" if self.cp > 1 and self.cp_method != "all_gather" else "")
                + (",keep_weights=1" if self.keep_weights else "")
                + (f",sites={self.sites}" if self.sites > 1 else "")
                + (f",outer_steps={self.outer_steps}" if self.outer_steps else "")
                + (f",capacity={self.capacity_factor:g}" if self.capacity_factor is not None else ""))

    def short(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        parts.append(f"mbs{self.mbs}")
        if self.sp:
            parts.append("sp")
        if self.zero:
            parts.append(f"zero{self.zero}" + ("-keep" if self.keep_weights else ""))
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.capacity_factor is not None:
            parts.append(f"cf{self.capacity_factor:g}")
        if self.sites > 1:
            parts.append(f"sites{self.sites}")
        if self.outer_steps:
            parts.append(f"outer{self.outer_steps}")
        return "-".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSpec:
    """Fixed choices from a spec string; None means searched."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    ep: int | None = None
    cp: int | None = None  # None: searched (`context_degrees`)
    cp_method: str | None = None  # None: searched where cp > 1 (`context_methods`)
    mbs: int | None = None
    sp: int | None = None
    zero: int | None = None
    keep_weights: int | None = None  # 0 or 1; 1 needs zero=3
    recompute: str | None = None
    schedule: str | None = None
    capacity: float | None = None  # experts' capacity factor (None: dropless); passed through, not searched
    sites: int | None = None  # None: searched where the cluster has several sites (`site_options`)
    outer_steps: int | None = None  # None: synchronous unless inexact training is allowed (`outer_variants`)

    @property
    def is_auto(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    def __str__(self) -> str:
        """The spec string that gives this spec, keys fixed only (`tp=8,pp=4`; `auto` when none is):
        what messages quote, rather than the dataclass's repr."""
        given = [(key, getattr(self, key)) for key in _KEYS if getattr(self, key) is not None]
        return ",".join(f"{key}={value:g}" if key == "capacity" else f"{key}={value}" for key, value in given) or "auto"

    def admits(self, config: ParallelConfig) -> bool:
        for key in _KEYS:
            if key == "capacity":
                if self.capacity != config.capacity_factor:
                    return False
                continue
            want = getattr(self, key)
            have = getattr(config, key)
            if key == "cp_method" and config.cp == 1:
                continue  # read only where cp > 1
            if key in ("sites", "outer_steps"):
                continue  # chosen after the mesh, against the cluster (`site_variants`, `outer_variants`)
            if want is not None and (int(have) if key in _FLAG_KEYS else have) != want:
                return False
        return True


def parse_plan_spec(text: str) -> PlanSpec:
    """`tp=2,dp=2,sp=1` -> PlanSpec; `auto` or "" -> all searched. One clear error per mistake."""
    text = text.strip()
    if text in ("", "auto"):
        return PlanSpec()
    values: dict[str, object] = {}
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or key not in _KEYS:
            raise PlanSpecError(f"plan spec {text!r}: bad item {part.strip()!r}; expected key=value with keys "
                                f"{', '.join(_KEYS)} (or 'auto')")
        if key in values:
            raise PlanSpecError(f"plan spec {text!r}: {key} given twice")
        if raw == "auto" or (key == "capacity" and raw == "none"):
            continue
        if key == "capacity":
            values[key] = _capacity(text, raw)
        elif key == "zero":
            if raw not in tuple(map(str, ZERO_LEVELS)):
                raise PlanSpecError(f"plan spec {text!r}: zero must be 0, 1, 2 or 3 (0 replicated optimizer, 1 "
                                    f"optimizer state sharded over DP, 2 and gradients, 3 and parameters), "
                                    f"got {raw!r}")
            values[key] = int(raw)
        elif key == "outer_steps":
            if not raw.isdigit():
                raise PlanSpecError(f"plan spec {text!r}: outer_steps must be a whole number of inner steps per "
                                    f"outer step (0: synchronous), got {raw!r}")
            values[key] = int(raw)
        elif key in _FLAG_KEYS:
            if raw not in ("0", "1"):
                raise PlanSpecError(f"plan spec {text!r}: {key} must be 0 or 1, got {raw!r}")
            values[key] = int(raw)
        elif key in _INT_KEYS:
            if not raw.isdigit() or int(raw) < 1:
                raise PlanSpecError(f"plan spec {text!r}: {key} must be a positive integer, got {raw!r}")
            values[key] = int(raw)
        else:
            choices = {"recompute": RECOMPUTE_MODES, "cp_method": CP_METHODS}.get(key, SCHEDULES)
            if raw not in choices:
                raise PlanSpecError(f"plan spec {text!r}: {key} must be one of {', '.join(choices)}, got {raw!r}")
            values[key] = raw
    if values.get("keep_weights") == 1 and values.get("zero", 3) != 3:
        raise PlanSpecError(f"plan spec {text!r}: keep_weights=1 keeps zero=3's gathered weights through the step; "
                            f"it needs zero=3, got zero={values['zero']}")
    if values.get("outer_steps") and values.get("sites") == 1:
        raise PlanSpecError(f"plan spec {text!r}: outer_steps={values['outer_steps']} averages over sites; it needs "
                            f"sites > 1, got sites=1")
    return PlanSpec(**values)  # type: ignore[arg-type]


def carving_refusal(ep: int, dp: int, cp: int) -> str | None:
    """Why `ep` cannot be carved from the dp x cp replicas (one line, without the plan's name), or
    None: an ep group is any `ep` consecutive replicas (`MeshShape`'s replica coordinate
    `cp_rank + cp * dp_rank`), so ep must divide dp * cp, not dp alone (dp=1, cp=4, ep=2 runs)."""
    replicas = dp * cp
    if not replicas % ep:
        return None
    if cp == 1:
        return f"ep={ep} does not divide the dp={dp} data-parallel ranks it is carved from ({dp} % {ep} = {dp % ep})"
    return (f"ep={ep} divides neither dp={dp} nor the dp x cp = {dp} x {cp} = {replicas} replicas its groups are "
            f"carved from ({replicas} % {ep} = {replicas % ep})")


def outer_refusal(config: ParallelConfig) -> str | None:
    """Why `config` cannot run its outer loop (one line), or None: it needs sites to average over,
    whole parameters (zero=0) and no expert parallelism (experts' replicas span sites flat)."""
    if not config.outer_steps:
        return None
    if config.sites == 1:
        return f"outer_steps={config.outer_steps} averages over sites; it needs sites > 1, got sites=1"
    if config.zero:
        return (f"outer_steps={config.outer_steps} runs with zero=0 only (the outer step reads and writes whole "
                f"parameters), got zero={config.zero}")
    if config.ep > 1:
        return (f"outer_steps={config.outer_steps} runs with ep=1 only (experts' replicas span sites flat), "
                f"got ep={config.ep}")
    return None


def outer_variants(config: ParallelConfig, spec: PlanSpec, inexact_ok: bool) -> list[ParallelConfig]:
    """`config` at each outer-loop period the search tries: the spec's, else synchronous (0) and,
    where the user allows inexact training, each of `OUTER_STEPS_SEARCHED` that can run there
    (`outer_refusal`)."""
    wanted = (spec.outer_steps,) if spec.outer_steps is not None else \
        (0, *OUTER_STEPS_SEARCHED) if inexact_ok else (0,)
    variants = [config if h == config.outer_steps else replace(config, outer_steps=h) for h in wanted]
    return [v for v in variants if outer_refusal(v) is None]


def _capacity(text: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise PlanSpecError(f"plan spec {text!r}: capacity must be a number > 0 (the experts' capacity factor; "
                            f"'none' for dropless routing), got {raw!r}")
    return value


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLimits:
    """What the model allows each degree to be (from the captured graph)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int  # 0 for dense models
    seq_len: int
    # `passes/split_context` can make the loss exact over cp ranks (`context_pricing.splits_loss`):
    # a token-mean cross-entropy, alone or beside terms of token means (an MoE load-balancing loss,
    # `ir.token_statistics`); any other loss is refused there, so the search keeps cp=1 for it
    splits_loss: bool = True
    # an MoE layer keeps a capacity of its own: it counts a micro-batch's tokens, which cp would
    # split over its ranks (each counting only its own), so the search keeps cp=1 for it
    capacity_limited: bool = False


def enumerate_configs(*, world_size: int, gpus_per_node: int, global_batch: int, limits: ModelLimits,
                      spec: PlanSpec, allow_cross_node_tp: bool = False,
                      max_mbs: int = 8, zero_levels: tuple[int, ...] = ZERO_LEVELS,
                      runtime: str = DEFAULT_RUNTIME) -> Iterator[ParallelConfig]:
    """Every config the spec admits: dp*tp*pp*cp == world, tp | heads, pp <= layers, mbs | batch share,
    zero among `zero_levels` as `runtime` runs them (`zero_variants`), cp among `context_degrees`
    with every method `context_methods` allows, but none that `replicated_context` prices no better
    than data parallelism."""
    for cp in context_degrees(world_size, limits, spec):
        yield from _meshes(world_size // cp, cp, gpus_per_node, global_batch, limits, spec, allow_cross_node_tp,
                           max_mbs, zero_levels, runtime)


MIN_CONTEXT_CHUNK = 128
"""The fewest tokens of one head-tail chunk a searched cp degree leaves (a rank holds two): the
query and key tile of the flash attention kernels the planner prices every SDPA as (FlashAttention-2
and -3 tile both by 128 rows on H100), below which a chunk fills a tile partly and the attention's
seconds stop scaling with its tokens. Above it the search lets the pricing decide; a spec's cp is
taken as given."""


def context_degrees(world_size: int, limits: ModelLimits, spec: PlanSpec) -> list[int]:
    """The cp degrees a search tries: the spec's, else 1 and every degree that divides the world,
    splits each sequence into 2 cp head-tail chunks and leaves each chunk `MIN_CONTEXT_CHUNK`
    tokens or more. The search prices them in the order of a lower bound on their step and skips
    those a fitting plan beats (`search.Planner._context_bound`). MoE models too where cp can make
    their loss exact, a load-balancing loss included (`ModelLimits.splits_loss`), and no capacity
    counts their tokens: a cp rank routes its own tokens, to every expert at ep=1, over an ep group
    carved from the dp x cp replicas at ep > 1 (tests/test_cp_moe.py, tests/test_cp_router_loss.py,
    tests/test_cp_ep.py)."""
    if spec.cp is not None:
        return [spec.cp] if world_size % spec.cp == 0 else []
    if limits.num_experts and (not limits.splits_loss or limits.capacity_limited or spec.capacity is not None):
        return [1]  # a capacity counts the whole micro-batch's tokens (`resolve.check_experts` refuses cp with it)
    return [1] + [cp for cp in divisors(world_size)[1:]
                  if limits.seq_len % (2 * cp) == 0 and limits.seq_len // (2 * cp) >= MIN_CONTEXT_CHUNK]


def replicated_context(cp: int, mbs: int, spec: PlanSpec) -> bool:
    """Whether a searched cp > 1 at `mbs` sequences a micro-batch is data parallelism with an
    exchange added: where cp divides mbs each rank holds mbs / cp sequences' tokens, as a rank of
    the same mesh with dp * cp replicas at mbs / cp whole sequences does (the same GEMM rows,
    attention pairs, activations and micro-batches a step, `context_pricing.whole_batch`), plus
    the K/V exchange, so that config is never slower and holds no more. Skipped unless the spec
    fixes cp, dp or mbs (the config without cp may then be outside it)."""
    return cp > 1 and mbs % cp == 0 and spec.cp is None and spec.dp is None and spec.mbs is None


def context_methods(tp: int, cp: int, limits: ModelLimits, spec: PlanSpec) -> tuple[str, ...]:
    """How attention may exchange the sequence at this tp and cp: the spec's method, else every one
    the runtime runs here (all_to_all splits each tp rank's query heads over cp)."""
    if cp == 1:
        return ("all_gather",)
    local_heads = limits.num_heads // tp
    return tuple(m for m in ((spec.cp_method,) if spec.cp_method else CP_METHODS)
                 if m != "all_to_all" or local_heads % cp == 0)


def _meshes(world_size: int, cp: int, gpus_per_node: int, global_batch: int, limits: ModelLimits, spec: PlanSpec,
            allow_cross_node_tp: bool, max_mbs: int, zero_levels: tuple[int, ...],
            runtime: str) -> Iterator[ParallelConfig]:
    """`enumerate_configs` at one cp degree; `world_size`: the ranks left for dp * tp * pp."""
    for tp in divisors(world_size):
        if not allow_cross_node_tp and (tp > gpus_per_node or gpus_per_node % tp):
            continue  # a TP group must sit inside one node (and not straddle two)
        if limits.num_heads % tp:
            continue
        for pp in divisors(world_size // tp):
            if pp > max(1, limits.num_layers):  # a model without repeated blocks is one stage
                continue
            dp = world_size // (tp * pp)
            if global_batch % dp:
                continue
            # ep groups are carved from the dp x cp replicas (`MeshShape`), as the runtime carves them
            # (`Planner.evaluate` prices a cp rank as one of those replicas, its experts at its tokens):
            # dp=1 with cp > 1 still shards experts (a long-context MoE on one node)
            for ep in divisors(dp * cp) if limits.num_experts else [1]:
                if limits.num_experts and limits.num_experts % ep:
                    continue
                # every micro-batch that divides the replica's share, not only powers of two: a
                # share of 6 (6 sequences on one replica, 12 on two) splits in 3s too
                for mbs in divisors(global_batch // dp):
                    if mbs > max_mbs or replicated_context(cp, mbs, spec):
                        continue
                    m = global_batch // (dp * mbs)
                    for method in context_methods(tp, cp, limits, spec):
                        yield from _variants(ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, cp_method=method,
                                                            mbs=mbs, num_micro_batches=m),
                                             limits, spec, zero_levels, runtime)


def zero_variants(base: ParallelConfig, levels: tuple[int, ...], runtime: str = DEFAULT_RUNTIME, *,
                  dominated: bool = False, asked: int | None = None) -> list[tuple[int, bool]]:
    """(zero, keep_weights) pairs a config tries: every level of `levels` where dp > 1 (at dp = 1
    there is nothing to shard over, so only a spec that `asked` for a level gets it there: its
    runtime still runs the master shard and zero=3's unit gathers, over one rank); zero=3 under a pipeline as `runtime` runs it, keeping its
    weights where it always does (`ZERO3_KEEPS_UNDER_PIPELINES`), else both ways, but keeping them
    only where zero=2 is not searched or `dominated` asks for it too: keeping them costs zero=2's
    reduce-scatters and a gather of the stage once a step (zero=2 gathers once too, after the
    step) for zero=2's memory plus the parameter shard (`planner/evaluate.py`), so zero=2 is that
    plan, no slower and never larger. (The search prices it beside its plan for `explain`.)"""
    if base.dp == 1:
        level = asked or 0
        return [(level, False)] if level in levels else []
    pairs = [(zero, False) for zero in levels if zero < 3]
    if 3 in levels:
        if base.pp > 1 and ZERO3_KEEPS_UNDER_PIPELINES[runtime]:
            pairs.append((3, True))
        else:
            pairs.append((3, False))
            if base.pp > 1 and (2 not in levels or dominated):
                pairs.append((3, True))
    return pairs


def _variants(base: ParallelConfig, limits: ModelLimits, spec: PlanSpec,
              zero_levels: tuple[int, ...] = ZERO_LEVELS, runtime: str = DEFAULT_RUNTIME) -> Iterator[ParallelConfig]:
    schedules: list[tuple[str, int]] = [("1f1b", 1)]
    if base.pp > 1:
        if spec.schedule == "gpipe":  # same time as 1F1B, more memory: only when asked for
            schedules.append(("gpipe", 1))
        # a smaller bubble than 1F1B's for up to pp micro-batches in flight on every rank, not pp - r
        schedules.append(("zb-h1", 1))
        for vpp in (2, 3, 4, 6, 8):
            if limits.num_layers % (base.pp * vpp) == 0 and base.num_micro_batches % base.pp == 0:
                schedules.append(("interleaved", vpp))
    admits_all = spec.is_auto  # an auto spec admits every config made here (capacity_factor: its None)
    for schedule, vpp in schedules:
        for sp in ((False, True) if base.tp > 1 else (False,)):
            for zero, keep in zero_variants(base, zero_levels, runtime, asked=spec.zero):
                for recompute in RECOMPUTE_MODES:
                    config = replace(base, schedule=schedule, vpp=vpp, sp=sp, zero=zero, keep_weights=keep,
                                     recompute=recompute, capacity_factor=spec.capacity)
                    if admits_all or spec.admits(config):
                        yield config


def site_variants(config: ParallelConfig, cluster_sites: int, spec: PlanSpec) -> list[ParallelConfig]:
    """`config` at each site layout a cluster of `cluster_sites` sites admits and `spec` allows:
    hierarchical (`sites = cluster_sites`, where they divide dp and leave ep inside a site) and flat
    (`sites = 1`, where no TP, CP, EP or PP group would cross a site, `MeshShape.check_sites`).
    One site: `config` alone."""
    if cluster_sites == 1:
        return [config] if spec.sites in (None, 1) else []
    wanted = (cluster_sites, 1) if spec.sites is None else (spec.sites,)
    variants = []
    for sites in wanted:
        try:
            variant = replace(config, sites=sites)
            variant.mesh.check_sites(cluster_sites)
        except ValueError:
            continue
        variants.append(variant)
    return variants
