"""Peak memory of one GPU under a plan: parameters, gradients, optimizer state, activations, transients.

Role: the one memory model. The planner (`planner/evaluate.py`) calls `estimate_memory` for every
pipeline rank of every candidate (stage, mesh, schedule, recomputation, optimizer sharding) to
reject plans that do not fit, and reports its `MemoryBreakdown`. It knows nothing of graphs: the
planner feeds it numbers measured on the captured graph (`planner/unit_costs.py`).
Input: ``estimate_memory(...)``: the rank's local parameter count (after TP/PP; the experts' apart,
after EP, their optimizer state sharded over the ranks holding the same experts), whose
per-parameter accounting (``BytesPerParam``: Megatron's ``bytes_per_param`` or mplan's runtime's
``mplan_bytes_per_param``), ZeRO stage and DP size, activation bytes per microbatch per stage chunk
under each recomputation mode, the number of (chunk, microbatch) activations in flight
(``ir.schedule.max_in_flight`` on the schedule the rank runs), the recomputation mode, and the
largest single-op workspace.
Output: ``MemoryBreakdown`` in bytes (``.gib`` for GiB, ``.as_dict()`` for JSON).

Optimizer accounting (Megatron-LM's distributed optimizer, docs/source/api-guide/dist_optimizer.md):
bytes per parameter = parameter + gradient (never sharded at zero <= 1: Megatron's grad buffer stays
whole) + optimizer state, the last divided by DP when ``zero >= 1``. Optimizer state = an fp32 master
copy when parameters are narrower than fp32, Adam's two moments (fp32; fp64 for fp64 parameters) and
an fp32 copy of the gradient when gradients are kept in 16 bits. That reproduces Megatron's table:
  bf16 params, fp32 grads: 2 + 4 + 12      = 18  -> 6 + 12/d with the distributed optimizer
  fp16 params, fp16 grads: 2 + 2 + 4+8+4   = 20  -> 4 + 16/d
  fp32 params, fp32 grads: 4 + 4 + 8       = 16  -> 8 + 8/d
``mplan_bytes_per_param`` is mplan's own runtime instead, measured against on two H200s.
ZeRO-2 and ZeRO-3 (FSDP-style; ``BytesPerParam.total``), per local parameter:
  zero=2: param + grad_shard/d + optimizer/d, plus the gradients that exist whole between
          backward making them and their reduce-scatter into the shard (``grad_transient_bytes``:
          a bucket's gradients and the flat copies its reduce-scatters hold);
  zero=3: param_shard/d + grad_shard/d + optimizer/d, plus the gathered units in flight
          (``gathered_params``, the caller's count) in the gathered dtype, and the same gradient
          transient; with ``keep_weights`` the rank's whole gathered stage instead of the units in
          flight (held from the first forward to the last backward).
  bf16 under mplan's runtime: zero=2 2 + 16/d, zero=3 (2 + 16)/d; under Megatron's: 2 + 16/d and
  (2 + 4 + 12)/d.
  With ``grads_whole`` (mplan's runtime under a pipeline: its executor adds each stage's gradients
  into ``.grad`` itself, where no hook sees them, so zero 2 and 3 reduce-scatter every bucket at
  the step, runtime/sharded_optimizer.py) the parameters' whole gradients are held too, from the
  first backward to the step, beside the shard: zero=2 2 + 2 + 16/d, zero=3 keeping its weights
  2 + 2 + (2 + 16)/d. The step's reductions then drop each bucket's whole gradients as they
  flatten it (``reduction_peak``). On 4 gloo ranks (pp=2 x dp=2, a 16-layer bf16 Llama) zero=3's
  first stage peaked in its backward 5.4% above this prediction, 13.3% above the shard-only count
  (tests/test_zero23_pipeline_memory.py).
Gradient reductions (``reduction_peak``, mplan's runtime): zero=1 flattens every bucket's
gradients into a master-dtype copy for its reduce-scatter too, beside the whole gradients, at
most three in flight as at zero 2/3. The
copies a step's reductions hold rise as backward frees the activations, so the caller walks them
(``reduction_peak``) and passes their worst moment: the bytes (``grad_transient_bytes``) and the
activations still held then (``activations_beside_transient``); the peak holds the larger of all
the activations and the two together. On 4 gloo CPU ranks (a 4-layer Llama in bf16, dp=4) the
predicted peak came within 2% of the allocator's at zero 0-3 (zero=1 had been 38% low without
its copies; benchmarks/ranks/zero_memory.py, results/zero_memory-cpu-2026-12-06.json).
Activations: ``none`` keeps every in-flight microbatch's activations; ``selective`` keeps
``selective_activation_bytes`` per microbatch (Korthikanti et al. 2022: attention's softmax/dropout
recomputed, 34sbh instead of 34sbh + 5as^2b per layer); ``full`` keeps only each layer's input
(``checkpoint_bytes`` per microbatch) plus one layer's full activations while it is recomputed
(``layer_activation_bytes``: one unit re-runs at a time).
Gradients: held through the whole step where they live in buffers (DP buckets, Megatron's grad
buffer) or accumulate over several micro-batches; where they only exist from the backward on and
that backward frees each layer's activations as it makes its gradients (``grads_during_backward``:
mplan's runtime with one micro-batch and no data-parallel buckets), the peak holds the larger of
the two, not their sum, and ``activations_bytes`` reports only the activations above the gradients.
Transient: the largest single-op workspace plus FRAGMENTATION_FRACTION of everything else.
Invariants: every term >= 0; ``total == params + grads + optimizer + activations + transient``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mplan.cost_models.dtypes import canonical_dtype, dtype_bytes

RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
"""``adam`` (also AdamW): two moments; ``sgd``: one momentum buffer."""
FRAGMENTATION_FRACTION = 0.10
"""Share of allocated bytes lost to the caching allocator's fragmentation and the CUDA context: an
assumption (reports of PyTorch runs range from a few to ~10%), not measured here; erring high. It
is headroom, not bytes any tensor holds: `torch.cuda.max_memory_allocated` never sees it, so a
Plan's `memory_gib` reads this share above such a peak by construction (one H100, a 1.26B Llama
at zero 0, 1 and 3: +9.4% to +10.5%, while the prediction without it came within 0.6%;
benchmarks/results/zero_bench_h100-2026-12-06.json, tests/test_memory_model_gpu_rows.py).
What it stands for, reserved beyond allocated plus the context, is still unmeasured."""
GiB = float(1 << 30)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Peak bytes of one GPU, by what holds them."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float  # master weights + optimizer moments (+ fp32 grad copy), after ZeRO sharding
    activations_bytes: float  # saved for backward, all in-flight microbatches
    transient_bytes: float  # largest op workspace + fragmentation

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.transient_bytes)

    @property
    def gib(self) -> float:
        """Total in GiB (2^30 bytes)."""
        return self.total_bytes / GiB

    def as_dict(self) -> dict[str, float]:
        return {"params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes, "activations_bytes": self.activations_bytes,
                "transient_bytes": self.transient_bytes, "total_bytes": self.total_bytes, "total_gib": self.gib}


ZERO_LEVELS: tuple[int, ...] = (0, 1, 2, 3)
"""0 replicated optimizer; 1 optimizer state sharded over DP; 2 gradients too; 3 parameters too."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BytesPerParam:
    """Bytes each local parameter costs, before ZeRO sharding."""

    param: float  # the parameter as the forward reads it (whole at zero <= 2; gathered at zero=3)
    grad: float  # its gradient as backward makes it (held whole at zero <= 1)
    optimizer: float  # master + moments (+ fp32 grad copy at zero <= 1), sharded over DP at zero >= 1
    # bytes per element of the gradient shard a zero >= 2 reduce-scatter accumulates into (None: `grad`)
    grad_shard: float | None = None
    # bytes per element of zero=3's persistent parameter shard, the one the all-gathers read (None:
    # `param`; 0: the gathers read the master shard, counted in `optimizer`)
    param_shard: float | None = None

    def shard_bytes(self) -> tuple[float, float]:
        """(parameter shard, gradient shard) bytes per element at zero=3 (zero=2: the second)."""
        return (self.param if self.param_shard is None else self.param_shard,
                self.grad if self.grad_shard is None else self.grad_shard)

    def total(self, *, zero: int = 0, dp: int = 1, keep_weights: bool = False, grads_whole: bool = False) -> float:
        """Bytes a local parameter holds through the step at `zero` over `dp` replicas, the
        transients of zero 2 and 3 apart (one unit's gradients, the gathered units in flight), but
        with zero=3's weights whole where it keeps them through the step (`keep_weights`) and zero
        2 and 3's gradients whole beside their shard where the runtime reduces them at the step
        (`grads_whole`, module docstring)."""
        check_zero(zero)
        param_shard, grad_shard = self.shard_bytes()
        optimizer = self.optimizer / (dp if zero else 1)
        if zero <= 1:
            return self.param + self.grad + optimizer
        whole_grads = self.grad if grads_whole else 0.0
        if zero == 2:
            return self.param + grad_shard / dp + whole_grads + optimizer
        return param_shard / dp + grad_shard / dp + whole_grads + optimizer + (self.param if keep_weights else 0.0)


