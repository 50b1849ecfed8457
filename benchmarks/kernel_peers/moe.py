"""A Mixtral MoE block's forward + backward: mplan's grouped experts against Hugging Face's own block.

The block is transformers' `MixtralSparseMoeBlock` (router: a linear, fp32 softmax, top-k,
renormalized; experts: gate_up_proj [E, 2F, h], down_proj [E, h, F], SiLU), Mixtral-shaped:
hidden 4096, 8 experts, top-2, FFN 14336, 4 x 4096 = 16384 tokens, bf16 weights and activations,
one GPU. One step is: output = block(x) from a leaf x, then output.backward(dout) with a fixed
random dout, from no gradients (every .grad None). The variants, all on the same parameters:
    hf              the block as transformers runs it, config._experts_implementation set to
                    "grouped_mm" explicitly (the report names the function that ran)
    hf_compile      torch.compile of that block (default mode), compiled in this run
    mplan_kernel    the same block with its experts' forward replaced by
                    `mplan.kernels.moe_grouped.moe_experts_grouped` (registered with transformers'
                    ExpertsInterface; the router stays Hugging Face's)
    mplan_runtime   `mplan.autoparallel(block, plan="dp=1", loss_fn=(out * dout).sum())`: the
                    block captured (its experts as one `mplan.moe_experts` node), lowered by
                    mplan's runtime (whose experts module runs `moe_experts_grouped` at ep=1,
                    dropless), and its program's forward + backward timed (not its optimizer step)
Figures per variant:
    ms              median over rounds x iters samples of CUDA events around one step (the
                    variants interleaved round by round, after warm-up steps that include
                    torch.compile's compilation, whose time is reported separately)
    tflops          model FLOPs over that time: the experts' three GEMMs and the router's,
                    forward and backward (3x forward): 6 T k 3 h F + 6 T h E
    peak_gib        torch.cuda.max_memory_allocated during one step less what was allocated
                    when it began (parameters, x, dout; no gradients): activations, temporaries
                    and the gradients the step creates (the parameters' 2.63 GiB among them)
    host_ms         the host's time until the step returned (the GPU still busy: not host-bound)
    profile         one step under the profiler: each kernel's GPU ms (top 12), the GEMMs' sum,
                    and the span first kernel start to last kernel end (--trace-dir: the traces)
and, once, the six expert GEMMs of a step alone: `torch._grouped_mm` against a per-expert cuBLAS loop.
Correctness, checked in the same run from the same x and dout: each variant's output and its
gradients of x, router weight, gate_up_proj and down_proj against Hugging Face's (bf16), and
against an fp32 reference (the block's math in fp32 on fp32 copies of the same bf16 values, with
the bf16 run's expert choices, so that near-tied router logits cannot route a token elsewhere),
as ||a - b|| / ||b||. mplan passes when its error against fp32 is within 1.25x Hugging Face's
(+1e-3) and within 3e-2 of Hugging Face's bf16 result. Unit checks of the kernels on the GPU:
`grouped_expert_mlp` and `moe_experts_grouped` in bf16 at a small shape in which two experts
receive no token, against the fp32 reference, under torch.cuda.set_sync_debug_mode("error") (a
host synchronization fails the check), the empty experts' weight gradients exactly zero, and a
second backward through the same graph (which recomputes what the first overwrote) equal to the first.

The bar (issue 18): mplan's ms at most the faster of hf and hf_compile, and its peak_gib no higher
than theirs. Reference figures of 2026-12-01: hf 57.4 ms, hf_compile 56.1 ms, ~600 TFLOP/s,
3.25 GiB above the inputs.

Run on the GPU (from the repository root; about 3-4 minutes, most of it torch.compile and the
fp32 reference; mplan_runtime needs PuLP and HiGHS: scripts/device_wheels.sh):
    PYTHONPATH=. python -m benchmarks.kernel_peers moe -o $OUT/moe_block.json
Smoke mode on a CPU (float32, a tiny block, float64 reference; the profile, the sync check and
torch.compile are left out; ~20 s):
    PYTHONPATH=. python -m benchmarks.kernel_peers moe --device cpu --small -o /tmp/moe_block.json
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks import harness
from benchmarks.gpu_time import kernel_table
from benchmarks.kernel_peers import engine
from benchmarks.report import Clock
from mplan.kernels.moe import expert_mlp, moe_experts_reference, route
from mplan.kernels.moe_grouped import grouped_available, grouped_expert_mlp, moe_experts_grouped

GiB = 2**30
REFERENCE_2026_12_01 = {"hf_ms": 57.4, "hf_compile_ms": 56.1, "tflops": 600, "peak_gib_above_inputs": 3.25}


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    batch: int
    seq: int
    hidden: int
    experts: int
    top_k: int
    ffn: int
    dtype: torch.dtype
    device: torch.device
    warmup: int  # untimed steps of each variant first (compilation, autotuning, the allocator's pools)
    rounds: int  # interleaved rounds
    iters: int  # timed steps per variant and round
    compile: bool
    profile: bool


FULL = Settings(batch=4, seq=4096, hidden=4096, experts=8, top_k=2, ffn=14336, dtype=torch.bfloat16,
                device=torch.device("cuda"), warmup=3, rounds=5, iters=5, compile=True, profile=True)
SMOKE = Settings(batch=2, seq=16, hidden=32, experts=4, top_k=2, ffn=48, dtype=torch.float32,
                 device=torch.device("cpu"), warmup=1, rounds=1, iters=2, compile=False, profile=False)


def mplan_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature, run by mplan's grouped path (Mixtral: SiLU, packed)."""
    return moe_experts_grouped(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                               activation="silu", gated=True)


