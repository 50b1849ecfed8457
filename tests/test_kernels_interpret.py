"""Triton kernels run by Triton's CPU interpreter, held against their PyTorch references.

Run by `tests/test_kernels.py::test_interpreter_suite` in a subprocess started with
TRITON_INTERPRET=1 (Triton fixes compile-vs-interpret when it is imported, and the rest of the
suite must keep the fast reference dispatch); skipped otherwise. On its own:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels_interpret.py

Shapes are tiny and not powers of two, so every mask and loop tail runs. In fp32 the outputs
and the gradients must match the fp32 reference within 1e-6 (relative, in norm); in fp16 the
float64 reference within 2e-3. bf16 is not checked here (the interpreter computes it wrongly);
`python -m benchmarks.kernel_peers fused` checks it on the GPU.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import rel_err, run_ranks

from mplan.kernels import (
    VocabReductions,
    bias_gelu,
    bias_gelu_reference,
    cross_entropy,
    cross_entropy_reference,
    layer_norm_residual,
    layer_norm_residual_reference,
    layernorm,
    rms_norm,
    rms_norm_reference,
    rms_norm_residual,
    rms_norm_residual_reference,
    rmsnorm,
    rope,
    rope_reference,
    rotary,
    swiglu,
    swiglu_packed,
    swiglu_packed_reference,
    swiglu_reference,
    use_triton,
    vocab_parallel_cross_entropy,
)
from mplan.kernels.dispatch import INTERPRET
from mplan.kernels.rmsnorm import NormForm
from mplan.kernels.partials import sum_partials
from mplan.kernels.fp8 import cast_fp8
from mplan.models import GPTConfig, GPTModel, LlamaConfig, LlamaModel
from mplan.models.layers import rope_tables
from mplan.passes.fuse_kernels import fuse_kernels

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from process start; "
                                             "run by tests/test_kernels.py::test_interpreter_suite"),
]

FP32_TOL = 1e-6
FP16_TOL = 2e-3


def _outputs(result: Any) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _run(fn: Callable[..., Any], args: list[Any], upstream: list[torch.Tensor] | None,
         ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], list[torch.Tensor]]:
    outputs = _outputs(fn(*args))
    if upstream is None:
        upstream = [torch.randn_like(out) for out in outputs]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(outputs, leaves, [u.to(out.dtype) for u, out in zip(upstream, outputs)])
    return outputs, grads, upstream


def _check(fused: Callable[..., Any], reference: Callable[..., Any], args: list[Any], dtype: torch.dtype,
           function_name: str) -> None:
    """Outputs and gradients of `fused` on `args` against `reference` (fp32: same dtype; fp16: float64)."""
    torch.manual_seed(1)
    outputs, grads, upstream = _run(fused, args, None)
    assert function_name in outputs[0].grad_fn.name(), f"the Triton path did not run: {outputs[0].grad_fn}"
    ref_dtype = torch.float32 if dtype == torch.float32 else torch.float64
    ref_args = [a.detach().to(ref_dtype).requires_grad_(a.requires_grad)
                if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref_outputs, ref_grads, _ = _run(reference, ref_args, [u.to(ref_dtype) for u in upstream])
    tol = FP32_TOL if dtype == torch.float32 else FP16_TOL
    for i, (got, want) in enumerate(zip(outputs, ref_outputs)):
        assert got.dtype == dtype and got.shape == want.shape
        assert rel_err(got.to(ref_dtype), want) < tol, f"output {i}: {rel_err(got.to(ref_dtype), want):.3g}"
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        assert rel_err(got.to(ref_dtype), want) < tol, f"gradient {i}: {rel_err(got.to(ref_dtype), want):.3g}"


def _leaf(*shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (shift + scale * torch.randn(*shape, dtype=torch.float32)).to(dtype).requires_grad_()


DTYPES = [torch.float32, torch.float16]


def test_cpu_tensors_dispatch_to_triton_under_the_interpreter() -> None:
    assert use_triton(torch.zeros(1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_residual(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, r = _leaf(3, 5, 48, dtype=dtype), _leaf(3, 5, 48, dtype=dtype)
    w = _leaf(48, dtype=dtype, scale=0.1, shift=1.0)
    _check(rms_norm_residual, rms_norm_residual_reference, [x, r, w, 1e-5], dtype, "RMSNormResidualFunction")
    _check(rms_norm, rms_norm_reference, [x, w, 1e-5], dtype, "RMSNormResidualFunction")


@pytest.mark.parametrize("form", [NormForm(upcast=True, norm_dtype=torch.float16),
                                  NormForm(upcast=True, out_dtype=torch.float16)], ids=["llama", "gemma"])
def test_rms_norm_in_hugging_faces_forms(form: NormForm) -> None:
    """fp16 stream, statistics in fp32, then Llama's rounding of the normalized value before the
    (fp16) weight, or Gemma's fp32 product with a (1 + weight) in fp32 cast once at the end: the
    kernel's outputs are the reference's within an fp16 ulp, its gradients within FP16_TOL."""
    torch.manual_seed(0)
    x, r = _leaf(3, 5, 48, dtype=torch.float16), _leaf(3, 5, 48, dtype=torch.float16)
    w_dtype = torch.float16 if form.norm_dtype is not None else torch.float32
    w = _leaf(48, dtype=w_dtype, scale=0.1, shift=1.0)
    keywords = {"upcast": form.upcast, "norm_dtype": form.norm_dtype, "out_dtype": form.out_dtype}
    outputs, grads, upstream = _run(lambda *a: rms_norm_residual(*a, **keywords), [x, r, w, 1e-5], None)
    assert "RMSNormResidualFunction" in outputs[0].grad_fn.name()
    ref_outputs, ref_grads, _ = _run(lambda *a: rms_norm_residual_reference(*a, form), [x, r, w, 1e-5], upstream)
    assert outputs[0].dtype == ref_outputs[0].dtype == torch.float16
    assert ((outputs[0] - ref_outputs[0]).abs().float() <= 2 ** -10 * ref_outputs[0].abs().float() + 1e-6).all()
    for got, want in zip(grads, ref_grads):
        assert rel_err(got.double(), want.double()) < FP16_TOL


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_layer_norm_residual(dtype: torch.dtype, with_bias: bool) -> None:
    torch.manual_seed(0)
    x, r = _leaf(15, 40, dtype=dtype, shift=0.5), _leaf(15, 40, dtype=dtype)
    w = _leaf(40, dtype=dtype, scale=0.1, shift=1.0)
    b = _leaf(40, dtype=dtype, scale=0.1) if with_bias else None
    _check(layer_norm_residual, layer_norm_residual_reference, [x, r, w, b, 1e-5], dtype,
           "LayerNormResidualFunction")


@pytest.mark.parametrize("op", ["rms", "layer"])
@pytest.mark.parametrize("with_dsum", [True, False], ids=["dsum", "no_dsum"])
@pytest.mark.parametrize(("n_rows", "programs", "tile_rows"), [(15, 2, 4), (7, 3, 2), (2, 3, 8)],
                         ids=["15_rows_2_programs_x4", "7_rows_3_programs_x2", "2_rows_3_programs_x8"])
def test_norm_backward_row_tiles(op: str, with_dsum: bool, n_rows: int, programs: int, tile_rows: int) -> None:
    """The backward kernels launched directly at tile heights and program counts that the
    autograd path (the interpreter's one config: tiles of 2 rows on at most 2 programs) does not
    reach: a last tile half past the end, programs with one tile fewer than others, programs
    with no row at all (their partials must still be written: the buffers start as NaN). dx,
    dw (and db) against autograd through the reference, all fp32."""
    torch.manual_seed(0)
    n_cols, eps = 40, 1e-5
    stream = (0.5 + torch.randn(n_rows, n_cols)).requires_grad_()
    weight = (1.0 + 0.1 * torch.randn(n_cols)).requires_grad_()
    bias = (0.1 * torch.randn(n_cols)).requires_grad_()
    dy, dsum = torch.randn(n_rows, n_cols), torch.randn(n_rows, n_cols)
    values = stream.detach()
    if op == "rms":
        kernel, leaves = rmsnorm._backward_kernel, (stream, weight)
        normed = rms_norm_reference(stream, weight, eps)
        stats: tuple[torch.Tensor, ...] = (torch.rsqrt(values.pow(2).mean(-1) + eps),)
    else:
        kernel, leaves = layernorm._backward_kernel, (stream, weight, bias)
        normed = F.layer_norm(stream, (n_cols,), weight, bias, eps)
        var, mean = torch.var_mean(values, -1, correction=0)
        stats = (mean, torch.rsqrt(var + eps))
    want = list(torch.autograd.grad(normed, leaves, dy))
    if with_dsum:
        want[0] = want[0] + dsum
    dx = torch.full_like(values, float("nan"))
    partials = [torch.full((programs, n_cols), float("nan")) for _ in leaves[1:]]
    kernel.fn[(programs,)](dy, dsum if with_dsum else dy, values, weight.detach(), *stats, dx, *partials,
                           n_rows, n_cols, HAS_DSUM=with_dsum, BLOCK=64, ROWS=tile_rows)
    for name, got, expected in zip(["dx", "dw", "db"], [dx, *(p.sum(0) for p in partials)], want):
        assert rel_err(got, expected) < FP32_TOL, f"{name}: {rel_err(got, expected):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_partials_sum_over_rows_into_the_parameter_dtype(dtype: torch.dtype) -> None:
    """Two matrices of 11 x 21 partials (neither a multiple of the interpreter's 4 x 8 tiles),
    summed in one launch and rounded once to the parameter dtype."""
    torch.manual_seed(0)
    partials = torch.randn(2, 11, 21)
    got = sum_partials(partials, dtype)
    assert got.dtype == dtype and got.shape == (2, 21)
    assert rel_err(got, partials.double().sum(1)) < (FP32_TOL if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("op", ["rms", "layer"])
def test_norms_promote_a_mixed_precision_residual_stream(op: str) -> None:
    """An fp16 branch added to an fp32 residual stream (what autocast makes): the stream stays
    fp32, as `x + residual` keeps it, and gradients reach each input in its own dtype."""
    torch.manual_seed(0)
    x, r = _leaf(6, 40, dtype=torch.float16), _leaf(6, 40, dtype=torch.float32)
    w = _leaf(40, dtype=torch.float32, scale=0.1, shift=1.0)
    fused, reference = ((rms_norm_residual, rms_norm_residual_reference) if op == "rms"
                        else (layer_norm_residual, layer_norm_residual_reference))
    extra = [1e-5] if op == "rms" else [None, 1e-5]
    outputs = fused(x, r, w, *extra)
    expected = reference(x.detach().double(), r.detach().double(), w.detach().double(), *extra)
    assert [out.dtype for out in outputs] == [torch.float32, torch.float32]
    assert "Function" in outputs[0].grad_fn.name()
    for got, want in zip(outputs, expected):
        assert rel_err(got.double(), want) < 1e-6
    grads = torch.autograd.grad(outputs, (x, r, w), [torch.ones_like(out) for out in outputs])
    assert [g.dtype for g in grads] == [torch.float16, torch.float32, torch.float32]


def test_fused_ops_return_what_their_references_return_under_autocast() -> None:
    """Autocast does not see inside an autograd Function: each op asks its reference what the
    replaced chain returns (here the CPU policy, fp16), and bias_gelu casts the bias as the
    linear it came from would have."""
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 32), torch.randn(5, 32, dtype=torch.float16), 1.0 + 0.1 * torch.randn(32)
    logits, labels = torch.randn(5, 70), torch.randint(0, 70, (5,))
    cases = [(rms_norm_residual, rms_norm_residual_reference, (r, x, w, 1e-5)),
             (layer_norm_residual, layer_norm_residual_reference, (r, x, w, w, 1e-5)),
             (bias_gelu, lambda a, b: bias_gelu_reference(a, b.half()), (r, w)),
             (cross_entropy, cross_entropy_reference, (logits.half(), labels))]
    with torch.autocast("cpu", dtype=torch.float16):
        for fused, reference, args in cases:
            got, want = _outputs(fused(*args)), _outputs(reference(*args))
            assert [t.dtype for t in got] == [t.dtype for t in want], fused.__name__
            for a, b in zip(got, want):
                assert rel_err(a.double(), b.double()) < FP16_TOL, fused.__name__


def test_marked_outputs_come_out_in_the_autocast_dtype() -> None:
    """consumer= (fuse_kernels' mark: the output feeds only linears, or attention): under autocast
    the kernel writes the dtype that consumer casts to, the very values of casting the unmarked
    fp32 result (up to the interpreter's bf16 truncation); the gradient, arriving in that dtype,
    gives the unmarked op's input gradients."""
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 32), torch.randn(5, 32), 1.0 + 0.1 * torch.randn(32)
    cos, sin = (t.float() for t in rope_tables(5, 8, 10000.0, device=torch.device("cpu")))
    q = torch.randn(2, 3, 5, 8)
    cases = [(rms_norm_residual, (x, r, w, 1e-5), "linear"), (rms_norm, (x, w, 1e-5), "linear"),
             (layer_norm_residual, (x, r, w, w, 1e-5), "linear"), (rope, (q, cos, sin), "attention")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for fused, args, consumer in cases:
            leaves = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
            plain = _outputs(fused(*leaves))[0]
            marked = _outputs(fused(*leaves, consumer=consumer))[0]
            assert plain.dtype == torch.float32 and marked.dtype == torch.bfloat16, fused.__name__
            # within one bf16 step of the fp32 result (the interpreter truncates to bf16 where the
            # compiled kernel rounds to nearest, as the cast does)
            assert torch.allclose(marked.float(), plain, rtol=2**-7, atol=0), fused.__name__
            tensors = [a for a in leaves if isinstance(a, torch.Tensor)][:1]  # the activation input
            dy = torch.randn_like(marked)
            (want,) = torch.autograd.grad(plain, tensors, dy.float())
            (got,) = torch.autograd.grad(marked, tensors, dy)
            assert rel_err(got.double(), want.double()) < 1e-6, fused.__name__


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_gelu(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # 22 rows: two row splits of 11 with 4-row tiles, so a tile straddles the split boundary
    _check(bias_gelu, bias_gelu_reference, [_leaf(2, 11, 45, dtype=dtype, scale=3.0), _leaf(45, dtype=dtype)],
           dtype, "BiasGeluFunction")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_on_one_gemms_packed_halves(dtype: torch.dtype) -> None:
    """7 x (2 x 45): rows and columns both leave partial tiles; the gradient comes back packed."""
    _check(swiglu_packed, swiglu_packed_reference, [_leaf(7, 90, dtype=dtype, scale=3.0)], dtype,
           "PackedSwiGLUFunction")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    _check(swiglu, swiglu_reference, [_leaf(7, 45, dtype=dtype, scale=3.0), _leaf(7, 45, dtype=dtype)],
           dtype, "SwiGLUFunction")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [8, 12])
def test_rope_on_a_transposed_input(dtype: torch.dtype, head_dim: int) -> None:
    torch.manual_seed(0)
    cos, sin = (t.to(dtype) for t in rope_tables(5, head_dim, 10000.0, device=torch.device("cpu")))
    projected = _leaf(2, 5, 3, head_dim, dtype=dtype)  # [batch, seq, heads, head_dim], as q_proj gives

    def fused(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return rope(x.transpose(1, 2), c, s)

    def reference(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return rope_reference(x.transpose(1, 2), c, s)

    _check(fused, reference, [projected, cos, sin], dtype, "RopeFunction")


@pytest.mark.parametrize("shape", [(2, 4, 6, 8), (2, 5, 3, 8)], ids=["no masks", "masked"])
def test_rope_with_and_without_masks(shape: tuple[int, int, int, int]) -> None:
    """[2, 4, 6, 8] has 48 head vectors (a multiple of every BLOCK_R) of a power-of-two half, so
    the kernel runs unmasked (EVEN); [2, 5, 3, 8] leaves a partial block, masked."""
    torch.manual_seed(0)
    cos, sin = (t.float() for t in rope_tables(shape[1], shape[-1], 10000.0, device=torch.device("cpu")))
    _check(lambda x, c, s: rope(x.transpose(1, 2), c, s), lambda x, c, s: rope_reference(x.transpose(1, 2), c, s),
           [_leaf(*shape, dtype=torch.float32), cos, sin], torch.float32, "RopeFunction")


def test_rope_indexes_in_64_bits_only_past_2_31_elements() -> None:
    """32-bit offsets are what Inductor uses below 2^31 elements (and what ran fastest on the
    H200); a tensor whose strides reach past that takes 64-bit offsets."""
    small = torch.empty(4, 8, 16, 128, device="meta")
    assert not rotary._needs_64_bit_offsets(small, small.transpose(1, 2))
    assert rotary._needs_64_bit_offsets(small, torch.empty(2, device="meta").as_strided((2, 128), (2**31, 1)))
    assert not rotary._needs_64_bit_offsets(torch.empty(2, device="meta").as_strided((2, 128), (2**31 - 128, 1)))


def test_rope_keeps_the_layout_of_its_input_and_gradient() -> None:
    """q arrives as a transpose of [batch, seq, heads, head_dim]: the result and the gradient
    keep that layout (the gradient's transpose back is then a view, not a copy); 7 heads and
    5 positions leave partial head groups and position blocks."""
    torch.manual_seed(0)
    cos, sin = rope_tables(5, 8, 10000.0, device=torch.device("cpu"))
    projected = _leaf(2, 5, 7, 8, dtype=torch.float32)
    x = projected.transpose(1, 2)
    y = rope(x, cos.float(), sin.float())
    assert y.stride() == x.stride() and "RopeFunction" in y.grad_fn.name()
    (grad,) = torch.autograd.grad(y, projected, torch.randn(y.shape).transpose(1, 2).contiguous().transpose(1, 2))
    assert grad.is_contiguous()
    contiguous = x.detach().contiguous()
    assert rel_err(rope(contiguous, cos.float(), sin.float()), rope_reference(contiguous, cos.float(), sin.float())) < 1e-6


def test_rope_on_a_slice_of_a_grouped_projection_writes_dense_results() -> None:
    """q as a slice of one q/k/v GEMM's [batch, seq, 3 * heads * head_dim] result: the output and
    the gradient are dense in [batch, seq, heads, head_dim] order, so the gradient's way back to
    the GEMM (transpose, view, the split's concatenation) copies nothing but the concatenation."""
    torch.manual_seed(0)
    cos, sin = rope_tables(5, 8, 10000.0, device=torch.device("cpu"))
    grouped = _leaf(2, 5, 3 * 7 * 8, dtype=torch.float32)
    q = grouped[..., : 7 * 8].view(2, 5, 7, 8).transpose(1, 2)
    y = rope(q, cos.float(), sin.float())
    assert "RopeFunction" in y.grad_fn.name() and y.transpose(1, 2).is_contiguous()
    upstream = torch.randn(y.shape)
    (grad,) = torch.autograd.grad(y, grouped, upstream)
    (want,) = torch.autograd.grad(rope_reference(q, cos.float(), sin.float()), grouped, upstream)
    assert rel_err(grad, want) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_with_ignored_rows(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    labels = torch.randint(0, 70, (9,))
    labels[[2, 5]] = -100
    _check(cross_entropy, cross_entropy_reference, [_leaf(9, 70, dtype=dtype, scale=2.0), labels], dtype,
           "VocabParallelCrossEntropyFunction")


def _logits_with_masked_blocks(rows: int, vocab: int) -> torch.Tensor:
    """fp32 logits with -inf runs that fill a whole partial of the block stats (2 blocks of 32
    ids under the interpreter), straddle two partials, or end a row. Row 1 sits near -120:
    were a -inf partial's max taken as 0, its sum would underflow to 0 and its loss be inf."""
    logits = 2.0 * torch.randn(rows, vocab, dtype=torch.float32)
    logits[1] -= 120.0
    logits[1, :70] = float("-inf")
    logits[3, 32:96] = float("-inf")
    logits[5, 64:] = float("-inf")
    return logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_with_masked_blocks(dtype: torch.dtype) -> None:
    """150 ids: partials [0, 64), [64, 128) and [128, 150) (a partial block and an empty one);
    labels on finite logits, and an ignored row among the masked ones."""
    torch.manual_seed(0)
    logits = _logits_with_masked_blocks(9, 150)
    labels = torch.randint(0, 150, (9,))
    labels[[1, 3]] = torch.tensor([100, 10])
    labels[[2, 5]] = -100
    _check(cross_entropy, cross_entropy_reference, [logits.to(dtype).requires_grad_(), labels], dtype,
           "VocabParallelCrossEntropyFunction")


def _sharded_cross_entropy_on_gloo() -> tuple[float, float]:
    """On each rank: its vocabulary slice (uneven: 70 and 80 ids, each ending in a partial block
    and an empty one) of one set of logits; rank 0's slice of row 1 and rank 1's of row 5 are
    all -inf."""
    torch.manual_seed(0)
    logits = _logits_with_masked_blocks(9, 150)
    labels = torch.randint(0, 150, (9,))
    labels[[1, 3, 5]] = torch.tensor([100, 10, 40])
    labels[4] = -100
    start, stop = (0, 70) if dist.get_rank() == 0 else (70, 150)
    local = logits[:, start:stop].clone().requires_grad_()
    assert use_triton(local), "the rank did not inherit TRITON_INTERPRET=1"
    loss = vocab_parallel_cross_entropy(local, labels, start, VocabReductions.from_group(None))
    (grad,) = torch.autograd.grad(loss, local)
    assert grad.grad_fn is None and "VocabParallelCrossEntropyFunction" in loss.grad_fn.name()
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full, labels)
    (expected_grad,) = torch.autograd.grad(expected, full)
    return rel_err(loss, expected), rel_err(grad, expected_grad[:, start:stop])


@pytest.mark.distributed
def test_vocab_parallel_cross_entropy_on_two_gloo_ranks() -> None:
    for loss_err, grad_err in run_ranks(2, _sharded_cross_entropy_on_gloo, timeout_s=60):
        assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def _tiny_models() -> list[torch.nn.Module]:
    return [
        GPTModel(GPTConfig(num_layers=2, hidden=16, num_heads=2, seq_len=8, vocab=32), device="cpu"),
        LlamaModel(LlamaConfig(num_layers=2, hidden=16, num_heads=2, num_kv_heads=1, seq_len=8, vocab=32,
                               ffn_hidden=24), device="cpu"),
    ]


@pytest.mark.parametrize("model", _tiny_models(), ids=["gpt", "llama"])
def test_fused_model_matches_unfused_under_the_interpreter(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    labels[0, 3] = -100
    unfused = torch.export.export(model, (ids,), {"labels": labels}, strict=False).module()
    fused = fuse_kernels(copy.deepcopy(unfused))
    assert sum(fused.meta["fuse_kernels"].counts.values()) >= 7
    losses = []
    for gm in (unfused, fused):
        loss = gm(ids, labels=labels)
        loss.backward()
        losses.append(loss)
    assert rel_err(losses[1], losses[0]) < FP32_TOL
    fused_params = dict(fused.named_parameters())
    for name, param in unfused.named_parameters():
        # floor: some gradients are zero up to rounding (a key bias shifts every score of a query
        # equally, so softmax ignores it); their "relative" error says nothing
        scale = max(param.grad.norm().item(), 1e-3)
        assert (fused_params[name].grad - param.grad).norm().item() / scale < FP32_TOL, name


@pytest.mark.parametrize(("dtype", "transpose"), [(torch.float8_e4m3fn, True), (torch.float8_e5m2, False)])
def test_fp8_cast_writes_both_layouts_and_the_amax(dtype: torch.dtype, transpose: bool) -> None:
    """The cast kernel's tiling, masks, transposed store and atomic amax, on values both fp8
    formats hold exactly (2^k and 1.5 * 2^k, scaled by 2): the interpreter's own fp8 rounding
    is wrong, so rounding itself is checked on the GPU (`python -m benchmarks.kernel_peers fp8`)."""
    torch.manual_seed(0)
    exact = torch.tensor([0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # 2^k and 1.5 * 2^k
    x = exact[torch.randint(0, len(exact), (37, 53))] * torch.randint(0, 2, (37, 53)).mul(2).sub(1)
    fp8_max = torch.finfo(dtype).max
    cast = cast_fp8(x, torch.tensor(fp8_max / 2), dtype, transpose)  # scale = fp8_max / amax = 2
    assert use_triton(x) and torch.equal(cast.data.float(), 2 * x)
    assert cast.amax.item() == x.abs().max().item() and cast.inv_scale.item() == 0.5
    if transpose:
        assert cast.transposed is not None and cast.transposed.is_contiguous()
        assert torch.equal(cast.transposed.float(), 2 * x.t())
    else:
        assert cast.transposed is None
