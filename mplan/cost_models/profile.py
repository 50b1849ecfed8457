"""Measured profiles: the data format of kernel and link measurements, and its JSON file.

Role: hold what ``measure_device.profile_device`` and ``measure_links.profile_links`` measured so a
``ClusterSpec`` can carry it and the cost models can read it (``compute_cost`` interpolates the
kernel tables, ``collective_cost`` uses the alpha-beta fits).
Input/output: ``ClusterProfile.to_json(path)`` / ``ClusterProfile.from_json(path)``.

File format (``"format": "mplan.profile"``, ``"version": 1``)::

    {"format": "mplan.profile", "version": 1, "note": "...",
     "device": null | {"name", "torch_version", "measured_on", "timing" (optional),
                       "eager_fallbacks" (optional): [{entry, reason}], "l2_flush" (optional),
                       "gemm": [{m, n, k, dtype, seconds}],
                       "attention": [{batch, heads, seq_q, seq_kv, head_dim, dtype, causal,
                                      forward_s, forward_backward_s}],
                       "copy": [{bytes_moved, seconds}],
                       "host": {aten_op_s, view_op_s, launch_s, backward_node_s, triton_launch_s,
                                adamw_foreach_tensor_s, adamw_fused_tensor_s, overlaps, source,
                                runtime_factor (optional)}},
     "links": null | {"backend", "world_size", "ranks_per_node", "measured_on",
                      "timings": [{collective, level, group_size, ranks_per_node, nbytes, seconds}],
                      "fits": [{collective, level, alpha_s, beta_Bps, group_size, num_points,
                                max_rel_error}]}}

``host`` (host seconds per launch kind, ``HostTiming``) may be absent: profiles written before it
was measured load with ``NOMINAL_HOST`` (or ``NOMINAL_CPU_HOST`` for a "cpu" device), whose
``source`` says "nominal, not measured" (``DeviceProfile.host_timing``).
``timing`` (how the GEMM and attention tables were timed, ``TIMINGS``) may be absent: profiles
written before 2026-12-06 load as "events_per_call" (a GPU's, the launch floor included) or
"wall_clock" (a "cpu" device's), which is how they were timed.
``l2_flush`` (how the calls timed together avoid reading operands that the call before left in L2)
may be absent: profiles written before 2026-12-06's rotation load as "none" (every call read the
same operands, so a mid-sized GEMM's were L2-warm), which is how they were timed.

Invariants: every field is validated on load and the first wrong one raises one ``ProfileError``
naming the file and the field; nothing is unpickled. A ``ClusterSpec`` file may hold a profile
inline under its ``profile`` key, or the path of a profile file (see ``cluster.py``).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from mplan.cost_models.alpha_beta import LEVELS, AlphaBetaFit
from mplan.cost_models.collectives import COLLECTIVES
from mplan.cost_models.dtypes import DTYPES
from mplan.json_fields import FieldReader, load_json_file

PROFILE_FORMAT = "mplan.profile"
PROFILE_VERSION = 1
TIMING_LEVELS: tuple[str, ...] = (*LEVELS, "hierarchical")
"""Levels a timing may be taken on: one node, one rank per node, or several ranks on several nodes."""


TIMINGS: tuple[str, ...] = ("cuda_graph_replay", "events_per_call", "wall_clock")
"""How a profile's GEMM and attention tables were timed (``measure_device.MedianTimer``):
"cuda_graph_replay": CUDA events around replays of a graph of back-to-back calls, per call: the
device's time. "events_per_call": CUDA events around one eager call, so a kernel shorter than its
launch is timed at the host's launch (the H100 profile of 2026-12-05 priced no GEMM under ~36 us).
"wall_clock": the host's clock around each call (a CPU, where the host runs the kernels)."""