def build_block(s: Settings) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    ALL_EXPERTS_FUNCTIONS.register("mplan", mplan_experts_forward)
    config = MixtralConfig(hidden_size=s.hidden, intermediate_size=s.ffn, num_local_experts=s.experts,
                           num_experts_per_tok=s.top_k, hidden_act="silu", router_jitter_noise=0.0)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(s.device):
        block = MixtralSparseMoeBlock(config).to(s.dtype)
    for param in block.parameters():
        nn.init.normal_(param, std=config.initializer_range)
    return block


def resolved_experts_function(block: nn.Module) -> str:
    """The function transformers' dispatch runs for the block's experts now."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts = block.experts
    fn = ALL_EXPERTS_FUNCTIONS.get_interface(experts.config._experts_implementation, None)
    return f"{experts.config._experts_implementation} -> {getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)}"


@dataclass(slots=True, kw_only=True)
class Variant:
    name: str
    step: Callable[[], torch.Tensor]  # forward + backward from no gradients; returns the output
    params: list[nn.Parameter]  # whose .grad a step leaves
    named: dict[str, nn.Parameter]  # router, gate_up_proj, down_proj: the gradients compared
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)


def clear_grads(x: torch.Tensor, params: list[nn.Parameter]) -> None:
    x.grad = None
    for param in params:
        param.grad = None


def make_variants(block: nn.Module, x: torch.Tensor, dout: torch.Tensor, s: Settings, clock: Clock,
                  ) -> tuple[list[Variant], dict[str, str]]:
    params = list(block.parameters())
    named = {"router": block.gate.weight, "gate_up_proj": block.experts.gate_up_proj,
             "down_proj": block.experts.down_proj}
    config = block.experts.config

    def eager(implementation: str, module: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            clear_grads(x, params)
            config._experts_implementation = implementation
            out = module(x)
            out.backward(dout)
            return out.detach()
        return step

    variants = [Variant(name="hf", step=eager("grouped_mm", block), params=params, named=named)]
    config._experts_implementation = "grouped_mm"
    ran = {"hf": resolved_experts_function(block)}
    if s.compile:
        variants.append(Variant(name="hf_compile", step=eager("grouped_mm", torch.compile(block)), params=params,
                                named=named))
        ran["hf_compile"] = ran["hf"]
    variants.append(Variant(name="mplan_kernel", step=eager("mplan", block), params=params, named=named,
                            notes={"fast_path": grouped_available(x.view(-1, s.hidden), block.experts.gate_up_proj)}))
    config._experts_implementation = "mplan"
    ran["mplan_kernel"] = resolved_experts_function(block)
    config._experts_implementation = "grouped_mm"
    runtime = runtime_variants(block, x, dout, s, clock)
    if isinstance(runtime, list):
        variants.extend(runtime)
    else:
        ran["mplan_runtime"] = runtime
    return variants, ran


def runtime_variants(block: nn.Module, x: torch.Tensor, dout: torch.Tensor, s: Settings, clock: Clock,
                     ) -> list[Variant] | str:
    """mplan's runtime on the block (module docstring), as it lowers the experts node today and
    with that lowering replaced by `moe_experts_grouped`; or the error that stopped it."""
    try:
        import mplan
        from mplan.passes import expert_parallel

        class Block(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.block = inner

            def forward(self, hidden: torch.Tensor) -> torch.Tensor:
                return self.block(hidden)

        began = time.perf_counter()
        pm = mplan.autoparallel(Block(block), example_inputs=(x.detach(),),
                                loss_fn=lambda out, labels: (out * labels).sum(), global_batch=s.batch,
                                micro_batch_size=s.batch, plan="dp=1")
        setup_s = time.perf_counter() - began
        clock.log(f"mplan_runtime built in {setup_s:.1f} s")
    except Exception:  # reported, not fatal: the runtime's MoE lowering is work in progress
        return "error: " + traceback.format_exc(limit=4)[-1500:]
    params = list(pm.params.values())
    named = {role: next(p for name, p in pm.params.items() if name.endswith(suffix))
             for role, suffix in (("router", "gate.weight"), ("gate_up_proj", "experts.gate_up_proj"),
                                  ("down_proj", "experts.down_proj"))}
    lowered = [m for m in pm.program.modules() if isinstance(m, expert_parallel.RoutedExperts)]

    def step() -> torch.Tensor:
        clear_grads(x, params)
        pm.optimizer.zero_grad()
        loss = pm.program(*pm._feed(pm.program, (x, dout)))
        loss.backward()
        return loss.detach()

    notes = {"setup_s": round(setup_s, 2), "plan": pm.plan.describe(), "kernels": pm.kernels,
             "experts_nodes_lowered": len(lowered),
             "step_is": "pm.program forward + backward of (out * dout).sum(), no optimizer step"}
    return [Variant(name="mplan_runtime", step=step, params=params, named=named, notes=notes)]


def sync(s: Settings) -> None:
    if s.device.type == "cuda":
        torch.cuda.synchronize()


def time_step(step: Callable[[], torch.Tensor], s: Settings) -> tuple[float, float]:
    """Milliseconds of one step (CUDA events on a GPU, perf_counter on the CPU) and the host's
    milliseconds until the step returned, before waiting for the GPU (near the first: host-bound)."""
    sync(s)
    began = time.perf_counter()
    if s.device.type != "cuda":
        step()
        return (time.perf_counter() - began) * 1e3, (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    host = (time.perf_counter() - began) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host


def peak_gib(variant: Variant, x: torch.Tensor, s: Settings) -> dict[str, float] | None:
    """engine.memory_during of one step from no gradients, in GiB above what was allocated before it."""
    clear_grads(x, variant.params)
    memory = engine.memory_during(variant.step, s.device)
    clear_grads(x, variant.params)
    if memory is None:
        return None
    return {"peak_gib": (memory["peak"] - memory["before"]) / GiB, "baseline_gib": memory["before"] / GiB,
            "held_after_gib": (memory["after"] - memory["before"]) / GiB}


GEMM_KERNELS = ("cutlass", "gemm", "nvjet", "xmma")


def kernel_profile(variant: Variant, s: Settings, trace: str | None) -> dict[str, Any] | None:
    """One step under the profiler: each kernel's GPU ms (summed by name, top 12), the GEMMs' ms,
    and the span from the first kernel's start to the last one's end (span - kernels = GPU idle)."""
    if not s.profile:
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(s)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        variant.step()
        sync(s)
    if trace is not None:
        prof.export_chrome_trace(trace)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.is_user_annotation]
    table = kernel_table(prof)
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
    return {"kernel_ms_total": sum(table.values()), "gpu_span_ms": span,
            "gemm_ms": sum(ms for name, ms in table.items() if any(k in name.lower() for k in GEMM_KERNELS)),
            "top": {name[:100]: ms for name, ms in list(table.items())[:12]}}


def gemm_breakdown(block: nn.Module, x: torch.Tensor, s: Settings) -> dict[str, Any]:
    """The six expert GEMMs of one step at this step's routing, each timed alone (median of 10,
    CUDA events, random operands): `torch._grouped_mm` as mplan calls it, and a per-expert
    `torch.mm` loop (cuBLAS, counts read on the host) for comparison."""
    with torch.no_grad():
        flat = x.detach().view(-1, s.hidden)
        _, _, index = block.gate(flat)
        routed = route(index, s.experts, flat.shape[0])
        rows = flat.index_select(0, routed.tokens)
    counts = routed.counts.tolist()
    offs = torch.cumsum(routed.counts, 0, dtype=torch.int32)
    w_in, w_out = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    n = rows.shape[0]
    act, dy = torch.randn(n, s.ffn, device=x.device, dtype=s.dtype), torch.randn_like(rows)
    dh = torch.randn(n, 2 * s.ffn, device=x.device, dtype=s.dtype)

    def loop(a: torch.Tensor, b: Callable[[int], torch.Tensor], k_grouped: bool) -> Callable[[], Any]:
        def run() -> None:
            start = 0
            for e, count in enumerate(counts):
                piece = slice(start, start + count)
                torch.mm(a[:, piece] if k_grouped else a[piece], b(e)[piece] if k_grouped else b(e))
                start += count
        return run

    cases = {
        "fwd gate_up [N,h]x[h,2F]": (lambda: torch._grouped_mm(rows, w_in.transpose(-2, -1), offs=offs),
                                     loop(rows, lambda e: w_in[e].t(), False)),
        "fwd down [N,F]x[F,h]": (lambda: torch._grouped_mm(act, w_out.transpose(-2, -1), offs=offs),
                                 loop(act, lambda e: w_out[e].t(), False)),
        "bwd d_act [N,h]x[h,F]": (lambda: torch._grouped_mm(dy, w_out, offs=offs), loop(dy, lambda e: w_out[e], False)),
        "bwd d_w_out [h,N]x[N,F]": (lambda: torch._grouped_mm(dy.t(), act, offs=offs),
                                    loop(dy.t(), lambda e: act, True)),
        "bwd d_rows [N,2F]x[2F,h]": (lambda: torch._grouped_mm(dh, w_in, offs=offs),
                                     loop(dh, lambda e: w_in[e], False)),
        "bwd d_w_in [2F,N]x[N,h]": (lambda: torch._grouped_mm(dh.t(), rows, offs=offs),
                                    loop(dh.t(), lambda e: rows, True)),
    }
    flop_each = 2 * n * s.hidden * s.ffn
    result: dict[str, Any] = {"counts": counts}
    for name, (grouped, per_expert) in cases.items():
        flop = flop_each * (2 if "gate_up" in name or "d_rows" in name or "d_w_in" in name else 1)
        times = {}
        for label, fn in (("grouped_mm", grouped), ("cublas_loop", per_expert)):
            for _ in range(2):
                fn()
            samples = [time_step(fn, s)[0] for _ in range(10)]
            times[label] = {"ms": statistics.median(samples), "tflops": flop / statistics.median(samples) / 1e9}
        result[name] = times
    return result


def rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def outputs_and_grads(variant: Variant, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = variant.step()
    found = {"x": x.grad, **{role: param.grad for role, param in variant.named.items()}}
    result = {name: t.detach().clone() for name, t in found.items() if t is not None}
    if out.shape == x.shape:
        result["out"] = out.clone()
    return result


def fp32_reference(block: nn.Module, x: torch.Tensor, dout: torch.Tensor, index: torch.Tensor,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The block's math in `dtype` on upcast copies of the bf16 values, routed by `index` (the
    bf16 run's choices): output and gradients."""
    h = x.shape[-1]
    xr = x.detach().to(dtype).requires_grad_()
    router = block.gate.weight.detach().to(dtype).requires_grad_()
    w_in = block.experts.gate_up_proj.detach().to(dtype).requires_grad_()
    w_out = block.experts.down_proj.detach().to(dtype).requires_grad_()
    flat = xr.view(-1, h)
    probs = torch.softmax(flat @ router.t(), dim=-1)
    top = probs.gather(1, index)
    gate = top / top.sum(-1, keepdim=True)
    out = moe_experts_reference(flat, index, gate, w_in, w_out, None, activation="silu", gated=True).view(x.shape)
    out.backward(dout.to(dtype))
    return {"out": out.detach(), "x": xr.grad, "router": router.grad, "gate_up_proj": w_in.grad,
            "down_proj": w_out.grad}


