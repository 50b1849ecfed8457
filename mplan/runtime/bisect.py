"""`bisect`: the first op at which a plan's local program parts from the single-device graph.

Role: when a plan's losses differ from one device (`mplan verify --bisect`), say where. A layer
of the runtime because it runs a `ParallelModule`'s own program on its own groups and reads only
what the passes left there; `mplan.verify` (the application) builds the run and calls it. Input: a
flat (one-stage) `ParallelModule`, the captured `Graph` the plan runs (its `program`, the
ExportedProgram: `pm.graph` where it kept one, else a capture of the same model at the same
inputs, whose node names are the same), one micro-batch, and the whole weights (default
`pm.full_state_dict()`; pass the model's own to also catch a parameter sharded wrongly, which the
gathered shards would reproduce). Output: a `BisectReport`: the first value, forward then
backward, whose parallel result differs beyond tolerance, with its op, module, strategy,
placement per mesh axis, error, and where in the tensor the error is largest; or none.

How, in four steps (`bisect`):
1. Reference: the exported graph runs on the whole weights under an fx Interpreter that records
   every node's output. Each output is handed on through an alias (`view_as`), so the gradient
   that reaches it is its own consumers' sum, even where an op returns its input itself.
2. Local: `pm.program` runs the same way on this rank's shards (fresh leaf copies, so the real
   parameters' `.grad`, the data-parallel hooks and the optimizer are never touched). Every local
   value is keyed back to the IR value it holds, by what `insert_collectives` leaves in the program:
     an op node             emitted under its IR node's name; placement: the strategy's output
     a `Redistribute` call  the reshard (collective) of IR value `module.value`: placement `dst`,
                            gradient placement `grad_src` (what its consumers' backward delivers)
     getitem (source, k)    element k of a multi-output op: the source's output placement
     a parameter            its `ParamLayout` (gradient: `grad_placement`), experts S(0) on ep
   A `CheckpointedUnit` (recomputation) is walked inside, as the ops it holds. Nodes that hold no
   IR value (row_bias's bias share, a fused kernel's inside) are not compared. The program runs
   to its end or to the op that raises (reported, after any value that diverged before it).
3. Whole values: each recorded value is moved to R with `apply_transition` (S(d): all-gather,
   P: all-reduce), its gradient likewise from its gradient placement; a replicated value's copies
   are all gathered, so one rank's wrong copy shows. A piece whose shape is not its placement's
   share of the whole is a divergence by itself (split along the wrong dim), never gathered.
4. Compare, forward values in program order, then (when all agree) gradients in reverse program
   order, the order backward makes them, parameters last. The first beyond tolerance is reported.

Why an ordered scan and not a binary search: one run of each side records every value, and the
scan then costs nothing more. The first divergent value locates the fault: its inputs all agreed,
so the op (or the collective) that made it from them is wrong. For a gradient, the backward of
its consumers made it from their output gradients, which agreed: the report names them.

Tolerance: a value diverges when ||a - e|| > tol * ||e|| (tol 1e-9: the float64 bar of
`mplan verify`) and also ||a - e|| > ROUNDING * (the largest norm among the values it was computed
from: its inputs forward, its consumers' gradients backward). The second clause keeps a value that
is zero in exact arithmetic (a GPT key bias's gradient: softmax ignores a shift shared by all keys)
from comparing rounding noise with rounding noise.

Invariants: collective (every rank of the job calls it with the same micro-batch; every replica
then holds the same values, so DP and EP ranks agree, and an expert's gradient, which holds every
EP rank's tokens, is divided by ep); the ranks of a TP group compare the same whole values, reach
the same verdicts in the same order, so their collectives match and their reports are equal;
nothing of `pm` changes. The keying relies on `insert_collectives` naming each emitted op after its
IR node (tests/test_bisect.py holds it to that on GPT, Llama and SP). Refused: pipeline
plans (each rank holds only its stages' parameters and no flat program runs them), autocast and
FP8 (the local program then computes in another precision than the graph it is compared with).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from mplan.collectives.redistribute import AxisGroup, apply_transition
from mplan.ir.graph import Graph
from mplan.ir.placement import Placement, R, Replicate, Shard, grad_placement, local_shape, transition
from mplan.passes.insert_collectives import INPUTS, LocalInput, Redistribute
from mplan.passes.recompute import CheckpointedUnit

if TYPE_CHECKING:  # the module that runs the plan; bisect only reads it
    from mplan.runtime.parallel_module import ParallelModule

TOLERANCE = 1e-9  # relative, float64: the bar of `mplan verify` (docs/execution.md)
ROUNDING = 1e-13
"""Errors below this fraction of the inputs' norm are rounding (float64's epsilon is 2.2e-16; a
sum of a few hundred terms in another order moves by a few hundred of them)."""


class BisectRefused(ValueError):
    """A ParallelModule bisect cannot compare op by op; the message says why and what runs instead."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Divergence:
    """The first value (or gradient) of the local program that differs from one device."""

    phase: str  # "forward": the value itself; "backward": its gradient
    node: str  # the captured graph's node (or parameter) whose value differs
    op: str  # its ATen op ("aten.linear.default"), or "parameter"
    computed_by: str  # the local program's node that made it: the op itself, or the reshard after it
    collective: str  # that reshard's collective ("all_reduce P->R"), "" for an op
    module_path: str  # the module the op belongs to ("" for the root)
    block: str | None  # the repeated block instance ("layers.0"), if any
    source: str  # the model's own source line the capture recorded (innermost frame outside torch), "" where none
    strategy: str  # the op's Strategy (text form of ir/strategy.py); a parameter's storage layout
    placements: tuple[tuple[str, str], ...]  # (mesh axis, placement) of the local value compared
    consumers: tuple[str, ...]  # backward: the local nodes whose backward produced this gradient
    shape: tuple[int, ...]  # of the whole value (one device)
    local_shape: tuple[int, ...]  # of this rank's piece
    rel_err: float  # ||a - e|| / ||e||; inf where the shapes differ or the program raised
    max_abs_err: float  # largest |a - e| of one element
    worst_index: tuple[int, ...]  # where it is (index into the whole value)
    worst_rank: int | None  # the tp rank whose shard (or copy, where the copies differ) holds it; else None
    expected: float  # the one-device value there
    actual: float  # the parallel value there
    note: str = ""  # a shape mismatch, or the error the local program raised

    def describe(self) -> str:
        where = f" in {self.module_path}" if self.module_path else ""
        by = (f"{self.computed_by}: {self.collective} on the tp axis (the reshard of {self.node})"
              if self.collective else self.computed_by)
        placed = ", ".join(f"{axis}={p}" for axis, p in self.placements) or "-"
        lines = [f"first divergence ({self.phase}): {'gradient of ' if self.phase == 'backward' else ''}"
                 f"{self.node} ({self.op}){where}",
                 f"  computed by   {by}"]
        if self.phase == "backward" and self.consumers:
            lines.append(f"  backward of   {', '.join(self.consumers)}")
        lines += [f"  strategy      {self.strategy or '-'}",
                  f"  placement     {placed}",
                  f"  shape         {list(self.shape)} whole, {list(self.local_shape)} on each rank"]
        if math.isfinite(self.rel_err):
            holder = f", held by tp rank {self.worst_rank}" if self.worst_rank is not None else ""
            lines.append(f"  error         relative {self.rel_err:.3e}, largest |diff| {self.max_abs_err:.3e} at "
                         f"{list(self.worst_index)}{holder} (expected {self.expected:.6g}, got {self.actual:.6g})")
        if self.note:
            lines.append(f"  note          {self.note}")
        if self.source:
            lines.append(f"  source        {self.source}")
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True, slots=True)
class BisectReport:
    first: Divergence | None  # None: every compared value agrees
    num_values: int  # forward values compared (parameters included), up to the first divergent one
    num_gradients: int  # gradients compared (none after a forward divergence)
    not_compared: tuple[str, ...]  # IR nodes with no value in the local program (dropped, fused)
    loss: float  # the local program's loss on the micro-batch (nan where it raised)
    reference_loss: float  # the exported graph's on one device
    tolerance: float
    raised: str = ""  # where and what the local program raised ("" where it ran): no gradients then

    @property
    def agrees(self) -> bool:
        return self.first is None

    def describe(self) -> str:
        loss = f"loss {self.loss:.12g}" if not self.raised else f"the local program raised at {self.raised}"
        head = (f"bisect: one micro-batch, {loss} (one device: loss {self.reference_loss:.12g}); "
                f"{self.num_values} values and {self.num_gradients} gradients compared (tolerance {self.tolerance:g})")
        if self.first is None:
            return (f"{head}\nno op diverges: forward and backward of one micro-batch agree op by op (a loss that "
                    f"still differs comes from the step: gradient sync, clipping, the optimizer)")
        return f"{head}\n{self.first.describe()}"

    def to_dict(self) -> dict[str, Any]:
        first = None
        if self.first is not None:
            first = {k: getattr(self.first, k) for k in Divergence.__slots__}
            first["placements"] = dict(self.first.placements)
            for key in ("rel_err", "max_abs_err"):  # JSON has no inf
                first[key] = first[key] if math.isfinite(first[key]) else None
        return {"agrees": self.agrees, "first": first, "num_values": self.num_values,
                "num_gradients": self.num_gradients, "not_compared": list(self.not_compared),
                "loss": self.loss if math.isfinite(self.loss) else None, "reference_loss": self.reference_loss,
                "tolerance": self.tolerance, "raised": self.raised}


