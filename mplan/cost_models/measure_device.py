"""Measure one device's kernels: GEMMs, SDPA attention and copies, into a ``DeviceProfile``.

Role: produce the tables ``compute_cost`` interpolates. Run by ``mplan profile`` on each cluster and
by ``python -m benchmarks.calibration profile`` for the packaged H200 profile.
Input: ``profile_device(device, dtypes, quick, grid)``: a torch device ("cuda", "cuda:1", "cpu"),
the dtypes to time GEMMs in, and a ``ProfileGrid`` (by default ``ProfileGrid.transformer``: the
GEMM shapes of transformer training for hidden 1024-8192 and 2k-16k tokens per microbatch, or a
tiny grid with ``quick``).
Output: ``DeviceProfile``.
Method: random data, a few warm-up calls, then the median of repeated timed calls; repetitions adapt
so each shape takes roughly ``target_s``. On a GPU each GEMM and attention entry is timed as the
device runs it in a CUDA graph (``MedianTimer``, ``CudaGraphCapture``): CUDA events around one eager
call time a kernel shorter than its launch at the host's launch (15-40 us of Python and dispatch
while the GPU idles), so the H100 profile of 2026-12-05 priced no GEMM under ~36 us, and steps
replayed as graphs were over-priced (Gemma-3: +67% predicted against measured,
benchmarks/reprice/races.py). An entry whose capture fails is timed per call with events and listed in
the profile's ``eager_fallbacks``; the profile's ``timing`` names the method (the smallest H100 GEMM
entry went from 39 us to 2.6 us, benchmarks/results/profile_h100-2026-12-06-graphed.json). The calls
of one graph read rotated copies of their operands (``OperandCopies``, ``operand_copies``), call i
copy i % k, k copies together at least twice the device's L2: with one set of operands a mid-sized
GEMM (2048 tokens x 2048 hidden bf16, 8 MB, against a 2048 x 6144 weight, 24 MB) finds them in the
H100's 50 MB L2 from the call before, which no GEMM of a training step does (each weight is read
once per pass, activations come mostly from HBM); steps of 1.7B models at micro-batch 1 replayed
as graphs ran 12-17% slower than priced from that graph-timed profile, at micro-batch 8 (operands
far above L2) within 1.3%. The profile's ``l2_flush`` says how. On a CPU, ``time.perf_counter``
around each call, no graph and no copies. GEMM grids are full products of their m, n and k lists so
the table interpolates multilinearly. Attention is ``scaled_dot_product_attention`` on [batch,
heads, seq, head_dim] with seq_q == seq_kv; its backward is timed as forward-then-backward. Copies
time ``dst.copy_(src)`` and count bytes read plus written, COPY_BATCH copies back to back between
two events: a memory-bound kernel in a training step runs among others, and events around one copy
add a launch (about 7 us on the H200: 3.4 TB/s at 134 MB against 4.2 back to back,
benchmarks/calibration/copy_table.py).
Host time per launch (``measure_host``): streams of tiny eager ops (one element of work each) timed
on the host's clock with the device idle, so the host binds: an ATen op with autograd recording, a
view, the same two without autograd (their difference is one kernel launch), one autograd backward
node per op of a chain, a Triton kernel launch, and the per-tensor slope of a foreach and a fused
AdamW step (32 against 160 tensors).
Invariants: torch is imported inside the functions (planning never pays for it); nothing is kept on
the device after return.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from mplan.cost_models.dtypes import canonical_dtype
from mplan.cost_models.profile import (NO_L2_FLUSH, AttentionTiming, CopyTiming, DeviceProfile, EagerFallback,
                                      GemmTiming, HostTiming)

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "float32", "fp64": "float64"}
COPY_BATCH = 20
"""Copies timed back to back per sample (module docstring, Method)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileGrid:
    """The shapes ``profile_device`` times."""

    gemm_m: tuple[int, ...]  # rows: tokens per microbatch (after any sequence-parallel gather)
    gemm_n: tuple[int, ...]  # output features
    gemm_k: tuple[int, ...]  # reduction (input features)
    attention_batch_heads: tuple[tuple[int, int], ...]  # (batch, heads) pairs
    attention_seq: tuple[int, ...]
    attention_head_dim: tuple[int, ...]
    attention_causal: bool
    copy_bytes: tuple[int, ...]  # bytes of the source tensor (bytes moved = 2x)
    target_s: float  # seconds of timed calls per shape (repetitions adapt to it)

    @classmethod
    def transformer(cls, *, quick: bool, on_gpu: bool) -> ProfileGrid:
        if quick:
            return cls(gemm_m=(32, 64), gemm_n=(32, 64), gemm_k=(32, 64), attention_batch_heads=((1, 2),),
                       attention_seq=(32, 64), attention_head_dim=(16,), attention_causal=True,
                       copy_bytes=(1 << 12, 1 << 16), target_s=0.002)
        if not on_gpu:
            return cls(gemm_m=(128, 512, 2048), gemm_n=(128, 512, 2048), gemm_k=(128, 512, 2048),
                       attention_batch_heads=((1, 4), (1, 16)), attention_seq=(128, 512, 1024),
                       attention_head_dim=(64,), attention_causal=True,
                       copy_bytes=tuple(1 << p for p in range(12, 29, 4)), target_s=0.05)
        # n and k cover hidden 1024-8192 split by TP 1-8 (h/8 = 128 is below 256: the curve extrapolates)
        # up to the MLP's 4h = 32768; m covers 2k-16k tokens plus smaller microbatches.
        dims = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
        return cls(gemm_m=(512, 1024, 2048, 4096, 8192, 16384), gemm_n=dims, gemm_k=dims,
                   attention_batch_heads=((1, 8), (1, 32), (4, 32)), attention_seq=(1024, 2048, 4096, 8192, 16384),
                   attention_head_dim=(64, 128), attention_causal=True,
                   copy_bytes=tuple(1 << p for p in range(16, 33, 2)), target_s=0.03)