def check_zero(zero: object) -> None:
    if zero not in ZERO_LEVELS or isinstance(zero, bool):
        raise ValueError(f"zero must be 0, 1, 2 or 3 (1 optimizer state sharded over DP, 2 gradients too, 3 "
                         f"parameters too), got {zero!r}")


def bytes_per_param(param_dtype: object = "bf16", grad_dtype: object = "fp32", optimizer: str = "adam", *,
                    fp32_grad_copy: bool = True) -> BytesPerParam:
    """Megatron's per-parameter accounting (module docstring). `fp32_grad_copy=False` describes
    mplan's runtime, which reduces 16-bit gradients bucket by bucket straight into the fp32 master
    shard's update and keeps no persistent fp32 copy of them. At zero 2 and 3 (Megatron-FSDP) the
    gradient shard is the main gradient's dtype and the parameter shard the parameters' (its model
    weight buffer, beside the fp32 main weights in `optimizer`)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    param, grad = dtype_bytes(param_dtype), dtype_bytes(grad_dtype)
    state = 8 if canonical_dtype(param_dtype) == "fp64" else 4
    master = 4 if param < 4 else 0
    grad_copy = 4 if grad < 4 and fp32_grad_copy else 0
    moments = (2 if optimizer == "adam" else 1) * state
    return BytesPerParam(param=param, grad=grad, optimizer=master + moments + grad_copy)


def mplan_bytes_per_param(param_dtype: object = "bf16", *, zero: int) -> BytesPerParam:
    """mplan's runtime with torch's Adam(W) (mplan/runtime/replicated_optimizer.py and
    sharded_optimizer.py): gradients in the parameters' dtype, no fp32 copy of them. zero=0 steps
    the parameters themselves (two moments in their dtype, no master: bf16 2 + 2 + 4 = 8 bytes);
    zero=1 keeps a master shard in at least fp32 with its gradient and fp32 moments
    (bf16 2 + 2 + 16/d). zero 2 and 3 (runtime/sharded_optimizer.py, fully_sharded.py) reduce-scatter
    each bucket's gradients into a gradient shard in the master's dtype beside the master and its
    moments (bf16 2 + 16/d); zero=3 keeps the parameters' shard in their own dtype for the gathers to
    read, where that is narrower than the master (bf16 (2 + 16)/d; fp32 gathers the master itself,
    16/d). Read off the runtime's layout; held, with the reductions' copies (`reduction_peak`), to
    the allocator's peak on 4 gloo CPU ranks at zero 0-3 (benchmarks/ranks/zero_memory.py), not yet
    on a GPU."""
    check_zero(zero)
    param = dtype_bytes(param_dtype)
    if not zero:
        return BytesPerParam(param=param, grad=param, optimizer=2 * param)
    master = max(param, 4)
    if zero == 1:
        return BytesPerParam(param=param, grad=param, optimizer=4 * master)
    return BytesPerParam(param=param, grad=param, optimizer=3 * master, grad_shard=master,
                         param_shard=param if param < master else 0.0)


def activation_bytes_kept(*, recompute: str, activation_bytes: float, num_in_flight: int,
                          selective_activation_bytes: float | None = None, checkpoint_bytes: float | None = None,
                          layer_activation_bytes: float = 0.0) -> float:
    """Activation bytes held at the peak for one rank (all in-flight microbatches)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {recompute!r}; expected one of {', '.join(RECOMPUTE_MODES)}")
    if num_in_flight < 0:
        raise ValueError(f"num_in_flight must be >= 0, got {num_in_flight}")
    if recompute == "none":
        return num_in_flight * activation_bytes
    if recompute == "selective":
        if selective_activation_bytes is None:
            raise ValueError("recompute='selective' needs selective_activation_bytes")
        return num_in_flight * selective_activation_bytes
    if checkpoint_bytes is None:
        raise ValueError("recompute='full' needs checkpoint_bytes (the stage's layer inputs per microbatch)")
    return num_in_flight * checkpoint_bytes + (layer_activation_bytes if num_in_flight else 0.0)


