"""The fusion registry: every fused kernel's entry, in the order the entries are tried.

`FUSIONS` is the one table: the `fuse_kernels` pass, the planner's prices and memory model, the
host-time model and `mplan inspect` all read it, so a new layer form is one edit in one entry's
module. At each node (in graph order) the entries whose pattern anchors there are tried in this
order, the first match winning: a longer chain before the shorter one it contains (RMSNorm after
a residual add, or before one, before RMSNorm alone; a GLU with its GEMM before the GLU alone;
the head + loss before the loss), and a hand-written LayerNorm before the RMSNorms (written with
one X - mean, its tail is an RMSNorm of the centred value). ROPE_QK pairs ROPE's chains once
they are fused; ATTENTION joins on CUDA
(`fusions(device_is_cuda=)`); FP8 only when asked (mplan.fusion.fp8).
"""
from __future__ import annotations

from mplan.fusion.attention import ATTENTION
from mplan.fusion.entry import FusionEntry, FusionPattern
from mplan.fusion.loss import CROSS_ENTROPY, LINEAR_CROSS_ENTROPY
from mplan.fusion.mlp import BIAS_GELU, GELU_TANH, GEGLU, LINEAR_GEGLU, LINEAR_SWIGLU, SWIGLU
from mplan.fusion.norms import LAYER_NORM, LAYER_NORM_RESIDUAL, RMS_NORM, RMS_NORM_ADD, RMS_NORM_RESIDUAL
from mplan.fusion.projections import LINEAR_GROUP
from mplan.fusion.rope import ROPE, ROPE_QK

__all__ = ["ATTENTION", "FUSIONS", "MATCHED", "ROPE_QK", "entry", "fused_op_bytes"]

FUSIONS: tuple[FusionEntry, ...] = (
    LINEAR_GROUP,
    LAYER_NORM_RESIDUAL,
    LAYER_NORM,
    RMS_NORM_RESIDUAL,
    RMS_NORM_ADD,
    RMS_NORM,
    BIAS_GELU,
    GELU_TANH,
    LINEAR_SWIGLU,
    SWIGLU,
    LINEAR_GEGLU,
    GEGLU,
    ROPE,
    LINEAR_CROSS_ENTROPY,
    CROSS_ENTROPY,
    ROPE_QK,
    ATTENTION,
)
"""Every fused kernel mplan knows (FP8's aside: mplan.fusion.fp8), in the order they are tried."""

MATCHED: tuple[FusionEntry, ...] = tuple(e for e in FUSIONS if isinstance(e.pattern, FusionPattern))
"""The entries matched at an anchor (every one but the pairings), in FUSIONS' order."""

_BY_NAME = {e.name: e for e in FUSIONS}


def entry(name: str) -> FusionEntry:
    """The entry of the fused kernel called `name`; KeyError naming the known ones otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no fused kernel {name!r}; known: {sorted(_BY_NAME)}") from None


def fused_op_bytes(op: str, *, num_rows: int, row_size: int, itemsize: int, backward: bool = False,
                   table_rows: int = 1) -> int:
    """Bytes the forward (or the backward) of memory-bound fused op `op` moves
    (`FusedOpTraffic.bytes`); KeyError for an op priced as its ATen ops."""
    traffic = getattr(entry(op).pricing, "traffic", None)
    if traffic is None:
        raise KeyError(f"fused op {op!r} is priced as its ATen ops: it has no traffic entry")
    return traffic.bytes(num_rows=num_rows, row_size=row_size, itemsize=itemsize, backward=backward,
                         table_rows=table_rows)
