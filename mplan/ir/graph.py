"""The typed graph that every later stage reads.

`capture` turns a model into a `Graph`: a list of `OpNode`s in execution order, each with its
ATen op, input and output tensor metadata, FLOPs, bytes moved, the parameters it reads (by
original fully-qualified name), its module path and the tensors it keeps for backward. Nodes
are grouped into `BlockType`s (the repeated transformer layers) so later stages cost one
instance and multiply.

Invariants:
- `nodes` are in execution order; every name in `OpNode.inputs` is an earlier node or a graph
  input (placeholder), never a later one.
- Parameter names are the user's module FQNs (`layers.3.attn.q_proj.weight`), not export names.
- Totals (`forward_flops`, ...) count every block instance, also those a shallow capture skipped:
  `BlockType.num_instances` is the model's count, `BlockType.captured_instances` what was traced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8, "complex128": 16,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype given by name (`float32`, `bfloat16`, ...)."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """Shape and dtype of one tensor value; no data."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    # Per dim, the sympy expression in the batch symbol when captured with a dynamic batch
    # (None for static dims or a static capture): what `rebatch` evaluates at another batch.
    sym: tuple[Any, ...] | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class OpNode:
    """One ATen operation of the forward (+ loss) graph."""

    name: str  # unique node name from the exported FX graph
    op: str  # ATen overload, e.g. "aten.linear.default"
    kind: str  # category from op_table: matmul, attention, embedding, norm, elementwise, ...
    inputs: tuple[str, ...]  # names of the tensor arguments, in argument order
    args: tuple[Any, ...]  # positional arguments; tensors as "%name", dtypes as strings
    kwargs: tuple[tuple[str, Any], ...]  # keyword arguments, normalized the same way
    input_metas: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    params: tuple[tuple[int, str], ...]  # (argument position, parameter FQN) for parameter inputs
    flops: int  # forward FLOPs (a multiply-add is 2)
    bytes_read: int  # every tensor input read once, parameters included
    bytes_written: int  # every output written once
    saved: tuple[str, ...]  # names of tensors (inputs or this node) that backward needs
    saved_extra_bytes: int  # small side tensors saved by the op itself (norm stats, logsumexp)
    module_path: str  # innermost module FQN ("" for the root)
    block: str | None  # instance prefix of the repeated block holding it ("layers.3"), if any
    key: str  # stable name inside its segment, shared by every instance of a block (`trace._node_keys`)
    known: bool  # False when no rule in op_table describes the op: later stages replicate it

    @property
    def output(self) -> TensorMeta:
        return self.outputs[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamInfo:
    """A model parameter: its original FQN, metadata, and the module that owns it."""

    name: str
    meta: TensorMeta
    module_path: str
    block: str | None  # instance prefix when the parameter belongs to a repeated block


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockType:
    """A repeated structure (e.g. the transformer layer): one template, N instances."""

    name: str  # class name of the block module ("GPTBlock", "LlamaDecoderLayer")
    container: str  # FQN of the ModuleList holding the instances ("layers", "model.layers")
    instances: tuple[str, ...]  # instance prefixes in model order, all N of them
    captured_instances: int  # how many were traced (all, or fewer under shallow capture)
    template: tuple[str, ...]  # node names of the first captured instance, in order
    num_params: int  # parameters of one instance (elements)
    forward_flops: int  # of one instance
    saved_bytes: int  # activations one instance keeps for backward, per (micro)batch traced

    @property
    def num_instances(self) -> int:
        return len(self.instances)


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """A contiguous run of the model in execution order: a block instance or glue between blocks."""

    name: str  # "layers.3" for an instance, "prologue"/"epilogue"/"glue.N" otherwise
    block_type: str | None  # BlockType.name when this is a block instance
    nodes: tuple[str, ...]  # node names (empty for instances a shallow capture did not trace)


@dataclass(slots=True, kw_only=True)
class Graph:
    """A captured model: typed nodes, parameters, repeated blocks and per-model totals."""

    model_name: str
    nodes: list[OpNode]
    graph_inputs: dict[str, TensorMeta]  # non-parameter placeholders (ids, labels, buffers)
    params: dict[str, ParamInfo]  # by FQN, in registration order
    block_types: list[BlockType]
    segments: list[Segment]  # the model in execution order, every block instance included
    batch_size: int
    seq_len: int | None
    has_loss: bool
    capture_seconds: float
    shallow: bool
    num_parameters: int  # exact: counted on the full model, also under shallow capture
    program: Any = field(default=None, repr=False, compare=False)  # the torch.export ExportedProgram
    # the other names of tied parameters -> the name in `params` (`lm_head.weight` -> `wte.weight`):
    # one tensor, trained once, reported under every name
    tied: dict[str, str] = field(default_factory=dict)
    # experts modules capture left as plain ATen ops (no `moe_experts` node: replicated, computed
    # as the model wrote them) -> why, e.g. "GptOssExperts: biases, transposed weights"
    declined_experts: dict[str, str] = field(default_factory=dict)
    _by_name: dict[str, OpNode] = field(default_factory=dict, repr=False)
    _segment_of: dict[str, Segment] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}
        self._segment_of = {name: seg for seg in self.segments for name in seg.nodes}

    def plan_key(self, node_name: str) -> tuple[str, str]:
        """(segment key, node key) under which a Plan stores this node's strategy: the block type
        for nodes of a repeated block (one entry serves every instance), else the glue segment."""
        segment = self._segment_of[node_name]
        return segment.block_type or segment.name, self._by_name[node_name].key

    def names_of(self, param: str) -> tuple[str, ...]:
        """Every name of a parameter in `params`: its own, then those it is tied under."""
        return (param, *(alias for alias, name in self.tied.items() if name == param))

    def node(self, name: str) -> OpNode:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def nodes_of(self, names: Iterable[str]) -> Iterator[OpNode]:
        return (self._by_name[n] for n in names)

    def block_type(self, name: str) -> BlockType:
        for bt in self.block_types:
            if bt.name == name:
                return bt
        raise KeyError(f"no block type {name!r}; have {[b.name for b in self.block_types]}")

    @property
    def num_layers(self) -> int:
        """Instances of the most repeated block type (the transformer layers)."""
        return max((bt.num_instances for bt in self.block_types), default=0)

    def _outside_blocks(self) -> Iterator[OpNode]:
        return (n for n in self.nodes if n.block is None)

    @property
    def forward_flops(self) -> int:
        """Model FLOPs of one forward pass over the traced batch, all block instances counted."""
        glue = sum(n.flops for n in self._outside_blocks())
        return glue + sum(bt.forward_flops * bt.num_instances for bt in self.block_types)

    @property
    def training_flops(self) -> int:
        """Forward + backward model FLOPs (backward = 2x forward, as Megatron counts; no recompute)."""
        return 3 * self.forward_flops

    def tokens(self) -> int:
        return self.batch_size * (self.seq_len or 1)

    def saved_bytes(self, node_names: Iterable[str]) -> int:
        """Bytes of activations kept for backward by these nodes, each storage counted once."""
        roots: set[str] = set()
        extra = 0
        for node in self.nodes_of(node_names):
            roots.update(self.storage_root(s) for s in node.saved)
            extra += node.saved_extra_bytes
        return extra + sum(self._value_bytes(r) for r in roots if r not in self.params)

    def storage_root(self, name: str) -> str:
        """Follow views back to the tensor whose storage they share."""
        while name in self._by_name:
            node = self._by_name[name]
            if node.kind != "view" or not node.inputs:
                break
            name = node.inputs[0]
        return name

    def _value_bytes(self, name: str) -> int:
        if name in self._by_name:  # every output of a multi-output op (topk keeps values and indices)
            return sum(o.nbytes for o in self._by_name[name].outputs)
        if name in self.graph_inputs:
            return self.graph_inputs[name].nbytes
        return 0

    def unknown_ops(self) -> list[str]:
        """ATen ops no rule describes; planners must replicate them."""
        return sorted({n.op for n in self.nodes if not n.known})
