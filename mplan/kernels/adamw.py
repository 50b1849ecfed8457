"""Multi-tensor Adam/AdamW: one Triton launch updates every parameter of a dtype and device.

    applies(optimizer) -> bool          `step` reproduces this torch Adam/AdamW's step() by the kernel
    step(optimizer, grad_scale=None, copies=None)
                                        one optimizer step of every param group, torch's state kept

Why: torch's fused AdamW took 9.5 ms of a 254 ms GPT-1.3B step on the H200 (1.42B bf16
parameters in ~300 tensors), 49% of the copy bandwidth; its fewest bytes (read p, g, m, v,
write p, m, v) take 4.7 ms there.

Math, per element, in fp32 (float64 parameters, on the reference: float64), each stored value
rounded once, with the formulas of torch's fused kernel (`_fused_adam` in torch/optim/adam.py;
`_single_tensor_adam` differs only in how it rounds intermediates); g is the gradient, s the
step after its increment:
    g = g / grad_scale                              (if given; and g is stored back so divided)
    p = p * (1 - lr * wd)                           AdamW (decoupled weight decay)
    g = g + wd * p                                  Adam (L2 weight decay), when wd != 0
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / (1 - beta1^s)) * m / (sqrt(v) / sqrt(1 - beta2^s) + eps)
The per-tensor scalars (bias corrections, step size, 1 - lr * wd) are computed in float64 and
rounded to fp32 once, as torch computes them in Python floats; divisions and square roots are
IEEE round-to-nearest (`div_rn`, `sqrt_rn`), not Triton's approximate defaults. torch's fused
kernel keeps a few element-wise products in float64, so fp32 results may differ from it in the
last place; for 16-bit parameters both round one fp32 value, and torch's for-loop and foreach
paths, which round every intermediate to 16 bits, differ from both by a rounding or two.

Compute copies (`copies`: parameter -> a copy in a narrower dtype, mplan/runtime/compute_copies.py,
Megatron's bf16 weights beside fp32 masters): such a parameter's gradient is read from its
copy's `.grad` (in the copy's dtype; the parameter's own `.grad` is not used) and the kernel
writes the updated parameter, rounded, into the copy in the same pass: 2 bytes a parameter
more, where refreshing the copy apart would read the parameter again.

Kernel: programs walk a work list of (tensor, chunk) pairs, a chunk being `blocks_per_chunk`
blocks of BLOCK elements, and reach their tensor through a table, one row of int64 words per
tensor:
    param, grad, exp_avg, exp_avg_sq and step addresses (0: step read on the host), numel,
    then as float64 bits: lr, beta1, beta2, eps, AdamW decay, Adam (L2) decay, host step,
    then the compute copy's address (0: none).
Gradients are reallocated by autograd every step (mplan keeps no gradient buffer at dp=1), so
the table is written on the host every step (only the words that change, on the plan's path:
below) and reaches the GPU in one pinned, non-blocking copy; the work list depends only on the
tensors' sizes and is cached. Full blocks load and store unmasked, 16 bytes at a time when
every address is 16-byte aligned (the `ALIGNED` launch; gradients that are views into a bucket
at an odd offset go to a second launch); a tensor's last block is masked. No autotuning: the
kernel updates in place, so a timing trial would step the optimizer.

Steps (torch's state, kept exactly: `step`, `exp_avg`, `exp_avg_sq`, same dtypes and devices,
created lazily as torch creates them): a float32 step on the parameter's device (fused groups)
is incremented by one `torch._foreach_add_` and read by the kernel through its address; a step
on the CPU (torch's for-loop and foreach groups) is incremented there (on the plan's path
through a ctypes float over its memory: `_foreach_add_` dispatches per CPU scalar) and its value
written into the table, so no step costs a device-to-host sync. `optimizer.state_dict()`,
`load_state_dict()`, learning-rate schedulers (the table reads `group["lr"]` every step) and
torch's own `optimizer.step()` work before, after and between these steps.

Invariants: `step` takes every Adam/AdamW whose options and states it implements; tensors the
kernel cannot take (no Triton for the device or dtype, float64, tensor subclasses,
non-contiguous, mixed dtypes) are updated by the reference, with the same formulas. `applies` is true only where every
parameter takes the kernel, so the runtime never relies on the reference. found_inf (AMP's
skipped steps) is not supported.

Plan (`_Plan`, cached per optimizer): the first step, and any step after the optimizer changed,
takes the full path (every parameter checked, states made, the tables packed) and leaves a plan:
its launches with their tables, the parameters and state tensors they were made from, and the
`applies` answer once asked. The next steps check it by identity (the same groups and
parameters, the same state tensors, the same parameter addresses; gradients on exactly the
planned parameters, each of a kind the kernel takes) and write only the words that change into
the kept tables: gradient addresses, every group's hyperparameters (so a scheduler's lr is read
each step), CPU steps. Anything else (load_state_dict, add_param_group, a state entry replaced, a
gradient that became None or appeared) sends the step down the full path, which plans anew.

Cost: 7 bytes per parameter byte moved (read p, g, m, v; write p, m, v), 8 with `grad_scale`
(with a compute copy the gradient's bytes are the copy dtype's, and the copy's are written);
plus per step one host-to-device copy of 112 bytes per tensor and, for device steps, one
`_foreach_add_`. Host work, measured on this repository's 2-core CPU with the kernel launch
stubbed (389 fp32 tensors of GPT-1.3B's layout, each dimension / 32; `applies` then `step`,
median of 100): 0.64 ms a step on the plan (`applies` 0.16 ms; `step` ~1.2 us a parameter: the
identity checks again, and each gradient's checks and address), where the full path, which
every step took before plans, takes 5.5 ms (`applies` 1.5 ms); a step that plans anew 6.1 ms.
Not counted (they run only with a GPU): Triton's launch, the pinned copy and, for device steps,
the `_foreach_add_` launch. For scale, torch's fused step took 2.6-2.8 ms of host time on the
H200's host (benchmarks/results/optimizer_h200-2026-11-29-first.json). mplan's train_step
syncs only after the optimizer, so host work overlaps the GPU's backward.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import numbers
import struct
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.optim.optimizer as torch_optimizer

from mplan.kernels.dispatch import INTERPRET, tl, triton, use_triton

_ROW = 14
"""int64 words per tensor in the table (layout in the module docstring)."""

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""Parameter dtypes the kernel streams (name of the Triton dtype)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """The kernel's launch shape: each program updates one chunk of `block * blocks_per_chunk`
    elements of one tensor, a block at a time."""

    block: int
    """Elements per block (a power of two): each thread holds block / (32 num_warps) of each stream."""
    blocks_per_chunk: int
    """Blocks per program: more spreads the program's start (work item, table row, step: three
    dependent loads) over more data."""
    num_warps: int

    @property
    def chunk(self) -> int:
        return self.block * self.blocks_per_chunk


def default_config(dtype: torch.dtype) -> LaunchConfig:
    """2 KiB of each stream per block (1024 bf16 or 512 fp32 elements: one 16-byte vector per
    thread and stream at 4 warps), four blocks per program: the fastest of 24 launch shapes for
    GPT-1.3B's bf16 parameters on the H200 (5.66 ms with a grad_scale, 95% of copy bandwidth;
    torch's fused AdamW 8.50 ms) and within 2% of the fastest for fp32 (11.14 against 10.94 ms;
    torch 13.22) (benchmarks/results/optimizer_h200-2026-11-29.json). Under the interpreter
    128-element blocks, two per chunk, so tiny tests run full, partial and empty blocks."""
    if INTERPRET:
        return LaunchConfig(block=128, blocks_per_chunk=2, num_warps=1)
    return LaunchConfig(block=2048 // dtype.itemsize, blocks_per_chunk=4, num_warps=4)


def _kernel_streams(param: torch.Tensor) -> bool:
    """The kernel can update `param`: a plain tensor (a subclass's data_ptr need not be its data)
    of a dtype the kernel streams, on a device Triton runs on."""
    return type(param) in (torch.Tensor, torch.nn.Parameter) and param.dtype in _KERNEL_DTYPES and use_triton(param)


class _Hyper(NamedTuple):
    """One param group's options, in the order of the table's float words. (Named tuples, here and
    in `_Update`: they are made per parameter per step, at a fraction of a frozen dataclass's cost.)"""

    lr: float
    beta1: float
    beta2: float
    eps: float
    decoupled_decay: float
    """AdamW's weight decay (0 for Adam)."""
    l2_decay: float
    """Adam's weight decay, added to the gradient (0 for AdamW)."""

    @staticmethod
    def of(group: dict, optimizer: torch.optim.Optimizer) -> _Hyper:
        beta1, beta2 = group["betas"]
        decay = float(group["weight_decay"])
        # torch < 2.7 has no such key: its AdamW was a class of its own
        decoupled = bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))
        return _Hyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                      decoupled_decay=decay if decoupled else 0.0, l2_decay=0.0 if decoupled else decay)