@dataclass(slots=True)
class _Value:
    """One recorded value of a run: what it holds and how it is placed."""

    ir: str  # the IR node or parameter it holds
    local: str  # the local program's node
    tensor: torch.Tensor  # the value as computed (the alias whose .grad is this value's own)
    placement: Placement = R
    grad: Placement = R
    collective: str = ""
    ep: bool = False  # split over the ep axis on dim 0 (expert parameters)
    consumers: list[str] = field(default_factory=list)


def bisect(pm: ParallelModule, inputs: torch.Tensor | Sequence[torch.Tensor], labels: torch.Tensor, *,
           captured: Graph | None = None, weights: Mapping[str, torch.Tensor] | None = None,
           tolerance: float = TOLERANCE) -> BisectReport:
    """Compare `pm`'s local program with the captured graph op by op on the first micro-batch of
    `inputs`/`labels` (module docstring). Collective: every rank calls it with the same tensors."""
    _check_runnable(pm)
    program = (captured or pm.graph).program
    if program is None:
        raise BisectRefused("this ParallelModule kept no exported program (a model whose training graph holds only "
                            "its loss): pass captured=capture_for_training(model, example_inputs)")
    specs: tuple[LocalInput, ...] = pm.program.meta[INPUTS]
    missing = sorted({n.name for n in pm.graph.nodes} - {n.name for n in program.graph.nodes})
    if missing:
        raise BisectRefused(f"the captured graph given is not the one the plan runs: it lacks {missing[:5]}")
    rows = pm.plan.micro_batch_size
    user = tuple(t[:rows].to(pm.device) for t in ((inputs,) if isinstance(inputs, torch.Tensor) else inputs))
    user += (labels[:rows].to(pm.device),)
    whole = dict(weights) if weights is not None else pm.full_state_dict()

    reference, ref_loss, ref_leaves = _run_reference(pm, program, specs, whole, user)
    local, loss, failure = _run_local(pm, specs, user)
    expected = {v.ir: v.tensor.detach() for v in reference}
    expected.update({name: leaf.detach() for name, leaf in ref_leaves.items()})
    gradients = {v.ir: v.tensor.grad for v in reference}
    gradients.update({name: leaf.grad for name, leaf in ref_leaves.items()})

    # Every rank of a TP group reaches the same verdict on each value (it compares the same whole
    # value), so all stop at the same one and their collectives stay matched.
    compare = _Comparer(pm, program, expected, gradients, tolerance)
    first, num_values, num_gradients = None, 0, 0
    for v in local:
        num_values += 1
        if (first := compare.value(v)) is not None:
            break
    if first is None and failure is not None:
        first = compare.raised(*failure)
    if first is None:  # gradients of a wrong forward say nothing more
        for v in reversed(local):
            if v.tensor.requires_grad:
                num_gradients += 1
                if (first := compare.gradient(v)) is not None:
                    break
    seen = {v.ir for v in local}
    return BisectReport(first=first, num_values=num_values, num_gradients=num_gradients,
                        not_compared=tuple(n.name for n in pm.graph.nodes if n.name not in seen and n.outputs),
                        loss=float(loss) if loss is not None else math.nan, reference_loss=float(ref_loss),
                        tolerance=tolerance, raised=f"{failure[0]}: {failure[1]}" if failure else "")


