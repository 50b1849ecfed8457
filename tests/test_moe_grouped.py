"""The grouped-GEMM experts path (`mplan.kernels.moe_grouped`) against `mplan.kernels.moe`'s reference.

On the CPU `torch._grouped_mm` runs float32, so the whole path runs here: routing, the grouped
GEMMs, the in-place backward, the combine, with its elementwise steps as torch ops. The same
checks with those steps as Triton kernels run in a subprocess under TRITON_INTERPRET=1
(`test_interpreter_suite`; Triton fixes interpret-vs-compile at import), and the kernels are
compiled for sm_90 as the H200 runs them (`test_kernels_compile_for_sm90_without_spills`). bf16
on the GPU: `python -m benchmarks.kernel_peers moe`.

Shapes are tiny and ragged (13 tokens, hidden 24, width 40, so every tile mask runs), and the
last expert is never chosen: its weights' gradients must be exactly zero. Float32 against the
float32 reference within 1e-5 (relative, in norm): only the order of additions differs.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mplan.kernels.dispatch import HAVE_TRITON, INTERPRET, use_triton
from mplan.kernels.moe import ACTIVATIONS, expert_mlp, moe_experts_reference, route
from mplan.kernels.moe_grouped import grouped_available, grouped_expert_mlp, moe_experts_grouped

ROOT = Path(__file__).resolve().parents[1]
TOKENS, HIDDEN, WIDTH, EXPERTS = 13, 24, 40, 4
TOL = 1e-5
LAYOUTS = ["packed", "separate_up", "not_gated"]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _layer(top_k: int, layout: str, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Leaves of one layer; routing never picks the last expert."""
    torch.manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS - 1)[:top_k] for _ in range(TOKENS)])
    return {
        "x": torch.randn(TOKENS, HIDDEN).requires_grad_(),
        "index": index,
        "gate": torch.rand(TOKENS, top_k).requires_grad_(),
        "w_in": (0.2 * torch.randn(EXPERTS, 2 * WIDTH if layout == "packed" else WIDTH, HIDDEN)).requires_grad_(),
        "w_out": (0.2 * torch.randn(EXPERTS, HIDDEN, WIDTH)).requires_grad_(),
        "w_up": (0.2 * torch.randn(EXPERTS, WIDTH, HIDDEN)).requires_grad_() if layout == "separate_up" else None,
    }


def _check_moe(top_k: int, layout: str, activation: str) -> None:
    layer = _layer(top_k, layout)
    x, index, gate, w_in, w_out, w_up = layer.values()
    leaves = [t for name, t in layer.items() if name != "index" and t is not None]
    options = {"activation": activation, "gated": layout != "not_gated"}
    out = moe_experts_grouped(x, index, gate, w_in, w_out, w_up, **options)
    assert out.grad_fn.name() == "GroupedMoEFunctionBackward" and out.dtype == x.dtype
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, upstream)
    want = moe_experts_reference(x, index, gate, w_in, w_out, w_up, **options)
    want_grads = torch.autograd.grad(want, leaves, upstream)
    assert _rel(out, want) < TOL, _rel(out, want)
    for name, got, expected in zip([n for n, t in layer.items() if n != "index" and t is not None], grads, want_grads):
        assert got.shape == expected.shape and _rel(got, expected) < TOL, (name, _rel(got, expected))
    for grad in grads[2:]:  # the weights: the unchosen expert's gradient is exactly zero
        assert torch.count_nonzero(grad[EXPERTS - 1]) == 0


def _check_mlp(top_k: int, layout: str, activation: str) -> None:
    layer = _layer(top_k, layout, seed=1)
    routed = route(layer["index"], EXPERTS, TOKENS)
    assert routed.counts[EXPERTS - 1] == 0
    rows = layer["x"].detach().index_select(0, routed.tokens).requires_grad_()
    weights = [layer["w_in"], layer["w_out"], layer["w_up"]]
    leaves = [rows, *(w for w in weights if w is not None)]
    options = {"activation": activation, "gated": layout != "not_gated"}
    out = grouped_expert_mlp(rows, routed.counts, *weights, **options)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, upstream)
    want = expert_mlp(rows, routed.counts, *weights, **options)
    want_grads = torch.autograd.grad(want, leaves, upstream)
    assert _rel(out, want) < TOL
    for got, expected in zip(grads, want_grads):
        assert _rel(got, expected) < TOL
    for grad in grads[1:]:
        assert torch.count_nonzero(grad[EXPERTS - 1]) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_experts_grouped_matches_the_reference(top_k: int, layout: str) -> None:
    _check_moe(top_k, layout, "silu")


@pytest.mark.parametrize("activation", sorted(set(ACTIVATIONS) - {"silu"}))
def test_moe_experts_grouped_activations(activation: str) -> None:
    _check_moe(2, "packed", activation)
    _check_moe(1, "not_gated", activation)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_grouped_expert_mlp_matches_the_reference(top_k: int, layout: str) -> None:
    _check_mlp(top_k, layout, "silu")