class ProfileError(ValueError):
    """A profile file or object is malformed; the message names the file and the field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmTiming:
    """One timed ``[m, k] @ [k, n]`` matmul."""

    m: int
    n: int
    k: int
    dtype: str  # dtypes.DTYPES
    seconds: float  # median wall time of one call

    @property
    def flops_per_s(self) -> float:
        return 2.0 * self.m * self.n * self.k / self.seconds


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionTiming:
    """One timed scaled-dot-product attention, forward alone and forward plus backward."""

    batch: int
    heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    dtype: str
    causal: bool
    forward_s: float  # seconds, median
    forward_backward_s: float  # seconds, median of forward then backward

    @property
    def backward_s(self) -> float:
        return max(self.forward_backward_s - self.forward_s, 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyTiming:
    """One timed device-to-device copy."""

    bytes_moved: int  # bytes read plus bytes written
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class HostTiming:
    """Host seconds per kind of launch, timed on a stream of tiny ops while the device is idle, so
    the host is the bottleneck (``measure_device.measure_host``); ``host_cost`` prices a program
    with them and ``host_queue`` overlaps them with the device."""

    aten_op_s: float  # one ATen op launching one kernel, autograd recording (a training forward's op)
    view_op_s: float  # one view op (no kernel), autograd recording
    launch_s: float  # each kernel an op launches beyond its first (no-grad op minus no-grad view)
    backward_node_s: float  # one autograd backward node launching one kernel
    triton_launch_s: float  # one Triton kernel launched from Python (mplan's fused kernels)
    adamw_foreach_tensor_s: float  # per parameter tensor of torch's foreach AdamW step (the default)
    adamw_fused_tensor_s: float  # per parameter tensor of torch's fused AdamW step (mplan's kernel alike)
    # whether kernels run beside the host (a GPU's stream) or on it (a CPU: host and device add up)
    overlaps: bool = True
    source: str  # "measured by ... on DATE" or "nominal, not measured: ..."
    runtime_factor: float | None = None
    """Host seconds mplan's runtime pays per op over these bare streams, measured on this machine
    (`mplan.host_calibration`: a tiny host-bound model trained through mplan, its step fitted);
    None: not measured, `planner.host_cost` uses its constant fitted on one H100."""

    def scaled(self, factor: float, why: str) -> HostTiming:
        """Every per-launch figure times `factor` (a runtime that pays more per op than the
        micro-benchmark's stream of bare ops), `why` appended to the source."""
        return dataclasses.replace(self, **{f: getattr(self, f) * factor for f in HOST_SECONDS},
                                   source=f"{self.source}; x {factor:g}: {why}")


HOST_SECONDS = ("aten_op_s", "view_op_s", "launch_s", "backward_node_s", "triton_launch_s",
                "adamw_foreach_tensor_s", "adamw_fused_tensor_s")
"""The per-launch fields of HostTiming (seconds)."""


NOMINAL_HOST = HostTiming(
    aten_op_s=10e-6, view_op_s=4e-6, launch_s=3e-6, backward_node_s=12e-6, triton_launch_s=15e-6,
    adamw_foreach_tensor_s=6e-6, adamw_fused_tensor_s=2e-6, overlaps=True,
    source="nominal, not measured: the order of eager PyTorch's per-op host overhead on a server CPU "
           "driving a GPU (a few us to launch a kernel, about 10 us for an op with autograd); "
           "run `mplan profile` (measure_device.measure_host) to measure it")
"""Host figures of a GPU profile that has none (profiles before 2026-12-05, presets)."""
NOMINAL_CPU_HOST = HostTiming(
    aten_op_s=10e-6, view_op_s=4e-6, launch_s=3e-6, backward_node_s=12e-6, triton_launch_s=10e-6,
    adamw_foreach_tensor_s=6e-6, adamw_fused_tensor_s=2e-6, overlaps=False,
    source="nominal, not measured: NOMINAL_HOST's figures for a CPU rank, where the kernels run on the "
           "host thread itself; run `mplan profile` to measure it")
"""Host figures of a "cpu" device without a measured host table."""


NO_L2_FLUSH = "none"
"""``DeviceProfile.l2_flush`` of tables whose timed calls all read the same operands: those that fit
the L2 were read from it (profiles before 2026-12-06, CPU profiles)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EagerFallback:
    """An entry of a "cuda_graph_replay" profile timed eagerly (events per call) because its graph
    capture failed: its time carries the launch floor."""

    entry: str  # e.g. "gemm m=512 n=256 k=256 bf16"
    reason: str  # the capture's error, one short line


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """Kernel timings of one device."""

    name: str  # e.g. "NVIDIA H200" or "cpu"
    torch_version: str
    measured_on: str  # ISO date
    gemm: tuple[GemmTiming, ...] = ()
    attention: tuple[AttentionTiming, ...] = ()
    copy: tuple[CopyTiming, ...] = ()
    host: HostTiming | None = None  # None: not measured (`host_timing` gives the nominal figures)
    timing: str = "events_per_call"  # TIMINGS: how `gemm` and `attention` were timed
    eager_fallbacks: tuple[EagerFallback, ...] = ()  # entries timed per call where `timing` is graph replay
    l2_flush: str = NO_L2_FLUSH
    """How the GEMM and attention calls timed together avoided operands the call before left in L2:
    NO_L2_FLUSH, or ``measure_device``'s rotation of operand copies (``l2_flush_note``)."""

    @property
    def host_timing(self) -> HostTiming:
        """The measured host figures, else the nominal ones of this kind of device."""
        return self.host or nominal_host(self.name)


def nominal_host(device_name: str) -> HostTiming:
    """The nominal host figures of a device by name: a CPU's runs its kernels on the host."""
    return NOMINAL_CPU_HOST if device_name == "cpu" else NOMINAL_HOST


# -- kernel tables too thin to price a model ----------------------------------------------------------
# A table prices shapes above its largest point at that point's rate (`compute_cost` holds it flat
# there), and a tiny kernel's rate is its launch's: `mplan profile --quick`'s largest GEMM, 64 x 64
# x 64, ran at about 0.01% of an H100's peak, and a Llama step priced from it came to 11,359 s
# against 0.383 s measured. Such a table is not used: the device's datasheet figures (the preset
# of the same GPU, which the profile's cluster file carries as its `device`) price those kernels
# instead, and the cluster's `figures` say "completed". Completed rather than refused: the quick
# file's links and host timings are measured and still price the plan, and a plan priced like the
# preset is what the user would get without any profile; every place a prediction is shown then
# says that its kernels were not measured (`ClusterSpec.figures`). The reaches below are those of
# the smallest grid `mplan profile` measures without --quick (the CPU one): shapes a model's
# layers actually have, so a full profile of any device passes.
THIN_GEMM_REACH = 1024
"""A GEMM table must hold a product whose m, n and k are all at least this (elements)."""
THIN_ATTENTION_SEQ = 512
"""An attention table must hold a sequence at least this long (tokens)."""
THIN_COPY_BYTES = 1 << 24
"""A copy table must hold a copy moving at least this many bytes (16 MiB)."""


def thin_tables(device: DeviceProfile) -> dict[str, str]:
    """The kernel tables of `device` too small to price a model (see above), by field name
    ("gemm", "attention", "copy"), each with its reach; empty for a full profile. A table the
    profile lacks is not thin: the datasheet prices it anyway."""
    reaches = {"gemm": (max((min(t.m, t.n, t.k) for t in device.gemm), default=None), THIN_GEMM_REACH,
                        "GEMMs up to {} per side"),
               "attention": (max((t.seq_q for t in device.attention), default=None), THIN_ATTENTION_SEQ,
                             "attention up to {} tokens"),
               "copy": (max((t.bytes_moved for t in device.copy), default=None), THIN_COPY_BYTES,
                        "copies up to {} bytes")}
    return {table: f"{words.format(reach)} (a model needs {needed}+)"
            for table, (reach, needed, words) in reaches.items() if reach is not None and reach < needed}


def usable_tables(device: DeviceProfile) -> DeviceProfile:
    """`device` without its thin kernel tables (its host timings kept): what prices kernels."""
    return dataclasses.replace(device, **{table: () for table in thin_tables(device)})


def completion_note(device: DeviceProfile) -> str | None:
    """One line saying which tables of `device` the datasheet completes, or None when none."""
    thin = thin_tables(device)
    if not thin:
        return None
    return (f"the profile of {device.name} measured on {device.measured_on} is too thin to price a model "
            f"({'; '.join(thin.values())}): those kernels are priced from the datasheet instead "
            "(run `mplan profile` without --quick to measure them)")


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveTiming:
    """One timed collective on one group shape and message size."""

    collective: str  # collectives.COLLECTIVES
    level: str  # TIMING_LEVELS
    group_size: int  # ranks in the group
    ranks_per_node: int  # of those, how many share a node
    nbytes: int  # message size, nccl-tests' "size" (see collectives.py)
    seconds: float  # slowest rank's median


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """Collective timings over the groups a world could make, and their alpha-beta fits."""

    backend: str  # "nccl" or "gloo"
    world_size: int
    ranks_per_node: int  # LOCAL_WORLD_SIZE when measured
    measured_on: str  # ISO date
    timings: tuple[CollectiveTiming, ...] = ()
    fits: tuple[AlphaBetaFit, ...] = ()

    def fit(self, collective: str, level: str, bus_bytes: float = 0.0) -> AlphaBetaFit | None:
        """The fit of the size segment holding `bus_bytes` (the last one starting at or below it)."""
        segments = [f for f in self.fits if f.collective == collective and f.level == level]
        below = [f for f in segments if f.min_bus_bytes <= bus_bytes]
        return max(below, key=lambda f: f.min_bus_bytes) if below else (segments[0] if segments else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterProfile:
    """Everything measured on one cluster: kernels of its device and its links (either may be absent)."""

    version: int = PROFILE_VERSION
    note: str = ""
    device: DeviceProfile | None = None
    links: LinkProfile | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "version": self.version, "note": self.note,
                "device": None if self.device is None else _device_to_dict(self.device),
                "links": None if self.links is None else _links_to_dict(self.links)}

    def to_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=1)
            handle.write("\n")

    @classmethod
    def from_dict(cls, obj: Any, *, file: str = "<profile>", path: str = "") -> ClusterProfile:
        return _read_profile(FieldReader(obj, file=file, path=path, error=ProfileError))

    @classmethod
    def from_json(cls, path: str) -> ClusterProfile:
        return cls.from_dict(load_json_file(path, ProfileError), file=str(path))