def correctness(variants: list[Variant], block: nn.Module, x: torch.Tensor, dout: torch.Tensor, s: Settings,
                ) -> dict[str, Any]:
    # the router's choices in the two eager runs (a hook on a compiled module would recompile it)
    choices: list[torch.Tensor] = []
    eager = ("hf", "mplan_kernel")
    results = {}
    for variant in sorted(variants, key=lambda v: v.name not in eager):
        hook = (block.gate.register_forward_hook(lambda _m, _i, out: choices.append(out[2].detach().clone()))
                if variant.name in eager else None)
        results[variant.name] = outputs_and_grads(variant, x)
        clear_grads(x, variant.params)
        if hook is not None:
            hook.remove()
    reference = fp32_reference(block, x, dout, choices[0], torch.float32 if s.dtype != torch.float32 else torch.float64)
    report: dict[str, Any] = {}
    hf = results["hf"]
    for variant in variants:
        got = results[variant.name]
        vs_ref = {name: rel(got.get(name), reference[name]) for name in reference}
        vs_hf = {name: rel(got.get(name), hf.get(name)) for name in reference}
        entry: dict[str, Any] = {"vs_fp32": vs_ref, "vs_hf": vs_hf}
        if variant.name.startswith("mplan"):
            hf_ref = {name: rel(hf[name], reference[name]) for name in reference}
            checks = [(vs_ref[n], hf_ref[n], vs_hf[n]) for n in reference if vs_ref[n] is not None]
            entry["passed"] = bool(checks) and all(
                err <= 1.25 * floor + 1e-3 and against_hf <= 3e-2 for err, floor, against_hf in checks)
        report[variant.name] = entry
    report["same_routing_as_hf"] = {"mplan_kernel": len(choices) == 2 and bool(torch.equal(choices[0], choices[1]))}
    return report