def _check_runnable(pm: ParallelModule) -> None:
    if pm.pipeline is not None:
        raise BisectRefused(f"plan {pm.plan.describe()}: bisect compares the flat program, and under a pipeline each "
                            f"rank holds only its stages' parameters; bisect the same tp/sp/ep layout with pp=1")
    if pm.autocast is not None or pm.fp8:
        raise BisectRefused("bisect compares values in the dtypes the graph was captured in; under autocast or FP8 "
                            "the local program computes in another precision: build it without them")
    if pm.plan.zero >= 3:
        raise BisectRefused(f"plan {pm.plan.describe()}: under zero=3 the program gathers and frees its own weights "
                            f"unit by unit, so bisect cannot feed it copies; bisect the same layout with zero=1 "
                            f"(the arithmetic is the same)")


# -- step 1 and 2: the two runs ---------------------------------------------------------------
class _Recorder(fx.Interpreter):
    """Runs a GraphModule, handing each node's value to `keep`, which may return an alias."""

    def __init__(self, module: fx.GraphModule, keep: Callable[[fx.GraphModule, fx.Node, Any], Any]) -> None:
        super().__init__(module)
        self.keep, self.current = keep, None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        return self.keep(self.module, n, super().run_node(n))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        sub = self.fetch_attr(target)
        if isinstance(sub, CheckpointedUnit):  # recomputation changes when values are made, never what
            inner = _Recorder(sub.unit, self.keep)
            try:
                return inner.run(*args)
            finally:
                self.current = inner.current
        return super().call_module(target, args, kwargs)