def _record_dict(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__slots__}


def _device_to_dict(device: DeviceProfile) -> dict[str, Any]:
    return {"name": device.name, "torch_version": device.torch_version, "measured_on": device.measured_on,
            "timing": device.timing, "eager_fallbacks": [_record_dict(f) for f in device.eager_fallbacks],
            "l2_flush": device.l2_flush,
            "gemm": [_record_dict(t) for t in device.gemm],
            "attention": [_record_dict(t) for t in device.attention],
            "copy": [_record_dict(t) for t in device.copy],
            **({} if device.host is None else {"host": _host_dict(device.host)})}


def _host_dict(host: HostTiming) -> dict[str, Any]:
    """The host record, `runtime_factor` only where measured (files before it carry none)."""
    return {k: v for k, v in _record_dict(host).items() if k != "runtime_factor" or v is not None}


def _links_to_dict(links: LinkProfile) -> dict[str, Any]:
    return {"backend": links.backend, "world_size": links.world_size, "ranks_per_node": links.ranks_per_node,
            "measured_on": links.measured_on, "timings": [_record_dict(t) for t in links.timings],
            "fits": [_record_dict(f) for f in links.fits]}


def _read_profile(r: FieldReader) -> ClusterProfile:
    if r.string("format") != PROFILE_FORMAT:
        raise r.error("format", f'must be "{PROFILE_FORMAT}"')
    version = r.integer("version")
    if version != PROFILE_VERSION:
        raise r.error("version", f"must be {PROFILE_VERSION} (the only profile version this mplan reads)")
    profile = ClusterProfile(version=version, note=r.string("note") if r.has("note") else "",
                             device=_read_device(r.obj("device")) if r.has("device") else None,
                             links=_read_links(r.obj("links")) if r.has("links") else None)
    r.finish()
    return profile