def backward_peak(kept: Sequence[float], working: Sequence[float], grads: Sequence[float],
                  again: Sequence[float]) -> float:
    """The most activations and gradients one micro-batch's backward holds at once, walked unit by
    unit in reverse (``grads_during_backward``: no gradient buffer, each unit's gradients appear as
    its backward runs and its activations go). While unit u's backward runs, the units before it
    keep what they keep (``kept``: all, selective or their checkpointed inputs), u holds its working
    set (``working``: all its activations, recomputed where it was checkpointed), the gradients the
    units after it made are held, and u's own appear (``grads[u]``, of which ``again[u]`` are of a
    tied parameter whose gradient a later unit made: a second gradient, added into the first and
    dropped). The first moment is the end of the forward, every unit's ``kept`` held.

    Why a walk: under full recomputation the units keep little (a layer's input), and the peak
    comes late, nearly every gradient made while the first layer re-runs and the embedding's
    backward makes its tied weight's gradient again; the larger of all the activations and all
    the gradients missed it by 9.5-11% of the peak on an H100 (Gemma-2B, Qwen3-1.7B and
    SmolLM2-1.7B shapes at micro-batch 8: 1.4-2.1 GiB, benchmarks/calibration/bench_cli.py)."""
    if not len(kept) == len(working) == len(grads) == len(again):
        raise ValueError("backward_peak: one kept, working, grads and again figure per unit")
    before = sum(kept)
    peak, made = before, 0.0
    for u in reversed(range(len(kept))):
        before -= kept[u]
        peak = max(peak, before + working[u] + made + grads[u])
        made += grads[u] - again[u]
    return peak


