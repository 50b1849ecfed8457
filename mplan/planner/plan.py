"""The Plan: the only thing that passes from planning to execution, and its JSON (version 1).

A `Plan` records the mesh, the schedule, micro-batching, recomputation, optimizer sharding, the
stages with their layers, every parameter's placement on each mesh axis, the TP strategy of every
op, the predicted figures and the best rejected alternatives. `model.graph_hash` and `cluster`
let a rank refuse a plan made for another model or world size.

`ops` maps a segment key (a block type, whose entry serves every instance, or a glue segment:
"prologue", "glue.N", "epilogue") to {node key: strategy text} (`OpNode.key`, `ir/strategy.py`).
A Plan the resolver (`planner/resolve.py`) hands to the runtime has an entry for every node of
the graph the runtime executes; `op_strategies` reads them back, and is all the runtime knows of
sharding: it never solves, searches or consults the op registry.

`op_costs` (optional) is keyed like `ops` and holds what the sharding ILP priced each op at under
its chosen strategy (`OpCost`), for `mplan explain`'s per-op table; the runtime never reads it.

`zero` is 0-3 (`parallel_config.ZERO_LEVELS`); `zero3_keep_weights` (optional, False; True only
with zero=3) tells the runtime to keep each unit's gathered weights from its first forward to its
last backward of the step (one all-gather per step) instead of gathering them before every forward
and backward. `zero_levels` (optional) records, for `explain`, the plan's layout priced at every
other ZeRO level the search could choose and the search's best plan at each (`ZeroLevel`).

`outer_steps` (optional; absent or 0: synchronous) is the outer loop across sites of an inexact
plan (`parallel_config.outer_refusal`, `runtime/outer_loop.py`): each site reduces its gradients
inside itself for H steps, then one outer step averages the sites' parameters. Valid only with
mesh.sites > 1, zero=0 and ep=1; written only where it is set, so plans without it read as before.

JSON is validated field by field on load (`PlanError` names the field); nothing is unpickled.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from mplan.json_fields import FieldReader, is_finite_number, load_json_file
from mplan.cost_models.memory_model import RECOMPUTE_MODES, ZERO_LEVELS
from mplan.ir.graph import Graph
from mplan.ir.mesh import MeshShape
from mplan.ir.schedule import SCHEDULES
from mplan.ir.strategy import Strategy, StrategyParseError, parse_strategy
from mplan.planner.parallel_config import (CP_METHODS, DEFAULT_RUNTIME, RUNTIMES, ParallelConfig,
                                           carving_refusal, outer_refusal)

LEGACY_RUNTIME = "megatron"
"""A Plan file without a `runtime` field was written before plans recorded it, when `mplan plan`
priced Megatron-LM's runtime."""

PLAN_VERSION = 1
TP_LAYOUTS = ("ilp", "megatron")
"""`ilp`: the sharding ILP's cheapest valid mix on the plan's cluster; `megatron`: Megatron-LM's
layout (columns, rows, heads, vocabulary), as a hand-written Megatron plan has it."""


SEQ_LEN_SOURCES = ("--seq-len", "model preset", "model spec seq=", "config max_position_embeddings",
                   "config n_positions", "config n_ctx", "config seq_length", "factory config", "example inputs")
"""Where a plan's sequence length came from (`model.seq_len_source`): given (`--seq-len`, or
`seq_len=` in Python), a preset, a family spec's `seq=`, the Hugging Face config field that states
it, a model factory's config, or the example inputs of a module (`autoparallel`, `mplan.plan(module)`)."""