def _finished(reader: FieldReader, record: Any) -> Any:
    reader.finish()
    return record


def _read_gemm(g: FieldReader) -> GemmTiming:
    return _finished(g, GemmTiming(m=g.integer("m"), n=g.integer("n"), k=g.integer("k"),
                                   dtype=g.string("dtype", choices=DTYPES), seconds=g.number("seconds")))


def _read_attention(a: FieldReader) -> AttentionTiming:
    return _finished(a, AttentionTiming(
        batch=a.integer("batch"), heads=a.integer("heads"), seq_q=a.integer("seq_q"), seq_kv=a.integer("seq_kv"),
        head_dim=a.integer("head_dim"), dtype=a.string("dtype", choices=DTYPES), causal=a.boolean("causal"),
        forward_s=a.number("forward_s"), forward_backward_s=a.number("forward_backward_s")))


def _read_device(r: FieldReader) -> DeviceProfile:
    name = r.string("name")
    return _finished(r, DeviceProfile(
        name=name, torch_version=r.string("torch_version"), measured_on=r.string("measured_on"),
        timing=r.string("timing", choices=TIMINGS) if r.has("timing") else
        "wall_clock" if name == "cpu" else "events_per_call",
        eager_fallbacks=tuple(_finished(f, EagerFallback(entry=f.string("entry"), reason=f.string("reason")))
                              for f in r.objects("eager_fallbacks")) if r.has("eager_fallbacks") else (),
        l2_flush=r.string("l2_flush") if r.has("l2_flush") else NO_L2_FLUSH,
        gemm=tuple(_read_gemm(g) for g in r.objects("gemm")),
        attention=tuple(_read_attention(a) for a in r.objects("attention")),
        copy=tuple(_finished(c, CopyTiming(bytes_moved=c.integer("bytes_moved"), seconds=c.number("seconds")))
                   for c in r.objects("copy")),
        host=_read_host(r.obj("host")) if r.has("host") else None))


