"""Rewrite the captured ATen graph into one rank's local program: shards in, collectives inside.

Input: a captured `Graph` (its `program` is the torch.export ExportedProgram; its shapes those of
the batch the program will run at, `ir.rebatch`), the TP choice (node name -> `Strategy` for every
node, read from the Plan), the TP axis, and which user output to return: 0, the loss of a training
capture; 1, the model's own first output after it (the logits), for inference.
Output: a `torch.fx.GraphModule` whose placeholders are those of the exported graph (parameters,
buffers, lifted constants, user inputs, in the signature's order; an inference program drops the
user inputs it no longer reads, the labels) and that returns that one value, replicated.
Parameters are fed as local shards (`shard_parameters`), everything else whole.

Why the exported graph itself: its node names are the `OpNode` names the planner chose for, it
is already functional ATen (no mutation, no Python control flow), and keeping `aten.linear`,
`aten.scaled_dot_product_attention`, `aten.embedding` whole is what makes a local rule per op
possible. We copy it node by node into a new `fx.Graph` rather than edit it in place, so the
program the planner saw stays intact for the next capture or solve.

Per node (in order):
1. each tensor argument is resharded from its producer's placement to the strategy's input
   placement (`Redistribute`, a submodule: forward `transition(out, in)`, backward
   `transition(input_grad, grad_placement(out))`); consumers that want the same value in the
   same (placement, gradient placement) share one copy, as Megatron's single all-gather feeds
   q, k and v;
2. the op is emitted under its strategy's lowering (`local_ops.LOWERINGS`): unchanged, with local shape
   arguments, or through a vocabulary-/batch-parallel module;
3. device constants are rewritten to the execution device (a meta-device capture says `meta`).
Every emitted tensor node carries `meta["mplan_local_shape"]`, its expected local shape, which
`check_local_graph` verifies on meta tensors, and (single tensors) `meta["val"]`, a meta tensor of
that shape and the captured dtype, as an exported graph's nodes carry fake tensors: the local
program is then a valid input to `fuse_kernels`.
"""
from __future__ import annotations

import copy

import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch import nn

from mplan.collectives.redistribute import AxisGroup, redistribute
from mplan.ir.causal_mask import CONSTANT_META
from mplan.ir.graph import Graph, OpNode, TensorMeta
from mplan.ir.moe import is_experts
from mplan.ir.placement import Placement, R, can_transition, grad_placement, local_shape
from mplan.ir.sharding import ParamLayout, parameter_layouts
from mplan.ir.strategy import Strategy
from mplan.passes.expert_parallel import NO_EXPERT_PARALLELISM, ExpertsLowering, experts_module
from mplan.passes.local_ops import (UnexecutableStrategy, attention_module, embedding_module, loss_module,
                                    lowering_of, normalized_kwargs)

LOCAL_SHAPE = "mplan_local_shape"  # fx node meta key: the shape this rank's value must have
INPUTS = "mplan_inputs"  # GraphModule.meta key: the program's inputs, as `LocalInput`s in order


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalInput:
    """One placeholder of the local program and what to feed it."""

    placeholder: str  # the fx placeholder name (positional order of the GraphModule)
    kind: str  # PARAMETER (a local shard), BUFFER, CONSTANT_TENSOR or USER_INPUT (whole)
    name: str  # IR name: parameter/buffer FQN as the user's model names it, or the input's name
    target: str  # the export signature's target (constants are looked up by it), "" for inputs


class Redistribute(nn.Module):
    """One reshard edge of the local program (see collectives/redistribute.py)."""

    def __init__(self, *, src: Placement, dst: Placement, grad_src: Placement, grad_dst: Placement,
                 axis: AxisGroup, value: str) -> None:
        super().__init__()
        self.src, self.dst, self.grad_src, self.grad_dst = src, dst, grad_src, grad_dst
        self.axis, self.value = axis, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return redistribute(x, self.src, self.dst, self.grad_src, self.grad_dst, self.axis)

    def extra_repr(self) -> str:
        return f"{self.value}: {self.src}->{self.dst}, grad {self.grad_src}->{self.grad_dst}"


def insert_collectives(graph: Graph, choice: Mapping[str, Strategy], axis: AxisGroup,
                       *, device: torch.device | str | None = None, output: int = 0,
                       experts: ExpertsLowering = NO_EXPERT_PARALLELISM) -> fx.GraphModule:
    """The local program of this TP rank (see the module docstring). `axis` is the rank's TP
    axis (`group=None` with any size: shape checks on meta tensors); `experts` the plan's
    expert parallelism (`passes/expert_parallel.py`): its parameters are fed as this EP rank's
    experts, dim 0 divided by ep."""
    return _Rewriter(graph, choice, axis, device, output, experts).run()