class PlanError(ValueError):
    """A plan file that is malformed, or that does not match the model or cluster at hand."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    stage: int  # pipeline rank
    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    transient_gib: float
    total_gib: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Predicted:
    step_time_s: float
    tflops_per_gpu: float  # model FLOPs (no recomputation), as Megatron counts them
    mfu: float
    tokens_per_s: float
    bubble_fraction: float
    memory_gib: float  # peak per GPU: the largest stage
    memory_by_stage: tuple[StageMemory, ...]
    compute_s: float
    comm_s: float
    p2p_s: float = 0.0  # one micro-batch's activations across a stage border
    optimizer_s: float = 0.0
    # MoE models (optional in the file; 0.0 for dense ones): the experts' all-to-all over one step on
    # the busiest pipeline rank (seconds), the experts of a layer each rank holds, and the busiest
    # expert-parallel rank's load over the mean that the prediction assumed
    a2a_s: float = 0.0
    experts_per_rank: int = 0
    moe_imbalance: float = 0.0
    # zero 2/3 (optional, 0.0): seconds per step their per-unit all-gathers and reduce-scatters add
    # to the busiest pipeline rank's forward and backward (not overlapped with compute)
    zero_comm_s: float = 0.0
    # the DP gradient sync's traffic per link over one step (optional; None: not recorded)
    dp_links: LinkTraffic | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkTraffic:
    """What one step's data-parallel collectives move over each link (`planner.dp_sync.LinkUse`):
    GB (1e9 bytes) one rank pushes over NVLink and through its NIC, GB one site sends over the
    long-haul link in each direction (all its ranks), and each level's transfer seconds."""

    intra_node_gb: float
    inter_node_gb: float
    inter_site_gb: float
    intra_node_s: float
    inter_node_s: float
    inter_site_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    name: str
    num_parameters: int
    num_layers: int
    seq_len: int
    graph_hash: str  # structural hash of the captured model (graph_hash.py)
    # where seq_len came from (SEQ_LEN_SOURCES); optional in the file (plans written before it: None)
    seq_len_source: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterInfo:
    name: str
    nodes: int
    gpus_per_node: int
    world_size: int
    device: str
    # where the prices came from (`ClusterSpec.figures`): "measured", "datasheet" or "nominal"
    # (placeholders: every prediction shown from them says so); "unrecorded" in plans made before
    figures: str = "unrecorded"
    # data centers the nodes are split among and their long-haul link (optional: one site)
    sites: int = 1
    inter_site_gbps: float = 0.0  # Gb/s per direction, a site's whole share
    inter_site_latency_ms: float = 0.0  # one way


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    dp: int
    tp: int
    pp: int
    ep: int
    vpp: int
    # context parallelism: each rank holds 1/cp of every sequence; optional in the file (absent: 1)
    cp: int = 1
    # how attention exchanges the sequence over cp (parallel_config.CP_METHODS); optional (absent: all_gather)
    cp_method: str = "all_gather"
    # sites data parallelism spans hierarchically, dp's outermost factor (`ir/mesh.py`); optional (absent: 1, flat)
    sites: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    index: int  # global stage (virtual stage v on rank r is v * pp + r)
    rank: int  # pipeline rank that runs it
    units: tuple[str, ...]  # segments in order: "prologue", "layers.0", ..., "epilogue"
    forward_ms: float  # one micro-batch
    backward_ms: float
    grad_sync_ms: float = 0.0  # this stage's share of its rank's DP gradient sync
    # the weight-gradient (W) part of backward_ms, which zero-bubble schedules run apart from the
    # input gradient (I); optional in the file (plans written before it: 0.0, backward unsplit)
    weight_ms: float = 0.0

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(u for u in self.units if u not in ("prologue", "epilogue") and not u.startswith("glue"))


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCost:
    """What the planner's sharding ILP charged one op under its chosen strategy, in forward +
    backward milliseconds of one instance and one micro-batch (`sharding_ilp.OpPrice`): its
    compute on local shapes, its own collectives (with its share of the TP all-reduce of partial
    parameter gradients) and the resharding copies of its inputs charged to it. The ops of a segment
    add up to that segment's priced time (a unit's forward + backward before recomputation)."""

    compute_ms: float
    comm_ms: float
    reshard_ms: float

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms + self.reshard_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroLevel:
    """One ZeRO level beside the plan's (the plan's own level included), for `explain`: the plan's
    layout priced at that level, and the search's fastest plan at that level that fits."""

    zero: int
    keep_weights: bool  # zero=3 keeping its gathered weights through the step
    spec: str  # the plan's layout at this level
    fits: bool
    step_time_s: float  # of the layout at this level (priced even where it does not fit)
    memory_gib: float  # its peak per GPU
    zero_comm_s: float  # its zero 2/3 collectives per step (`Predicted.zero_comm_s`)
    # the search's fastest fitting plan at this level (a level above 1 is searched only where the
    # level below does not fit); None where it found none
    best_spec: str | None = None
    best_step_time_s: float | None = None
    nothing_fits_below: bool = False  # no plan of the search fits at a lower level