GRAPH_REPLAY_S = 1e-3
"""Seconds one timed graph replay should last: long beside the host's ~10 us to launch it and the
events' resolution (~0.5 us), short enough for tens of replays per entry."""
MAX_GRAPH_CALLS = 64
"""Most calls captured in one graph (a kernel of a few us then replays for a few hundred us)."""
CAPTURE_WARMUP = 2
"""Eager calls on the capture stream before capture: cuBLAS takes a workspace per stream on first
use, and allocating it inside the capture would fail or land in the graph's pool."""

DEFAULT_L2_BYTES = 50 * 2**20
"""L2 bytes assumed where the device reports none (``l2_cache_bytes``): the H100's 50 MiB."""
L2_FLUSH_FACTOR = 2
"""The copies one graph rotates through hold at least this many times the L2's bytes, so a copy is
evicted (by the others' reads and the outputs' writes) before its next call reads it again."""
MAX_COPY_BYTES = 1 << 30
"""Most bytes of operand copies beyond the original one entry allocates (1 GiB): binds only for an
L2 of hundreds of MB, since the copies stop at about L2_FLUSH_FACTOR x L2 plus one call's bytes."""

ReplayTimes = Callable[[int], list[float]]
"""``replays(count)``: seconds of each of `count` replays of a captured graph."""
Capture = Callable[[Sequence[Callable[[], object]]], AbstractContextManager[ReplayTimes]]
"""``capture(calls)``: a graph of the callables of `calls` run back to back in order, entered as its
``ReplayTimes`` and released on exit; raises RuntimeError where a call cannot be captured."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OperandCopies:
    """A call to time, built from its operands so that the calls of one graph can each read their
    own copy of them (module docstring, Method: a graph of calls on one set of operands times
    mid-sized GEMMs L2-warm)."""

    call_on: Callable[[int], Callable[[], object]]
    """``call_on(i)``: the call reading copy i of the operands; copy 0 is the original set, each
    other a fresh one this allocates, held by the callable returned (freed with it)."""
    bytes_read: int  # bytes of one set of operands, what one call reads; 0: unknown (never copied)

    @classmethod
    def shared(cls, fn: Callable[[], object]) -> OperandCopies:
        """A call whose operands cannot be copied: every call of its graph is fn."""
        return cls(call_on=lambda _copy: fn, bytes_read=0)


def operand_copies(bytes_read: int, l2_bytes: int, calls: int) -> int:
    """Copies of one call's operands a graph of `calls` calls cycles through (call i reads copy
    i % k): the fewest whose bytes together reach L2_FLUSH_FACTOR x `l2_bytes`, so each copy is
    read again only after that much other data went through the L2; 1 where one call already
    reads that much (or `bytes_read` is unknown, 0). At most `calls` (a copy past them would
    never be read) and 1 + MAX_COPY_BYTES // bytes_read. Under those caps a small entry's copies
    fall short of the L2 (on the H100, below 100 MiB / 64 calls = 1.6 MiB a call): such a kernel
    is bound by its latency more than by its reads, and stays partly L2-warm."""
    if bytes_read <= 0:
        return 1
    wanted = math.ceil(L2_FLUSH_FACTOR * l2_bytes / bytes_read)
    return max(1, min(wanted, calls, 1 + MAX_COPY_BYTES // bytes_read))


def l2_cache_bytes(torch: Any, device: Any) -> tuple[int, str]:
    """The L2 bytes of `device` and where the figure comes from: the CUDA device's properties,
    else DEFAULT_L2_BYTES (a CPU, or a torch whose properties lack ``L2_cache_size``)."""
    if device.type == "cuda":
        reported = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if reported > 0:
            return reported, "reported by the device"
    return DEFAULT_L2_BYTES, "default, the device reports none"


def l2_flush_note(l2_bytes: int, source: str) -> str:
    """The profile's ``l2_flush`` for graph-timed tables whose calls rotate operand copies."""
    return (f"rotated operands: call i of a graph reads copy i % k, k copies >= {L2_FLUSH_FACTOR} x L2 "
            f"({l2_bytes / 2**20:g} MiB, {source}); k at most the graph's calls and "
            f"{MAX_COPY_BYTES / 2**30:g} GiB of copies")


