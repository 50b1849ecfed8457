"""Cost models: what the cluster is, and what compute, communication, memory and a schedule cost on it.

Public names (one module per idea):
  cluster.py          ClusterSpec, DeviceSpec, LinkSpec, LinkHierarchy, ClusterSpecError
  presets.py          PRESETS (dgx-a100, dgx-h100, dgx-h200, h200, cpu), each figure with its source
  collective_cost.py  collective_time, GroupShape
  compute_cost.py     ComputeCostModel, gemm_shape_efficiency, attention_flops
  memory_model.py     estimate_memory, MemoryBreakdown, bytes_per_param
  moe_cost.py         ExpertsLayer, experts_time, all_to_all_time, load_factor (an MoE layer under EP)
  simulator.py        simulate, PipelineCosts, SimResult
  host_queue.py       HostQueue (a stream of ops: the host issues, the device runs; makespan)
  profile.py          ClusterProfile, DeviceProfile, HostTiming, LinkProfile (the measured-profile file format)
  measure_device.py   profile_device, measure_host (import torch when called)
  measure_links.py    profile_links (imports torch when called)
  alpha_beta.py       AlphaBetaFit, fit_alpha_beta
Importing this package does not import torch.
"""
from __future__ import annotations

from mplan.cost_models.alpha_beta import AlphaBetaFit, fit_alpha_beta
from mplan.cost_models.cluster import ClusterSpec, ClusterSpecError, DeviceSpec, LinkHierarchy, LinkSpec
from mplan.cost_models.collective_cost import GroupShape, collective_time
from mplan.cost_models.collectives import COLLECTIVES, bus_factor
from mplan.cost_models.compute_cost import ComputeCostModel, attention_flops, gemm_shape_efficiency
from mplan.cost_models.dtypes import DTYPES, canonical_dtype, dtype_bytes
from mplan.cost_models.measure_device import ProfileGrid, profile_device
from mplan.cost_models.measure_links import profile_links
from mplan.cost_models.memory_model import MemoryBreakdown, bytes_per_param, estimate_memory
from mplan.cost_models.moe_cost import ExpertsLayer, all_to_all_time, experts_time, load_factor
from mplan.cost_models.presets import PRESETS
from mplan.cost_models.profile import (AttentionTiming, ClusterProfile, CollectiveTiming, CopyTiming, DeviceProfile,
                                       GemmTiming, LinkProfile, ProfileError)
from mplan.cost_models.simulator import PipelineCosts, SimResult, TimelineEvent, simulate

__all__ = [
    "COLLECTIVES", "DTYPES", "PRESETS", "AlphaBetaFit", "AttentionTiming", "ClusterProfile", "ClusterSpec",
    "ClusterSpecError", "CollectiveTiming", "ComputeCostModel", "CopyTiming", "DeviceProfile", "DeviceSpec",
    "ExpertsLayer", "GemmTiming", "GroupShape", "LinkHierarchy", "LinkProfile", "LinkSpec", "MemoryBreakdown",
    "PipelineCosts", "ProfileError", "ProfileGrid", "SimResult", "TimelineEvent", "all_to_all_time",
    "attention_flops", "bus_factor", "bytes_per_param", "canonical_dtype", "collective_time", "dtype_bytes",
    "estimate_memory", "experts_time", "fit_alpha_beta", "gemm_shape_efficiency", "load_factor", "profile_device",
    "profile_links", "simulate",
]
