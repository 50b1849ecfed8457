"""Host seconds of each op of a rank's program: what the Python side of a training step costs.

Role: give every op the host time it takes to issue (forward) and to run its autograd node
(backward), from the cluster's measured ``HostTiming`` (``mplan profile``; nominal where it was
not measured), for ``unit_costs`` to queue against the device (``cost_models.host_queue``).
Input: an ``OpNode``, what the fused kernel it belongs to is (``FusedSave``, from the planner's
fusion), whether it takes part in autograd, the host figures. Output: ``OpHost`` (seconds).

Counting, not guessing: an op's host time is its kinds of launch times their counts.
- An ATen op in the forward: ``aten_op_s`` (dispatch, autograd recording, one kernel); a view
  launches nothing: ``view_op_s``; a tuple's ``getitem`` and a symbolic scalar are Python only: 0.
- Its backward node: ``backward_node_s`` for the node and its first kernel, ``launch_s`` for each
  further one, one kernel per floating-point input that needs a gradient (a linear with a bias:
  dX, dW and db); a view's node launches nothing (``backward_node_s - launch_s``); an op no
  gradient flows through (masks, position ids, RoPE's tables) has no node.
- A fused chain (``fuse_kernels``): nothing on its inner ops, and on its anchor the kernels
  ``FusionEntry.launches`` (mplan.fusion) counts: the autograd Function's bookkeeping (a view's host
  time forward, a kernel-less node backward) plus ``triton_launch_s`` per Triton kernel and
  ``aten_op_s`` per ATen op it calls; the fused head + loss's forward per chunk of rows.
Left out: the host time of collectives (TP reshards, the vocabulary-parallel loss's), of the
allocator, and of mplan's runtime around the program (pipeline sends, hooks).
Invariants: every figure >= 0; an op's host time does not depend on its sharding.
"""
from __future__ import annotations

from dataclasses import dataclass

from mplan.cost_models.cluster import ClusterSpec
from mplan.cost_models.profile import HostTiming, nominal_host
from mplan.ir.graph import Graph, OpNode
from mplan.fusion.entry import FusedSave
from mplan.fusion.registry import entry

_FLOATING = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128",
                       "float8_e4m3fn", "float8_e5m2"})
_PYTHON_ONLY = ("getitem", "scalar")


@dataclass(frozen=True, slots=True, kw_only=True)
class OpHost:
    forward_s: float  # host seconds to issue the op in the forward
    backward_s: float  # host seconds of its autograd node in the backward (0: none)


MPLAN_RUNTIME_HOST_FACTOR = 6.03
"""Host seconds mplan's own runtime pays per op over what `measure_host`'s streams of bare ops
take: its fused kernels are autograd Functions whose Python forward and backward allocate and
launch, the local program is an FX module, a micro-batch runs the runtime's hooks. Fitted on ONE
step measured on an H100 (Qwen2-0.5B shape, 8 x 1024 tokens at micro-batch 1, the most host-bound:
938 ms, 117 ms a micro-batch) with that session's measured host figures and kernel tables; held
out on six other steps of the same session (the same model at micro-batch 2 and 8, Qwen3-1.7B and
SmolLM2-1.7B shapes at 8 x 2048 tokens at micro-batch 1 and 8): within 7.9% with the factor,
up to 57% low without it on the host-bound rows (benchmarks/reprice/host_fit.py,
results/host_factor_fit-cpu-2026-12-05.json).
It scales the program's ops only: the optimizer's per-tensor host time (`evaluate`) stays at the
bare figures, as it was in the fit. A constant of mplan's runtime on a GPU host, not of a
machine: fitted, not measured per cluster."""


def host_timing(cluster: ClusterSpec) -> HostTiming:
    """The cluster's measured host figures, else the nominal ones of its device."""
    device = cluster.profile.device if cluster.profile is not None else None
    return device.host_timing if device is not None else nominal_host(cluster.device.name)