@dataclass(frozen=True, slots=True, kw_only=True)
class Alternative:
    spec: str
    predicted: Predicted | None  # None when it does not fit
    why: str  # why it lost: slower by X ms, or needs Y GiB


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    model: ModelInfo
    cluster: ClusterInfo
    mesh: Mesh
    sequence_parallel: bool
    zero: int
    micro_batch_size: int
    num_micro_batches: int
    global_batch: int
    schedule: str
    recompute: str
    stages: tuple[Stage, ...]
    sharding: dict[str, dict[str, str]] = field(hash=False)  # parameter -> {axis: placement}
    ops: dict[str, dict[str, str]] = field(hash=False)  # segment key -> {node key: strategy} (module doc)
    predicted: Predicted
    alternatives: tuple[Alternative, ...] = ()
    planner: dict[str, float] = field(default_factory=dict, hash=False)  # seconds, candidates, ...
    fp8: bool = False  # the blocks' linears run as FP8 GEMMs (optional in the file; absent = False)
    tp_layout: str = "ilp"  # how the op strategies were chosen: TP_LAYOUTS (optional in the file)
    runtime: str = DEFAULT_RUNTIME  # whose runtime the memory and overlap are priced for: RUNTIMES (optional)
    # the experts' capacity factor the plan sets for every MoE layer (optional; None: each layer
    # keeps its model's own, dropless unless the model drops)
    capacity_factor: float | None = None
    # rows per chunk of the fused head + loss (optional; None: the op's default). The planner sets
    # it only where the default chunk of logits is all that keeps the last stage over memory.
    head_loss_chunk_rows: int | None = None
    # segment key -> {node key: what the ILP priced it at} (module doc); optional in the file (absent: {})
    op_costs: dict[str, dict[str, OpCost]] = field(default_factory=dict, hash=False)
    # zero=3 only: the gathered weights kept through the step (module doc); optional (absent: False)
    zero3_keep_weights: bool = False
    zero_levels: tuple[ZeroLevel, ...] = ()  # optional (absent: none recorded)
    # inner steps per outer step of the outer loop across sites (module doc); optional (absent: 0, synchronous)
    outer_steps: int = 0
    version: int = PLAN_VERSION

    @property
    def inexact(self) -> bool:
        """Whether this plan changes the single-device loop's arithmetic (an outer loop across sites)."""
        return self.outer_steps > 0

    def outer_refusal(self) -> str | None:
        """Why this plan's outer loop cannot run (`parallel_config.outer_refusal`), or None."""
        m = self.mesh
        return outer_refusal(ParallelConfig(dp=m.dp, tp=m.tp, pp=m.pp, ep=m.ep, sites=m.sites, zero=self.zero,
                                            outer_steps=self.outer_steps))

    def spec(self) -> str:
        """The manual spec string that asks for exactly this plan."""
        m = self.mesh
        return (f"dp={m.dp},tp={m.tp},pp={m.pp},vpp={m.vpp},ep={m.ep},mbs={self.micro_batch_size},"
                f"sp={int(self.sequence_parallel)},zero={self.zero},recompute={self.recompute},"
                f"schedule={self.schedule}"
                + (f",cp={m.cp}" if m.cp > 1 else "")
                + (f",cp_method={m.cp_method}" if m.cp > 1 and m.cp_method != "all_gather" else "")
                + (",keep_weights=1" if self.zero3_keep_weights else "")
                + (f",capacity={self.capacity_factor:g}" if self.capacity_factor is not None else "")
                + (f",sites={m.sites}" if m.sites > 1 else "")
                + (f",outer_steps={self.outer_steps}" if self.outer_steps else ""))

    def mesh_shape(self) -> MeshShape:
        """The rank layout of this plan's mesh (ep and vpp do not add ranks)."""
        m = self.mesh
        return MeshShape(dp=m.dp, tp=m.tp, pp=m.pp, ep=m.ep, cp=m.cp, sites=m.sites)

    def describe(self) -> str:
        """The layout in one line, for messages: the spec and the micro-batching."""
        return f"{self.spec()},micro_batches={self.num_micro_batches}"

    def op_strategies(self, graph: Graph) -> dict[str, Strategy]:
        """The strategy of every node of `graph`, read from `ops` by its stable key; a node the
        plan has no entry for is a PlanError (the resolver binds a Plan to the graph first)."""
        choice: dict[str, Strategy] = {}
        missing: list[str] = []
        parsed: dict[str, Strategy] = {}
        for node in graph.nodes:
            segment, key = graph.plan_key(node.name)
            text = self.ops.get(segment, {}).get(key)
            if text is None:
                missing.append(f"{segment}/{key}")
                continue
            if text not in parsed:
                try:
                    parsed[text] = parse_strategy(text)
                except StrategyParseError as exc:
                    raise PlanError(f"plan ops[{segment}][{key}]: {exc}") from None
            choice[node.name] = parsed[text]
        if missing:
            raise PlanError(f"the plan has no strategy for {len(missing)} ops of this graph ({', '.join(missing[:4])}"
                            f"{', ...' if len(missing) > 4 else ''}): resolve it against this model first "
                            f"(mplan.planner.resolve.resolve_plan)")
        return choice

    def to_dict(self) -> dict[str, Any]:
        """The Plan as JSON data (objects, arrays as lists, strings, numbers, booleans, null), which
        `from_dict` reads back to an equal Plan; `op_costs` is left out when there are none."""
        doc = asdict(self)
        doc["stages"] = [{**asdict(s), "layers": list(s.layers)} for s in self.stages]
        if not self.op_costs:
            del doc["op_costs"]
        if not self.zero_levels:
            del doc["zero_levels"]
        if not self.outer_steps:
            del doc["outer_steps"]
        return _json_data({"version": doc.pop("version"), **doc})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> Plan:
        return cls.from_dict(load_json_file(path, PlanError), file=path)

    @classmethod
    def from_dict(cls, obj: Any, *, file: str = "<plan>") -> Plan:
        r = FieldReader(obj, file=file, path="", error=PlanError)
        version = r.integer("version")
        if version != PLAN_VERSION:
            raise PlanError(f"{file}: version {version} is not supported (this mplan reads version {PLAN_VERSION})")
        plan = cls(model=_model(r.obj("model")), cluster=_cluster(r.obj("cluster")), mesh=_mesh(r.obj("mesh")),
                   sequence_parallel=r.boolean("sequence_parallel"), zero=_choice(r, "zero", ZERO_LEVELS),
                   micro_batch_size=r.integer("micro_batch_size"), num_micro_batches=r.integer("num_micro_batches"),
                   global_batch=r.integer("global_batch"),
                   schedule=r.string("schedule", choices=SCHEDULES),
                   recompute=r.string("recompute", choices=RECOMPUTE_MODES),
                   stages=tuple(_stage(s) for s in r.objects("stages")),
                   sharding=_string_table(r, "sharding"), ops=_op_table(r, "ops"),
                   predicted=_predicted(r.obj("predicted")),
                   alternatives=tuple(_alternative(a) for a in r.objects("alternatives")),
                   planner=_numbers(r, "planner"), fp8=r.boolean("fp8") if r.has("fp8") else False,
                   tp_layout=r.string("tp_layout", choices=TP_LAYOUTS) if r.has("tp_layout") else "ilp",
                   runtime=r.string("runtime", choices=RUNTIMES) if r.has("runtime") else LEGACY_RUNTIME,
                   capacity_factor=_capacity(r), head_loss_chunk_rows=_head_loss_chunk_rows(r),
                   op_costs=_op_costs(r, "op_costs"),
                   zero3_keep_weights=r.boolean("zero3_keep_weights") if r.has("zero3_keep_weights") else False,
                   zero_levels=tuple(_zero_level(z) for z in r.objects("zero_levels")) if r.has("zero_levels")
                   else (), outer_steps=_outer_steps(r), version=version)
        r.finish()
        _check_consistent(plan, file)
        return plan

    def check_runs_on(self, *, world_size: int, graph_hash: str | None = None) -> None:
        """Refuse a plan made for another world size or another model, before any collective."""
        if self.cluster.world_size != world_size:
            raise PlanError(f"plan was made for {self.cluster.world_size} ranks "
                            f"(dp*tp*pp*cp = {self.mesh.dp}*{self.mesh.tp}*{self.mesh.pp}*{self.mesh.cp}) but this job has "
                            f"{world_size}; re-plan with `mplan plan` for this cluster")
        if graph_hash is not None and graph_hash != self.model.graph_hash:
            raise PlanError(f"plan was made for another model ({self.model.name}, graph hash "
                            f"{self.model.graph_hash[:12]}); this model's graph hash is {graph_hash[:12]}: "
                            f"the plan is stale, re-plan it")