class _Rewriter:
    def __init__(self, graph: Graph, choice: Mapping[str, Strategy], axis: AxisGroup,
                 device: torch.device | str | None, output: int, experts: ExpertsLowering) -> None:
        self.graph, self.choice, self.axis, self.output_index = graph, choice, axis, output
        self.experts = experts
        self.device = torch.device(device) if device is not None else None
        self.layouts = parameter_layouts(graph, choice)
        self.root = nn.Module()
        self.out = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.place: dict[str, Placement] = {}
        self.grad_needed: dict[str, Placement] = {}  # placement the producer wants its gradient in
        self.meta: dict[str, TensorMeta] = {}
        self.differentiable: set[str] = set()  # values that depend on a parameter
        self.copies: dict[tuple[str, Placement, Placement], fx.Node] = {}
        self.ir_names: dict[str, str] = {}  # placeholder name -> IR name (param FQN, buffer, input)

    def run(self) -> fx.GraphModule:
        program = self.graph.program
        specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
        inputs: list[LocalInput] = []
        result: fx.Node | None = None
        for fx_node in program.graph.nodes:
            if fx_node.op == "placeholder":
                inputs.append(self._placeholder(fx_node, specs[fx_node.name]))
            elif fx_node.op == "get_attr":
                setattr(self.root, fx_node.target, _retargeted(getattr(program.graph_module, fx_node.target),
                                                               self.device))
                self.env[fx_node.name] = self.out.get_attr(fx_node.target)
                self.place[fx_node.name] = R
            elif fx_node.op == "call_function":
                self._call(fx_node)
            elif fx_node.op == "output":
                result = self._output(fx_node)
        assert result is not None
        self.out.output(result)
        module = fx.GraphModule(self.root, self.out, class_name="LocalProgram")
        module.graph.eliminate_dead_code()  # e.g. HF's logits output, not returned in training
        if self.output_index:  # inference: the labels (and the loss they fed) are gone
            unused = {n.name for n in module.graph.nodes if n.op == "placeholder" and not n.users}
            for n in [n for n in module.graph.nodes if n.name in unused and n.op == "placeholder"]:
                if next(spec for spec in inputs if spec.placeholder == n.name).kind == "USER_INPUT":
                    module.graph.erase_node(n)
            inputs = [spec for spec in inputs if not (spec.kind == "USER_INPUT" and spec.placeholder in unused)]
        # the reshards and region bodies nothing reads any more; not torch's
        # delete_all_unused_submodules, which also deletes the regions nested in a body that is
        # read (transformers 4.x's RoPE: an autocast region inside a no_grad one)
        read = {n.target for n in module.graph.nodes if n.op in ("call_module", "get_attr")}
        for name in [name for name, _ in module.named_children() if name not in read]:
            module.delete_submodule(name)
        module.recompile()
        module.meta[INPUTS] = tuple(inputs)
        return module

    # -- values -------------------------------------------------------------------------------
    def _placeholder(self, fx_node: fx.Node, spec: Any) -> LocalInput:
        kind = spec.kind.name
        name = self._ir_name(fx_node.name, spec)
        new = self.out.placeholder(fx_node.name)
        if CONSTANT_META in fx_node.meta:  # a lifted constant's value, whole on every rank (causal_mask reads it)
            new.meta[CONSTANT_META] = fx_node.meta[CONSTANT_META]
        layout: ParamLayout | None = self.layouts.get(name) if kind == "PARAMETER" else None
        self.place[fx_node.name] = layout.placement if layout else R
        self.grad_needed[fx_node.name] = layout.grad_placement if layout else R
        if layout:
            self.differentiable.add(fx_node.name)
        meta = self.graph.params[name].meta if layout else self.graph.graph_inputs.get(name)
        if meta is not None and name in self.experts.parameters:  # this EP rank's experts only
            meta = TensorMeta(shape=(meta.shape[0] // self.experts.ep.size, *meta.shape[1:]), dtype=meta.dtype)
        if meta is not None:
            self.meta[fx_node.name] = meta
            _annotate(new, meta, self.place[fx_node.name], self.axis.size)
        self.env[fx_node.name] = new
        return LocalInput(placeholder=fx_node.name, kind=kind, name=name,
                          target=getattr(spec, "target", None) or "")

    def _ir_name(self, placeholder: str, spec: Any) -> str:
        target = getattr(spec, "target", None)
        if target is None:
            return placeholder
        known = self.graph.params.keys() | self.graph.graph_inputs.keys()
        # capture wraps the model as `model.`; the IR strips that prefix and names a tied weight once
        name = target if target in known or not target.startswith("model.") else target[len("model."):]
        return self.graph.tied.get(name, name)

    def _reshard(self, name: str, dst: Placement, grad_src: Placement, consumer: str) -> fx.Node:
        src, grad_dst = self.place[name], self.grad_needed.get(name, R)
        if name not in self.differentiable:
            grad_src = grad_dst  # no gradient ever flows back here (ids, RoPE tables, masks)
        if src == dst and grad_src == grad_dst:
            return self.env[name]
        if not can_transition(src, dst) or not can_transition(grad_src, grad_dst):
            raise UnexecutableStrategy(
                f"edge {name} -> {consumer}: no collective turns {src} into {dst} (forward) or "
                f"{grad_src} into {grad_dst} (backward)")
        key = (name, dst, grad_src)
        if key not in self.copies:
            module = Redistribute(src=src, dst=dst, grad_src=grad_src, grad_dst=grad_dst,
                                  axis=self.axis, value=name)
            attr = f"reshard_{name}_{len(self.copies)}"
            self.root.add_module(attr, module)
            node = self.out.call_module(attr, (self.env[name],))
            if name in self.meta:
                _annotate(node, self.meta[name], dst, self.axis.size)
            self.copies[key] = node
        return self.copies[key]

    # -- ops ----------------------------------------------------------------------------------
    def _call(self, fx_node: fx.Node) -> None:
        if fx_node.target is operator.getitem and fx_node.name in self.choice:
            self._getitem(fx_node)
            return
        node = self.graph.node(fx_node.name)
        if node.kind == "scalar" and self._fold(fx_node, node):
            return
        strategy = self.choice[fx_node.name]
        rule = lowering_of(node, strategy)
        if rule == "dropped":  # before its arguments: no copy is made for it, and none is priced
            return
        args = self._args(fx_node, node, strategy)
        if any(v.name in self.differentiable for v in fx_node.all_input_nodes):
            self.differentiable.add(fx_node.name)
        kwargs = {k: self._kwarg(v, node, strategy) for k, v in fx_node.kwargs.items()}
        args, kwargs = _on_device(args, self.device), _on_device(kwargs, self.device)
        new = self._emit(rule, fx_node, node, strategy, args, kwargs)
        self._record(fx_node.name, new, node, strategy.output)

    def _fold(self, fx_node: fx.Node, node: OpNode) -> bool:
        """A symbolic size (a symbolic-batch capture's `sym_size`, and arithmetic on sizes) becomes
        the number it is at the batch this program runs: the graph's shapes are those of that
        batch, global ones, as the captured program's size arguments are. The local program is then
        static, as a capture at that batch would be (what `fuse_kernels` matches on)."""
        if fx_node.target is torch.ops.aten.sym_size.int and node.input_metas:
            value: Any = node.input_metas[0].shape[int(fx_node.args[1])]
        else:
            args = [self.env.get(a.name) if isinstance(a, fx.Node) else a for a in fx_node.args]
            if fx_node.kwargs or not all(isinstance(a, (int, float, bool)) for a in args):
                return False
            value = fx_node.target(*args)
        self.env[fx_node.name], self.place[fx_node.name] = value, R
        return True

    def _args(self, fx_node: fx.Node, node: OpNode, strategy: Strategy) -> tuple[Any, ...]:
        slot = iter(range(len(node.inputs)))

        def convert(item: Any) -> Any:
            if not isinstance(item, fx.Node):
                return item
            j = next(slot)
            return self._reshard(item.name, strategy.inputs[j], strategy.input_grads[j], node.name)

        args = tuple([convert(i) for i in a] if isinstance(a, (list, tuple)) else convert(a)
                     for a in fx_node.args)
        if next(slot, None) is not None:
            raise UnexecutableStrategy(f"node {node.name}: its arguments do not match the "
                                       f"captured inputs {node.inputs}")
        return args

    def _kwarg(self, value: Any, node: OpNode, strategy: Strategy) -> Any:
        if not isinstance(value, fx.Node):
            return value
        if strategy.lowering != "replicated":
            raise UnexecutableStrategy(f"node {node.name}: tensor keyword argument {value.name} "
                                       f"under the split strategy {strategy}")
        return self._reshard(value.name, R, R, node.name)

    def _emit(self, rule: str, fx_node: fx.Node, node: OpNode, strategy: Strategy,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Node:
        aten = torch.ops.aten
        if rule in ("replicated", "local") and not is_experts(node):
            return self.out.create_node("call_function", fx_node.target, args, kwargs, name=fx_node.name)
        if rule in ("reshape_local", "expand_local"):
            shape = list(local_shape(node.output.shape, strategy.output, self.axis.size))
            target = aten.reshape.default if rule == "reshape_local" else aten.expand.default
            return self.out.create_node("call_function", target, (args[0], shape), {}, name=fx_node.name)
        if rule == "row_bias":
            x, weight, bias = args[:3]
            share = self.out.call_function(aten.div.Tensor, (bias, float(self.axis.size)))
            return self.out.create_node("call_function", fx_node.target, (x, weight, share), {}, name=fx_node.name)
        if is_experts(node):  # every strategy of a routed-experts node runs through its module
            module: nn.Module = experts_module(num_experts=node.input_metas[3].shape[0], args=node.args,
                                               lowering=self.experts, node=node.name)
            attr = f"experts_{node.name}"
            self.root.add_module(attr, module)
            return self.out.create_node("call_module", attr, tuple(args[:6]), {}, name=fx_node.name)
        call = normalized_kwargs(fx_node.target, args, kwargs)
        if rule == "vocab_embedding":
            module = embedding_module(node, call, self.axis)
            operands = (call["weight"], call["indices"])
        elif rule == "kv_replicated_attention":
            module = attention_module(node, call, self.axis)
            mask = call.get("attn_mask")
            operands = (call["query"], call["key"], call["value"]) + (() if mask is None else (mask,))
        else:
            module = loss_module(rule, node, call, self.axis)
            operands = (call["self"], call["target"])
        attr = f"{rule}_{node.name}"
        self.root.add_module(attr, module)
        # named after the IR node, as every emitted op is, so later passes (recompute) know its segment
        return self.out.create_node("call_module", attr, tuple(operands), {}, name=fx_node.name)

    def _getitem(self, fx_node: fx.Node) -> None:
        # A multi-output producer's placement holds for each element; the getitem's own strategy
        # says what its consumers get, so the reshard runs on the element, after the getitem.
        source, index = fx_node.args
        element = self.out.call_function(operator.getitem, (self.env[source.name], index))
        if source.name in self.differentiable:
            self.differentiable.add(fx_node.name)
        self.env[fx_node.name], self.place[fx_node.name] = element, self.place[source.name]
        self.grad_needed[fx_node.name] = grad_placement(self.place[source.name])
        node = self.graph.node(fx_node.name)
        if node.outputs:
            self.meta[fx_node.name] = node.output
        strategy = self.choice[fx_node.name]
        moved = self._reshard(fx_node.name, strategy.inputs[0], strategy.input_grads[0], node.name)
        self._record(fx_node.name, moved, node, strategy.output)

    def _record(self, name: str, new: fx.Node, node: OpNode, placement: Placement) -> None:
        self.env[name], self.place[name] = new, placement
        self.grad_needed[name] = grad_placement(placement)
        if node.outputs:
            self.meta[name] = node.output
            _annotate(new, node.output, placement, self.axis.size, value=len(node.outputs) == 1)

    def _output(self, fx_node: fx.Node) -> fx.Node:
        user = [spec for spec in self.graph.program.graph_signature.output_specs]
        if any(spec.kind.name != "USER_OUTPUT" for spec in user):
            kinds = sorted({spec.kind.name for spec in user} - {"USER_OUTPUT"})
            raise UnexecutableStrategy(f"the model's forward has side outputs {kinds} (e.g. buffer "
                                       f"mutations), which the local program does not carry")
        outputs = fx_node.args[0]
        if self.output_index >= len(outputs):
            raise UnexecutableStrategy(f"the captured program has {len(outputs)} outputs, none at index "
                                       f"{self.output_index}")
        return self._reshard(outputs[self.output_index].name, R, R, "output")


def _annotate(node: fx.Node, meta: TensorMeta, placement: Placement, size: int, *, value: bool = True) -> None:
    """Record the node's local shape; and, for a single tensor, a meta tensor of that shape and
    dtype as `meta["val"]`, where later passes (`fuse_kernels`) read shapes and dtypes."""
    shape = local_shape(meta.shape, placement, size)
    node.meta[LOCAL_SHAPE] = shape
    if value:
        node.meta["val"] = torch.empty(shape, dtype=getattr(torch, meta.dtype), device="meta")


def _retargeted(attr: Any, device: torch.device | None) -> Any:
    """A submodule the program calls (a higher-order op's body: `torch.no_grad()` or autocast
    regions of the forward) with its device constants on the execution device, as `_on_device`
    does for the program's own nodes: a meta-device capture records `device=meta` there too."""
    if device is None or not isinstance(attr, fx.GraphModule):
        return attr
    body = copy.deepcopy(attr)
    for node in body.graph.nodes:
        node.args, node.kwargs = _on_device(node.args, device), _on_device(node.kwargs, device)
        if node.op == "get_attr":
            setattr(body, node.target, _retargeted(getattr(body, node.target), device))
    body.recompile()
    return body


def _on_device(value: Any, device: torch.device | None) -> Any:
    """Device constants rewritten to the execution device (None keeps them)."""
    if device is None:
        return value
    if isinstance(value, torch.device):
        return device
    if isinstance(value, tuple):
        return tuple(_on_device(v, device) for v in value)
    if isinstance(value, list):
        return [_on_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    return value