def estimate_memory(*, num_params: float, per_param: BytesPerParam, zero: int = 0, dp: int = 1,
                    expert_params: float = 0.0, expert_dp: int = 1, keep_weights: bool = False,
                    gathered_params: float = 0.0, grad_transient_bytes: float = 0.0,
                    activations_beside_transient: float | None = None,
                    activation_bytes: float, num_in_flight: int,
                    recompute: str = "none",
                    selective_activation_bytes: float | None = None, checkpoint_bytes: float | None = None,
                    layer_activation_bytes: float = 0.0, largest_workspace_bytes: float = 0.0,
                    fragmentation: float = FRAGMENTATION_FRACTION,
                    grads_during_backward: bool = False, backward_peak_bytes: float | None = None,
                    grads_whole: bool = False) -> MemoryBreakdown:
    """Peak memory of one rank whose parameters cost `per_param` each (before ZeRO sharding).

    ``activation_bytes`` (and ``selective_activation_bytes``, ``checkpoint_bytes``) are per
    microbatch per stage chunk; ``num_in_flight`` counts (chunk, microbatch) pairs, as
    ``max_in_flight`` does, so interleaved stages need no special case. ``grads_during_backward``:
    see the module docstring (on one H200, a Llama of 8 layers of hidden 8192 at one sequence of
    4096 peaked at 70.4 GiB: 80.9 GiB counting both, 68.6 GiB counting the larger).
    ``expert_params``: the rank's share of MoE experts' parameters (E/ep experts a layer), on top of
    its ``num_params``; ZeRO shards their optimizer state over the ``expert_dp`` ranks that hold the
    same experts (``ir/mesh.py``), not over all ``dp``; so do zero 2 and 3 their gradients and
    parameters. ``gathered_params`` (zero=3 without ``keep_weights``): elements of the units
    gathered at once; ``grad_transient_bytes`` (zero >= 1): what the gradient reductions hold at
    their worst moment beyond the gradients held through the step (zero=1: the flat copies of every
    bucket until the step; zero 2/3: a bucket's gradients whole and the copies in flight), and
    ``activations_beside_transient`` the activations the backward still holds then (None: all of
    them); the peak is the larger of the activations and the two together (``reduction_peak``
    walks the reductions for both). Both counted by the caller, who knows the units.
    ``grads_whole`` (zero >= 2): the gradients are held whole from the first backward to the step
    beside their shard, and reduced there (module docstring); ``grad_transient_bytes`` then counts
    from them (``reduction_peak``'s ``grads_whole``).
    """
    check_zero(zero)
    if dp < 1 or num_params < 0 or activation_bytes < 0 or largest_workspace_bytes < 0 or not 0 <= fragmentation < 1:
        raise ValueError("estimate_memory: dp >= 1, non-negative sizes and 0 <= fragmentation < 1 required")
    if expert_dp < 1 or dp % expert_dp or expert_params < 0:
        raise ValueError(f"estimate_memory: expert_dp must divide dp (it is dp / ep) and expert_params be >= 0, got "
                         f"dp={dp}, expert_dp={expert_dp}, expert_params={expert_params}")
    if gathered_params < 0 or grad_transient_bytes < 0 or (activations_beside_transient or 0) < 0 or \
            (keep_weights and zero != 3):
        raise ValueError(f"estimate_memory: gathered_params, grad_transient_bytes and activations_beside_transient "
                         f"must be >= 0 and keep_weights needs zero=3, got {gathered_params}, {grad_transient_bytes}, "
                         f"{activations_beside_transient}, keep_weights={keep_weights} at zero={zero}")
    held = num_params + expert_params
    param_shard, grad_shard = per_param.shard_bytes()
    if zero <= 2:
        params = held * per_param.param
    else:
        whole = held if keep_weights else min(gathered_params, held)
        params = (num_params / dp + expert_params / expert_dp) * param_shard + whole * per_param.param
    if zero <= 1:
        grads = held * per_param.grad
    else:
        grads = (num_params / dp + expert_params / expert_dp) * grad_shard
        grads += held * per_param.grad if grads_whole else 0.0
    opt = num_params * per_param.optimizer / (dp if zero else 1) + \
        expert_params * per_param.optimizer / (expert_dp if zero else 1)
    acts = activation_bytes_kept(recompute=recompute, activation_bytes=activation_bytes, num_in_flight=num_in_flight,
                                 selective_activation_bytes=selective_activation_bytes,
                                 checkpoint_bytes=checkpoint_bytes, layer_activation_bytes=layer_activation_bytes)
    if grads_during_backward:  # the activations above the gradients at the backward's peak
        acts = max(0.0, (acts if backward_peak_bytes is None else backward_peak_bytes) - grads)
    beside = acts if activations_beside_transient is None else min(acts, activations_beside_transient)
    if grad_transient_bytes and beside + grad_transient_bytes >= acts:  # the peak is the reductions'
        grads, acts = grads + grad_transient_bytes, beside
    transient = largest_workspace_bytes + fragmentation * (params + grads + opt + acts + largest_workspace_bytes)
    return MemoryBreakdown(params_bytes=params, grads_bytes=grads, optimizer_bytes=opt, activations_bytes=acts,
                           transient_bytes=transient)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReductionPeak:
    """The worst moment of a rank's gradient reductions in a step (`reduction_peak`), in bytes."""

    transient_bytes: float  # what the reductions hold then, besides the gradients held through the step
    activations_bytes: float | None  # the activations the backward still holds then (None: all of them)


