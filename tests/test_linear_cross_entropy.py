"""The fused LM head + loss (`mplan.kernels.linear_cross_entropy`): what it computes, what it never
materializes, what it skips, its sharded variant on two gloo ranks, its memory formula, and its
Triton path under the interpreter (in a subprocess started with TRITON_INTERPRET=1, since Triton
fixes compile-vs-interpret at import).

Shapes are tiny; chunks are forced small (`chunk_rows=`), so every batch spans several chunks
and ends in a short one.
"""
from __future__ import annotations

import weakref

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import rel_err, run_checks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from mplan.kernels import (
    VocabReductions,
    linear_cross_entropy,
    linear_cross_entropy_bytes,
    linear_cross_entropy_reference,
    use_triton,
    vocab_parallel_linear_cross_entropy,
)
from mplan.kernels.dispatch import INTERPRET
from mplan.kernels.head_loss import (
    LinearCrossEntropyBytes,
    _logits_buffer,
    aligned_vocab,
    default_chunk_rows,
    logits_row_bytes,
)

needs_reference_dispatch = pytest.mark.skipif(INTERPRET, reason="this process runs Triton's interpreter")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from process start; run by "
                                                             "tests/test_kernels.py::test_interpreter_suite")


def _problem(rows: tuple[int, ...], hidden: int, vocab: int, dtype: torch.dtype, *, bias: bool = True,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x [*rows, hidden], weight [vocab, hidden], bias [vocab], labels [*rows]: a quarter of the
    rows ignored (-100), the rest spread over the whole vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, hidden, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) / hidden ** 0.5
    b = 0.1 * torch.randn(vocab, generator=generator, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, rows, generator=generator)
    labels.view(-1)[::4] = -100
    return x.to(dtype), 2.0 * weight.to(dtype), None if b is None else b.to(dtype), labels


def _leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Fresh leaves requiring grad of the floating tensors; labels (and None) pass through."""
    return [t.detach().clone().requires_grad_() if t is not None and t.is_floating_point() else t for t in tensors]


def _loss_and_grads(fn: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor, upstream: float = 3.0, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """loss and the gradients of `upstream * loss` w.r.t. x, weight (and bias)."""
    leaves = [t for t in (x, weight, bias) if t is not None]
    loss = fn(x, weight, labels, bias=bias, **kwargs)
    return (loss.detach(), *torch.autograd.grad(upstream * loss, leaves))


# -- what it computes -------------------------------------------------------------------------------
@needs_reference_dispatch
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_float64_loss_and_gradients_equal_the_unfused_ops(with_bias: bool) -> None:
    """21 rows in chunks of 4 (the last of 1), a quarter ignored, grad_output 3: the loss, d_x,
    d_W and d_b equal F.linear + F.cross_entropy's to 1e-12."""
    x, weight, bias, labels = _leaves(*_problem((3, 7), 16, 50, torch.float64, bias=with_bias))
    got = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels, chunk_rows=4)
    want = _loss_and_grads(linear_cross_entropy_reference, x, weight, bias, labels)
    assert got[0].dtype == torch.float64 and got[1].shape == x.shape
    for name, g, w in zip(["loss", "d_x", "d_W", "d_b"], got, want):
        assert rel_err(g, w) < 1e-12, name


@needs_reference_dispatch
def test_an_odd_vocabulary_computes_on_row_aligned_logits_and_equals_the_unfused_ops() -> None:
    """A 51-token vocabulary (408 bytes a float64 row, Granite's 49155 tokens are the real case):
    each chunk's logits are a view whose rows start every 128 bytes, so cuBLAS can align its GEMMs,
    and the loss and every gradient are still F.linear + F.cross_entropy's to 1e-12; an aligned
    vocabulary gets a plain contiguous buffer."""
    odd = _logits_buffer(4, 51, torch.empty(0, dtype=torch.float64))
    assert odd.shape == (4, 51) and odd.stride() == (64, 1) and logits_row_bytes(51, 8) == 512
    assert _logits_buffer(4, 50, torch.empty(0, dtype=torch.float64)).is_contiguous()
    assert logits_row_bytes(49155, 2) == 98432 and logits_row_bytes(32000, 2) == 64000
    x, weight, bias, labels = _leaves(*_problem((3, 7), 16, 51, torch.float64))
    got = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels, chunk_rows=4)
    want = _loss_and_grads(linear_cross_entropy_reference, x, weight, bias, labels)
    for name, g, w in zip(["loss", "d_x", "d_W", "d_b"], got, want):
        assert rel_err(g, w) < 1e-12, name