def graph_calls(eager_s: float) -> int:
    """Calls of fn to capture in one graph, from one eager call's seconds: enough for a replay of
    about GRAPH_REPLAY_S, between 1 and MAX_GRAPH_CALLS. The eager time holds the launch floor, so
    it is at least the device's: a replay of tiny kernels falls short of the target, and none
    overshoots it by more than one call, which bounds what one graph's pool can hold (a call of
    GRAPH_REPLAY_S or more is captured alone)."""
    return max(1, min(MAX_GRAPH_CALLS, math.ceil(GRAPH_REPLAY_S / max(eager_s, 1e-9))))


def _repetitions(target_s: float, sample_s: float, min_reps: int, max_reps: int) -> int:
    return int(min(max(target_s / max(sample_s, 1e-7), min_reps), max_reps))


def _short_reason(err: BaseException) -> str:
    """The error's type and the first line of its message, at most ~160 characters."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:140]}" if lines else type(err).__name__


class CudaGraphCapture:
    """``Capture`` on one CUDA device: fn is warmed up on a side stream, captured there
    (``torch.cuda.graph``, calls back to back) and replayed. The side stream lives as long as this
    object, so cuBLAS's per-stream workspace is taken once, not once per entry."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.device = torch, device
        self._stream: Any = None

    @contextlib.contextmanager
    def __call__(self, calls: Sequence[Callable[[], object]]) -> Iterator[ReplayTimes]:
        torch = self.torch
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            caller = torch.cuda.current_stream()
            try:
                torch.cuda.synchronize()
                self._stream.wait_stream(caller)
                with torch.cuda.stream(self._stream):
                    for i in range(CAPTURE_WARMUP):
                        calls[i % len(calls)]()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self._stream):
                    for call in calls:
                        call()
                torch.cuda.synchronize()
                try:
                    yield lambda count: self._replay_seconds(graph, count)
                finally:
                    graph.reset()  # frees its pool: entries never pile up on the device
            finally:
                # a failed capture_end leaves torch.cuda.graph's stream current
                torch.cuda.set_stream(caller)

    def _replay_seconds(self, graph: Any, count: int) -> list[float]:
        """Seconds of `count` replays, each between its own events, queued behind one untimed
        replay: the host launches each next replay while the device runs the one before, so no
        replay waits on its launch."""
        torch = self.torch
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
        graph.replay()
        for begin, end in events:
            begin.record()
            graph.replay()
            end.record()
        events[-1][1].synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in events]