class _Update(NamedTuple):
    """One parameter's tensors for one step (exp_avg and exp_avg_sq have the parameter's shape,
    dtype and device: `_unsupported_param` checked an existing state, `_init_state` made a new one)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    """torch's state["step"], already incremented."""
    hyper: _Hyper
    group: int
    """The index of its param group."""
    copy: torch.Tensor | None = None
    """Its compute copy, whose `.grad` is `grad` and which the step rewrites; None: none."""

    @property
    def grad_dtype(self) -> torch.dtype:
        """The gradient's dtype the kernel streams: the copy's, or the parameter's."""
        return self.param.dtype if self.copy is None else self.copy.dtype

    def kernel_takes(self) -> bool:
        p, grad, copy = self.param, self.grad, self.copy
        return (_kernel_streams(p) and type(grad) is torch.Tensor and grad.dtype == self.grad_dtype
                and grad.device == p.device and p.is_contiguous() and grad.is_contiguous()
                and self.exp_avg.is_contiguous() and self.exp_avg_sq.is_contiguous()
                and (copy is None or (_kernel_streams(copy) and copy.device == p.device and copy.is_contiguous()))
                and (self.step.device.type == "cpu" or self._step_on_device()))

    def _step_on_device(self) -> bool:
        """The kernel reads the step through its address (else its value goes into the table)."""
        return self.step.dtype == torch.float32 and self.step.device == self.param.device

    def table_row(self) -> tuple[int | float, ...]:
        """The tensor's row of the kernel's table, as the module docstring lays it out."""
        on_device = self._step_on_device()
        return (self.param.data_ptr(), self.grad.data_ptr(), self.exp_avg.data_ptr(), self.exp_avg_sq.data_ptr(),
                self.step.data_ptr() if on_device else 0, self.param.numel(),
                *self.hyper, 0.0 if on_device else self.step.item(), 0 if self.copy is None else self.copy.data_ptr())