def _alias(value: Any) -> Any:
    """A distinct autograd node for the value, so its .grad is this node's consumers' alone."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        value = value.view_as(value)
        value.retain_grad()
    return value


def _run_reference(pm: ParallelModule, program: Any, specs: tuple[LocalInput, ...], whole: Mapping[str, torch.Tensor],
                   user: tuple[torch.Tensor, ...]) -> tuple[list[_Value], torch.Tensor, dict[str, torch.Tensor]]:
    """The exported graph's values on whole weights, its loss, and the weights' leaves (by IR
    name), after backward."""
    by_placeholder = {s.placeholder: s for s in specs}
    leaves = {s.name: whole[s.name].detach().clone().requires_grad_(whole[s.name].is_floating_point())
              for s in specs if s.kind == "PARAMETER"}
    given = iter(user)
    feed = []
    for n in program.graph.nodes:
        if n.op != "placeholder":
            continue
        spec = by_placeholder[n.name]
        feed.append(leaves[spec.name] if spec.kind == "PARAMETER" else next(given) if spec.kind == "USER_INPUT"
                    else pm.statics[spec.name])
    values: list[_Value] = []

    def keep(_: fx.GraphModule, n: fx.Node, value: Any) -> Any:
        if n.op == "call_function" and n.name in pm.graph and isinstance(value, torch.Tensor):
            value = _alias(value)
            values.append(_Value(ir=n.name, local=n.name, tensor=value))
        return value

    outputs = _Recorder(program.graph_module, keep).run(*feed)
    loss = outputs[0]
    loss.backward()
    return values, loss.detach(), leaves


def _run_local(pm: ParallelModule, specs: tuple[LocalInput, ...], user: tuple[torch.Tensor, ...]
               ) -> tuple[list[_Value], torch.Tensor | None, tuple[str, str] | None]:
    """The local program's values (a parameter's: the leaf it was fed), its loss, and where and
    what it raised (None: it ran, and backward too)."""
    leaves = {name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in pm.params.items()}
    given = iter(user)
    feed = [leaves[s.name] if s.kind == "PARAMETER" else next(given) if s.kind == "USER_INPUT"
            else pm.statics[s.name] for s in specs]
    kinds = {s.placeholder: s for s in specs}
    multi = _getitems(pm.graph)
    values: list[_Value] = []
    by_local: dict[str, _Value] = {}
    top = pm.program

    def keep(module: fx.GraphModule, n: fx.Node, value: Any) -> Any:
        held = _held(pm, module, n, value, kinds if module is top else {}, multi)
        for arg in n.all_input_nodes:  # whose backward feeds each recorded value's gradient
            if arg.name in by_local and n.op != "output":
                by_local[arg.name].consumers.append(n.name)
        if held is None:
            return value
        if n.op != "placeholder":
            value = _alias(value)
        held.tensor = value
        values.append(held)
        by_local[n.name] = held
        return value

    recorder = _Recorder(top, keep)
    try:
        loss = recorder.run(*feed)
    except Exception as error:  # noqa: BLE001 - where the local program breaks is the finding
        where = recorder.current.name if recorder.current is not None else "?"
        return values, None, (where, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    loss.backward()
    return values, loss.detach(), None


def _getitems(graph: Graph) -> dict[tuple[str, int], str]:
    """(multi-output node, index) -> the IR getitem node that takes element `index` of it."""
    found = {}
    for n in graph.nodes:
        if n.op == "getitem" and n.inputs and len(n.args) == 2 and isinstance(n.args[1], int):
            found[(n.inputs[0], n.args[1])] = n.name
    return found


def _held(pm: ParallelModule, module: fx.GraphModule, n: fx.Node, value: Any, placeholders: Mapping[str, LocalInput],
          multi: Mapping[tuple[str, int], str]) -> _Value | None:
    """The IR value local node `n` holds, with its placements (module docstring, step 2); None if none."""
    if not isinstance(value, torch.Tensor):
        return None
    if n.op == "placeholder":
        spec = placeholders.get(n.name)
        if spec is None or spec.kind != "PARAMETER":
            return None
        layout = pm.layouts[spec.name]
        return _Value(ir=spec.name, local=n.name, tensor=value, placement=layout.placement,
                      grad=layout.grad_placement, ep=spec.name in pm.experts.parameters and pm.experts.ep.size > 1)
    if n.op == "call_module":
        sub = module.get_submodule(n.target)
        if isinstance(sub, Redistribute):
            kind = transition(sub.src, sub.dst) or "slice"
            return _Value(ir=sub.value, local=n.name, tensor=value, placement=sub.dst, grad=sub.grad_src,
                          collective=f"{kind} {sub.src}->{sub.dst}" + (
                              f", backward {sub.grad_src}->{sub.grad_dst}" if sub.grad_src != sub.grad_dst else ""))
    if n.op == "call_function" and n.target is operator.getitem:
        source, index = n.args
        ir = multi.get((getattr(source, "name", ""), index))
        if ir is None:
            return None
        placement = pm.choice[source.name].output
        return _Value(ir=ir, local=n.name, tensor=value, placement=placement, grad=grad_placement(placement))
    if n.op in ("call_function", "call_module") and n.name in pm.graph and n.name in pm.choice:
        placement = pm.choice[n.name].output
        return _Value(ir=n.name, local=n.name, tensor=value, placement=placement, grad=grad_placement(placement))
    return None


# -- step 3 and 4: whole values, compared -----------------------------------------------------
class _Comparer:
    def __init__(self, pm: ParallelModule, program: Any, expected: Mapping[str, torch.Tensor],
                 gradients: Mapping[str, torch.Tensor | None], tolerance: float) -> None:
        self.pm, self.expected, self.gradients, self.tolerance = pm, expected, gradients, tolerance
        self.axis: AxisGroup = pm.axis
        self.stack = {n.name: n.meta.get("stack_trace") or "" for n in program.graph.nodes}
        self.users: dict[str, list[str]] = {}
        for node in pm.graph.nodes:
            for name in node.inputs:
                self.users.setdefault(name, []).append(node.name)

    def value(self, v: _Value) -> Divergence | None:
        reference = self.expected.get(v.ir)
        if reference is None:
            return None
        inputs = self.pm.graph.node(v.ir).inputs if v.ir in self.pm.graph else ()
        scale = max((_norm(self.expected[i]) for i in inputs if i in self.expected), default=0.0)
        return self._compare(v, "forward", v.tensor.detach(), v.placement, reference, scale)

    def gradient(self, v: _Value) -> Divergence | None:
        reference = self.expected.get(v.ir)
        if reference is None:
            return None
        local = v.tensor.grad
        expected = self.gradients.get(v.ir)
        if v.ep and local is not None:
            # every EP rank ran the same micro-batch, so each expert's gradient holds ep ranks' tokens
            local = local / self.pm.experts.ep.size
        local = torch.zeros_like(v.tensor) if local is None else local
        expected = torch.zeros_like(reference) if expected is None else expected
        scale = max((_norm(g) for u in self.users.get(v.ir, ()) if (g := self.gradients.get(u)) is not None),
                    default=0.0)
        return self._compare(v, "backward", local, v.grad, expected, scale)

    def _compare(self, v: _Value, phase: str, local: torch.Tensor, placement: Placement, expected: torch.Tensor,
                 scale: float) -> Divergence | None:
        # the same decision on every rank (shapes are), so the collectives below match
        wanted = local_shape(tuple(expected.shape), placement, self.axis.size)
        if v.ep:
            wanted = (wanted[0] // self.pm.experts.ep.size, *wanted[1:])
        if tuple(local.shape) != wanted:
            return self._divergence(v, phase, placement, expected, local, None, note=(
                f"this rank's piece is {list(local.shape)}, but {placement} of {list(expected.shape)} over "
                f"{self.axis.size} ranks is {list(wanted)}: split along another dim (or by another count)"))
        expected = expected.detach().to(torch.float64)
        holder, note = None, ""
        if isinstance(placement, Replicate) and self.axis.size > 1:
            # every rank's copy, so that a copy one rank alone got wrong is seen (and all ranks report alike)
            copies = apply_transition(local.detach().unsqueeze(0), Shard(0), R, self.axis).to(torch.float64)
            errors = [float((copy - expected).norm()) for copy in copies]
            holder = max(range(len(errors)), key=errors.__getitem__)
            actual = copies[holder]
            if all(torch.equal(copies[0], copy) for copy in copies[1:]):
                holder = None
            else:
                note = f"the tp ranks hold different copies of this replicated value; rank {holder}'s differs most"
        else:
            actual = apply_transition(local.detach(), placement, R, self.axis).to(torch.float64)
        if v.ep:
            actual = apply_transition(actual, Shard(0), R, self.pm.experts.ep)
        diff = (actual - expected).abs()
        error, size = float(diff.norm()), float(expected.norm())
        if error <= self.tolerance * size or error <= ROUNDING * scale:
            return None
        found = (actual, diff, error / size if size else math.inf, holder)
        return self._divergence(v, phase, placement, expected, local, found, note=note)

    def _divergence(self, v: _Value, phase: str, placement: Placement, expected: torch.Tensor, local: torch.Tensor,
                    found: tuple[torch.Tensor, torch.Tensor, float, int | None] | None, note: str = "") -> Divergence:
        node = self.pm.graph.node(v.ir) if v.ir in self.pm.graph else None
        index: tuple[int, ...] = ()
        at = (math.nan, math.nan, math.nan)
        rank = None
        if found is not None:
            actual, diff, _, rank = found
            index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
            at = (float(diff[index]), float(expected[index]), float(actual[index]))
            if isinstance(placement, Shard) and index:
                rank = index[placement.dim] // local.shape[placement.dim]
        shown = f"{_transition_of(v)}" if v.collective else str(v.placement)
        placements = [("tp", shown if phase == "forward" else f"{shown}, gradient {placement}")]
        if v.ep:
            placements.append(("ep", "S(0)"))
        return Divergence(
            phase=phase, node=v.ir, op=node.op if node else "parameter", computed_by=v.local,
            collective=v.collective, module_path=node.module_path if node else v.ir.rpartition(".")[0],
            block=node.block if node else None, source=_source(self.stack.get(v.ir, "")),
            strategy=str(self.pm.choice[v.ir]) if v.ir in self.pm.choice else (
                f"parameter stored {v.placement}, gradient {v.grad}" if v.ir in self.pm.layouts else ""),
            placements=tuple(placements), consumers=tuple(v.consumers) if phase == "backward" else (),
            shape=tuple(expected.shape), local_shape=tuple(local.shape),
            rel_err=found[2] if found is not None else math.inf, max_abs_err=at[0], worst_index=index,
            worst_rank=rank, expected=at[1], actual=at[2], note=note)

    def raised(self, where: str, error: str) -> Divergence:
        node = self.pm.graph.node(where) if where in self.pm.graph else None
        return Divergence(
            phase="forward", node=where, op=node.op if node else "", computed_by=where, collective="",
            module_path=node.module_path if node else "", block=node.block if node else None,
            source=_source(self.stack.get(where, "")), strategy=str(self.pm.choice.get(where, "")),
            placements=(), consumers=(), shape=node.output.shape if node and node.outputs else (), local_shape=(),
            rel_err=math.inf, max_abs_err=math.nan, worst_index=(), worst_rank=None, expected=math.nan,
            actual=math.nan, note=f"the local program raised here: {error}")


def _transition_of(v: _Value) -> str:
    """`src->dst` of a reshard's collective text ("all_reduce P->R" -> "P->R")."""
    return v.collective.split(",")[0].split()[-1]


def _norm(t: torch.Tensor) -> float:
    return float(t.detach().to(torch.float64).norm())


def _source(stack_trace: str) -> str:
    """The innermost frame of a capture's stack trace outside torch (the model's own line, not
    `nn.Linear`'s): 'file:line  code'."""
    lines = [line.strip() for line in stack_trace.strip().splitlines()]
    for k in range(len(lines) - 1, -1, -1):
        if lines[k].startswith("File ") and "/torch/" not in lines[k]:
            parts = lines[k].split('"')
            place = f"{parts[1]}:{lines[k].split('line ')[-1].split(',')[0]}" if len(parts) > 2 else lines[k]
            code = lines[k + 1] if k + 1 < len(lines) else ""
            return f"{place}  {code}".strip()
    return ""