class MedianTimer:
    """Median seconds of a callable on one device. With a ``capture`` (``profile_device`` gives a
    GPU one) a call's seconds are those of a replay of `n` captured calls over `n`: the device's
    time, without the host's launch, each call on its copy of the operands where the callable is
    an ``OperandCopies`` (module docstring, Method); an entry that cannot be captured is timed per
    call as without one, on the original operands, and listed in ``eager_fallbacks``. Without:
    CUDA events around each call on a GPU (launch included, as ``python -m benchmarks.calibration copy-table``
    wants), the host's clock on a CPU. `l2_bytes` sizes the copies (``operand_copies``)."""

    def __init__(self, torch: Any, device: Any, target_s: float, *, capture: Capture | None = None,
                 l2_bytes: int = DEFAULT_L2_BYTES) -> None:
        self.torch, self.device, self.target_s, self.capture = torch, device, target_s, capture
        self.l2_bytes = l2_bytes
        self.cuda = device.type == "cuda"
        self.eager_fallbacks: list[EagerFallback] = []

    def __call__(self, fn: Callable[[], Any] | OperandCopies, *, warmup: int = 2, min_reps: int = 3,
                 max_reps: int = 50, timed: bool = True, entry: str = "an entry") -> float:
        """Median seconds of fn() (an ``OperandCopies``: of its call on the original operands);
        `timed=False`: fn times itself and returns its seconds (never captured). `entry` names the
        call in ``eager_fallbacks`` should its capture fail."""
        copies = fn if isinstance(fn, OperandCopies) else OperandCopies.shared(fn)
        call = copies.call_on(0)
        once = self._once if timed else (lambda f: float(f()))
        for _ in range(warmup):
            call()
        first = once(call)
        if timed and self.capture is not None:
            try:
                return self._replayed(self.capture, copies, first, min_reps, max_reps)
            except RuntimeError as err:  # a syncing or uncapturable op, out of memory: CUDA errors are RuntimeErrors
                self.eager_fallbacks.append(EagerFallback(entry=entry, reason=_short_reason(err)))
        reps = _repetitions(self.target_s, first, min_reps, max_reps)
        return statistics.median([first] + [once(call) for _ in range(reps - 1)])

    def _replayed(self, capture: Capture, copies: OperandCopies, eager_s: float, min_reps: int,
                  max_reps: int) -> float:
        """Median seconds per call over replays of a graph of ``graph_calls(eager_s)`` calls,
        call i on operand copy i % k (``operand_copies``); the copies are freed on return, after
        the graph that reads them."""
        calls = graph_calls(eager_s)
        on_copy = [copies.call_on(i) for i in range(operand_copies(copies.bytes_read, self.l2_bytes, calls))]
        with capture([on_copy[i % len(on_copy)] for i in range(calls)]) as replays:
            reps = _repetitions(self.target_s, replays(1)[0], min_reps, max_reps)
            return statistics.median(replays(reps)) / calls

    def _once(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def _operand_copy(torch: Any, originals: tuple[Any, ...], copy: int) -> tuple[Any, ...]:
    """Copy `copy` of a call's operands: the originals for 0, else fresh random tensors of their
    shapes, dtypes and ``requires_grad`` (random, not empty: a GEMM's power and clock depend on
    its data)."""
    if copy == 0:
        return originals
    return tuple(torch.randn_like(t).requires_grad_(t.requires_grad) for t in originals)


def _bytes_of(*tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _gemm_copies(torch: Any, a: Any, b: Any) -> OperandCopies:
    """``a @ b`` on copies of both operands."""
    def call_on(copy: int) -> Callable[[], object]:
        x, w = _operand_copy(torch, (a, b), copy)
        return lambda: torch.matmul(x, w)
    return OperandCopies(call_on=call_on, bytes_read=_bytes_of(a, b))


def _time_gemms(torch: Any, device: Any, dtype: str, grid: ProfileGrid, timer: MedianTimer) -> list[GemmTiming]:
    torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
    out = []
    for m in grid.gemm_m:
        for k in grid.gemm_k:
            a = torch.randn(m, k, device=device, dtype=torch_dtype)
            for n in grid.gemm_n:
                b = torch.randn(k, n, device=device, dtype=torch_dtype)
                seconds = timer(_gemm_copies(torch, a, b), entry=f"gemm m={m} n={n} k={k} {dtype}")
                out.append(GemmTiming(m=m, n=n, k=k, dtype=dtype, seconds=seconds))
                del b
            del a
    return out


def _attention_copies(torch: Any, q: Any, k: Any, v: Any, grad: Any,
                      causal: bool) -> tuple[OperandCopies, OperandCopies]:
    """SDPA's forward (no grad) and its forward then backward of `grad`, on copies of their
    operands (q, k, v; and grad)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward_on(copy: int) -> Callable[[], object]:
        cq, ck, cv = _operand_copy(torch, (q, k, v), copy)

        def forward() -> object:
            with torch.no_grad():
                return sdpa(cq, ck, cv, is_causal=causal)
        return forward

    def forward_backward_on(copy: int) -> Callable[[], object]:
        cq, ck, cv, cgrad = _operand_copy(torch, (q, k, v, grad), copy)

        def forward_backward() -> object:
            cq.grad = ck.grad = cv.grad = None
            sdpa(cq, ck, cv, is_causal=causal).backward(cgrad)
            return None
        return forward_backward
    return (OperandCopies(call_on=forward_on, bytes_read=_bytes_of(q, k, v)),
            OperandCopies(call_on=forward_backward_on, bytes_read=_bytes_of(q, k, v, grad)))


def _time_attention(torch: Any, device: Any, dtype: str, grid: ProfileGrid,
                    timer: MedianTimer) -> list[AttentionTiming]:
    torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
    out = []
    for batch, heads in grid.attention_batch_heads:
        for seq in grid.attention_seq:
            for head_dim in grid.attention_head_dim:
                q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch_dtype,
                                       requires_grad=True) for _ in range(3))
                grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch_dtype)
                causal = grid.attention_causal
                forward, forward_backward = _attention_copies(torch, q, k, v, grad, causal)
                shape = f"b={batch} h={heads} s={seq} d={head_dim} {dtype}"
                out.append(AttentionTiming(batch=batch, heads=heads, seq_q=seq, seq_kv=seq, head_dim=head_dim,
                                           dtype=dtype, causal=causal,
                                           forward_s=timer(forward, entry=f"attention forward {shape}"),
                                           forward_backward_s=timer(forward_backward,
                                                                    entry=f"attention forward+backward {shape}")))
                del q, k, v, grad
    return out


def batched_seconds(torch: Any, device: Any, fn: Callable[[], object], count: int) -> float:
    """Seconds per call of `count` calls issued back to back: CUDA events around the batch on a
    GPU (the launches overlap the kernels before them, as in a step), wall time on a CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(count):
            fn()
        return (time.perf_counter() - start) / count
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(count):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / count


def _time_copies(torch: Any, device: Any, grid: ProfileGrid, timer: MedianTimer) -> list[CopyTiming]:
    out = []
    for nbytes in grid.copy_bytes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        dst = torch.empty_like(src)
        seconds = timer(lambda: batched_seconds(torch, device, lambda: dst.copy_(src), COPY_BATCH), timed=False)
        out.append(CopyTiming(bytes_moved=2 * nbytes, seconds=seconds))
        del src, dst
    return out


HOST_STREAM = 400
"""Tiny ops per timed stream when measuring host time: below CUDA's launch queue (about a thousand
kernels), so the host never waits for a free slot, and long enough to dwarf the timer."""


def _host_seconds(torch: Any, device: Any, stream: Callable[[int], Callable[[], object]], count: int,
                  reps: int) -> float:
    """Median host seconds per op of `stream(count)` (a setup returning the timed call), the
    device idle at its start (synchronized before, and after, outside the timed part)."""
    samples = []
    for _ in range(reps + 1):  # the first stream warms up
        run = stream(count)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) / count)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(samples[1:])


