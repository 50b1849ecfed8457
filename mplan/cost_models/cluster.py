"""The cluster a plan is made for: devices, nodes and the links between them.

Role: the one description of hardware every cost model reads. A ``ClusterSpec`` is ``num_nodes``
nodes of ``gpus_per_node`` identical devices (``DeviceSpec``), joined by a two-level link hierarchy
(``LinkHierarchy``: ``intra_node`` NVLink/NVSwitch/PCIe/loopback, ``inter_node`` InfiniBand/RoCE/none),
optionally carrying a measured ``ClusterProfile`` (kernel tables and alpha-beta link fits) that
overrides the analytic figures wherever it has data.
Input: a named preset (``presets.py``, each constant labelled with its source), a JSON file, or the
torchrun environment of the current process (``ClusterSpec.local()``).
Output: frozen records; ``to_json`` writes the file ``from_json`` reads.

File format (``"format": "mplan.cluster"``, ``"version": 1``)::

    {"format": "mplan.cluster", "version": 1, "name": "dgx-h100", "num_nodes": 4, "gpus_per_node": 8,
     "source": "...",
     "device": {"name", "peak_flops": {"bf16", "fp16", "fp32", "tf32", "fp8", "fp64"} (FLOP/s, 0 = none),
                "memory_bytes", "memory_bandwidth_Bps", "gemm_efficiency", "memory_efficiency", "source"},
     "links": {"intra_node": {"kind", "bandwidth_Bps", "latency_s", "efficiency", "source"},
               "inter_node": {...}},
     "profile": null | {a profile object, see profile.py} | "path/to/profile.json",
     "sites": {"count", "inter_site_gbps", "inter_site_latency_ms", "source"}   (optional: one site)}

Sites (``Sites``): ``count`` data centers, the nodes split evenly among them in order (rank r on site
r // (world_size / count)), joined by a long-haul link: ``inter_site_gbps`` Gb/s per direction, the
whole of what one site sends to the others (not per GPU: every rank of a site shares it), as a
transfer reaches it (give a measured figure: it is priced as given, no efficiency applied), and
``inter_site_latency_ms``, one way. Units as the CLI's ``--inter-site-gbps`` and
``--inter-site-latency-ms``.

Decision on profiles: ``mplan profile`` writes a *cluster* file whose ``profile`` key holds the
measurements inline, so one file describes a measured cluster. A bare profile file (such as the
packaged ``profiles/h200.json``, which measures one device and no links) is not a cluster and is not
accepted by ``ClusterSpec.from_json``; reference it from a cluster file by path (relative to the
cluster file) or attach it with ``spec.with_profile(ClusterProfile.from_json(path))``.
Invariants: all bandwidths are per GPU, per direction, in bytes/s; latencies in seconds; a wrong
file raises one ``ClusterSpecError`` naming the file and the field; ``inter_node.kind == "none"``
only on one node; the sites divide the nodes.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from mplan.cost_models.alpha_beta import AlphaBetaFit
from mplan.cost_models.dtypes import DTYPES, canonical_dtype
from mplan.json_fields import FieldReader, load_json_file
from mplan.cost_models.profile import ClusterProfile, ProfileError, thin_tables

CLUSTER_FORMAT = "mplan.cluster"
CLUSTER_VERSION = 1
INTRA_NODE_KINDS: tuple[str, ...] = ("nvlink", "nvswitch", "pcie", "loopback")
INTER_NODE_KINDS: tuple[str, ...] = ("infiniband", "roce", "none")


class ClusterSpecError(ValueError):
    """A cluster description is wrong; the message names the file (if any) and the field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """One accelerator (or one CPU rank). Peaks are dense (no sparsity) and 0 where unsupported."""

    name: str
    peak_bf16: float  # FLOP/s
    peak_fp16: float  # FLOP/s
    peak_fp32: float  # FLOP/s, plain fp32 (no TF32 tensor cores)
    peak_tf32: float  # FLOP/s
    peak_fp8: float  # FLOP/s
    peak_fp64: float  # FLOP/s
    memory_bytes: int  # bytes of device memory
    memory_bandwidth_Bps: float  # bytes/s of device memory
    gemm_efficiency: float  # fraction of peak that large GEMMs approach (see compute_cost.py)
    memory_efficiency: float  # fraction of memory_bandwidth_Bps that a large copy reaches
    source: str  # where the figures come from

    def __post_init__(self) -> None:
        for dtype in DTYPES:
            if getattr(self, f"peak_{dtype}") < 0:
                raise ClusterSpecError(f"device {self.name}: peak_{dtype} must be >= 0")
        if self.peak_bf16 <= 0 or self.peak_fp32 <= 0:
            raise ClusterSpecError(f"device {self.name}: peak_bf16 and peak_fp32 must be positive")
        if self.memory_bytes <= 0 or self.memory_bandwidth_Bps <= 0:
            raise ClusterSpecError(f"device {self.name}: memory_bytes and memory_bandwidth_Bps must be positive")
        if not (0 < self.gemm_efficiency <= 1 and 0 < self.memory_efficiency <= 1):
            raise ClusterSpecError(f"device {self.name}: gemm_efficiency and memory_efficiency must be in (0, 1]")

    def peak_flops(self, dtype: object) -> float:
        """Dense peak FLOP/s for ``dtype``; ClusterSpecError if the device has none."""
        name = canonical_dtype(dtype)
        peak = getattr(self, f"peak_{name}")
        if peak <= 0:
            raise ClusterSpecError(f"device {self.name} has no {name} peak (unsupported dtype)")
        return peak


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One level of the link hierarchy, as seen by one GPU."""

    kind: str  # INTRA_NODE_KINDS or INTER_NODE_KINDS
    bandwidth_Bps: float  # bytes/s per GPU per direction (line rate); 0 only for kind "none"
    latency_s: float  # seconds per ring step (one hop)
    efficiency: float  # fraction of bandwidth_Bps a ring collective achieves (NCCL busbw / line rate)
    source: str

    @property
    def effective_bandwidth_Bps(self) -> float:
        """Bus bandwidth a ring collective reaches on this link, bytes/s."""
        return self.bandwidth_Bps * self.efficiency


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkHierarchy:
    intra_node: LinkSpec
    inter_node: LinkSpec

    def __post_init__(self) -> None:
        if self.intra_node.kind not in INTRA_NODE_KINDS:
            raise ClusterSpecError(f"links.intra_node.kind must be one of {INTRA_NODE_KINDS}, "
                                   f"got {self.intra_node.kind!r}")
        if self.inter_node.kind not in INTER_NODE_KINDS:
            raise ClusterSpecError(f"links.inter_node.kind must be one of {INTER_NODE_KINDS}, "
                                   f"got {self.inter_node.kind!r}")
        for level, link in (("intra_node", self.intra_node), ("inter_node", self.inter_node)):
            if link.kind != "none" and link.bandwidth_Bps <= 0:
                raise ClusterSpecError(f"links.{level}.bandwidth_Bps must be positive for kind {link.kind!r}")
            if link.latency_s < 0 or not 0 < link.efficiency <= 1:
                raise ClusterSpecError(f"links.{level}: latency_s must be >= 0 and efficiency in (0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class Sites:
    """The data centers a cluster spans and the long-haul link between them (module docstring)."""

    count: int = 1
    inter_site_gbps: float = 0.0  # Gb/s per direction, a site's whole share of the link (not per GPU)
    inter_site_latency_ms: float = 0.0  # milliseconds, one way
    source: str = ""  # where the link figures come from (measured, or given by the user)

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise ClusterSpecError(f"sites.count must be an integer >= 1, got {self.count!r}")
        if self.count > 1 and not self.inter_site_gbps > 0:
            raise ClusterSpecError(f"sites.inter_site_gbps must be a positive number with {self.count} sites, "
                                   f"got {self.inter_site_gbps!r}")
        if not self.inter_site_latency_ms >= 0:
            raise ClusterSpecError(f"sites.inter_site_latency_ms must be a non-negative number, "
                                   f"got {self.inter_site_latency_ms!r}")

    @property
    def bandwidth_Bps(self) -> float:
        """The inter-site link, bytes/s per direction (Gb/s are 1e9 bits)."""
        return self.inter_site_gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.inter_site_latency_ms * 1e-3


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """``num_nodes`` x ``gpus_per_node`` identical devices and the links between them."""

    name: str
    num_nodes: int
    gpus_per_node: int
    device: DeviceSpec
    links: LinkHierarchy
    source: str = ""  # where the cluster figures come from (presets name their sources)
    profile: ClusterProfile | None = None  # measured kernels and links; overrides analytic figures
    sites: Sites = Sites()  # the data centers the nodes are split among (one unless said)

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ClusterSpecError(f"cluster {self.name}: num_nodes and gpus_per_node must be >= 1, "
                                   f"got {self.num_nodes} and {self.gpus_per_node}")
        if self.num_nodes > 1 and self.links.inter_node.kind == "none":
            raise ClusterSpecError(f"cluster {self.name}: {self.num_nodes} nodes need an inter_node link, "
                                   f"got kind 'none'")
        if self.num_nodes % self.sites.count:
            raise ClusterSpecError(f"cluster {self.name}: sites.count = {self.sites.count} must divide the "
                                   f"{self.num_nodes} nodes (each site holds as many)")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def num_sites(self) -> int:
        return self.sites.count

    @property
    def ranks_per_site(self) -> int:
        return self.world_size // self.sites.count

    def site_of(self, rank: int) -> int:
        """The site rank `rank` runs on: ranks fill sites in order, as they fill nodes."""
        return rank // self.ranks_per_site

    def with_sites(self, count: int, *, inter_site_gbps: float = 0.0, inter_site_latency_ms: float = 0.0,
                   source: str = "given") -> ClusterSpec:
        """This cluster's nodes split evenly among `count` sites joined by the given link."""
        return dataclasses.replace(self, sites=Sites(count=count, inter_site_gbps=inter_site_gbps,
                                                     inter_site_latency_ms=inter_site_latency_ms, source=source))

    @property
    def figures(self) -> str:
        """Where this cluster's prices come from, in one word, for every place a prediction is
        shown: "measured" (a profile from `mplan profile`, or the packaged one of this device),
        "nominal" (a placeholder, such as the `cpu` preset's: no prediction for any machine, since
        a CPU step measured 22-30x the step priced from it), or "datasheet" (published figures);
        "completed" where a profile's kernel tables are too thin to price a model and the device's
        datasheet prices those kernels (`profile.thin_tables`, `mplan profile --quick`'s file)."""
        if self.profile is not None and self.profile.device is not None and thin_tables(self.profile.device):
            return "nominal" if self.device.source.startswith("nominal") else "completed"
        if self.profile is not None or self.device.source.startswith("measured"):
            return "measured"
        links = [link for link in (self.links.intra_node, self.links.inter_node) if link.kind != "none"]
        if any(part.source.startswith("nominal") for part in (self.device, *links)):
            return "nominal"
        return "datasheet"

    def link_fit(self, collective: str, level: str, bus_bytes: float = 0.0) -> AlphaBetaFit | None:
        """The measured alpha-beta fit for ``collective`` on ``level`` at ``bus_bytes``, if the profile has one."""
        if self.profile is None or self.profile.links is None:
            return None
        return self.profile.links.fit(collective, level, bus_bytes)

    def with_profile(self, profile: ClusterProfile | None) -> ClusterSpec:
        return dataclasses.replace(self, profile=profile)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, nodes: int = 1, gpus_per_node: int | None = None, *,
               measured: bool = True, sites: int = 1, inter_site_gbps: float = 0.0,
               inter_site_latency_ms: float = 0.0) -> ClusterSpec:
        """A named cluster (``presets.PRESETS``); ``measured`` attaches a packaged device profile if any;
        ``sites`` > 1 splits its ``nodes`` (all of them, every site's) among that many sites."""
        from mplan.cost_models.presets import make_preset

        cluster = make_preset(name, nodes=nodes, gpus_per_node=gpus_per_node, measured=measured)
        if sites == 1 and not inter_site_gbps and not inter_site_latency_ms:
            return cluster
        return cluster.with_sites(sites, inter_site_gbps=inter_site_gbps, inter_site_latency_ms=inter_site_latency_ms)

    @classmethod
    def local(cls) -> ClusterSpec:
        """The cluster this process runs in, from torchrun's WORLD_SIZE/LOCAL_WORLD_SIZE and the local device."""
        from mplan.cost_models.presets import local_cluster

        return local_cluster(os.environ)

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        device = self.device
        return {
            "format": CLUSTER_FORMAT, "version": CLUSTER_VERSION, "name": self.name,
            "num_nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node, "source": self.source,
            "device": {"name": device.name,
                       "peak_flops": {dtype: getattr(device, f"peak_{dtype}") for dtype in DTYPES},
                       "memory_bytes": device.memory_bytes, "memory_bandwidth_Bps": device.memory_bandwidth_Bps,
                       "gemm_efficiency": device.gemm_efficiency, "memory_efficiency": device.memory_efficiency,
                       "source": device.source},
            "links": {level: {"kind": link.kind, "bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s,
                              "efficiency": link.efficiency, "source": link.source}
                      for level, link in (("intra_node", self.links.intra_node),
                                          ("inter_node", self.links.inter_node))},
            "profile": None if self.profile is None else self.profile.to_dict(),
            **({"sites": {"count": self.sites.count, "inter_site_gbps": self.sites.inter_site_gbps,
                          "inter_site_latency_ms": self.sites.inter_site_latency_ms, "source": self.sites.source}}
               if self.sites.count > 1 else {}),
        }

    def to_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=1)
            handle.write("\n")

    @classmethod
    def from_dict(cls, obj: Any, *, file: str = "<cluster>", base_dir: str = ".") -> ClusterSpec:
        """Validate and build; ``base_dir`` resolves a ``profile`` given as a relative path."""
        return _read_cluster(FieldReader(obj, file=file, path="", error=ClusterSpecError), file, base_dir)

    @classmethod
    def from_json(cls, path: str) -> ClusterSpec:
        return cls.from_dict(load_json_file(str(path), ClusterSpecError), file=str(path),
                             base_dir=os.path.dirname(os.path.abspath(path)))


