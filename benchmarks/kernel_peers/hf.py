"""Kernel against kernel at the Hugging Face models' shapes: mplan, Liger Kernel, torch.compile, HF eager.

For the shapes of benchmarks/models/hf_step.py's three models (Llama at TinyLlama-1.1B's shape,
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

Method (engine.py), per op and model: every system gets its own inputs (same seed, same values:
Liger writes into some of them); correctness against HF's function run in fp32 on the upcast
inputs, passed within max(1e-2, 2x HF eager's); timing by both clocks, the GPU kernel time's
medians of --rounds interleaved rounds over the op's systems (fwd_ms, fwd_bwd_ms) judged; peak MB
of one forward+backward (the op's saved activations, temporaries and the gradients it returns).
Reported per model: a table (op, system, fwd ms, fwd+bwd ms, peak MB, max relative error) and per
op mplan_vs_best_peer: the fastest of the peers (Liger, compile, eager) over mplan's fastest
variant, by fwd+bwd and by fwd kernel time (> 1: mplan faster; target >= 1.0), and for head_loss
mplan's lowest peak over the lowest peer's (target <= 1.10).

Run on the GPU (from the repository root, Liger installed from the carried wheels; about 3-4
minutes with torch.compile's and Triton's cold compiles; ops not started within --budget-s are
skipped and say so):
    pip install --no-index --find-links .device_wheels --no-deps liger-kernel
    PYTHONPATH=. python -m benchmarks.kernel_peers hf --out $OUT/hf_kernels.json
Smoke mode on a CPU (tiny shapes; mplan's ops run their PyTorch references, Liger is skipped,
torch.compile only with --compile):
    PYTHONPATH=. python -m benchmarks.kernel_peers hf --device cpu --small --out /tmp/hf_kernels.json
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import mplan.kernels as mk
from benchmarks import harness
from benchmarks.kernel_peers import engine
from benchmarks.kernel_peers.head_loss import liger_chunk_rows
from benchmarks.models.hf_step import HFModel, _families
from benchmarks.report import Clock

ROUNDS, ITERS = 5, 10
TARGET_VS_BEST_PEER = 1.0
TARGET_PEAK_VS_LOWEST_PEER = 1.10
OPS = ("rmsnorm", "rope", "swiglu", "swiglu_packed", "head_loss")
Fn = engine.Fn


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


def head_loss_eager(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's ForCausalLMLoss on already-shifted labels: the logits upcast to fp32."""
    return F.cross_entropy(F.linear(x, weight).float(), labels, ignore_index=-100)


# ---- inputs --------------------------------------------------------------------------------------