def _json_data(value: Any) -> Any:
    """`asdict`'s output in the JSON data model: its tuples as lists, as `json.loads` would give them
    (the readers take arrays as lists only)."""
    if isinstance(value, dict):
        return {k: _json_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_data(v) for v in value]
    return value


def _choice(r: FieldReader, key: str, choices: tuple[int, ...]) -> int:
    value = r.integer(key, minimum=0)
    if value not in choices:
        raise r.error(key, f"must be one of {choices}")
    return value


def _capacity(r: FieldReader) -> float | None:
    if not r.has("capacity_factor") or r.raw("capacity_factor") is None:
        return None
    return r.number("capacity_factor")


def _outer_steps(r: FieldReader) -> int:
    """Inner steps per outer step; absent: 0 (synchronous, as every plan written before the key)."""
    return r.integer("outer_steps", minimum=0) if r.has("outer_steps") else 0


def _head_loss_chunk_rows(r: FieldReader) -> int | None:
    if not r.has("head_loss_chunk_rows") or r.raw("head_loss_chunk_rows") is None:
        return None
    return r.integer("head_loss_chunk_rows")


def _model(r: FieldReader) -> ModelInfo:
    info = ModelInfo(name=r.string("name"), num_parameters=r.integer("num_parameters"),
                     num_layers=r.integer("num_layers", minimum=0), seq_len=r.integer("seq_len"),
                     graph_hash=r.string("graph_hash"), seq_len_source=_seq_len_source(r))
    r.finish()
    return info