def _read_link(r: FieldReader, kinds: tuple[str, ...]) -> LinkSpec:
    kind = r.string("kind", choices=kinds)
    link = LinkSpec(kind=kind, bandwidth_Bps=r.number("bandwidth_Bps", allow_equal=kind == "none"),
                    latency_s=r.number("latency_s", allow_equal=True), efficiency=r.fraction("efficiency"),
                    source=r.string("source"))
    r.finish()
    return link


def _read_device(r: FieldReader) -> DeviceSpec:
    peaks = r.obj("peak_flops")
    values = {dtype: peaks.number(dtype, allow_equal=dtype not in ("bf16", "fp32")) for dtype in DTYPES}
    peaks.finish()
    device = DeviceSpec(name=r.string("name"), **{f"peak_{d}": v for d, v in values.items()},
                        memory_bytes=r.integer("memory_bytes"), memory_bandwidth_Bps=r.number("memory_bandwidth_Bps"),
                        gemm_efficiency=r.fraction("gemm_efficiency"), memory_efficiency=r.fraction("memory_efficiency"),
                        source=r.string("source"))
    r.finish()
    return device


def _read_profile(r: FieldReader, file: str, base_dir: str) -> ClusterProfile | None:
    if not r.has("profile"):
        return None
    value = r.raw("profile")
    if isinstance(value, str):
        path = value if os.path.isabs(value) else os.path.join(base_dir, value)
        try:
            return ClusterProfile.from_json(path)
        except ProfileError as exc:  # names the profile file; say which cluster file and field led there
            raise ClusterSpecError(f"{file}: profile {value!r}: {exc}") from None
    try:
        return ClusterProfile.from_dict(value, file=file, path="profile")
    except ProfileError as exc:
        raise ClusterSpecError(str(exc)) from None