class _GemmExtents(TorchFunctionMode):
    """Records the shapes of the matrices every GEMM (mm, addmm, addmm_) is given."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[-2], args[-1]
            self.shapes.append((tuple(a.shape), tuple(b.shape)))
        return func(*args, **(kwargs or {}))


@needs_reference_dispatch
@pytest.mark.parametrize("dtype, vocab, aligned", [(torch.float64, 51, 50), (torch.float32, 51, 48),
                                                   (torch.float32, 3, 3), (torch.float64, 50, 50)])
def test_every_head_gemm_runs_on_an_aligned_vocabulary_extent_but_one_of_the_rest(
        dtype: torch.dtype, vocab: int, aligned: int) -> None:
    """Granite's 49155 tokens sent the head's backward GEMMs to cuBLAS's align1 kernels even on
    row-aligned logits: the vocabulary is also a contiguous GEMM extent. Each GEMM over the
    vocabulary is split at `aligned_vocab` (a multiple of 16 bytes of columns): every vocabulary
    extent a GEMM sees is that many columns or the few left over, and the result is unchanged."""
    assert aligned_vocab(vocab, torch.empty(0, dtype=dtype).element_size()) == aligned
    assert aligned_vocab(49155, 2) == 49152 and aligned_vocab(32000, 2) == 32000
    x, weight, bias, labels = _leaves(*_problem((3, 7), 16, vocab, dtype))
    with _GemmExtents() as spy:
        got = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels, chunk_rows=8)
    vocab_extents = [dim for a, b in spy.shapes for dim in (*a, *b) if dim not in (16, 8, 5)]
    assert vocab_extents and set(vocab_extents) == ({aligned} if aligned == vocab else {aligned, vocab - aligned})
    want = _loss_and_grads(linear_cross_entropy_reference, x, weight, bias, labels)
    for name, g, w in zip(["loss", "d_x", "d_W", "d_b"], got, want):
        assert rel_err(g, w) < (1e-12 if dtype == torch.float64 else 1e-5), name


@needs_reference_dispatch
def test_every_row_ignored_gives_nan_loss_and_zero_gradients_as_unfused() -> None:
    x, weight, bias, labels = _leaves(*_problem((5,), 8, 20, torch.float64))
    labels = torch.full_like(labels, -100)
    got = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels, chunk_rows=2)
    want = _loss_and_grads(linear_cross_entropy_reference, x, weight, bias, labels)
    assert got[0].isnan() and want[0].isnan()
    assert all(torch.equal(g, w) for g, w in zip(got[1:], want[1:]))


@needs_reference_dispatch
def test_under_cpu_autocast_bf16_it_behaves_as_the_unfused_ops_do() -> None:
    """fp32 x and weight under autocast: GEMMs in bf16, the loss in fp32 (F.cross_entropy's
    autocast dtype), gradients back in fp32; values within bf16 rounding of the unfused chain."""
    x, weight, bias, labels = _leaves(*_problem((24,), 32, 40, torch.float32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(linear_cross_entropy, x, weight, bias, labels, chunk_rows=5)
        want = _loss_and_grads(linear_cross_entropy_reference, x, weight, bias, labels)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32] * 4
    assert rel_err(got[0], want[0]) < 4e-3
    for name, g, w in zip(["d_x", "d_W", "d_b"], got[1:], want[1:]):
        assert rel_err(g, w) < 2e-2, name


# -- what it never materializes, what it skips ------------------------------------------------------
GEMMS = frozenset({"mm", "addmm", "addmm_", "matmul", "__matmul__", "linear"})


class _CallRecorder(TorchFunctionMode):
    """Every torch call made from Python (the op is Python over torch calls): the largest tensor
    any returned, and how many were GEMMs. (A TorchDispatchMode would see ATen's own ops too, but
    its first use imports torch._dynamo: seconds of this file's budget.)"""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.gemms = 0, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.gemms += getattr(func, "__name__", "") in GEMMS
        self.largest = max([self.largest] + [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        return out


@needs_reference_dispatch
def test_no_op_ever_makes_a_tensor_of_the_whole_logits() -> None:
    """64 rows x 50 vocabulary in chunks of 16: forward and backward, no call returns a tensor
    larger than one chunk of logits (16 x 50); the unfused ops, recorded the same way, return
    the whole 64 x 50."""
    x, weight, bias, labels = _leaves(*_problem((64,), 8, 50, torch.float64))
    fused, unfused = _CallRecorder(), _CallRecorder()
    with fused:
        _loss_and_grads(linear_cross_entropy, x, weight, bias, labels, chunk_rows=16)
    with unfused:
        _loss_and_grads(linear_cross_entropy_reference, x, weight, bias, labels)
    assert fused.largest <= 16 * 50 < 64 * 50 <= unfused.largest


@needs_reference_dispatch
@pytest.mark.parametrize(("x_grad", "weight_grad", "grad_mode", "gemms_per_chunk"), [
    (True, True, True, 3), (True, False, True, 2), (False, True, True, 2), (True, True, False, 1)],
    ids=["both", "frozen_head", "frozen_input", "no_grad"])
def test_only_the_gradients_asked_for_are_computed(x_grad: bool, weight_grad: bool, grad_mode: bool,
                                                   gemms_per_chunk: int) -> None:
    """Per chunk: the logits GEMM, then the d_x GEMM only for an x that requires grad and the d_W
    GEMM only for a weight that does; under no_grad the logits alone. The gradients computed
    equal the unfused ones."""
    x, weight, _, labels = _problem((10,), 8, 30, torch.float64, bias=False)
    x.requires_grad_(x_grad)
    weight.requires_grad_(weight_grad)
    recorder = _CallRecorder()
    with recorder, torch.set_grad_enabled(grad_mode):
        loss = linear_cross_entropy(x, weight, labels, chunk_rows=4)
    assert recorder.gemms == 3 * gemms_per_chunk  # 3 chunks: 4 + 4 + 2 rows
    expected = linear_cross_entropy_reference(x, weight, labels)
    assert rel_err(loss, expected) < 1e-12
    if grad_mode:
        leaves = [t for t in (x, weight) if t.requires_grad]
        for got, want in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, leaves)):
            assert rel_err(got, want) < 1e-12


@needs_reference_dispatch
def test_a_second_backward_hands_out_the_same_gradients_never_scaled_twice() -> None:
    """A zero-bubble schedule's W step runs the loss node again with the gradient it got first."""
    x, weight, _, labels = _leaves(*_problem((6,), 4, 10, torch.float64, bias=False))
    loss = linear_cross_entropy(x, weight, labels) * 3
    first = torch.autograd.grad(loss, (x, weight), retain_graph=True)
    second = torch.autograd.grad(loss, (x, weight), retain_graph=True)
    expected = torch.autograd.grad(linear_cross_entropy_reference(x, weight, labels) * 3, (x, weight))
    for a, b, want in zip(first, second, expected):
        assert torch.equal(a, b) and rel_err(a, want) < 1e-12
    halved = torch.autograd.grad(loss, (x, weight), torch.tensor(0.5, dtype=torch.float64))
    for got, want in zip(halved, expected):
        assert rel_err(got, want / 2) < 1e-12


def _op_node(loss: torch.Tensor) -> Any:
    """The op's autograd node (its ctx), under the views and scalings of its output."""
    node = loss.grad_fn
    while not hasattr(node, "grads"):
        node = node.next_functions[0][0]
    return node


@needs_reference_dispatch
@pytest.mark.parametrize("retain", [False, True])
def test_the_head_weight_adopts_the_ops_gradient_buffer_without_a_copy(retain: bool) -> None:
    """loss.backward() hands the head weight the d_W buffer the forward filled (a copy would be a
    vocab x hidden tensor at the step's memory peak); under retain_graph, every later backward
    adds the same gradient again, however the first was accumulated."""
    x, weight, _, labels = _leaves(*_problem((6,), 4, 10, torch.float64, bias=False))
    loss = linear_cross_entropy(x, weight, labels, chunk_rows=4) * 2
    node = _op_node(loss)
    filled = node.grads[1].data_ptr()
    loss.backward(retain_graph=retain)
    assert weight.grad.data_ptr() == filled
    if retain:
        first = weight.grad.clone()
        loss.backward(retain_graph=True)
        loss.backward()
        assert torch.allclose(weight.grad, 3 * first, rtol=1e-14, atol=0)


def test_a_loss_kept_after_its_backward_keeps_no_gradient_buffer() -> None:
    """`loss = model(...)` in a training loop holds the last step's graph into the next forward:
    the op lets go of d_x and d_W in the backward that frees the graph (as autograd frees saved
    tensors), so only the weight's .grad (d_W adopted) outlives it; a backward with retain_graph
    keeps them for the next run, and running a freed graph again is a clear error."""
    x, weight, _, labels = _leaves(*_problem((6,), 4, 10, torch.float64, bias=False))
    loss = linear_cross_entropy(x, weight, labels, chunk_rows=4)
    node = _op_node(loss)
    d_x = weakref.ref(node.grads[0])
    loss.backward(retain_graph=True)
    assert node.grads[0] is not None and d_x() is not None
    loss.backward()
    assert node.grads == (None, None, None) and d_x() is None
    with pytest.raises(RuntimeError, match="a second time"):
        node.apply(torch.ones((), dtype=torch.float64))


def test_a_split_backward_gets_both_gradients_and_then_frees_them() -> None:
    """A zero-bubble schedule's split: the input gradient first (graph kept), the weight gradient
    after (graph freed): each as one whole backward gives it, then nothing is held."""
    x, weight, _, labels = _leaves(*_problem((6,), 4, 10, torch.float64, bias=False))
    (want_x, want_w) = torch.autograd.grad(linear_cross_entropy(x, weight, labels, chunk_rows=4), (x, weight))
    loss = 3.0 * linear_cross_entropy(x, weight, labels, chunk_rows=4)
    (d_x,) = torch.autograd.grad(loss, x, retain_graph=True)
    (d_w,) = torch.autograd.grad(loss, weight)
    assert torch.allclose(d_x, 3 * want_x, rtol=1e-14, atol=0) and torch.allclose(d_w, 3 * want_w, rtol=1e-14, atol=0)
    assert _op_node(loss).grads == (None, None, None)


# -- memory model -----------------------------------------------------------------------------------
def test_default_chunks_and_the_memory_formula_at_llama_shapes() -> None:
    """bf16 chunks of 4096 rows at a 32000 vocabulary (256 MiB of logits) on a 4096-wide head, 2048
    at 128256 (the fewest rows whose d_W traffic stays near 5% of the GEMMs). A narrower head caps
    the rows at its width, down to 1024: a chunk's logits never outgrow the d_W the op keeps (a
    Gemma-3's 1152-wide head at 262144 tokens of vocabulary: 1024 rows, 512 MiB, not 1 GiB). At
    16384 tokens, hidden 4096, vocabulary 128256: the op keeps d_x and d_W (1.1 GiB) and peaks 501
    MiB above that, where the unfused logits alone are 3.9 GiB."""
    assert default_chunk_rows(32000, 2, 4096) == 4096 and default_chunk_rows(128256, 2, 4096) == 2048
    assert default_chunk_rows(151936, 2, 2048) == 2048  # at least MIN_CHUNK_ROWS on a head as wide
    assert default_chunk_rows(32000, 2, 2048) == 2048  # 4096 rows of logits would outgrow d_W
    assert default_chunk_rows(262144, 2, 1152) == 1024 and default_chunk_rows(151936, 2, 1024) == 1024
    assert default_chunk_rows(50, 8, 64) == 1024  # a tiny head: the width floor
    assert default_chunk_rows(50, 8, 1 << 20) == 1 << 19  # small vocabularies: 256 MiB of logits a chunk
    tokens, hidden, vocab, bf16 = 16384, 4096, 128256, 2
    saved = (tokens * hidden + vocab * hidden) * bf16
    got = linear_cross_entropy_bytes(tokens, hidden, vocab, bf16)
    assert got.saved == saved
    assert 2048 * vocab * bf16 < got.peak - saved < 1.01 * 2048 * vocab * bf16
    # the block-stats partials (8 bytes a row at this vocabulary) fit in the chunk's rows of d_x;
    # a 200-byte row of logits (not a multiple of 16) takes 256, aligned for cuBLAS
    assert linear_cross_entropy_bytes(100, 8, 50, 4, chunk_rows=16, bias=True) == LinearCrossEntropyBytes(
        saved=(100 * 8 + 50 * 8 + 50) * 4, peak=(100 * 8 + 50 * 8 + 50) * 4 + 16 * (256 + 64 + 4))
    # one byte wide rows of d_x hold none of them: they take memory of their own (50-byte rows take 128)
    assert linear_cross_entropy_bytes(100, 1, 50, 1, chunk_rows=16).peak == (100 + 50) + 16 * (128 + 8 + 64)


# -- vocabulary-parallel on two gloo ranks (float64) ------------------------------------------------
def _sharded_step(bounds: tuple[int, ...], chunk_rows: int | None) -> tuple[float, ...]:
    """This rank's slice [bounds[r], bounds[r+1]) of one head: the loss, the local weight and bias
    gradients, and x's gradient summed over the ranks against the single-process op."""
    rank = dist.get_rank()
    start, stop = bounds[rank], bounds[rank + 1]
    x, weight, bias, labels = _problem((3, 5), 6, bounds[-1], torch.float64)
    x_, local_w, local_b = _leaves(x, weight[start:stop], bias[start:stop])
    got = _loss_and_grads(vocab_parallel_linear_cross_entropy, x_, local_w, local_b, labels,
                          vocab_start=start, chunk_rows=chunk_rows)
    want = _loss_and_grads(linear_cross_entropy, *_leaves(x, weight, bias), labels, chunk_rows=chunk_rows)
    partial_dx = got[1]
    full_dx = partial_dx.clone()
    dist.all_reduce(full_dx)
    # the op hands back this rank's addend of d_x, not the sum: the caller all-reduces it
    assert rel_err(partial_dx, want[1]) > 0.05
    return (rel_err(got[0], want[0]), rel_err(full_dx, want[1]), rel_err(got[2], want[2][start:stop]),
            rel_err(got[3], want[3][start:stop]))


def check_uneven_shards_in_chunks_of_four() -> tuple[float, ...]:
    return _sharded_step((0, 20, 50), chunk_rows=4)


def check_even_shards_default_chunk() -> tuple[float, ...]:
    return _sharded_step((0, 32, 64), chunk_rows=None)


GLOO_CHECKS = [check_uneven_shards_in_chunks_of_four, check_even_shards_default_chunk]


@pytest.fixture(scope="module")
def gloo_outcomes() -> Any:
    return run_checks(2, GLOO_CHECKS, timeout_s=60)


@needs_reference_dispatch
@pytest.mark.distributed
@pytest.mark.parametrize("check", GLOO_CHECKS, ids=lambda c: c.__name__)
def test_vocab_parallel_on_two_gloo_ranks_equals_the_single_process_op(gloo_outcomes: Any,
                                                                        check: Callable[[], Any]) -> None:
    """Loss on every rank, d_local_W and d_local_b equal the single-process op's slices and x's
    partial gradients sum (all-reduce) to its d_x, to 1e-12."""
    for errors in gloo_outcomes.assert_passed(check):
        assert max(errors) < 1e-12, errors


# -- the Triton path, under the interpreter ---------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("upstream", [3.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_interpreted_kernels_match_the_unfused_ops(dtype: torch.dtype, upstream: float) -> None:
    """11 rows in chunks of 4 over a 70-token vocabulary (blocks of 32: a partial last one):
    loss and gradients within 1e-6 of fp32 unfused ops (fp16: 2e-3 of float64), for an incoming
    gradient of 3 (the backward's scaling kernel runs) and of 1 (it skips every element)."""
    x, weight, bias, labels = _problem((11,), 16, 70, dtype)
    assert use_triton(x)
    got = _loss_and_grads(linear_cross_entropy, *_leaves(x, weight, bias), labels, upstream, chunk_rows=4)
    ref_dtype, tol = (torch.float32, 1e-6) if dtype == torch.float32 else (torch.float64, 2e-3)
    want = _loss_and_grads(linear_cross_entropy_reference, *_leaves(x.to(ref_dtype), weight.to(ref_dtype),
                                                                     bias.to(ref_dtype)), labels, upstream)
    assert [t.dtype for t in got] == [dtype] * 4
    for name, g, w in zip(["loss", "d_x", "d_W", "d_b"], got, want):
        assert rel_err(g.to(ref_dtype), w) < tol, name


def _oracle_reductions(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int) -> VocabReductions:
    """Reductions that answer each chunk's collectives, in call order, from the whole float64
    logits: the row max (rounded to fp32, as a rank would hold it), then [sum of exp(logit - that
    max), the label's logit (0 on ignored rows)]: what the group's all-reduces would return."""
    calls = {"max": 0, "sum": 0}

    def next_rows(kind: str) -> slice:
        chunk = calls[kind]
        calls[kind] += 1
        return slice(chunk * chunk_rows, (chunk + 1) * chunk_rows)

    def row_max(rows: slice) -> torch.Tensor:
        return logits[rows].max(1).values.float().double()

    def all_reduce_max(local: torch.Tensor) -> torch.Tensor:
        return row_max(next_rows("max")).to(local.dtype)

    def all_reduce_sum(local: torch.Tensor) -> torch.Tensor:
        rows = next_rows("sum")
        z, ids = logits[rows], labels[rows]
        sumexp = (z - row_max(rows)[:, None]).exp().sum(1)
        target = torch.where(ids != -100, z.gather(1, ids.clamp(min=0)[:, None])[:, 0], 0.0)
        return torch.stack([sumexp, target]).to(local.dtype)

    return VocabReductions(all_reduce_max=all_reduce_max, all_reduce_sum=all_reduce_sum)


@needs_interpreter
def test_interpreted_sharded_path_with_oracle_reductions() -> None:
    """Two vocabulary shards, [0, 30) and [30, 70), run one after the other in fp32, each rank's
    collectives answered by an oracle: the sharded kernels (local stats, the gradient written at
    an offset vocab_start) give the loss, the shards' weight and bias gradients and, summed over
    the shards, d_x within 1e-6 of the unfused ops."""
    x, weight, bias, labels = _problem((11,), 16, 70, torch.float32)
    want = _loss_and_grads(linear_cross_entropy_reference, *_leaves(x, weight, bias), labels)
    logits = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    d_x = torch.zeros_like(x)
    for start, stop in [(0, 30), (30, 70)]:
        reductions = _oracle_reductions(logits, labels, chunk_rows=4)
        got = _loss_and_grads(vocab_parallel_linear_cross_entropy, *_leaves(x, weight[start:stop], bias[start:stop]),
                              labels, vocab_start=start, reductions=reductions, chunk_rows=4)
        assert rel_err(got[0], want[0]) < 1e-6
        assert rel_err(got[2], want[2][start:stop]) < 1e-6 and rel_err(got[3], want[3][start:stop]) < 1e-6
        d_x += got[1]
    assert rel_err(d_x, want[1]) < 1e-6


# -- on the GPU (through the device tool; skipped elsewhere) ----------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_matches_the_unfused_ops_and_keeps_what_the_formula_counts() -> None:
    """bf16, 4096 rows in 4 chunks over a 32000-token vocabulary, with a bias: loss and gradients
    as close to fp32 unfused ops as bf16 unfused ops are (d_W a little further: one rounding a
    chunk); the memory the forward holds for the backward and its peak, above the inputs, as
    `linear_cross_entropy_bytes` says (to allocator rounding)."""
    rows, hidden, vocab = 4096, 1024, 32000
    x, weight, bias, labels = (t.cuda() for t in _problem((rows,), hidden, vocab, torch.bfloat16))
    leaves = _leaves(x, weight, bias)
    linear_cross_entropy(*leaves[:2], labels, bias=leaves[2]).backward()  # autotuning and cuBLAS workspaces first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = linear_cross_entropy(*leaves[:2], labels, bias=leaves[2])
    kept, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    got = (loss.detach(), *torch.autograd.grad(3.0 * loss, leaves))
    counted = linear_cross_entropy_bytes(rows, hidden, vocab, 2, bias=True)
    assert counted.saved <= kept < counted.saved + (1 << 20), (kept, counted)
    assert counted.peak - (4 << 20) < peak <= counted.peak, (peak, counted)
    fp32 = _loss_and_grads(linear_cross_entropy_reference, *_leaves(x.float(), weight.float(), bias.float()), labels)
    bf16 = _loss_and_grads(linear_cross_entropy_reference, *_leaves(x, weight, bias), labels)
    for name, g, unfused, want in zip(["loss", "d_x", "d_W", "d_b"], got, bf16, fp32):
        assert rel_err(g.float(), want) < 2 * max(rel_err(unfused.float(), want), 4e-3), name
