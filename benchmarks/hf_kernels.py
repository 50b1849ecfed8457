"""Kernel against kernel at the Hugging Face models' shapes: mplan, Liger Kernel, torch.compile, HF eager.

For the shapes of benchmarks/hf_models.py's three models (Llama at TinyLlama-1.1B's shape,
Mistral ~1B, Qwen2-1.5B) at 16384 tokens (batch 8 x 2048), bf16, forward and forward+backward:
    rmsnorm        HF's RMSNorm (upcast to fp32, normalize, cast back, times the weight) on [16384, hidden]:
                   mplan.kernels.rms_norm in that form (upcast=True, norm_dtype=bf16, where this mplan
                   has those arguments); Liger's LigerRMSNormFunction (casting_mode "llama", in_place
                   False: in the model Liger writes dX over dY, which repeated timing calls cannot allow);
                   torch.compile of HF's LlamaRMSNorm.forward; that forward itself (eager)
    rope           RoPE on q [8, heads, 2048, 128] and k [8, kv_heads, 2048, 128], each the transpose of a
                   [batch, seq, heads, head_dim] projection, as HF hands them over, tables [1, 2048, 128]:
                   mplan.kernels.rope twice; mplan.kernels.rope_qk (one launch each way) where it exists;
                   Liger's liger_rotary_pos_emb (in place on q and k); torch.compile of HF's
                   apply_rotary_pos_emb; HF's function itself
    swiglu         silu(gate) * up on two [16384, ffn] tensors: mplan swiglu; Liger LigerSiLUMulFunction
                   (its backward overwrites its inputs with their gradients); compile; eager
    swiglu_packed  the same on one GEMM's [16384, 2 ffn] output: mplan swiglu_packed; Liger
                   LigerFusedGateUpSiLUMulFunction (where this Liger has it); compile; eager
    head_loss      the LM head's GEMM and the mean cross-entropy, x [16384, hidden], W [vocab, hidden],
                   the last label of each sequence ignored (HF's shift): mplan F.linear +
                   mplan.kernels.cross_entropy; mplan.kernels.linear_cross_entropy where it exists; Liger
                   LigerFusedLinearCrossEntropyLoss (it computes the gradients in its forward, so its fwd
                   is most of its fwd+bwd); compile of F.linear + F.cross_entropy on the fp32 logits (HF's
                   loss upcasts them); that function itself
Liger's functions are called directly (nothing is patched), so one process holds every system.

Method, per op and model: every system gets its own inputs (same seed, same values: Liger writes
into some of them); correctness: outputs and every input gradient of a bf16 call against the op
run in fp32 on the upcast inputs (HF's function), relative error in norm; passed when within
max(1e-2, 2x HF eager's) (benchmarks/fused_kernels.py's rule). Timing: fused_kernels.py's two clocks,
GPU kernel time from the profiler summed per call (medians of ROUNDS interleaved rounds over the
op's systems: fwd_ms, fwd_bwd_ms, the figures judged, since in a GPU-bound step the host runs
ahead) and CUDA events around the call (triton.testing.do_bench medians: event_fwd_ms,
event_fwd_bwd_ms, host overhead included). Peak memory: torch.cuda.max_memory_allocated during one
forward+backward from a reset, above what was allocated before it (every system's inputs), in MB:
the op's saved activations, temporaries and the gradients it returns.
Reported per model: a table (op, system, fwd ms, fwd+bwd ms, peak MB, max relative error) and per
op mplan_vs_best_peer: the fastest of the peers (Liger, compile, eager) over mplan's fastest
variant, by fwd+bwd and by fwd kernel time (> 1: mplan faster; target >= 1.0), and for head_loss
mplan's lowest peak over the lowest peer's (target <= 1.10).

Run on the GPU (from the repository root, Liger installed from the carried wheels; about 3-4
minutes with torch.compile's and Triton's cold compiles; ops not started within --budget-s are
skipped and say so):
    pip install --no-index --find-links .device_wheels --no-deps liger-kernel
    PYTHONPATH=. python3 benchmarks/hf_kernels.py --out $OUT/hf_kernels.json
Smoke test on a CPU (tiny shapes; mplan's ops run their PyTorch references, Liger is skipped,
torch.compile only with --compile):
    PYTHONPATH=. python3 benchmarks/hf_kernels.py --device cpu --small --out /tmp/hf_kernels.json
"""
from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mplan.kernels as mk  # noqa: E402
from benchmarks.hf_models import HFModel, _families, versions  # noqa: E402
from benchmarks.fused_kernels import _forward_backward, _leaf, _outputs, _rel, _timer  # noqa: E402
from benchmarks.report import Clock, run_header, write_report  # noqa: E402