def runtime_host(cluster: ClusterSpec, runtime: str, factor: float | None = None, *,
                 cuda_graphs: bool | None = None) -> HostTiming:
    """The host figures a plan for `runtime` pays: `host_timing`'s, times `factor` (None: for
    mplan's runtime on a GPU, whose kernels overlap the host, the factor `mplan profile` measured
    on the machine (`HostTiming.runtime_factor`), else MPLAN_RUNTIME_HOST_FACTOR; 1 for
    Megatron-LM's runtime, priced as bare ops, and on a CPU, whose figures are nominal).
    `cuda_graphs`: whether mplan's runtime replays the step's forwards and backwards as a CUDA
    graph (None: where autoparallel does by default, `replays_graphs`): its program's ops then cost
    the host nothing per step (factor 0; the optimizer's host time is priced apart, `evaluate`)."""
    host = host_timing(cluster)
    if graph_priced(cluster, runtime, factor, cuda_graphs):
        return host.scaled(0.0, GRAPH_REPLAY)
    if factor is None:
        measured = host.runtime_factor if host.runtime_factor is not None else MPLAN_RUNTIME_HOST_FACTOR
        factor = measured if runtime == "mplan" and host.overlaps else 1.0
    return host if factor == 1.0 else host.scaled(factor, f"per op in {runtime}'s runtime (host_cost)")


GRAPH_REPLAY = ("the step's forwards and backwards replay as one CUDA graph (runtime/step_graph.py), whose "
                "launches the host paid once, at capture")
"""Why a graphed plan's program ops cost the host nothing. Measured on an H100 (2026-12-06,
benchmarks/results/peers_h100-2026-12-06-session14-b.json): a 12-layer Gemma-3's graphed step took
38.1 ms against 35.9 ms of GPU kernels (the same model's profiled step), where its eager step took
82.2 ms."""


def graph_priced(cluster: ClusterSpec, runtime: str, factor: float | None, cuda_graphs: bool | None) -> bool:
    """Whether `runtime_host` prices the program's ops as a CUDA graph's replay: asked for
    (`cuda_graphs`; None: where autoparallel does by default, `replays_graphs`), and no host
    factor given (a factor prices launches, as the calibration's eager steps pay them)."""
    return factor is None and (replays_graphs(cluster, runtime) if cuda_graphs is None else cuda_graphs)


def replays_graphs(cluster: ClusterSpec, runtime: str) -> bool:
    """Whether mplan's runtime replays a plan's steps as CUDA graphs by default on `cluster`
    (`autoparallel(cuda_graphs=None)`): one rank on a GPU. (FP8, zero 2 and 3 and outer loops, which
    it also runs eagerly, are not told apart here: a one-rank search prices them as graphed.)"""
    return runtime == "mplan" and cluster.world_size == 1 and host_timing(cluster).overlaps


def grad_values(graph: Graph) -> frozenset[str]:
    """Values a gradient flows to: parameters, and floating outputs of ops reading one of them
    (forward order). Buffers and integer inputs (ids, labels, RoPE's tables) need none."""
    needs = set(graph.params)
    for node in graph.nodes:
        if node.outputs and node.output.dtype in _FLOATING and any(a in needs for a in node.inputs):
            needs.add(node.name)
    return frozenset(needs)


def op_host(node: OpNode, host: HostTiming, *, fused: FusedSave | None, needs_grad: frozenset[str],
            head_chunks: int = 1) -> OpHost:
    """Host seconds of `node` (module docstring); `fused`: its entry in the planner's fused saves
    (None: it runs as its ATen op); `head_chunks`: chunks of rows of a fused head + loss."""
    if fused is not None and fused.inside:
        return OpHost(forward_s=0.0, backward_s=0.0)  # the anchor launches the chain's kernels
    if fused is not None and fused.kernel:
        n = entry(fused.kernel).launches
        chunks = head_chunks if n.forward_per_chunk else 1
        forward = host.view_op_s + chunks * (n.forward_triton * host.triton_launch_s + n.forward_aten * host.aten_op_s)
        backward = (max(0.0, host.backward_node_s - host.launch_s) + n.backward_triton * host.triton_launch_s
                    + n.backward_aten * host.aten_op_s)
        return OpHost(forward_s=forward, backward_s=backward)
    if node.kind in _PYTHON_ONLY:
        return OpHost(forward_s=0.0, backward_s=0.0)
    if node.kind == "view" or not node.outputs:
        forward = host.view_op_s
        backward = max(0.0, host.backward_node_s - host.launch_s) if node.name in needs_grad else 0.0
        return OpHost(forward_s=forward, backward_s=backward)
    grads = sum(1 for a, meta in zip(node.inputs, node.input_metas) if meta.dtype in _FLOATING and a in needs_grad)
    backward = host.backward_node_s + (grads - 1) * host.launch_s if node.name in needs_grad and grads else 0.0
    return OpHost(forward_s=host.aten_op_s, backward_s=backward)