def _check_second_backward(entry: str) -> None:
    """retain_graph: the first backward overwrites the saved projections (on the Triton path);
    the second must still give the same gradients (the zero-bubble split's W pass reruns the node)."""
    layer = _layer(2, "separate_up")
    x, index, gate, w_in, w_out, w_up = layer.values()
    if entry == "moe_experts_grouped":
        out, leaves = moe_experts_grouped(x, index, gate, w_in, w_out, w_up), [x, gate, w_in, w_out, w_up]
    else:
        counts = torch.tensor([4, 5, 4, 0])
        out = grouped_expert_mlp(x, counts, w_in, w_out, w_up, activation="silu", gated=True)
        leaves = [x, w_in, w_out, w_up]
    upstream = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, upstream, retain_graph=True)
    second = torch.autograd.grad(out, leaves, upstream)
    for a, b in zip(first, second):
        assert _rel(b, a) < TOL


@pytest.mark.parametrize("entry", ["moe_experts_grouped", "grouped_expert_mlp"])
def test_a_second_backward_gives_the_same_gradients(entry: str) -> None:
    _check_second_backward(entry)


def test_zero_bubble_split_backward_equals_the_whole_backward() -> None:
    from mplan.runtime.split_backward import backward_full, backward_input

    layer = _layer(2, "packed")
    x, index, gate, w_in, w_out, _ = layer.values()
    params = [w_in, w_out]
    upstream = torch.randn(TOKENS, HIDDEN)
    results = []
    for split in (False, True):
        for param in params:
            param.grad = None
        out = moe_experts_grouped(x, index, gate, w_in, w_out)
        if split:
            input_grads, weights = backward_input([out], [upstream], [x, gate], params)
            weights.run()
        else:
            input_grads = backward_full([out], [upstream], [x, gate], params)
        results.append([*input_grads, *(p.grad for p in params)])
    for whole, split_grad in zip(*results):
        assert _rel(split_grad, whole) < TOL


def test_the_fast_path_needs_cuda_bf16() -> None:
    assert not grouped_available(torch.zeros(2, 16), torch.zeros(2, 32, 16))
    assert not grouped_available(torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(2, 32, 16, dtype=torch.bfloat16))


# Under TRITON_INTERPRET=1 (test_interpreter_suite's subprocess): the same checks on the Triton kernels.

interpreted = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from process start")


@interpreted
@pytest.mark.parametrize(("top_k", "layout", "activation"), [
    (2, "packed", "silu"), (1, "separate_up", "gelu_tanh"), (2, "not_gated", "relu"), (2, "packed", "gelu")])
def test_interpreted_kernels(top_k: int, layout: str, activation: str) -> None:
    assert use_triton(torch.zeros(1))
    _check_moe(top_k, layout, activation)
    _check_mlp(top_k, layout, activation)


@interpreted
@pytest.mark.parametrize("entry", ["moe_experts_grouped", "grouped_expert_mlp"])
def test_interpreted_second_backward(entry: str) -> None:
    _check_second_backward(entry)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET or not HAVE_TRITON, reason="starts the interpreter itself; needs Triton")
def test_interpreter_suite() -> None:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted",
                          "tests/test_moe_grouped.py"], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "6 passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(INTERPRET or not HAVE_TRITON, reason="needs Triton, compiling (not interpreting)")
def test_kernels_compile_for_sm90_without_spills() -> None:
    """Every kernel variant at the H200 launch configuration: no local memory, 16-byte loads
    (as tests/test_kernels_compile.py checks the other kernels)."""
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this Triton has another compiler API: {exc}")
    from mplan.kernels import moe_grouped

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("this Triton wheel ships no cuobjdump")
    tile = {"BLOCK_M": 1, "BLOCK_N": 2048}
    kernels = [(moe_grouped._combine_kernel, {"TOP_K": 2, "WEIGHTED": True, "BLOCK_M": 1, "BLOCK_N": 1024}, 4)]
    for act in range(len(ACTIVATIONS)):
        for gated in (True, False):
            kernels.append((moe_grouped._activate_kernel, {"GATED": gated, "ACT": act, **tile}, 8))
            kernels.append((moe_grouped._activation_backward_kernel,
                            {"GATED": gated, "ACT": act, "WEIGHTED": True, **tile}, 8))
    types = {"w_ptr": "*fp32", "part_ptr": "*fp32", "pos_ptr": "*i64"}
    for fn, constexprs, warps in kernels:
        signature = {arg: "constexpr" if arg in constexprs
                     else types.get(arg, "*bf16" if arg.endswith("_ptr") else "i32") for arg in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
                   if signature[arg].startswith("*") or arg in ("n_cols", "in_stride", "width")}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert re.search(r"ld\.global\S*\.v4", compiled.asm["ptx"]), f"{fn.__name__} {constexprs}: narrow loads"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
            handle.write(compiled.asm["cubin"])
            handle.flush()
            listing = subprocess.run([tool, "--dump-resource-usage", handle.name], capture_output=True, text=True,
                                     check=True).stdout
        usage = {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", listing)}
        assert usage.get("STACK", 0) == 0 and usage.get("LOCAL", 0) == 0, f"{fn.__name__} {constexprs}: {usage}"