def _read_cluster(r: FieldReader, file: str, base_dir: str) -> ClusterSpec:
    if r.string("format") != CLUSTER_FORMAT:
        raise r.error("format", f'must be "{CLUSTER_FORMAT}" (a bare profile file is attached with '
                                f'ClusterSpec.with_profile or referenced from a cluster file)')
    if r.integer("version") != CLUSTER_VERSION:
        raise r.error("version", f"must be {CLUSTER_VERSION} (the only cluster version this mplan reads)")
    num_nodes = r.integer("num_nodes")
    links = r.obj("links")
    intra, inter = _read_link(links.obj("intra_node"), INTRA_NODE_KINDS), _read_link(links.obj("inter_node"),
                                                                                   INTER_NODE_KINDS)
    links.finish()
    if num_nodes > 1 and inter.kind == "none":
        raise ClusterSpecError(f'{file}: links.inter_node.kind must not be "none" with num_nodes = {num_nodes}')
    spec = ClusterSpec(name=r.string("name"), num_nodes=num_nodes, gpus_per_node=r.integer("gpus_per_node"),
                       device=_read_device(r.obj("device")), links=LinkHierarchy(intra_node=intra, inter_node=inter),
                       source=r.string("source") if r.has("source") else "",
                       profile=_read_profile(r, file, base_dir), sites=_read_sites(r, num_nodes))
    r.finish()
    return spec


def _read_sites(r: FieldReader, num_nodes: int) -> Sites:
    if not r.has("sites"):
        return Sites()
    sites = r.obj("sites")
    count = sites.integer("count")
    if num_nodes % count:
        raise sites.error("count", f"must divide num_nodes = {num_nodes} (each site holds as many nodes)")
    spec = Sites(count=count, inter_site_gbps=sites.number("inter_site_gbps", allow_equal=count == 1),
                 inter_site_latency_ms=sites.number("inter_site_latency_ms", allow_equal=True),
                 source=sites.string("source") if sites.has("source") else "")
    sites.finish()
    return spec


def require_cluster(value: Any, where: str) -> ClusterSpec:
    """`value` if it is a ClusterSpec; otherwise one line naming what came and how to make one.
    A preset's name or a file's path handed to the Python API would else fail deep inside the
    planner with an AttributeError, after the capture's seconds."""
    if isinstance(value, ClusterSpec):
        return value
    raise ClusterSpecError(f"{where}: expected a mplan.ClusterSpec (ClusterSpec.preset(name), ClusterSpec."
                           f"from_json(path) or ClusterSpec.local()), got {type(value).__name__} {value!r:.80}")