def _seq_len_source(r: FieldReader) -> str | None:
    if not r.has("seq_len_source") or r.raw("seq_len_source") is None:
        return None
    return r.string("seq_len_source", choices=SEQ_LEN_SOURCES)


def _cluster(r: FieldReader) -> ClusterInfo:
    info = ClusterInfo(name=r.string("name"), nodes=r.integer("nodes"), gpus_per_node=r.integer("gpus_per_node"),
                       world_size=r.integer("world_size"), device=r.string("device"),
                       figures=r.string("figures") if r.has("figures") else "unrecorded",
                       sites=r.integer("sites") if r.has("sites") else 1,
                       inter_site_gbps=r.number("inter_site_gbps", allow_equal=True) if r.has("inter_site_gbps") else 0.0,
                       inter_site_latency_ms=r.number("inter_site_latency_ms", allow_equal=True)
                       if r.has("inter_site_latency_ms") else 0.0)
    if info.nodes % info.sites:
        raise r.error("sites", f"must divide nodes = {info.nodes} (each site holds as many)")
    r.finish()
    return info


def _mesh(r: FieldReader) -> Mesh:
    mesh = Mesh(dp=r.integer("dp"), tp=r.integer("tp"), pp=r.integer("pp"), ep=r.integer("ep"), vpp=r.integer("vpp"),
                cp=r.integer("cp") if r.has("cp") else 1,
                cp_method=r.string("cp_method", choices=CP_METHODS) if r.has("cp_method") else "all_gather",
                sites=r.integer("sites") if r.has("sites") else 1)
    if mesh.dp % mesh.sites:
        raise r.error("sites", f"must divide dp = {mesh.dp} (data parallelism is what spans sites)")
    r.finish()
    return mesh


