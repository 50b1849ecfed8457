"""The configuration of a training run (`mplan train CONFIG.toml [--set key=value ...]`).

Input: a TOML file and `--set section.key=value` overrides (the value read as a TOML value where it
parses as one, else as a string: `--set train.steps=100`, `--set plan.spec=tp=2,dp=2`). Output: a
frozen `TrainConfig` of one dataclass per section, every key typed and checked.

Why a schema of dataclasses: every key a user can write is a field here with its type, default and
meaning, so the file is validated like every mplan input (an unknown key, a wrong type or an
impossible value is one `ConfigError` line naming the file and `section.key`), and the defaults
are documented where they are defined. The sections follow torchtitan's job files: model, plan,
optimizer, schedule, train, data, checkpoint, metrics.
"""
from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A training configuration that cannot run: the message names the file and the key."""


@dataclass(frozen=True)
class ModelSection:
    spec: str = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=512,seq=128,vocab=4096"
    """Any model spec mplan accepts: a preset, a family with numbers, a Hugging Face config.json
    path, or package.module:factory. A family's `vocab` is replaced by the data's vocabulary."""
    dtype: str = "float32"
    """float32, float64 or bfloat16: the dtype the model is built and trained in."""
    init_from: str = ""
    """Weights to start from: a Hugging Face directory or an mplan checkpoint (empty: random init)."""


@dataclass(frozen=True)
class ClusterSection:
    name: str = "local"
    """`local` (torchrun's ranks as they are), a preset name, or a cluster.json path."""
    nodes: int = 1
    """Nodes of a preset cluster (a cluster.json says its own), all sites' together."""
    sites: int = 1
    """Data centers the preset's nodes are split among (a cluster.json says its own)."""
    inter_site_gbps: float = 0.0
    """The long-haul link between sites, Gb/s per direction (a site's whole share)."""
    inter_site_latency_ms: float = 0.0
    """Its one-way latency, milliseconds."""


@dataclass(frozen=True)
class PlanSection:
    spec: str = "auto"
    """`auto` (the planner searches), a plan spec string, or a plan.json path."""
    hang_timeout_s: float = 0.0
    """Seconds a rank may wait in one collective or transfer before the job reports where every
    rank is and stops (0: no watchdog)."""
    cuda_graphs: bool | None = None
    """Replay each step's forwards and backwards as one CUDA graph (`autoparallel(cuda_graphs=...)`):
    unset, wherever the plan allows it (one rank on CUDA); true, refused in one line elsewhere;
    false, never."""


@dataclass(frozen=True)
class OptimizerSection:
    name: str = "adamw"
    """adamw or sgd."""
    lr: float = 3e-4
    """The peak learning rate (the schedule scales it)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW's), or SGD's L2 term."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates."""
    eps: float = 1e-8
    """AdamW's denominator term."""
    momentum: float = 0.0
    """sgd only."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""


@dataclass(frozen=True)
class ScheduleSection:
    warmup_steps: int = 0
    """Linear warmup from lr/warmup_steps to lr."""
    decay: str = "cosine"
    """cosine, linear or constant, from the end of warmup to train.steps."""
    min_lr_ratio: float = 0.1
    """The decay ends at lr * min_lr_ratio."""


@dataclass(frozen=True)
class TrainSection:
    steps: int = 100
    """Optimizer steps of the whole run (what the schedule spans)."""
    global_batch: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    seq_len: int = 128
    """Tokens per sequence (the model's own is replaced for a family spec)."""
    seed: int = 0
    """The model's initial weights and the data's order."""
    log_every: int = 10
    """A progress line every this many steps (the first and the last always)."""
    stop_at: int = 0
    """End the job after this step (checkpointed), the schedule still planned for `steps`: how a
    job's time limit ends it before the run is over (0: run to `steps`)."""


@dataclass(frozen=True)
class DataSection:
    path: str = ""
    """Token shards written by `mplan data prepare` (required)."""
    document_mask: bool = False
    """No token attends across packed documents (each ends at its EOS); under cp each micro-batch is split so ranks get equal attention work."""
    packing: str = "stream"
    """stream: windows cut from the token stream wherever they end; cp_aligned: windows packed so
    their documents deal whole onto the plan's cp ranks with balanced work, which the runtime then
    runs at cp=1 with no K/V exchange where a micro-batch is one row (`mplan.data.cp_packing`; about
    1.5% padding, label -100; needs document_mask; a resume under another cp is refused: other windows)."""


@dataclass(frozen=True)
class CheckpointSection:
    dir: str = ""
    """Where checkpoints go (empty: none are saved). A run resumes from its newest one."""
    interval: int = 0
    """Save every this many steps (0: only at the end)."""
    keep_latest: int = 2
    """Checkpoints kept: the newest this many."""
    background: bool = False
    """Save asynchronously: training stalls only while the state is copied to CPU memory."""
    resume: bool = True
    """Resume from the newest checkpoint in `dir` when there is one."""
    export_hf: str = ""
    """At the end, also write a Hugging Face directory here (empty: none)."""


@dataclass(frozen=True)
class MetricsSection:
    jsonl: str = ""
    """One JSON object per step (step, loss, lr, tokens_per_s, step_time_s, ...); empty: none."""
    tensorboard: str = ""
    """A TensorBoard log directory (written when tensorboard is installed; else refused)."""
    plot: str = ""
    """A PNG of the loss curve, written at the end (empty: none)."""
    profile_steps: str = ""
    """`a:b`: a torch profiler trace of steps a to b-1, written next to the JSONL (empty: none)."""
    memory_snapshot: str = ""
    """A CUDA memory snapshot (pickle written by torch, for its memory viz) after the first
    step (empty: none; CUDA only)."""


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    plan: PlanSection = field(default_factory=PlanSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(self, f.name)).items()}
                for f in dataclasses.fields(self)}