def rope_tables(s: Shape, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's default RoPE tables for positions 0..seq-1: [1, seq, head_dim], the model's dtype."""
    inv_freq = 1.0 / s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim)
    freqs = torch.outer(torch.arange(s.seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def inputs(op: str, s: Shape, device: torch.device, dtype: torch.dtype) -> list[Any]:
    """The op's inputs: q and k for rope as HF hands them to apply_rotary_pos_emb (transposes of
    [batch, seq, heads, head_dim]); head_loss's labels with each sequence's last one ignored."""
    def leaf(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return engine.leaf(shape, device, dtype, scale, shift)

    if op == "rmsnorm":
        return [leaf(s.tokens, s.hidden), leaf(s.hidden, scale=0.1, shift=1.0)]
    if op == "rope":
        q = leaf(s.batch, s.seq, s.heads, s.head_dim).transpose(1, 2)
        k = leaf(s.batch, s.seq, s.kv_heads, s.head_dim).transpose(1, 2)
        return [q, k, *rope_tables(s, device, dtype)]
    if op == "swiglu":
        return [leaf(s.tokens, s.ffn, scale=2.0), leaf(s.tokens, s.ffn)]
    if op == "swiglu_packed":
        return [leaf(s.tokens, 2 * s.ffn, scale=2.0)]
    labels = torch.randint(0, s.vocab, (s.batch, s.seq), device=device)
    labels[:, -1] = -100  # HF's shift leaves each sequence's last position without a label
    return [leaf(s.tokens, s.hidden), leaf(s.vocab, s.hidden, scale=0.02), labels.view(-1)]


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


def systems_for(op: str, s: Shape) -> dict[str, Callable[[], Fn]]:
    """Each system of `op` as a factory; names starting with "mplan" are mplan's variants, the rest its peers."""
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
            "eager": lambda: _llama().apply_rotary_pos_emb,
        },
        "swiglu": {
            "mplan": lambda: mk.swiglu,
            "liger": lambda: _liger("liger_kernel.ops", "LigerSiLUMulFunction").apply,
            "eager": lambda: mk.swiglu_reference,  # silu(gate) * up
        },
        "swiglu_packed": {
            "mplan": lambda: mk.swiglu_packed,
            "liger": lambda: (lambda f: lambda y: f.apply(y, False))(
                _liger("liger_kernel.ops.swiglu", "LigerFusedGateUpSiLUMulFunction")),
            "eager": lambda: mk.swiglu_packed_reference,  # the same on y.chunk(2, -1)
        },
        "head_loss": {
            "mplan (linear + cross_entropy)": lambda: lambda x, w, labels: mk.cross_entropy(F.linear(x, w), labels),
            **({"mplan (linear_cross_entropy)": lambda: linear_ce,
                "mplan (linear_cross_entropy, Liger's chunk)": lambda: (
                    lambda x, w, labels: linear_ce(x, w, labels,
                                                   chunk_rows=liger_chunk_rows(s.tokens, s.hidden, s.vocab)))}
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


def op_of(name: str, s: Shape, device: torch.device, dtype: torch.dtype, use_compile: bool) -> engine.Op:
    systems = systems_for(name, s)
    if not use_compile:
        del systems["compile"]
    return engine.Op(name=name, make=lambda: inputs(name, s, device, dtype), systems=systems,
                     reference=systems["eager"](), scalar_output=name == "head_loss", gpu_only=("liger",))


# ---- the verdict ---------------------------------------------------------------------------------

def compare_op(op: engine.Op, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """mplan's fastest variant against the fastest peer, by fwd+bwd and by fwd; head_loss's memory."""
    verdict = engine.versus_best_peer(op, rows)
    if not verdict:
        return {}
    out: dict[str, Any] = {"mplan_vs_best_peer": verdict, "targets": {
        f"mplan_vs_best_peer(fwd_bwd)>={TARGET_VS_BEST_PEER}": verdict["fwd_bwd"]["ratio"] >= TARGET_VS_BEST_PEER}}
    peaks = {name: row["peak_mb"] for name, row in rows.items()
             if "fwd_bwd_ms" in row and row.get("peak_mb") is not None}
    mine = [name for name in peaks if op.is_mine(name)]
    peers = [name for name in peaks if not op.is_mine(name)]
    if op.name == "head_loss" and mine and peers:
        lowest_mine, lowest_peer = min(mine, key=peaks.__getitem__), min(peers, key=peaks.__getitem__)
        out["mplan_peak_vs_lowest_peer"] = {"ratio": peaks[lowest_mine] / peaks[lowest_peer],
                                            "mplan": lowest_mine, "peer": lowest_peer}
        out["targets"][f"peak<={TARGET_PEAK_VS_LOWEST_PEER}x_lowest_peer"] = (
            out["mplan_peak_vs_lowest_peer"]["ratio"] <= TARGET_PEAK_VS_LOWEST_PEER)
    return out


def table(ops: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op and system: the figures a reader compares."""
    return [{"op": op, "system": name, "fwd_ms": _round(row.get("fwd_ms")), "fwd_bwd_ms": _round(row.get("fwd_bwd_ms")),
             "peak_mb": _round(row.get("peak_mb"), 1), "max_rel_error": _round(row.get("max_rel_error"), 6),
             "error": row.get("error")}
            for op, entry in ops.items() for name, row in entry.get("systems", {}).items()]


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)
    parser.add_argument("--models", default="llama,mistral,qwen2", help="comma-separated, of llama,mistral,qwen2")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="time torch.compile of HF's function (default: on CUDA only)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no op after this many seconds")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timing rounds per op")


def run(args: argparse.Namespace) -> dict[str, Any]:
    clock = Clock()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    use_compile = args.compile if args.compile is not None else device.type == "cuda"
    report: dict[str, Any] = {
        **engine.header(device, "transformers", "liger-kernel"), "dtype": "bfloat16",
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

    def measure(op: engine.Op) -> dict[str, Any]:
        rows = engine.measure(op, device, rounds=args.rounds, iters=ITERS, log=clock.log)
        return {"systems": rows, **compare_op(op, rows)}

    for model in (m for m in _families(args.small) if m.name in args.models.split(",")):
        s = shape_of(model)
        entry: dict[str, Any] = {"shape": {name: getattr(s, name) for name in Shape.__slots__} | {"tokens": s.tokens},
                                 "ops": {}}
        report["models"][model.name] = entry
        for name in (op for op in OPS if op in args.ops.split(",")):
            op = op_of(name, s, device, dtype, use_compile)
            entry["ops"][name] = engine.guarded(f"{model.name} {name}", lambda op=op: measure(op), clock,
                                                args.budget_s, _summary)
        entry["table"] = table(entry["ops"])
        engine.save_partial(args, report)
        torch._dynamo.reset()
    report["wall_s"] = round(clock.elapsed(), 1)
    return report


def _summary(entry: dict[str, Any]) -> str:
    ratio = entry.get("mplan_vs_best_peer", {}).get("fwd_bwd", {}).get("ratio")
    return engine.summary(entry["systems"]) + (f"; mplan_vs_best_peer(fwd_bwd) {ratio:.3f}" if ratio else "")