def _triton_launch(torch: Any, device: Any, count: int, reps: int) -> float | None:
    """Host seconds per launch of a one-element Triton kernel, or None where Triton cannot run (a CPU)."""
    if device.type != "cuda":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def add_one(ptr):
        tl.store(ptr, tl.load(ptr) + 1.0)

    x = torch.zeros(1, device=device, dtype=torch.float32)

    def stream(n: int) -> Callable[[], object]:
        def run() -> None:
            for _ in range(n):
                add_one[(1,)](x)
        return run
    return _host_seconds(torch, device, stream, count, reps)


def _adamw_tensor_s(torch: Any, device: Any, reps: int, **kind: bool) -> float | None:
    """Host seconds per parameter tensor of one AdamW step (`kind`: foreach=True or fused=True):
    the slope between steps over 32 and 160 tiny tensors (the fixed per-step part cancels)."""
    def step_s(tensors: int) -> float:
        params = [torch.zeros(16, device=device, requires_grad=True) for _ in range(tensors)]
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-3, **kind)

        def stream(_n: int) -> Callable[[], object]:
            return optimizer.step
        return _host_seconds(torch, device, stream, 1, reps)
    try:
        return max(0.0, (step_s(160) - step_s(32)) / 128)
    except (RuntimeError, ValueError):  # fused AdamW where this torch has none for the device
        return None