def unit_checks(s: Settings) -> dict[str, Any]:
    """The two entry points at a small shape with two empty experts, against fp32 (module docstring)."""
    device, dtype = s.device, s.dtype
    ref_dtype = torch.float32 if dtype != torch.float32 else torch.float64
    tokens, hidden, ffn, experts, top_k = 512, 256, 384, 8, 2
    torch.manual_seed(1)
    live = torch.tensor([0, 1, 2, 4, 5, 6], device=device)
    index = live[torch.stack([torch.randperm(len(live))[:top_k] for _ in range(tokens)]).to(device)]
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gate = torch.rand(tokens, top_k, device=device)
    w_in = 0.05 * torch.randn(experts, 2 * ffn, hidden, device=device, dtype=dtype)
    w_out = 0.05 * torch.randn(experts, hidden, ffn, device=device, dtype=dtype)
    dout = torch.randn(tokens, hidden, device=device, dtype=dtype)
    report: dict[str, Any] = {"shape": {"tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts,
                                        "top_k": top_k, "empty_experts": [3, 7]}}

    def run(fn: Callable[..., torch.Tensor], args: list[torch.Tensor], cast: torch.dtype | None,
            upstream: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [a.detach().to(cast or a.dtype).requires_grad_() for a in args]
        out = fn(*leaves)
        return out.detach(), list(torch.autograd.grad(out, leaves, upstream.to(out.dtype)))

    cuda = device.type == "cuda"
    routed = route(index, experts, tokens)
    rows = x.index_select(0, routed.tokens)
    row_grad = torch.randn_like(rows)
    counts = routed.counts
    cases = {
        "grouped_expert_mlp": (lambda r, a, b: grouped_expert_mlp(r, counts, a, b, None, activation="silu", gated=True),
                               lambda r, a, b: expert_mlp(r, counts, a, b, None, activation="silu", gated=True),
                               [rows, w_in, w_out], row_grad),
        "moe_experts_grouped": (lambda t, g, a, b: moe_experts_grouped(t, index, g, a, b),
                                lambda t, g, a, b: moe_experts_reference(t, index, g, a, b),
                                [x, gate, w_in, w_out], dout),
    }
    for name, (fast, slow, args, upstream) in cases.items():
        try:
            out, grads = run(fast, args, None, upstream)
            ref_out, ref_grads = run(slow, args, ref_dtype, upstream)
            errors = [rel(out, ref_out)] + [rel(g, r) for g, r in zip(grads, ref_grads)]
            empty_zero = all(int(torch.count_nonzero(g[[3, 7]])) == 0 for g in grads[-2:])
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            report[name] = {"rel_errors_out_then_grads": errors, "empty_experts_grad_zero": empty_zero,
                            "passed": empty_zero and max(errors) < tol}
            if cuda:  # the same call again, any host synchronization an error
                torch.cuda.set_sync_debug_mode("error")
                try:
                    run(fast, args, None, upstream)
                    report[name]["no_host_sync"] = True
                except RuntimeError as error:
                    report[name].update(no_host_sync=False, sync_error=str(error)[-600:])
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            # a second backward through the same node (retain_graph; the zero-bubble split's W pass)
            leaves = [a.detach().requires_grad_() for a in args]
            out = fast(*leaves)
            first = torch.autograd.grad(out, leaves, upstream, retain_graph=True)
            second = torch.autograd.grad(out, leaves, upstream)
            report[name]["second_backward_rel_diff"] = max(rel(b, a) for a, b in zip(first, second))
            report[name]["passed"] &= report[name]["second_backward_rel_diff"] < 1e-2
        except Exception:
            report[name] = {"passed": False, "error": traceback.format_exc(limit=4)[-1500:]}
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)
    parser.add_argument("--trace-dir", help="write each variant's profiled step as a Chrome trace here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    s = dataclasses.replace(SMOKE if args.small else FULL, device=torch.device(args.device))
    clock = Clock()
    report: dict[str, Any] = {**engine.header(s.device, "transformers"),
                              "settings": {k: str(v) for k, v in dataclasses.asdict(s).items()},
                              "reference_2026_12_01": REFERENCE_2026_12_01}
    tokens = s.batch * s.seq
    flop = 3 * (2 * tokens * s.top_k * 3 * s.hidden * s.ffn + 2 * tokens * s.hidden * s.experts)
    report["model_tflop_per_step"] = flop / 1e12
    report["unit_checks"] = unit_checks(s)
    clock.log(f"unit checks: {[v.get('passed') for k, v in report['unit_checks'].items() if k != 'shape']}")

    block = build_block(s)
    generator = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(s.batch, s.seq, s.hidden, generator=generator).to(s.device, s.dtype).requires_grad_()
    dout = torch.randn(s.batch, s.seq, s.hidden, generator=generator).to(s.device, s.dtype)
    variants, ran = make_variants(block, x, dout, s, clock)
    report["experts_implementation"] = ran

    compile_s = {}
    for variant in list(variants):
        began = time.perf_counter()
        try:
            for _ in range(s.warmup):
                variant.step()
            sync(s)
        except Exception:  # reported; the other variants still run
            ran[variant.name] = "error: " + traceback.format_exc(limit=4)[-1500:]
            variants.remove(variant)
            clear_grads(x, variant.params)
            continue
        compile_s[variant.name] = time.perf_counter() - began
        clock.log(f"{variant.name}: warm-up {compile_s[variant.name]:.1f} s")
    report["correctness"] = correctness(variants, block, x, dout, s)
    clock.log("correctness done")

    samples: dict[str, list[tuple[float, float]]] = {v.name: [] for v in variants}
    for _ in range(s.rounds):
        for variant in variants:
            samples[variant.name].extend(time_step(variant.step, s) for _ in range(s.iters))
    rows = {}
    for variant in variants:
        ms = statistics.median(t for t, _ in samples[variant.name])
        trace = os.path.join(args.trace_dir, f"trace_{variant.name}.json") if args.trace_dir else None
        rows[variant.name] = {"ms": ms, "ms_samples": [t for t, _ in samples[variant.name]], "tflops": flop / ms / 1e9,
                              "host_ms": statistics.median(h for _, h in samples[variant.name]),
                              "warmup_s": compile_s[variant.name], "memory": peak_gib(variant, x, s),
                              "profile": kernel_profile(variant, s, trace), **variant.notes}
    report["variants"] = rows
    report["bar"] = bar(rows)
    report["gemms"] = gemm_breakdown(block, x, s)
    for name, row in rows.items():
        clock.log(f"{name}: {row['ms']:.2f} ms (host {row['host_ms']:.2f}), {row['tflops']:.0f} TFLOP/s, "
                  f"peak {row['memory'] and row['memory']['peak_gib']} GiB")
    clock.log(f"bar: {report['bar']}")
    return report


def bar(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """mplan_kernel against the faster of hf and hf_compile: time and peak memory."""
    baselines = [rows[name] for name in ("hf", "hf_compile") if name in rows]
    best = min(baselines, key=lambda row: row["ms"])
    mine = rows["mplan_kernel"]
    result: dict[str, Any] = {"baseline_ms": best["ms"], "mplan_ms": mine["ms"], "speedup": best["ms"] / mine["ms"],
                              "faster": mine["ms"] <= best["ms"]}
    if mine["memory"] is not None:
        lowest = min(row["memory"]["peak_gib"] for row in baselines)
        result.update(baseline_peak_gib=lowest, mplan_peak_gib=mine["memory"]["peak_gib"],
                      memory_ok=mine["memory"]["peak_gib"] <= lowest)
    result["passed"] = result["faster"] and result.get("memory_ok", True)
    return result

