"""Named clusters with published (or measured-here) hardware figures, each labelled with its source.

Role: ``ClusterSpec.preset(name, nodes, gpus_per_node)`` and ``ClusterSpec.local()`` build from here.
Input: a preset name (``PRESETS``), or the torchrun environment and the local device.
Output: a ``ClusterSpec``; with ``measured=True`` the packaged measured profile of its device
(``profiles/<device>.json``, written by ``python -m benchmarks.calibration profile``) is attached when it exists.
Invariants: every number below says where it comes from: "datasheet" (NVIDIA's dense figures; its
printed "with sparsity" values are 2x), "measured here on DATE", "published in X", or "nominal"
(a placeholder to be replaced by a measurement). Published sources are abbreviated here (issue and
PR numbers of nccl-tests and nccl, datasheet names); the measured H200 figures ship in
mplan/cost_models/reference/, whose README.md gives each file's source.

Efficiency constants (achievable fraction of the line rate for ring collectives):
  NVLink3 (A100): 232.5 / 300 = 0.775 -- 8x A100 all_reduce busbw 232.5 GB/s (nccl-tests#175)
                  over 300 GB/s per direction (datasheet); NCCL's own tuning model caps Ampere bus
                  bandwidth at 235 GB/s (src/graph/tuning.cc).
  NVLink4 (H100/H200): 370 / 450 = 0.822 -- ring collectives ~370 GB/s effective (sjeaugey,
                  nccl-tests#212). NVLink SHARP all-reduce (~480 GB/s busbw) is not modelled: the
                  ring figure is the conservative one and holds for all-gather/reduce-scatter.
  HDR 200 Gb/s IB: 24 / 25 = 0.96 -- "~24 GB/s per NIC" (nccl-tests#252, #160); consistent with
                  192 GB/s busbw per DGX A100 node = 8 x 24 (nccl#812).
  NDR 400 Gb/s IB: 47 / 50 = 0.94 -- "46-48 GB/s per NIC" (nccl-tests#290, #267).
Hop latencies: NCCL's tuning model (src/graph/tuning.cc at 01afd20, ring, LL128 protocol, per step):
  NVLink 1.9 us, PCIe 2.5 us, network 4.0 us.
Device efficiencies (gemm_efficiency, memory_efficiency) of datasheet presets: measured on the H200
here on 2026-11-29: large bf16 GEMMs reach 788 TFLOP/s of the 989.4 datasheet peak (0.796) and a
copy 4.25 of 4.8 TB/s (0.885). 788 was read off a run that is not committed; the committed one,
benchmarks/results/gemm_ceiling_h200-2026-11-29.json, times every GEMM of two 1B-parameter training
steps, and the median of those with both weight dimensions >= 2048 (24 of 27) is 786 TFLOP/s
(695-834; `compute_cost.achievable_gemm_rate`, checked in tests/test_held_out.py). The copy rate is
mplan/cost_models/reference/h200-measured-2026-11-29.json's. The H100 takes both as an assumption
(same GH100 compute; the published maximum achievable matmul rate below puts the H100 SXM at 794.5
of 989 TFLOP/s, 0.803, beside the H200's 0.796 here). The A100 takes the copy rate as an assumption
but not the GEMM rate: its largest bf16 GEMMs reach 271.2 of 312 TFLOP/s (0.869), published in
the "Maximum Achievable Matmul FLOPS comparison table" of stas00/ml-engineering,
compute/accelerator/README.md (A100 SXM, torch 2.6.0+cu126, best of a search over shapes, mean of
100 calls; an earlier revision of the table, CUDA 12.1, had 267.9, 0.859). The H200's 0.796,
carried over until 2026-12-05, rated the A100's GEMMs 8% below that.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import replace
from importlib import resources

from mplan.cost_models.cluster import ClusterSpec, ClusterSpecError, DeviceSpec, LinkHierarchy, LinkSpec
from mplan.cost_models.profile import ClusterProfile

GiB = 1 << 30
H200_MEASURED_ON = "2026-11-29"
_H200_ACHIEVABLE_BF16 = 788e12  # FLOP/s, achievable large bf16 GEMM on the H200 (module docstring)
_H200_COPY_BPS = 4.25e12  # B/s, measured here on 2026-11-29: copy, bytes read + written
_GEMM_EFF = _H200_ACHIEVABLE_BF16 / 989.4e12  # 0.796, see module docstring
_A100_ACHIEVABLE_BF16 = 271.2e12  # FLOP/s, published maximum achievable bf16 matmul (module docstring)
_MEM_EFF = _H200_COPY_BPS / 4.8e12  # 0.885, see module docstring

A100_80GB = DeviceSpec(
    name="A100-SXM4-80GB", peak_bf16=312e12, peak_fp16=312e12, peak_fp32=19.5e12, peak_tf32=156e12,
    peak_fp8=0.0, peak_fp64=19.5e12, memory_bytes=80 * GiB, memory_bandwidth_Bps=2.039e12,
    gemm_efficiency=_A100_ACHIEVABLE_BF16 / 312e12, memory_efficiency=_MEM_EFF,
    source="datasheet (NVIDIA A100 datasheet r4: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e); GEMM efficiency "
           "published (stas00/ml-engineering MAMF table: 271.2 TFLOP/s); copy efficiency measured on H200 "
           "here 2026-11-29, assumed to carry over")
H100_SXM = DeviceSpec(
    name="H100-SXM5-80GB", peak_bf16=989.4e12, peak_fp16=989.4e12, peak_fp32=66.9e12, peak_tf32=494.7e12,
    peak_fp8=1978.9e12, peak_fp64=66.9e12, memory_bytes=80 * GiB, memory_bandwidth_Bps=3.35e12,
    gemm_efficiency=_GEMM_EFF, memory_efficiency=_MEM_EFF,
    source="datasheet (NVIDIA H100 SXM5 datasheet, dense = printed sparse / 2; 3.35 TB/s HBM3); "
           "efficiencies measured on H200 here 2026-11-29, assumed to carry over")
H200_SXM = DeviceSpec(
    name="H200-SXM-141GB", peak_bf16=989.4e12, peak_fp16=989.4e12, peak_fp32=66.9e12, peak_tf32=494.7e12,
    peak_fp8=1978.9e12, peak_fp64=66.9e12, memory_bytes=141 * 10**9, memory_bandwidth_Bps=4.8e12,
    gemm_efficiency=_GEMM_EFF, memory_efficiency=_MEM_EFF,
    source="datasheet (NVIDIA H200 datasheet: GH100 compute as H100, 141 GB HBM3e, 4.8 TB/s); "
           "efficiencies measured on H200 here 2026-11-29")
H200_MEASURED = DeviceSpec(
    name="H200-SXM-141GB (measured)", peak_bf16=_H200_ACHIEVABLE_BF16, peak_fp16=_H200_ACHIEVABLE_BF16,
    peak_fp32=66.9e12 * _GEMM_EFF, peak_tf32=494.7e12 * _GEMM_EFF, peak_fp8=1978.9e12 * _GEMM_EFF,
    peak_fp64=66.9e12 * _GEMM_EFF, memory_bytes=139 * GiB, memory_bandwidth_Bps=_H200_COPY_BPS,
    gemm_efficiency=1.0, memory_efficiency=1.0,
    source="measured here on 2026-11-29 (mplan/cost_models/reference/h200-measured-2026-11-29.json): bf16 788 TFLOP/s "
           "achievable GEMM, 4.25 TB/s copy; fp16 taken equal to bf16 and fp8/tf32/fp32/fp64 as datasheet x 0.796 "
           "(not measured); memory: the ~139 GiB the device tool reports usable")
CPU_NOMINAL = DeviceSpec(
    name="cpu", peak_bf16=2e10, peak_fp16=1e10, peak_fp32=1e11, peak_tf32=1e11, peak_fp8=0.0, peak_fp64=5e10,
    memory_bytes=8 * GiB, memory_bandwidth_Bps=1e10, gemm_efficiency=1.0, memory_efficiency=1.0,
    source="nominal placeholder for a gloo CPU rank (not measured; run measure_device.profile_device('cpu'))")

NVLINK3 = LinkSpec(kind="nvswitch", bandwidth_Bps=300e9, latency_s=1.9e-6, efficiency=232.5 / 300,
                   source="datasheet NVLink3 600 GB/s bidirectional; efficiency nccl-tests#175; latency NCCL tuning.cc")
NVLINK4 = LinkSpec(kind="nvswitch", bandwidth_Bps=450e9, latency_s=1.9e-6, efficiency=370 / 450,
                   source="datasheet NVLink4 900 GB/s bidirectional; efficiency nccl-tests#212; latency NCCL tuning.cc")
HDR_IB = LinkSpec(kind="infiniband", bandwidth_Bps=25e9, latency_s=4.0e-6, efficiency=24 / 25,
                  source="8x ConnectX-6 HDR 200 Gb/s per node, one per GPU (Narayanan SC'21 sec. 5); "
                         "efficiency nccl-tests#252/#160; latency NCCL tuning.cc")
NDR_IB = LinkSpec(kind="infiniband", bandwidth_Bps=50e9, latency_s=4.0e-6, efficiency=47 / 50,
                  source="8x ConnectX-7 NDR 400 Gb/s per node, one per GPU (MLPerf system JSONs); "
                         "efficiency nccl-tests#290/#267; latency NCCL tuning.cc")
LOOPBACK = LinkSpec(kind="loopback", bandwidth_Bps=2e9, latency_s=2e-5, efficiency=1.0,
                    source="nominal gloo-over-loopback placeholder (not measured; run measure_links.profile_links)")
NO_LINK = LinkSpec(kind="none", bandwidth_Bps=0.0, latency_s=0.0, efficiency=1.0, source="single node")

PRESETS: dict[str, tuple[DeviceSpec, LinkSpec, LinkSpec, int, str]] = {
    # name: (device, intra_node, inter_node, default gpus_per_node, source)
    "dgx-a100": (A100_80GB, NVLINK3, HDR_IB, 8, "NVIDIA DGX A100 (Selene): 8x A100 80GB, 6x NVSwitch, 8x HDR IB"),
    "dgx-h100": (H100_SXM, NVLINK4, NDR_IB, 8, "NVIDIA DGX H100 (Eos): 8x H100 80GB, 4x NVSwitch, 8x NDR IB"),
    "dgx-h200": (H200_SXM, NVLINK4, NDR_IB, 8, "NVIDIA DGX/HGX H200: 8x H200 141GB, 4x NVSwitch, 8x NDR IB"),
    "h200": (H200_MEASURED, NVLINK4, NO_LINK, 1, "one H200 of this workplace, measured here on 2026-11-29"),
    "cpu": (CPU_NOMINAL, LOOPBACK, NO_LINK, 1, "local gloo CPU ranks on one machine (nominal figures)"),
}

_PACKAGED_PROFILES: dict[str, str] = {"H200": "h200.json"}
"""Device-name fragment -> packaged profile file under mplan/cost_models/profiles/."""


def packaged_profile(device_name: str) -> ClusterProfile | None:
    """The measured profile shipped for a device of this name, if one has been written."""
    for fragment, filename in _PACKAGED_PROFILES.items():
        if fragment in device_name:
            path = resources.files("mplan.cost_models").joinpath("profiles", filename)
            if path.is_file():
                return ClusterProfile.from_json(str(path))
    return None


def make_preset(name: str, *, nodes: int = 1, gpus_per_node: int | None = None, measured: bool = True) -> ClusterSpec:
    if name not in PRESETS:
        raise ClusterSpecError(f"unknown cluster preset {name!r}; presets: {', '.join(PRESETS)}")
    device, intra, inter, default_gpus, source = PRESETS[name]
    if inter.kind == "none" and nodes != 1:
        raise ClusterSpecError(f"preset {name!r} is a single node (no inter-node link); got nodes={nodes}")
    profile = packaged_profile(device.name) if measured else None
    return ClusterSpec(name=name, num_nodes=nodes, gpus_per_node=default_gpus if gpus_per_node is None else gpus_per_node,
                       device=device, links=LinkHierarchy(intra_node=intra, inter_node=inter), source=source,
                       profile=profile)


def preset_for_gpu(device_name: str, memory_bytes: int) -> str:
    """The preset whose device is nearest a CUDA device: by name, else by memory capacity (with a warning)."""
    for fragment, preset in (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100")):
        if fragment in device_name.upper():
            return preset
    # Newest first, so a tie in memory (A100 and H100 both 80 GiB) goes to the newer part.
    nearest = min(("dgx-h200", "dgx-h100", "dgx-a100"), key=lambda p: abs(PRESETS[p][0].memory_bytes - memory_bytes))
    warnings.warn(f"no preset for GPU {device_name!r}; using {nearest}'s figures (nearest memory capacity). "
                  f"Run `mplan profile` for measured ones.", stacklevel=3)
    return nearest


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ClusterSpecError(f"environment: {key} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ClusterSpecError(f"environment: {key} must be a positive integer, got {raw!r}")
    return value


def local_cluster(env: Mapping[str, str]) -> ClusterSpec:
    """The cluster of this torchrun job: WORLD_SIZE / LOCAL_WORLD_SIZE nodes of the local device."""
    world = _env_int(env, "WORLD_SIZE", 1)
    local = _env_int(env, "LOCAL_WORLD_SIZE", world)
    if world % local:
        raise ClusterSpecError(f"environment: WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name = preset_for_gpu(props.name, props.total_memory)
    else:
        name = "cpu"
    spec = make_preset(name, nodes=world // local, gpus_per_node=local)
    return replace(spec, name="local", source=f"this torchrun job ({world} ranks, {local} per node) with {name}'s figures")