def measure_host(device: str = "cuda", quick: bool = False) -> HostTiming:
    """Host seconds per kind of launch on `device` (``HostTiming``): streams of tiny ops timed on
    the host's clock while the device is idle, so the host is what binds."""
    import torch

    dev = torch.device(device)
    count, reps = (100, 3) if quick else (HOST_STREAM, 9)
    w = torch.ones(16, device=dev, requires_grad=True)

    def ops(grad: bool, view: bool) -> Callable[[int], Callable[[], object]]:
        def stream(n: int) -> Callable[[], object]:
            def run() -> None:
                with torch.set_grad_enabled(grad):
                    y = w
                    for _ in range(n):
                        y = y.view(16) if view else y.mul(1.0001)
            return run
        return stream

    def backward(n: int) -> Callable[[], object]:
        y = w
        for _ in range(n):
            y = y.mul(1.0001)  # MulBackward0: one kernel, the gradient times the scalar
        loss = y.sum()
        return lambda: loss.backward()

    aten_op = _host_seconds(torch, dev, ops(True, False), count, reps)
    view_op = _host_seconds(torch, dev, ops(True, True), count, reps)
    launch = max(0.0, _host_seconds(torch, dev, ops(False, False), count, reps)
                 - _host_seconds(torch, dev, ops(False, True), count, reps))
    backward_node = _host_seconds(torch, dev, backward, count, reps)
    triton = _triton_launch(torch, dev, count, reps)
    foreach = _adamw_tensor_s(torch, dev, reps, foreach=True)
    fused = _adamw_tensor_s(torch, dev, reps, fused=True)
    w.grad = None
    on_gpu = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    gaps = [what for what, value in (("Triton launch", triton), ("fused AdamW", fused)) if value is None]
    return HostTiming(
        aten_op_s=aten_op, view_op_s=view_op, launch_s=launch, backward_node_s=backward_node,
        triton_launch_s=aten_op if triton is None else triton,
        adamw_foreach_tensor_s=foreach if foreach is not None else 0.0,
        adamw_fused_tensor_s=(foreach or 0.0) if fused is None else fused, overlaps=on_gpu,
        source=f"measured by measure_device.measure_host on {name}, torch {torch.__version__}, "
               f"{datetime.date.today().isoformat()}" + ("; QUICK" if quick else "")
               + (f"; not measurable here, taken equal to the ATen op's or foreach's: {', '.join(gaps)}" if gaps else ""))