# -- the kernel ---------------------------------------------------------------------------------


@triton.jit
def _address(word_ptr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The tensor address stored at `word_ptr`, as a pointer to DTYPE (hinted 16-byte aligned)."""
    pointer = tl.load(word_ptr).to(tl.pointer_type(DTYPE))
    if ALIGNED:  # on the pointer: Triton's alignment analysis drops a hint on the integer before the cast
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _power(base, exponent):
    """base ** exponent for a whole-number float64 exponent >= 0, by squaring (float64 multiplies
    only: no transcendental whose accuracy differs between the compiler and the interpreter)."""
    n = exponent.to(tl.int64)
    result = base * 0.0 + 1.0
    while n > 0:
        if (n & 1) == 1:
            result = result * base
        base = base * base
        n = n >> 1
    return result


@triton.jit
def _update_block(param_ptrs, grad_ptrs, exp_avg_ptrs, exp_avg_sq_ptrs, copy_ptrs, mask, grad_scale, decay_factor,
                  l2_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps,
                  HAS_GRAD_SCALE: tl.constexpr, HAS_COPY: tl.constexpr):
    """One block of one tensor (`mask` None: all of it in range); the scalars are fp32."""
    dtype = param_ptrs.dtype.element_ty
    param = tl.load(param_ptrs, mask=mask).to(tl.float32)
    grad = tl.load(grad_ptrs, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptrs, mask=mask).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptrs, mask=mask).to(tl.float32)
    if HAS_GRAD_SCALE:
        grad = tl.div_rn(grad, grad_scale)
        tl.store(grad_ptrs, grad.to(grad_ptrs.dtype.element_ty), mask=mask)
    param = param * decay_factor  # exactly param when there is no decoupled decay (factor 1.0)
    if l2_decay != 0.0:
        grad = grad + l2_decay * param
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - tl.div_rn(step_size * exp_avg, denom)
    tl.store(param_ptrs, param.to(dtype), mask=mask)
    if HAS_COPY:  # rounded from the fp32 value: the same as rounding the stored parameter, when it is fp32
        tl.store(copy_ptrs, param.to(copy_ptrs.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptrs, exp_avg.to(dtype), mask=mask)
    tl.store(exp_avg_sq_ptrs, exp_avg_sq.to(dtype), mask=mask)


@triton.jit
def _adam_kernel(work_ptr, int_table, float_table, grad_scale_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCKS_PER_CHUNK: tl.constexpr, DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
                 HAS_GRAD_SCALE: tl.constexpr, HAS_COPY: tl.constexpr, ALIGNED: tl.constexpr):
    item = tl.program_id(0).to(tl.int64) * 2
    tensor = tl.load(work_ptr + item).to(tl.int64)
    chunk_start = tl.load(work_ptr + item + 1).to(tl.int64) * (BLOCK * BLOCKS_PER_CHUNK)
    ints = int_table + tensor * ROW
    floats = float_table + tensor * ROW
    param_ptr = _address(ints, DTYPE, ALIGNED)
    grad_ptr = _address(ints + 1, GRAD_DTYPE, ALIGNED)
    copy_ptr = _address(ints + 13, GRAD_DTYPE, ALIGNED)  # read only with HAS_COPY
    exp_avg_ptr = _address(ints + 2, DTYPE, ALIGNED)
    exp_avg_sq_ptr = _address(ints + 3, DTYPE, ALIGNED)
    step_address = tl.load(ints + 4)
    numel = tl.load(ints + 5)
    lr = tl.load(floats + 6)
    beta1 = tl.load(floats + 7)
    beta2 = tl.load(floats + 8)
    eps = tl.load(floats + 9).to(tl.float32)
    decay_factor = (1.0 - lr * tl.load(floats + 10)).to(tl.float32)
    l2_decay = tl.load(floats + 11).to(tl.float32)
    if step_address != 0:
        step = tl.load(step_address.to(tl.pointer_type(tl.float32))).to(tl.float64)
    else:
        step = tl.load(floats + 12)
    step_size = (lr / (1.0 - _power(beta1, step))).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1.0 - _power(beta2, step)).to(tl.float32)
    one_minus_beta1 = (1.0 - beta1).to(tl.float32)
    one_minus_beta2 = (1.0 - beta2).to(tl.float32)
    beta1 = beta1.to(tl.float32)
    beta2 = beta2.to(tl.float32)
    grad_scale = 1.0
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr)
    for block in range(BLOCKS_PER_CHUNK):
        offsets = chunk_start + block * BLOCK + tl.arange(0, BLOCK)
        if chunk_start + (block + 1) * BLOCK <= numel:
            _update_block(param_ptr + offsets, grad_ptr + offsets, exp_avg_ptr + offsets, exp_avg_sq_ptr + offsets,
                          copy_ptr + offsets, None, grad_scale, decay_factor, l2_decay, beta1, one_minus_beta1, beta2,
                          one_minus_beta2, step_size, bias_correction2_sqrt, eps, HAS_GRAD_SCALE, HAS_COPY)
        elif chunk_start + block * BLOCK < numel:
            _update_block(param_ptr + offsets, grad_ptr + offsets, exp_avg_ptr + offsets, exp_avg_sq_ptr + offsets,
                          copy_ptr + offsets, offsets < numel, grad_scale, decay_factor, l2_decay, beta1,
                          one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps,
                          HAS_GRAD_SCALE, HAS_COPY)


# -- the host side ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _work_list(numels: tuple[int, ...], chunk: int, device: torch.device) -> torch.Tensor:
    """[chunks, 2] int32 on `device`: (tensor index, chunk index) of every `chunk`-element chunk."""
    counts = torch.tensor([-(-n // chunk) for n in numels], dtype=torch.int64)
    tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    index = torch.arange(tensor.numel()) - first  # the chunk's index within its tensor
    return torch.stack([tensor, index], 1).to(torch.int32).to(device)


def _pack(rows: list[tuple[int | float, ...]]) -> np.ndarray:
    """[tensors, _ROW] int64: the table rows, float words as float64 bits."""
    packed = bytearray(struct.pack("<" + "6q7dq" * len(rows), *(word for row in rows for word in row)))
    return np.frombuffer(packed, dtype=np.int64).reshape(len(rows), _ROW)


def _table(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """`table` on `device` in one pinned non-blocking copy from the host. A fresh pinned buffer each
    step: torch's host allocator does not hand it out again before its copy has run, and the caller
    may overwrite `table` at once (on the CPU the kernel reads `table` itself, synchronously)."""
    host = torch.from_numpy(table)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _launch(table: np.ndarray, numels: tuple[int, ...], device: torch.device, dtype: torch.dtype, *, aligned: bool,
            grad_scale: torch.Tensor | None, config: LaunchConfig, copy_dtype: torch.dtype | None = None) -> None:
    """One kernel over the tensors of `table` (one device and dtype; `numels` is its numel column;
    `copy_dtype`: every row has a compute copy, of that dtype, as are their gradients)."""
    work = _work_list(numels, config.chunk, device)
    if work.numel() == 0:
        return
    table_on_device = _table(table, device)
    scale = table_on_device if grad_scale is None else grad_scale.to(device=device, dtype=torch.float32)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _adam_kernel[(work.shape[0],)](work, table_on_device, table_on_device.view(torch.float64), scale, ROW=_ROW,
                                       BLOCK=config.block, BLOCKS_PER_CHUNK=config.blocks_per_chunk,
                                       DTYPE=getattr(tl, _KERNEL_DTYPES[dtype]),
                                       GRAD_DTYPE=getattr(tl, _KERNEL_DTYPES[copy_dtype or dtype]),
                                       HAS_GRAD_SCALE=grad_scale is not None, HAS_COPY=copy_dtype is not None,
                                       ALIGNED=aligned,
                                       num_warps=config.num_warps)


def _update_reference(u: _Update, grad_scale: torch.Tensor | None) -> None:
    """The kernel's formulas in torch ops, computing in the parameter dtype promoted to fp32."""
    compute = torch.promote_types(u.param.dtype, torch.float32)
    h = u.hyper
    step = u.step.to(torch.float64)  # a 0-dim tensor: no device-to-host sync for a device step
    step_size = (h.lr / (1 - h.beta1**step)).to(compute)
    bias_correction2_sqrt = (1 - h.beta2**step).sqrt().to(compute)
    grad = u.grad.to(compute)
    if grad_scale is not None:
        grad = grad / grad_scale.to(device=grad.device, dtype=compute)
        u.grad.copy_(grad)
    param = u.param.to(compute) * (1 - h.lr * h.decoupled_decay)
    if h.l2_decay != 0:
        grad = grad + h.l2_decay * param
    exp_avg = h.beta1 * u.exp_avg.to(compute) + (1 - h.beta1) * grad
    exp_avg_sq = h.beta2 * u.exp_avg_sq.to(compute) + (1 - h.beta2) * grad * grad
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + h.eps
    param = param - step_size * exp_avg / denom
    u.param.copy_(param)
    if u.copy is not None:
        u.copy.copy_(param)
    u.exp_avg.copy_(exp_avg)
    u.exp_avg_sq.copy_(exp_avg_sq)


def _init_state(state: dict, param: torch.Tensor, group: dict) -> None:
    """torch's lazy state (`Adam._init_group`): the step on the parameter's device in float32 for
    fused (or capturable) groups, else on the CPU in float32 (float64 under a float64 default dtype)."""
    if group["fused"] or group["capturable"]:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
    else:
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state["step"] = torch.tensor(0.0, dtype=scalar)
    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _prepare(optimizer: torch.optim.Optimizer, copies: Mapping[torch.Tensor, torch.Tensor]) -> list[_Update]:
    """Every parameter with a gradient (its copy's, where it has a copy), its state made if new and
    its step incremented (torch's order)."""
    _refuse(_unsupported_options(optimizer))
    updates = []
    for index, group in enumerate(optimizer.param_groups):
        hyper = _Hyper.of(group, optimizer)
        for param in group["params"]:
            copy = copies.get(param)
            grad = param.grad if copy is None else copy.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
            state = optimizer.state[param]
            _refuse(_unsupported_param(param, state, kernel_only=False))
            if not state:
                _init_state(state, param, group)
            updates.append(_Update(param=param, grad=grad, exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"],
                                   step=state["step"], hyper=hyper, group=index, copy=copy))
    if updates:
        torch._foreach_add_([u.step for u in updates], 1)
    _note_step(optimizer)
    return updates


def _note_step(optimizer: torch.optim.Optimizer) -> None:
    """An LR scheduler wraps optimizer.step() to note that it ran (it warns otherwise)."""
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True  # type: ignore[attr-defined]


@torch.no_grad()
def step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None = None, *,
         config: LaunchConfig | None = None, copies: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One `optimizer.step()` of a torch Adam/AdamW: every parameter with a gradient, every group.

    `grad_scale` (a 0-dim fp32 tensor, or None): each gradient is divided by it as it is read and
    stored back so divided, as torch's fused Adam does with its `grad_scale`. `config` overrides
    the launch shape (benchmarks). `copies` (parameter -> compute copy): those parameters'
    gradients are their copies' and the copies are rewritten (module docstring). Raises
    ValueError for an optimizer `step` cannot reproduce.

    The optimizer's plan, where an earlier step made one and it still describes the optimizer,
    runs the step; else the full path prepares every parameter afresh and makes a new plan."""
    copies = copies or {}
    plan = _plans.get(optimizer)
    described = (plan is not None and _unsupported_options(optimizer) is None and plan.describes(optimizer)
                 and plan.has_copies(copies))
    if described and plan.run(optimizer, grad_scale, config):
        return
    by_kind: dict[tuple[torch.device, torch.dtype, torch.dtype | None], list[_Update]] = {}
    by_reference = False
    for u in _prepare(optimizer, copies):
        if u.kernel_takes():
            by_kind.setdefault((u.param.device, u.param.dtype, None if u.copy is None else u.copy.dtype), []).append(u)
        else:
            _update_reference(u, grad_scale)
            by_reference = True
    launches = [_Launch.of(updates) for updates in by_kind.values()]
    for launch in launches:
        launch.launch(grad_scale, config)
    # where the old plan described the optimizer, `applies` stands: the full path made only torch's states
    plan = None if by_reference else _Plan.of(optimizer, launches, copies, applies=plan.applies if described else None)
    if plan is None:
        _plans.pop(optimizer, None)
    else:
        _plans[optimizer] = plan


def applies(optimizer: torch.optim.Optimizer) -> bool:
    """True when `step(optimizer)` reproduces `optimizer.step()` with the kernel for every parameter:
    a torch Adam or AdamW whose own step would run (no step hooks, no AMP attributes), with the
    options `step` supports, on fp32/bf16/fp16 parameters on a device Triton runs on. (The answer
    is kept in the optimizer's plan: it stands while the plan describes the optimizer.)"""
    if _unsupported_options(optimizer) is not None:
        return False
    plan = _plans.get(optimizer)
    if plan is None or not plan.describes(optimizer):
        return _every_param_streams(optimizer)
    if plan.applies is None:
        plan.applies = _every_param_streams(optimizer)
    return plan.applies


def _every_param_streams(optimizer: torch.optim.Optimizer) -> bool:
    """Every parameter of every group takes the kernel and has no state or torch's."""
    return not any(_unsupported_param(param, optimizer.state.get(param), kernel_only=True)
                   for group in optimizer.param_groups for param in group["params"])


# -- the plan: what every step repeats ----------------------------------------------------------

_HOST_FLOATS = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}
"""The ctypes float over a step on the CPU, by its dtype (torch makes no other)."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _Launch:
    """The parameters with a gradient of one device and dtype, in torch's order, and their table,
    written once by the full path; a plan writes only the words that change, each step."""

    device: torch.device
    dtype: torch.dtype
    copy_dtype: torch.dtype | None
    """The dtype of every row's compute copy and of its gradient; None: no row has a copy."""
    params: list[torch.Tensor]
    grad_holders: list[torch.Tensor]
    """Whose `.grad` each row reads: its parameter, or its compute copy."""
    table: np.ndarray
    """[tensors, _ROW] int64: param, exp_avg, exp_avg_sq and device-step addresses and numel stay;
    a plan rewrites gradient addresses, hyperparameters and host steps in place."""
    numels: tuple[int, ...]
    state_addresses: np.ndarray
    """param | exp_avg | exp_avg_sq | copy address, per row: with the gradient's, whether the row is 16-byte aligned."""
    group_index: np.ndarray
    """The param group of each row (its hyperparameters)."""
    device_steps: list[torch.Tensor]
    """The steps on a GPU (incremented by one `_foreach_add_`)."""
    cpu_step_rows: np.ndarray
    """The rows whose step is on the CPU, whose values a plan writes into the table (the kernel
    ignores the word where it reads the step through its address: a CPU parameter's, interpreted)."""
    cpu_steps: list[ctypes.c_float | ctypes.c_double] | None
    """Those steps as ctypes floats over their memory; None where one is neither float32 nor
    float64 (no plan then). torch's `_foreach_add_` on CPU scalars dispatches per tensor (1.6 us
    each on this repository's CPU, 0.6 ms for 389 steps); a ctypes float adds 1 in 0.12 us,
    rounding as torch's add does (x + 1 is exact in float64, then rounded once to the step's dtype)."""

    @classmethod
    def of(cls, updates: list[_Update]) -> _Launch:
        """The launch of `updates` (one device and dtype, torch's order, steps incremented)."""
        table = _pack([u.table_row() for u in updates])
        on_cpu = [u.step.is_cpu for u in updates]
        cpu_steps = [u.step for u, cpu in zip(updates, on_cpu) if cpu]
        return cls(device=updates[0].param.device, dtype=updates[0].param.dtype,
                   copy_dtype=None if updates[0].copy is None else updates[0].copy.dtype,
                   params=[u.param for u in updates],
                   grad_holders=[u.param if u.copy is None else u.copy for u in updates],
                   table=table, numels=tuple(table[:, 5].tolist()),
                   state_addresses=table[:, 0] | table[:, 2] | table[:, 3] | table[:, 13],
                   group_index=np.array([u.group for u in updates], dtype=np.int64),
                   device_steps=[u.step for u, cpu in zip(updates, on_cpu) if not cpu],
                   cpu_step_rows=np.flatnonzero(on_cpu),
                   cpu_steps=([_HOST_FLOATS[s.dtype].from_address(s.data_ptr()) for s in cpu_steps]
                              if all(s.dtype in _HOST_FLOATS for s in cpu_steps) else None))

    def grad_addresses(self) -> list[int] | None:
        """The gradients' addresses, or None where one is missing or one the kernel does not take
        (the full path then does what it always did: skip, refuse, or the reference)."""
        device, dtype, tensor, strided = self.device, self.copy_dtype or self.dtype, torch.Tensor, torch.strided
        addresses = []
        for holder in self.grad_holders:
            grad = holder.grad
            if (type(grad) is not tensor or grad.layout is not strided or grad.dtype is not dtype
                    or grad.device != device or not grad.is_contiguous()):
                return None
            addresses.append(grad.data_ptr())
        return addresses

    def write(self, grad_addresses: list[int], hypers: np.ndarray) -> None:
        """This step's words: the gradients' addresses, every group's hyperparameters, and the CPU
        steps, incremented here (the device steps were, by the plan)."""
        table = self.table
        table[:, 1] = grad_addresses
        floats = table.view(np.float64)
        floats[:, 6:12] = hypers[self.group_index]
        if self.cpu_steps:
            values = []
            for step in self.cpu_steps:
                step.value += 1
                values.append(step.value)
            floats[self.cpu_step_rows, 12] = values

    def launch(self, grad_scale: torch.Tensor | None, config: LaunchConfig | None) -> None:
        """The kernel over the table: one launch, or two where some rows are not 16-byte aligned
        (gradients that are views into a bucket at an odd offset)."""
        config = config or default_config(self.dtype)
        aligned = (self.state_addresses | self.table[:, 1]) % 16 == 0
        if aligned.all():
            _launch(self.table, self.numels, self.device, self.dtype, aligned=True, grad_scale=grad_scale,
                    config=config, copy_dtype=self.copy_dtype)
            return
        for flag in (True, False):
            rows = np.flatnonzero(aligned == flag)
            if rows.size:
                table = self.table[rows]
                _launch(table, tuple(table[:, 5].tolist()), self.device, self.dtype, aligned=flag,
                        grad_scale=grad_scale, config=config, copy_dtype=self.copy_dtype)


class _PlannedState(NamedTuple):
    """One entry of optimizer.state as planned: the step held (a few bytes, and a ctypes float may
    point into it), the moments by weak reference (a stale plan must not keep the gigabytes that
    load_state_dict replaced alive until the next step)."""

    step: torch.Tensor
    exp_avg: weakref.ref
    exp_avg_sq: weakref.ref

    @staticmethod
    def of(entry: dict) -> _PlannedState | None:
        """`entry` as planned, or None where it is not three tensors under torch's keys."""
        step, exp_avg, exp_avg_sq = entry.get("step"), entry.get("exp_avg"), entry.get("exp_avg_sq")
        if len(entry) != 3 or not (isinstance(step, torch.Tensor) and isinstance(exp_avg, torch.Tensor)
                                   and isinstance(exp_avg_sq, torch.Tensor)):
            return None
        return _PlannedState(step=step, exp_avg=weakref.ref(exp_avg), exp_avg_sq=weakref.ref(exp_avg_sq))

    def is_in(self, entry: dict) -> bool:
        """`entry` holds exactly these three tensors (the very objects, under torch's keys)."""
        exp_avg, exp_avg_sq = self.exp_avg(), self.exp_avg_sq()
        return (len(entry) == 3 and exp_avg is not None and exp_avg_sq is not None and entry.get("step") is self.step
                and entry.get("exp_avg") is exp_avg and entry.get("exp_avg_sq") is exp_avg_sq)


@dataclass(kw_only=True, slots=True, eq=False)
class _Plan:
    """What one optimizer's step repeats: the full path's launches, kept with what it checked.

    Each step only the gradients (autograd reallocates them), the hyperparameters (schedulers
    write group["lr"]) and the CPU steps' values change. `describes` checks by identity that
    nothing else did, and the full path runs (and plans anew) where anything has: a param group
    added or its params changed, a state entry replaced (load_state_dict, or by hand), a
    parameter's storage swapped (`.data =`: its address is checked); and `run` declines where the
    parameters with a gradient are not those planned. Tensors are assumed not to be changed in
    place to other sizes, dtypes or strides under the same storage (`set_`, `resize_`), as torch
    never does."""

    group_param_ids: list[list[int]]
    """id() of each group's params (the plan holds the params: the ids stay theirs)."""
    params: list[torch.Tensor]
    """Every parameter of every group."""
    param_addresses: list[int]
    idle_params: list[torch.Tensor]
    """The parameters that had no gradient (their compute copies, where they have one: what holds
    the gradient): the plan skips them, so they must have none still."""
    states: list[tuple[torch.Tensor, _PlannedState | None]]
    """optimizer.state's entries in its order (None: an empty entry)."""
    launches: list[_Launch]
    device_steps: list[torch.Tensor]
    """Every launch's steps on a GPU: one `_foreach_add_` (one launch) increments them."""
    copies: list[tuple[torch.Tensor, torch.Tensor, int]]
    """The compute copies planned: (parameter, copy, the copy's address)."""
    applies: bool | None = None
    """`applies(optimizer)`, once asked (the one field a plan changes: it cannot change while the
    plan describes the optimizer, whose options `applies` checks apart)."""

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, launches: list[_Launch], copies: Mapping[torch.Tensor, torch.Tensor],
           *, applies: bool | None) -> _Plan | None:
        """The plan of the full step that has just run `launches` on `optimizer`, every parameter
        with a gradient among them (`applies`: its answer, where known); None where a plan would
        not hold (a state entry not three tensors, a CPU step neither float32 nor float64)."""
        if any(launch.cpu_steps is None for launch in launches):
            return None
        states: list[tuple[torch.Tensor, _PlannedState | None]] = []
        for param, entry in optimizer.state.items():
            planned = _PlannedState.of(entry) if entry else None
            if entry and planned is None:
                return None
            states.append((param, planned))
        params = [param for group in optimizer.param_groups for param in group["params"]]
        updated = {id(param) for launch in launches for param in launch.params}
        return cls(group_param_ids=[list(map(id, group["params"])) for group in optimizer.param_groups],
                   params=params, param_addresses=[param.data_ptr() for param in params],
                   idle_params=[copies.get(param, param) for param in params if id(param) not in updated],
                   states=states,
                   launches=launches, device_steps=[step for launch in launches for step in launch.device_steps],
                   copies=[(param, copy, copy.data_ptr()) for param, copy in copies.items()], applies=applies)

    def has_copies(self, copies: Mapping[torch.Tensor, torch.Tensor]) -> bool:
        """`copies` are those planned: the same parameters and copy tensors, at the same addresses."""
        return len(copies) == len(self.copies) and all(
            copies.get(param) is copy and copy.data_ptr() == address for param, copy, address in self.copies)

    def describes(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer's groups, parameters and state entries are those planned (identity checks;
        its options are checked apart, by `_unsupported_options`)."""
        groups = optimizer.param_groups
        if len(groups) != len(self.group_param_ids) or any(
                list(map(id, group["params"])) != ids for group, ids in zip(groups, self.group_param_ids)):
            return False
        state = optimizer.state
        if len(state) != len(self.states):
            return False
        for (param, entry), (planned_param, planned) in zip(state.items(), self.states):
            if param is not planned_param:
                return False
            if planned is None:
                if entry:
                    return False
            elif not planned.is_in(entry):
                return False
        return [param.data_ptr() for param in self.params] == self.param_addresses

    def run(self, optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None,
            config: LaunchConfig | None) -> bool:
        """The step, where every planned parameter has a gradient the kernel takes and no other
        parameter has one; else False, having changed nothing."""
        grad_addresses = []
        for launch in self.launches:
            addresses = launch.grad_addresses()
            if addresses is None:
                return False
            grad_addresses.append(addresses)
        if any(param.grad is not None for param in self.idle_params):
            return False
        if self.device_steps:
            torch._foreach_add_(self.device_steps, 1)
        hypers = np.array([_Hyper.of(group, optimizer) for group in optimizer.param_groups], dtype=np.float64)
        for launch, addresses in zip(self.launches, grad_addresses):
            launch.write(addresses, hypers)
            launch.launch(grad_scale, config)
        _note_step(optimizer)
        return True


_plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan] = weakref.WeakKeyDictionary()
"""Each optimizer's plan: a cache, made by `step` and dropped with the optimizer; where it no
longer describes its optimizer the full path runs and replaces it."""


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(f"mplan.kernels.adamw cannot step this optimizer: {reason}")


def _unsupported_options(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `step` cannot reproduce `optimizer.step()` whatever its parameters, or None."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not torch.optim.Adam or AdamW"
    if not _runs_own_step(optimizer):
        return "its step() is wrapped or has step hooks"
    for name in ("grad_scale", "found_inf"):
        if hasattr(optimizer, name):
            return f"it carries a {name} (torch's AMP protocol)"
    for group in optimizer.param_groups:
        for option in ("amsgrad", "maximize", "differentiable", "capturable"):
            if group[option]:
                return f"{option}=True"
        for name, value in (("lr", group["lr"]), ("beta1", group["betas"][0]), ("beta2", group["betas"][1]),
                            ("eps", group["eps"]), ("weight_decay", group["weight_decay"])):
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                return f"{name} is a {type(value).__name__}, not a float"
    return None


def _unsupported_param(param: torch.Tensor, state: dict | None, *, kernel_only: bool) -> str | None:
    """Why `step` cannot update `param` (with `kernel_only`: by the kernel), or None."""
    if kernel_only and not _kernel_streams(param):
        return f"a {type(param).__name__} of {param.dtype} on {param.device}: no kernel for it"
    if not param.dtype.is_floating_point:
        return f"a {param.dtype} parameter"
    if state and not _torch_state(state, param):
        return "a parameter's state is not torch Adam's (step, exp_avg, exp_avg_sq)"
    return None


def _runs_own_step(optimizer: torch.optim.Optimizer) -> bool:
    """`optimizer.step` is Adam's (bare, or counted by an LR scheduler) and no step hook is set."""
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks):
        return False
    bound = optimizer.step
    function = bound.__wrapped__ if getattr(bound, "_wrapped_by_lr_sched", False) else getattr(bound, "__func__", None)
    return function is type(optimizer).step


def _torch_state(state: dict, param: torch.Tensor) -> bool:
    """`state` is what torch's Adam keeps for `param` (amsgrad's third moment excluded)."""
    step, exp_avg, exp_avg_sq = state.get("step"), state.get("exp_avg"), state.get("exp_avg_sq")
    if len(state) != 3 or not all(isinstance(t, torch.Tensor) for t in (step, exp_avg, exp_avg_sq)):
        return False
    dtype, device, shape = param.dtype, param.device, param.shape
    return (exp_avg.dtype == dtype and exp_avg_sq.dtype == dtype and exp_avg.shape == shape
            and exp_avg_sq.shape == shape and exp_avg.device == device and exp_avg_sq.device == device
            and step.dim() == 0 and step.is_floating_point() and (step.is_cpu or step.device == device))