def load_config(path: str, overrides: list[str] = ()) -> TrainConfig:
    """The validated configuration of `path` with `--set` `overrides` applied."""
    try:
        with open(path, "rb") as handle:
            doc = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set {item!r}: must be section.key=value, e.g. train.steps=100")
        doc.setdefault(section, {})
        if not isinstance(doc[section], dict):
            raise ConfigError(f"{path}: [{section}] must be a table")
        doc[section][name] = _toml_value(text)
    return from_dict(doc, file=path)


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def from_dict(doc: dict[str, Any], *, file: str = "<config>") -> TrainConfig:
    sections = {f.name: f for f in dataclasses.fields(TrainConfig)}
    made = {}
    for name, value in doc.items():
        if name not in sections:
            raise ConfigError(f"{file}: [{name}] is not a known section ({', '.join(sections)})")
        if not isinstance(value, dict):
            raise ConfigError(f"{file}: {name} must be a table ([{name}])")
        made[name] = _section(sections[name].default_factory, value, f"{file}: {name}")
    config = TrainConfig(**made)
    _check(config, file)
    return config


def _section(cls: type, values: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{where}.{key} is not a known key ({', '.join(sorted(known))})")
        out[key] = _typed(value, hints[key], f"{where}.{key}")
    return cls(**out)


def _typed(value: Any, hint: Any, where: str) -> Any:
    if isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint):  # `X | None`: TOML has no None
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where} must be a list of {len(args)} numbers, got {value!r}")
        return tuple(_typed(v, a, where) for v, a in zip(value, args))
    raise AssertionError(f"no reader for {hint}")


def _check(config: TrainConfig, file: str) -> None:
    """Values that are typed right but cannot run."""
    def need(ok: bool, key: str, what: str, value: Any) -> None:
        if not ok:
            raise ConfigError(f"{file}: {key} {what}, got {value!r}")
    t, o, s, c = config.train, config.optimizer, config.schedule, config.checkpoint
    need(config.model.dtype in ("float32", "float64", "bfloat16"), "model.dtype", "must be float32, float64 or bfloat16",
         config.model.dtype)
    need(config.cluster.nodes >= 1, "cluster.nodes", "must be at least 1", config.cluster.nodes)
    need(config.cluster.sites >= 1, "cluster.sites", "must be at least 1", config.cluster.sites)
    need(config.cluster.sites == 1 or config.cluster.inter_site_gbps > 0, "cluster.inter_site_gbps",
         "must be positive with several sites", config.cluster.inter_site_gbps)
    need(config.cluster.inter_site_latency_ms >= 0, "cluster.inter_site_latency_ms", "must be >= 0",
         config.cluster.inter_site_latency_ms)
    need(config.plan.hang_timeout_s >= 0, "plan.hang_timeout_s", "must be >= 0", config.plan.hang_timeout_s)
    need(o.name in ("adamw", "sgd"), "optimizer.name", "must be adamw or sgd", o.name)
    need(o.lr > 0, "optimizer.lr", "must be positive", o.lr)
    need(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", o.weight_decay)
    need(all(0 <= b < 1 for b in o.betas), "optimizer.betas", "must be two numbers in [0, 1)", list(o.betas))
    need(o.eps > 0, "optimizer.eps", "must be positive", o.eps)
    need(o.max_grad_norm >= 0, "optimizer.max_grad_norm", "must be >= 0 (0: no clipping)", o.max_grad_norm)
    need(s.warmup_steps >= 0, "schedule.warmup_steps", "must be >= 0", s.warmup_steps)
    need(s.decay in ("cosine", "linear", "constant"), "schedule.decay", "must be cosine, linear or constant", s.decay)
    need(0 <= s.min_lr_ratio <= 1, "schedule.min_lr_ratio", "must be in [0, 1]", s.min_lr_ratio)
    need(t.steps >= 1, "train.steps", "must be at least 1", t.steps)
    need(t.global_batch >= 1, "train.global_batch", "must be at least 1", t.global_batch)
    need(t.seq_len >= 2, "train.seq_len", "must be at least 2", t.seq_len)
    need(t.seed >= 0, "train.seed", "must be >= 0", t.seed)
    need(t.log_every >= 1, "train.log_every", "must be at least 1", t.log_every)
    need(t.stop_at >= 0, "train.stop_at", "must be >= 0 (0: run to train.steps)", t.stop_at)
    need(config.data.packing in ("stream", "cp_aligned"), "data.packing", "must be stream or cp_aligned",
         config.data.packing)
    need(config.data.packing == "stream" or config.data.document_mask, "data.packing",
         "cp_aligned needs data.document_mask = true (padding and documents must not attend across)",
         config.data.packing)
    need(bool(config.data.path), "data.path", "must name token shards written by `mplan data prepare`", config.data.path)
    need(c.interval >= 0, "checkpoint.interval", "must be >= 0 (0: only at the end)", c.interval)
    need(c.keep_latest >= 1, "checkpoint.keep_latest", "must be at least 1", c.keep_latest)
    steps = config.metrics.profile_steps
    if steps:
        a, sep, b = steps.partition(":")
        need(sep == ":" and a.isdigit() and b.isdigit() and int(a) < int(b), "metrics.profile_steps",
             "must be a:b with a < b (steps a to b-1)", steps)