def _graph_capture(torch: Any, device: Any) -> Capture | None:
    """How ``profile_device`` captures calls on `device`: CUDA graphs on a GPU, none on a CPU
    (the host runs the kernels, there is no launch to hide)."""
    return CudaGraphCapture(torch, device) if device.type == "cuda" else None


def profile_device(device: str = "cuda", dtypes: tuple[str, ...] | None = None, quick: bool = False,
                   grid: ProfileGrid | None = None,
                   progress: Callable[[str], None] | None = None) -> DeviceProfile:
    """Time GEMMs (per dtype), attention (first dtype) and copies on ``device``."""
    import torch

    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise RuntimeError(f"profile_device({device!r}): CUDA is not available here; use device='cpu'")
    names = tuple(canonical_dtype(d) for d in (dtypes or (("bf16",) if on_gpu else ("fp32",))))
    if "fp8" in names:
        raise ValueError("profile_device: fp8 GEMMs need scaled matmul and are not profiled yet")
    grid = grid or ProfileGrid.transformer(quick=quick, on_gpu=on_gpu)
    capture = _graph_capture(torch, dev)
    l2_bytes, l2_source = l2_cache_bytes(torch, dev)
    timer = MedianTimer(torch, dev, grid.target_s, capture=capture, l2_bytes=l2_bytes)
    say = progress or (lambda _msg: None)
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    gemm: list[GemmTiming] = []
    try:
        for dtype in names:
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
            say(f"GEMM {dtype}: {len(grid.gemm_m) * len(grid.gemm_n) * len(grid.gemm_k)} shapes")
            gemm += _time_gemms(torch, dev, dtype, grid, timer)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    attention_dtype = next((d for d in names if d != "tf32"), "fp32")
    say(f"attention {attention_dtype}")
    attention = _time_attention(torch, dev, attention_dtype, grid, timer)
    if timer.eager_fallbacks:
        first = timer.eager_fallbacks[0]
        say(f"{len(timer.eager_fallbacks)} entries timed per call, their graph capture failed "
            f"(first: {first.entry}: {first.reason})")
    say("copies")
    copy = _time_copies(torch, dev, grid, timer)
    say("host time per launch")
    host = measure_host(device, quick=quick)
    name = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    if on_gpu:
        torch.cuda.empty_cache()
    return DeviceProfile(name=name, torch_version=torch.__version__, measured_on=datetime.date.today().isoformat(),
                         gemm=tuple(gemm), attention=tuple(attention), copy=tuple(copy), host=host,
                         timing="wall_clock" if capture is None else "cuda_graph_replay",
                         eager_fallbacks=tuple(timer.eager_fallbacks),
                         l2_flush=NO_L2_FLUSH if capture is None else l2_flush_note(l2_bytes, l2_source))