def _read_host(h: FieldReader) -> HostTiming:
    return _finished(h, HostTiming(
        aten_op_s=h.number("aten_op_s"), view_op_s=h.number("view_op_s"), launch_s=h.number("launch_s", allow_equal=True),
        backward_node_s=h.number("backward_node_s"), triton_launch_s=h.number("triton_launch_s"),
        adamw_foreach_tensor_s=h.number("adamw_foreach_tensor_s"),
        adamw_fused_tensor_s=h.number("adamw_fused_tensor_s"), overlaps=h.boolean("overlaps"),
        source=h.string("source"),
        runtime_factor=h.number("runtime_factor") if h.has("runtime_factor") else None))


def _read_timing(t: FieldReader) -> CollectiveTiming:
    return _finished(t, CollectiveTiming(
        collective=t.string("collective", choices=COLLECTIVES), level=t.string("level", choices=TIMING_LEVELS),
        group_size=t.integer("group_size"), ranks_per_node=t.integer("ranks_per_node"),
        nbytes=t.integer("nbytes"), seconds=t.number("seconds")))


def _read_fit(f: FieldReader) -> AlphaBetaFit:
    return _finished(f, AlphaBetaFit(
        collective=f.string("collective", choices=COLLECTIVES), level=f.string("level", choices=LEVELS),
        alpha_s=f.number("alpha_s", allow_equal=True), beta_Bps=f.number("beta_Bps"),
        group_size=f.integer("group_size"), num_points=f.integer("num_points"),
        max_rel_error=f.number("max_rel_error", allow_equal=True),
        min_bus_bytes=f.number("min_bus_bytes", allow_equal=True) if f.has("min_bus_bytes") else 0.0))


def _read_links(r: FieldReader) -> LinkProfile:
    return _finished(r, LinkProfile(
        backend=r.string("backend"), world_size=r.integer("world_size"), ranks_per_node=r.integer("ranks_per_node"),
        measured_on=r.string("measured_on"), timings=tuple(_read_timing(t) for t in r.objects("timings")),
        fits=tuple(_read_fit(f) for f in r.objects("fits"))))