def _stage(r: FieldReader) -> Stage:
    units = r.raw("units")
    if not isinstance(units, list) or not all(isinstance(u, str) for u in units):
        raise r.error("units", "must be a list of segment names")
    r.raw("layers")  # derived from units; read so that finish() accepts it
    stage = Stage(index=r.integer("index", minimum=0), rank=r.integer("rank", minimum=0), units=tuple(units),
                  forward_ms=r.number("forward_ms", allow_equal=True), backward_ms=r.number("backward_ms", allow_equal=True),
                  grad_sync_ms=r.number("grad_sync_ms", allow_equal=True),
                  weight_ms=r.number("weight_ms", allow_equal=True) if r.has("weight_ms") else 0.0)
    if stage.weight_ms > stage.backward_ms:
        raise r.error("weight_ms", f"{stage.weight_ms} is more than backward_ms {stage.backward_ms}, which it is "
                                   f"part of")
    r.finish()
    return stage


def _stage_memory(r: FieldReader) -> StageMemory:
    keys = ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "transient_gib", "total_gib")
    memory = StageMemory(stage=r.integer("stage", minimum=0), **{k: r.number(k, allow_equal=True) for k in keys})
    r.finish()
    return memory


def _predicted(r: FieldReader) -> Predicted:
    keys = ("step_time_s", "tflops_per_gpu", "mfu", "tokens_per_s", "bubble_fraction", "memory_gib",
            "compute_s", "comm_s", "p2p_s", "optimizer_s")
    values = {k: r.number(k, allow_equal=True) for k in keys}
    values.update({k: r.number(k, allow_equal=True) for k in ("a2a_s", "moe_imbalance", "zero_comm_s") if r.has(k)})
    experts = r.integer("experts_per_rank", minimum=0) if r.has("experts_per_rank") else 0
    predicted = Predicted(memory_by_stage=tuple(_stage_memory(s) for s in r.objects("memory_by_stage")),
                          experts_per_rank=experts, dp_links=_link_traffic(r.obj("dp_links")) if r.has("dp_links")
                          else None, **values)
    r.finish()
    return predicted


def _link_traffic(r: FieldReader) -> LinkTraffic:
    traffic = LinkTraffic(**{f"{level}_{unit}": r.number(f"{level}_{unit}", allow_equal=True)
                             for level in ("intra_node", "inter_node", "inter_site") for unit in ("gb", "s")})
    r.finish()
    return traffic


def _zero_level(r: FieldReader) -> ZeroLevel:
    best = r.string("best_spec") if r.has("best_spec") else None
    level = ZeroLevel(zero=_choice(r, "zero", ZERO_LEVELS), keep_weights=r.boolean("keep_weights"),
                      spec=r.string("spec"), fits=r.boolean("fits"),
                      step_time_s=r.number("step_time_s", allow_equal=True),
                      memory_gib=r.number("memory_gib", allow_equal=True),
                      zero_comm_s=r.number("zero_comm_s", allow_equal=True), best_spec=best,
                      best_step_time_s=r.number("best_step_time_s", allow_equal=True)
                      if r.has("best_step_time_s") else None,
                      nothing_fits_below=r.boolean("nothing_fits_below") if r.has("nothing_fits_below") else False)
    if level.keep_weights and level.zero != 3:
        raise r.error("keep_weights", f"is true at zero={level.zero}: only zero=3 keeps gathered weights")
    r.finish()
    return level


def _alternative(r: FieldReader) -> Alternative:
    predicted = _predicted(r.obj("predicted")) if r.has("predicted") else None
    alt = Alternative(spec=r.string("spec"), predicted=predicted, why=r.string("why"))
    r.finish()
    return alt


def _string_table(r: FieldReader, key: str) -> dict[str, dict[str, str]]:
    value = r.raw(key)
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) and all(isinstance(a, str) and isinstance(p, str)
                                                              for a, p in v.items()) for k, v in value.items()):
        raise r.error(key, "must map names to {axis: placement} objects of strings")
    return value