ROUNDS = 5
"""interleaved rounds of GPU kernel timing per op (benchmarks/gpu_time.py says why interleaved)"""
ITERS = 10
PEERS = ("liger", "compile", "eager")
TARGET_VS_BEST_PEER = 1.0
TARGET_PEAK_VS_LOWEST_PEER = 1.10
MB = 2**20
Fn = Callable[..., Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """One model's sizes at the benchmark's tokens."""

    batch: int
    seq: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def shape_of(model: HFModel) -> Shape:
    sizes = dict(model.sizes)
    heads = sizes["num_attention_heads"]
    return Shape(batch=model.batch, seq=model.seq, hidden=sizes["hidden_size"], heads=heads,
                 kv_heads=sizes["num_key_value_heads"], head_dim=sizes.get("head_dim") or sizes["hidden_size"] // heads,
                 ffn=sizes["intermediate_size"], vocab=sizes["vocab_size"], eps=sizes.get("rms_norm_eps", 1e-6),
                 rope_theta=model.rope_theta)


# ---- HF's own functions (every family runs Llama's: Mistral's and Qwen2's are copies of it) -------

class _NormStandIn:
    """Just what LlamaRMSNorm.forward reads from its module."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.variance_epsilon = weight, eps


def _llama() -> Any:
    return importlib.import_module("transformers.models.llama.modeling_llama")


def hf_rms_norm(eps: float) -> Fn:
    forward = _llama().LlamaRMSNorm.forward
    return lambda x, weight: forward(_NormStandIn(weight, eps), x)


def hf_rope() -> Fn:
    return _llama().apply_rotary_pos_emb


def swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_packed_eager(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def head_loss_eager(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's ForCausalLMLoss on already-shifted labels: the logits upcast to fp32."""
    return F.cross_entropy(F.linear(x, weight).float(), labels, ignore_index=-100)


# ---- inputs --------------------------------------------------------------------------------------

def rms_norm_inputs(s: Shape, device: torch.device, dtype: torch.dtype) -> list[Any]:
    return [_leaf((s.tokens, s.hidden), device, dtype), _leaf((s.hidden,), device, dtype, 0.1, 1.0)]


def rope_tables(s: Shape, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's default RoPE tables for positions 0..seq-1: [1, seq, head_dim], the model's dtype."""
    inv_freq = 1.0 / s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim)
    freqs = torch.outer(torch.arange(s.seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_inputs(s: Shape, device: torch.device, dtype: torch.dtype) -> list[Any]:
    """q and k as HF hands them to apply_rotary_pos_emb: transposes of [batch, seq, heads, head_dim]."""
    q = _leaf((s.batch, s.seq, s.heads, s.head_dim), device, dtype).transpose(1, 2)
    k = _leaf((s.batch, s.seq, s.kv_heads, s.head_dim), device, dtype).transpose(1, 2)
    return [q, k, *rope_tables(s, device, dtype)]


def swiglu_inputs(s: Shape, device: torch.device, dtype: torch.dtype) -> list[Any]:
    return [_leaf((s.tokens, s.ffn), device, dtype, 2.0), _leaf((s.tokens, s.ffn), device, dtype)]


def swiglu_packed_inputs(s: Shape, device: torch.device, dtype: torch.dtype) -> list[Any]:
    return [_leaf((s.tokens, 2 * s.ffn), device, dtype, 2.0)]


def head_loss_inputs(s: Shape, device: torch.device, dtype: torch.dtype) -> list[Any]:
    labels = torch.randint(0, s.vocab, (s.batch, s.seq), device=device)
    labels[:, -1] = -100  # HF's shift leaves each sequence's last position without a label
    return [_leaf((s.tokens, s.hidden), device, dtype), _leaf((s.vocab, s.hidden), device, dtype, 0.02),
            labels.view(-1)]


# ---- systems -------------------------------------------------------------------------------------

def _liger(module: str, name: str) -> Any:
    """A Liger object, or an ImportError/AttributeError naming what is missing."""
    return getattr(importlib.import_module(module), name)


def mplan_rms_norm(eps: float) -> Fn:
    """mplan's rms_norm in HF's form (upcast, the normalized value cast back before the weight), as
    fuse_kernels emits it for an HF model, where this mplan has the form's arguments; else its plain form."""
    if "upcast" in inspect.signature(mk.rms_norm).parameters:
        return lambda x, w: mk.rms_norm(x, w, eps, upcast=True, norm_dtype=x.dtype)
    return lambda x, w: mk.rms_norm(x, w, eps)


def _table_2d(fn: Fn) -> Fn:
    """mplan's rope takes [seq, head_dim] tables: HF's [1, seq, head_dim] ones, row 0 (a view)."""
    return lambda q, k, cos, sin: fn(q, k, cos[0], sin[0])


def liger_chunk_rows(s: Shape) -> int:
    """Rows per chunk of Liger's fused linear cross-entropy: mplan's op at this chunk holds the
    same memory."""
    from benchmarks.head_loss_chunks import liger_chunk_rows as rows
    return rows(s.tokens, s.hidden, s.vocab)


def systems_for(op: str, s: Shape) -> dict[str, Callable[[], Fn]]:
    """Each system of `op` as a factory (so that a missing Liger or mplan function fails that system
    alone); names starting with "mplan" are mplan's variants, the rest its peers."""
    rope_qk = getattr(mk, "rope_qk", None)
    linear_ce = getattr(mk, "linear_cross_entropy", None)
    table: dict[str, dict[str, Callable[[], Fn]]] = {
        "rmsnorm": {
            "mplan": lambda: mplan_rms_norm(s.eps),
            "liger": lambda: (lambda f: lambda x, w: f.apply(x, w, s.eps, 0.0, "llama", False, None))(
                _liger("liger_kernel.ops", "LigerRMSNormFunction")),
            "eager": lambda: hf_rms_norm(s.eps),
        },
        "rope": {
            "mplan (rope x2)": lambda: _table_2d(lambda q, k, c, n: (mk.rope(q, c, n), mk.rope(k, c, n))),
            **({"mplan (rope_qk)": lambda: _table_2d(rope_qk)} if rope_qk is not None else {}),
            "liger": lambda: _liger("liger_kernel.transformers.rope", "liger_rotary_pos_emb"),
            "eager": hf_rope,
        },
        "swiglu": {
            "mplan": lambda: mk.swiglu,
            "liger": lambda: _liger("liger_kernel.ops", "LigerSiLUMulFunction").apply,
            "eager": lambda: swiglu_eager,
        },
        "swiglu_packed": {
            "mplan": lambda: mk.swiglu_packed,
            "liger": lambda: (lambda f: lambda y: f.apply(y, False))(
                _liger("liger_kernel.ops.swiglu", "LigerFusedGateUpSiLUMulFunction")),
            "eager": lambda: swiglu_packed_eager,
        },
        "head_loss": {
            "mplan (linear + cross_entropy)": lambda: lambda x, w, labels: mk.cross_entropy(F.linear(x, w), labels),
            **({"mplan (linear_cross_entropy)": lambda: linear_ce,
                "mplan (linear_cross_entropy, Liger's chunk)": lambda: (
                    lambda x, w, labels: linear_ce(x, w, labels, chunk_rows=liger_chunk_rows(s)))}
               if linear_ce is not None else {}),
            "liger": lambda: (lambda loss: lambda x, w, labels: loss(w, x, labels))(
                _liger("liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss")()),
            "eager": lambda: head_loss_eager,
        },
    }
    systems = table[op]
    eager = systems["eager"]
    systems["compile"] = lambda: torch.compile(eager(), dynamic=False)
    return systems


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    name: str
    make: Callable[[Shape, torch.device, torch.dtype], list[Any]]
    scalar_output: bool = False
    """a loss: the backward starts from 1.0 (as in training), else from a random upstream"""


OPS = (Op(name="rmsnorm", make=rms_norm_inputs), Op(name="rope", make=rope_inputs),
       Op(name="swiglu", make=swiglu_inputs), Op(name="swiglu_packed", make=swiglu_packed_inputs),
       Op(name="head_loss", make=head_loss_inputs, scalar_output=True))


# ---- measurement ---------------------------------------------------------------------------------

def fresh_inputs(op: Op, s: Shape, device: torch.device, dtype: torch.dtype) -> list[Any]:
    """The op's inputs, the same values on every call (seed 0)."""
    torch.manual_seed(0)
    return op.make(s, device, dtype)


def upstream_for(op: Op, outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    generator = torch.Generator(device=outputs[0].device).manual_seed(1)
    if op.scalar_output:
        return [torch.ones_like(out) for out in outputs]
    return [torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float32).to(out.dtype)
            for out in outputs]


def reference(op: Op, s: Shape, device: torch.device, dtype: torch.dtype, eager: Fn
              ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """HF's function in fp32 on the upcast inputs: outputs, input gradients, and the (bf16) upstream."""
    inputs = fresh_inputs(op, s, device, dtype)
    upstream = upstream_for(op, _outputs(eager(*inputs)))
    wide = [a.detach().float().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
            and a.is_floating_point() else a for a in inputs]
    outs, grads = _forward_backward(eager, wide, [u.float() for u in upstream])
    return outs, grads, upstream


def errors_against(fn: Fn, op: Op, s: Shape, device: torch.device, dtype: torch.dtype,
                   exact: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
                   upstream: list[torch.Tensor]) -> dict[str, float]:
    outs, grads = _forward_backward(fn, fresh_inputs(op, s, device, dtype), [u.clone() for u in upstream])
    names = [f"out{i}" for i in range(len(exact[0]))] + [f"grad{i}" for i in range(len(exact[1]))]
    return {name: _rel(got, want) for name, got, want in zip(names, (*outs, *grads), (*exact[0], *exact[1]))}


def peak_mb(call: Callable[[], Any], device: torch.device) -> float | None:
    """max_memory_allocated during one call, above what was allocated before it."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - held
    del result
    return peak / MB


def measure_op(op: Op, s: Shape, device: torch.device, dtype: torch.dtype, use_compile: bool,
               log: Callable[[str], None], rounds: int = ROUNDS) -> dict[str, Any]:
    """Checks, warms, times (both clocks) and measures every system of `op` at `s`."""
    factories = systems_for(op.name, s)
    if not use_compile:
        del factories["compile"]
    exact_outs, exact_grads, upstream = reference(op, s, device, dtype, factories["eager"]())
    rows: dict[str, dict[str, Any]] = {}
    calls: dict[tuple[str, str], Callable[[], Any]] = {}
    timer = _timer(device)
    for name, factory in factories.items():
        unavailable = _unavailable(name, factory, device)
        if isinstance(unavailable, str):
            rows[name] = {"error": unavailable}
            log(f"  {op.name} {name}: {unavailable}")
            continue
        fn = unavailable
        try:
            errors = errors_against(fn, op, s, device, dtype, (exact_outs, exact_grads), upstream)
            inputs = fresh_inputs(op, s, device, dtype)  # this system's own (Liger writes into some inputs)
            grads_in = [u.clone() for u in upstream]
            start = time.perf_counter()
            _forward_backward(fn, inputs, grads_in)  # compiles, autotunes
            fwd = (lambda fn=fn, inputs=inputs: fn(*inputs))
            fwd_bwd = (lambda fn=fn, inputs=inputs, grads_in=grads_in: _forward_backward(fn, inputs, grads_in))
            rows[name] = {"warmup_s": round(time.perf_counter() - start, 2), "errors": errors,
                          "max_rel_error": max(errors.values()), "event_fwd_ms": timer(fwd),
                          "event_fwd_bwd_ms": timer(fwd_bwd), "peak_mb": peak_mb(fwd_bwd, device)}
            calls[(name, "fwd")], calls[(name, "fwd_bwd")] = fwd, fwd_bwd
        except Exception:  # noqa: BLE001 - one system's failure must not lose the others
            rows[name] = {"error": traceback.format_exc().strip().splitlines()[-1], "traceback": traceback.format_exc()}
            log(f"  {op.name} {name}: ERROR {rows[name]['error']}")
    kernel_times(calls, rows, device, rounds)
    _judge_errors(rows)
    return {"systems": rows, **compare_op(op, rows)}


def _unavailable(name: str, factory: Callable[[], Fn], device: torch.device) -> Fn | str:
    """The system's function, or why it cannot run here (a missing package or function, Liger on a CPU)."""
    try:
        fn = factory()
    except (ImportError, AttributeError) as error:
        return f"skipped: unavailable here ({type(error).__name__}: {error})"
    if name == "liger" and device.type != "cuda":
        return "skipped: Liger's kernels are Triton GPU kernels"
    return fn


def kernel_times(calls: dict[tuple[str, str], Callable[[], Any]], rows: dict[str, dict[str, Any]],
                 device: torch.device, rounds: int = ROUNDS) -> None:
    """fwd_ms / fwd_bwd_ms: GPU kernel time (medians of interleaved rounds) on CUDA, the events elsewhere."""
    if device.type == "cuda" and calls:
        from benchmarks.gpu_time import interleaved_kernel_ms

        for (name, what), values in interleaved_kernel_ms(calls, rounds=rounds, iters=ITERS).items():
            rows[name][f"{what}_ms"] = statistics.median(values)
            rows[name][f"{what}_range_ms"] = [round(min(values), 5), round(max(values), 5)]
            rows[name][f"{what}_rounds_ms"] = [round(v, 5) for v in values]  # round order: pairs with the peers
        return
    for row in rows.values():
        if "event_fwd_ms" in row:
            row["fwd_ms"], row["fwd_bwd_ms"] = row["event_fwd_ms"], row["event_fwd_bwd_ms"]


def _judge_errors(rows: dict[str, dict[str, Any]]) -> None:
    """fused_kernels.py's rule: each error within max(1e-2, 2x HF eager's)."""
    eager = rows.get("eager", {}).get("errors")
    for row in rows.values():
        if "errors" in row and eager is not None:
            row["passed"] = all(v <= max(1e-2, 2 * eager[k]) for k, v in row["errors"].items())


def compare_op(op: Op, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """mplan's fastest variant against the fastest peer, by fwd+bwd and by fwd; head_loss's memory."""
    timed = {name: row for name, row in rows.items() if "fwd_bwd_ms" in row}
    mine = [name for name in timed if name.startswith("mplan")]
    peers = [name for name in timed if name in PEERS]
    if not mine or not peers:
        return {}
    out: dict[str, Any] = {"mplan_vs_best_peer": {}}
    for what in ("fwd_bwd", "fwd"):
        best_mine = min(mine, key=lambda name: timed[name][f"{what}_ms"])
        best_peer = min(peers, key=lambda name: timed[name][f"{what}_ms"])
        out["mplan_vs_best_peer"][what] = {
            "ratio": timed[best_peer][f"{what}_ms"] / timed[best_mine][f"{what}_ms"],
            "mplan": best_mine, "peer": best_peer,
            "by_variant": {name: timed[best_peer][f"{what}_ms"] / timed[name][f"{what}_ms"] for name in mine}}
    out["targets"] = {f"mplan_vs_best_peer(fwd_bwd)>={TARGET_VS_BEST_PEER}":
                      out["mplan_vs_best_peer"]["fwd_bwd"]["ratio"] >= TARGET_VS_BEST_PEER}
    peaks = {name: timed[name]["peak_mb"] for name in timed if timed[name].get("peak_mb") is not None}
    if op.name == "head_loss" and any(n in peaks for n in mine) and any(n in peaks for n in peers):
        lowest_mine = min((n for n in mine if n in peaks), key=peaks.__getitem__)
        lowest_peer = min((n for n in peers if n in peaks), key=peaks.__getitem__)
        out["mplan_peak_vs_lowest_peer"] = {"ratio": peaks[lowest_mine] / peaks[lowest_peer],
                                            "mplan": lowest_mine, "peer": lowest_peer}
        out["targets"][f"peak<={TARGET_PEAK_VS_LOWEST_PEER}x_lowest_peer"] = (
            out["mplan_peak_vs_lowest_peer"]["ratio"] <= TARGET_PEAK_VS_LOWEST_PEER)
    return out


def table(ops: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op and system: the figures a reader compares."""
    rows = []
    for op, entry in ops.items():
        for name, row in entry.get("systems", {}).items():
            rows.append({"op": op, "system": name, "fwd_ms": _round(row.get("fwd_ms")),
                         "fwd_bwd_ms": _round(row.get("fwd_bwd_ms")), "peak_mb": _round(row.get("peak_mb"), 1),
                         "max_rel_error": _round(row.get("max_rel_error"), 6), "error": row.get("error")})
    return rows


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the smoke test")
    parser.add_argument("--small", action="store_true", help="tiny shapes (the smoke test)")
    parser.add_argument("--models", default="llama,mistral,qwen2", help="comma-separated, of llama,mistral,qwen2")
    parser.add_argument("--ops", default=",".join(op.name for op in OPS), help="comma-separated")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="time torch.compile of HF's function (default: on CUDA only)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no op after this many seconds")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timing rounds per op")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    clock = Clock()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    use_compile = args.compile if args.compile is not None else device.type == "cuda"
    report: dict[str, Any] = {
        **run_header(device), **versions(), "dtype": "bfloat16",
        "timing": f"fwd_ms/fwd_bwd_ms: GPU kernel time, medians of {args.rounds} interleaved rounds of {ITERS} calls "
                  "(CUDA); event_*: triton.testing.do_bench medians (CUDA events, host included)",
        "peak": "max_memory_allocated during one forward+backward above what was allocated before (MB)",
        "mplan_variants": {"rms_norm_hf_form": "upcast" in inspect.signature(mk.rms_norm).parameters,
                           "rope_qk": hasattr(mk, "rope_qk"),
                           "linear_cross_entropy": hasattr(mk, "linear_cross_entropy")},
        "targets": {"mplan_vs_best_peer": TARGET_VS_BEST_PEER, "head_loss_peak_vs_lowest_peer":
                    TARGET_PEAK_VS_LOWEST_PEER},
        "models": {},
    }
    wanted_ops = [op for op in OPS if op.name in args.ops.split(",")]
    for model in (m for m in _families(args.small) if m.name in args.models.split(",")):
        s = shape_of(model)
        entry: dict[str, Any] = {"shape": vars_of(s), "ops": {}}
        report["models"][model.name] = entry
        for op in wanted_ops:
            if clock.elapsed() > args.budget_s:
                entry["ops"][op.name] = {"error": f"skipped: past the {args.budget_s:.0f} s budget"}
                continue
            try:
                entry["ops"][op.name] = measure_op(op, s, device, dtype, use_compile, clock.log, args.rounds)
            except Exception:  # noqa: BLE001 - the other ops' numbers must survive
                entry["ops"][op.name] = {"error": traceback.format_exc()}
            clock.log(f"{model.name} {op.name}: " + _summary(entry["ops"][op.name]))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        entry["table"] = table(entry["ops"])
        write_report(args.out, report)
        torch._dynamo.reset()
    report["wall_s"] = round(clock.elapsed(), 1)
    write_report(args.out, report)
    clock.log(f"wrote {args.out}")


def vars_of(s: Shape) -> dict[str, Any]:
    return {name: getattr(s, name) for name in Shape.__slots__} | {"tokens": s.tokens}


def _summary(entry: dict[str, Any]) -> str:
    if "error" in entry:
        return "ERROR " + entry["error"].strip().splitlines()[-1]
    parts = []
    for name, row in entry["systems"].items():
        if "fwd_bwd_ms" in row:
            peak = f", {row['peak_mb']:.0f} MB" if row.get("peak_mb") is not None else ""
            parts.append(f"{name} {row['fwd_ms']:.3f}/{row['fwd_bwd_ms']:.3f} ms{peak} err {row['max_rel_error']:.1e}")
    ratio = entry.get("mplan_vs_best_peer", {}).get("fwd_bwd", {}).get("ratio")
    return "; ".join(parts) + (f"; mplan_vs_best_peer(fwd_bwd) {ratio:.3f}" if ratio is not None else "")


if __name__ == "__main__":
    main()