def reduction_peak(buckets: Sequence[float], activations_left: Sequence[float], *, zero: int,
                   per_param: BytesPerParam, copy_bytes: float, replicas: int, outstanding: int,
                   micro_batches: int = 1, activation_bytes: float = 0.0,
                   backend_copies: bool = False, grads_whole: bool = False) -> ReductionPeak:
    """One step's gradient reductions walked as mplan's runtime issues them
    (runtime/sharded_optimizer.py), and their worst moment: the most they hold together with the
    activations still held then (at least: no reduction beside all the activations).

    `buckets`: each bucket's local elements in the order backward completes them;
    `activations_left[k]`: the activations backward still holds once bucket k's gradients are all
    in; `activation_bytes`: one micro-batch's, all held when its backward starts.
    zero=1: the last micro-batch's backward flattens each bucket's gradients into a copy in the
    master dtype (`copy_bytes` an element) and reduce-scatters it into the master's gradient shard
    (the gradients themselves are whole through the step, counted apart). zero 2/3: every
    micro-batch's backward does so, the bucket's gradients (`per_param.grad`) whole until
    flattened, then dropped; a reduction also holds its result (1/`replicas` of the bucket in the
    master dtype), into the next micro-batch. At every level the runtime keeps at most
    `outstanding` reductions (a new one launches, then the oldest is waited for and dropped).
    What a reduction in flight holds is the backend's: gloo (`backend_copies`, CPU ranks) reduces a
    copy of its input made at launch (ours is freed once the launch returns) and keeps it until the
    runtime drops the work; NCCL reduces the copy itself. One replica: nothing stays in flight.
    `grads_whole` (zero >= 2 under mplan's pipelines): the reductions run once, at the step, the
    bucket's gradients already counted among the whole gradients held through the step; each
    reduction drops its bucket's once flattened, so the moments count what the step has dropped
    so far against what its reductions hold.
    (Before zero=1's reductions were bounded, gloo held a copy of every bucket until the step:
    on 2 gloo ranks, 16 buckets of 8 Linear(128, 128) layers in fp32, 1.06 MB of copies against
    0.26 MB bounded.)"""
    check_zero(zero)
    if len(buckets) != len(activations_left):
        raise ValueError(f"reduction_peak: {len(buckets)} buckets and {len(activations_left)} activation figures")
    peak = ReductionPeak(transient_bytes=0.0, activations_bytes=activation_bytes)
    if zero == 0:
        return peak
    pending: list[float] = []  # what each reduction in flight holds, oldest first
    in_flight = 0.0  # their sum
    dropped = 0.0  # (grads_whole) the whole gradients the step's reductions have dropped so far
    # the worst moment so far, (activations, held) and their sum: a moment is (activations left,
    # what the reductions hold then), compared by that sum in place (a search walks millions)
    worst_left, worst_held = activation_bytes, 0.0
    worst = worst_left + worst_held
    # a third micro-batch starts as the second did (the same reductions still in flight): two suffice
    for micro_batch in range(min(micro_batches, 2) if zero >= 2 and not grads_whole else 1):
        if micro_batch and activation_bytes + in_flight > worst:
            worst_left, worst_held, worst = activation_bytes, in_flight, activation_bytes + in_flight
        for size, left in zip(buckets, activations_left):
            copy = size * copy_bytes
            if zero >= 2:  # the bucket's gradients beside their copy, until dropped
                held = in_flight - dropped + copy + (0.0 if grads_whole else size * per_param.grad)
                if left + held > worst:
                    worst_left, worst_held, worst = left, held, left + held
                dropped += size * per_param.grad if grads_whole else 0.0
            if replicas == 1:
                held = in_flight - dropped + copy
                if left + held > worst:
                    worst_left, worst_held, worst = left, held, left + held
                continue
            pending.append(copy + (size / replicas * copy_bytes if zero >= 2 else 0.0))
            in_flight += pending[-1]
            held = in_flight - dropped + (copy if backend_copies else 0.0)
            if left + held > worst:
                worst_left, worst_held, worst = left, held, left + held
            if len(pending) > outstanding:
                in_flight -= pending.pop(0)
    return ReductionPeak(transient_bytes=worst_held, activations_bytes=worst_left)