def _op_table(r: FieldReader, key: str) -> dict[str, dict[str, str]]:
    value = r.raw(key)
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) and all(isinstance(n, str) and isinstance(s, str)
                                                              for n, s in v.items()) for k, v in value.items()):
        raise r.error(key, "must map segment keys to {node key: strategy} objects of strings (plans written "
                           "before 2026-12-01 listed strategies by position: re-plan)")
    for segment, entries in value.items():
        for node_key, text in entries.items():
            try:
                parse_strategy(text)
            except StrategyParseError as exc:
                raise r.error(key, f"[{segment}][{node_key}]: {exc}") from None
    return value


def _op_costs(r: FieldReader, key: str) -> dict[str, dict[str, OpCost]]:
    """The optional `op_costs` table: segment -> {node key: {compute_ms, comm_ms, reshard_ms}}."""
    if not r.has(key):
        return {}
    table = r.obj(key)
    costs: dict[str, dict[str, OpCost]] = {}
    for segment in r.raw(key):
        entries = table.obj(segment)
        costs[segment] = {node_key: _op_cost(entries.obj(node_key)) for node_key in table.raw(segment)}
        entries.finish()
    table.finish()
    return costs


def _op_cost(r: FieldReader) -> OpCost:
    cost = OpCost(**{k: r.number(k, allow_equal=True) for k in ("compute_ms", "comm_ms", "reshard_ms")})
    r.finish()
    return cost


def _numbers(r: FieldReader, key: str) -> dict[str, float]:
    value = r.raw(key) if r.has(key) else {}
    if not isinstance(value, dict) or not all(is_finite_number(v) for v in value.values()):
        raise r.error(key, "must map names to finite numbers")
    return value


def _check_consistent(plan: Plan, file: str) -> None:
    m = plan.mesh
    if m.dp * m.tp * m.pp * m.cp != plan.cluster.world_size:
        raise PlanError(f"{file}: mesh dp*tp*pp*cp = {m.dp}*{m.tp}*{m.pp}*{m.cp} = {m.dp * m.tp * m.pp * m.cp} does "
                        f"not equal cluster.world_size {plan.cluster.world_size}")
    if m.cp > 1 and plan.model.seq_len % (2 * m.cp):
        raise PlanError(f"{file}: mesh.cp={m.cp} needs model.seq_len divisible by 2*cp (head-tail chunks), got "
                        f"seq_len={plan.model.seq_len}")
    if plan.global_batch != m.dp * plan.micro_batch_size * plan.num_micro_batches:
        raise PlanError(f"{file}: global_batch {plan.global_batch} != dp*micro_batch_size*num_micro_batches = "
                        f"{m.dp}*{plan.micro_batch_size}*{plan.num_micro_batches}")
    if len(plan.stages) != m.pp * m.vpp:
        raise PlanError(f"{file}: stages has {len(plan.stages)} entries but pp*vpp = {m.pp * m.vpp}")
    carving = carving_refusal(m.ep, m.dp, m.cp)
    if carving:
        raise PlanError(f"{file}: mesh.{carving}")
    if m.sites > 1 and m.sites != plan.cluster.sites:
        raise PlanError(f"{file}: mesh.sites={m.sites} but cluster.sites={plan.cluster.sites}: a plan's sites are 1 "
                        f"(flat) or its cluster's")
    refused = plan.outer_refusal()
    if refused:
        raise PlanError(f"{file}: {refused}")
    if plan.zero3_keep_weights and plan.zero != 3:
        raise PlanError(f"{file}: zero3_keep_weights is true at zero={plan.zero}: only zero=3 gathers weights to keep")
    if m.ep > 1 and not any(placements.get("ep") == "S(0)" for placements in plan.sharding.values()):
        raise PlanError(f"{file}: mesh.ep={m.ep} but no parameter in sharding is split over ep (\"ep\": \"S(0)\")")
    for segment, entries in plan.op_costs.items():
        if segment not in plan.ops:
            raise PlanError(f"{file}: op_costs.{segment} is not a segment of ops: op_costs prices the ops that "
                            f"ops lists")
        unknown = [node_key for node_key in entries if node_key not in plan.ops[segment]]
        if unknown:
            raise PlanError(f"{file}: op_costs.{segment}.{unknown[0]} is not an op of ops.{segment}: op_costs "
                            f"prices the ops that ops lists")
