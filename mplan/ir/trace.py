"""Capture a model into a typed `Graph` with torch.export (non-strict): `capture(...)`.

(The module is `trace` rather than `capture` so that `mplan.ir.capture` stays the function.)

Input: a module (on the meta device for large models, or any real device), example inputs, and
optionally labels and a loss function. Output: a `Graph` at the ATen level (`aten.linear`,
`aten.layer_norm`, `aten.scaled_dot_product_attention` stay whole) with shapes, FLOPs, bytes,
parameter FQNs, module paths, saved-for-backward tensors and repeated blocks.

`shallow=True` traces only the first two instances of every repeated block and scales totals
by the true instance count, so capture time stays flat in depth (a test checks it against a
full capture). A model torch.export cannot trace raises `CaptureError` naming the construct.
"""
from __future__ import annotations

import inspect
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from mplan.ir.blocks import Container, find_containers, instance_of, relative_name, truncate_containers
from mplan.ir.causal_mask import CONSTANT_META
from mplan.ir.experts_capture import declined_experts, experts_as_op
from mplan.ir.graph import BlockType, Graph, OpNode, ParamInfo, Segment, TensorMeta
from mplan.ir.op_table import op_cost, op_packet, rule_for

SHALLOW_KEEP = 2  # instances traced per repeated block under shallow capture
# Reshapes of a non-contiguous tensor (attention output after its transpose) copy it: a new tensor
# with its own storage, which backward may keep; they are data movement, not views.
_COPY_IF_STRIDED = ("reshape", "flatten", "contiguous", "clone")


class CaptureError(RuntimeError):
    """torch.export could not trace the model; the message names the construct and where."""


class _TrainingCall(nn.Module):
    """The call a training step makes, as one module: `model(*args, **fixed)` and its loss.

    Outputs, in this order: the loss (when there are labels), then the model's own outputs
    (all of them: a loss it computed from `labels=`, logits, ...), so that one captured graph
    serves training (output 0) and inference (the model's first output after the loss).
    `fixed` holds keyword arguments the capture always passes (`use_cache=False`)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, fixed: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.loss_fn, self.fixed = model, loss_fn, fixed

    def forward(self, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is not None and self.loss_fn is None:
            return self.model(*args, labels=labels, **self.fixed, **kwargs)
        out = self.model(*args, **self.fixed, **kwargs)
        return out if labels is None else (self.loss_fn(out, labels), out)


def _named_call(names: Sequence[str]) -> type[_TrainingCall]:
    """`_TrainingCall` whose forward declares `names` as its parameters: torch.export names the
    program's inputs after them (`input_ids`, `labels`) and takes dynamic shapes by them, which it
    cannot do through `**kwargs`."""
    def forward(self: _TrainingCall, *args: Any, **kwargs: Any) -> Any:
        return _TrainingCall.forward(self, *args, **kwargs)

    P = inspect.Parameter
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [P("self", P.POSITIONAL_OR_KEYWORD)] + [P(n, P.POSITIONAL_OR_KEYWORD, default=None) for n in names])
    return type("TrainingCall", (_TrainingCall,), {"forward": forward})


class MissingLoss(CaptureError):
    """The model computes no loss from labels and no `loss_fn` was given."""


def training_keywords(model: nn.Module, *, labels: bool, loss_fn: Callable[..., Any] | None) -> dict[str, Any]:
    """Keyword arguments every training capture passes: `use_cache=False` where the forward
    takes it, by name or through **kwargs on a model whose config has `use_cache` (Hugging Face
    models build a key/value cache in training otherwise, which only adds outputs and ops, and a
    `DynamicCache` output that torch.export cannot return). Raises
    `MissingLoss`, naming what to pass, when labels are asked for, no loss_fn is given and the
    forward takes no `labels`."""
    parameters = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if labels and loss_fn is None and "labels" not in parameters and not takes_any:
        shown = ", ".join(parameters)
        raise MissingLoss(
            f"{type(model).__name__}.forward({shown}) takes no labels, so mplan cannot compute its training "
            f"loss: pass loss_fn=, a function (model output, labels) -> scalar loss, e.g. "
            f"loss_fn=lambda logits, labels: torch.nn.functional.cross_entropy(logits.flatten(0, -2), "
            f"labels.flatten())")
    # a forward taking **kwargs passes them on (GraniteMoE's): its config says whether it knows use_cache
    knows = "use_cache" in parameters or (takes_any and hasattr(getattr(model, "config", None), "use_cache"))
    return {"use_cache": False} if knows else {}


def capture(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: dict[str, Any] | None = None,
    labels: torch.Tensor | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    shallow: bool = False,
    dynamic_batch: bool = False,
    name: str | None = None,
) -> Graph:
    """Trace `model(*example_inputs, **example_kwargs)` (+ loss) into a `Graph`.

    With `labels` and no `loss_fn`, the model is called with `labels=` (mplan's families and
    Hugging Face causal LMs return the loss then). `dtype` casts a meta-device model first, so
    bytes are counted in the training dtype without touching real memory. `dynamic_batch` marks
    dim 0 of every input as one symbolic batch (the example batch must be >= 2, or torch
    specializes it): every shape then carries its expression and `rebatch` re-prices the graph at
    any batch without tracing again.
    """
    kwargs = dict(example_kwargs or {})
    fixed = training_keywords(model, labels=labels is not None, loss_fn=loss_fn)
    if labels is not None:
        kwargs["labels"] = labels
    args, named = _by_name(model, tuple(example_inputs))
    target = (_named_call([*named, *kwargs]) if named or not args else _TrainingCall)(model, loss_fn, fixed)
    prefix = "model."
    if dtype is not None:
        if any(p.device.type != "meta" for p in model.parameters()):
            raise ValueError("capture(dtype=...) casts the model in place; pass a meta-device model")
        model.to(dtype)

    num_parameters = sum(p.numel() for p in _unique_params(model))
    aliases = _tied_names(model)
    containers = find_containers(model)
    declined = declined_experts(model)
    start = time.perf_counter()
    try:
        with truncate_containers(model, containers if shallow else [], SHALLOW_KEEP), experts_as_op(model):
            exported = _export(target, args, {**named, **kwargs}, dynamic_batch)
            param_modules = {n: n.rpartition(".")[0] for n, _ in model.named_parameters()}
    except CaptureError as exc:
        if not declined or isinstance(exc, MissingLoss):
            raise
        module, why = next(iter(declined.items()))
        more = f" and {len(declined) - 1} like it" if len(declined) > 1 else ""
        raise CaptureError(f"{exc} (the experts module {module}{more} stays plain ops, not one `moe_experts` "
                           f"op: {why})") from exc
    seconds = time.perf_counter() - start

    builder = _GraphBuilder(exported, prefix, containers, param_modules, aliases)
    graph = builder.build(
        model_name=name or type(model).__name__, has_loss=labels is not None,
        capture_seconds=seconds, shallow=shallow, num_parameters=num_parameters)
    ops = [n.module_path for n in graph.nodes if op_packet(n.op) == "moe_experts"]
    graph.declined_experts = {module: why for module, why in declined.items()
                              if not any(path == module or path.startswith(module + ".") for path in ops)}
    return graph


def capture_for_training(model: nn.Module, example_inputs: Sequence[torch.Tensor], *,
                         loss_fn: Callable[..., torch.Tensor] | None = None, with_loss: bool = True,
                         shallow: bool = False) -> Graph:
    """The one capture `autoparallel` plans and executes (and `mplan.plan(module, ...)` plans).

    The model as the user built it (its device, dtypes and tied weights; nothing is copied or
    cast), at two rows of the example inputs with a symbolic batch, so that one graph prices and
    runs every micro-batch size (`ir.rebatch`); the labels a zero template of the first input
    (their values do not matter to the trace); `use_cache=False` where the forward takes it. A
    model torch.export cannot trace with a symbolic batch (it specializes on the batch size) is
    captured at a fixed batch of one sequence: only micro-batches of one run it then.
    `with_loss=False` captures the forward alone (inference); `shallow` traces two instances of
    each repeated block (planning only: the nodes' keys are those of the full capture, so a Plan
    made on it binds to the full graph `autoparallel` runs op for op)."""
    name = type(model).__name__
    device = next(iter(model.parameters())).device
    rows = tuple(_rows(x, 2).to(device) for x in example_inputs)
    labels = torch.zeros_like(rows[0]) if with_loss else None
    try:
        return capture(model, rows, labels=labels, loss_fn=loss_fn, dynamic_batch=True, name=name, shallow=shallow)
    except MissingLoss:
        raise
    except CaptureError:
        one = tuple(x[:1] for x in rows)
        return capture(model, one, labels=None if labels is None else labels[:1], loss_fn=loss_fn, name=name,
                       shallow=shallow)


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x`'s first `rows` rows, repeated when it has fewer."""
    if x.shape[0] >= rows:
        return x[:rows]
    return x.repeat(-(-rows // x.shape[0]), *([1] * (x.dim() - 1)))[:rows]


def _by_name(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs as keyword arguments named after the forward's parameters (`input_ids`), so the
    captured program's placeholders carry the user's names; positional where the forward takes
    `*args`."""
    first = list(inspect.signature(model.forward).parameters.values())[:len(inputs)]
    if len(first) < len(inputs) or any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in first):
        return inputs, {}
    return (), {p.name: x for p, x in zip(first, inputs)}


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Every other name of a tied parameter -> its first name (the one `named_parameters()`
    yields): `lm_head.weight` -> `transformer.wte.weight` when the head shares the embedding."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def _dynamic_shapes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """dim 0 of every tensor input is the batch (one symbol shared by all of them)."""
    batch = torch.export.Dim("batch", min=2)

    def spec(x: Any) -> Any:
        return {0: batch} if isinstance(x, torch.Tensor) and x.dim() >= 1 else None

    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    shapes: dict[str, Any] = {}
    for pname, value in bound.arguments.items():
        kind = inspect.signature(module.forward).parameters[pname].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                shapes[pname] = tuple(spec(v) for v in value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            shapes[pname] = {k: spec(v) for k, v in value.items()}
        else:
            shapes[pname] = spec(value)
    return shapes


def _export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_batch: bool) -> Any:
    try:
        shapes = _dynamic_shapes(module, args, kwargs) if dynamic_batch else None
        return torch.export.export(module, args, kwargs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:  # torch raises many types here; all mean "cannot trace"
        raise CaptureError(_describe_failure(type(module.model if isinstance(module, _TrainingCall)
                                                  else module).__name__, exc)) from exc


def _describe_failure(model_name: str, exc: BaseException) -> str:
    """One message: what kind of construct failed, where in the user's code, and torch's words."""
    text = str(exc).strip()
    lowered = text.lower()
    if "data-dependent" in lowered or "guardondatadependent" in type(exc).__name__.lower() \
            or "could not guard on data-dependent" in lowered:
        what = "data-dependent control flow or shape (Python branching on a tensor's value)"
    elif "unsupported" in lowered:
        what = "a Python construct torch.export does not support"
    else:
        what = f"{type(exc).__name__}"
    where = _user_frame(exc)
    first = text.splitlines()[0][:300] if text else type(exc).__name__
    loc = f" at {where}" if where else ""
    return f"cannot capture {model_name}: {what}{loc}: {first}"


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame outside torch and mplan.ir: the user's failing line."""
    torch_dir = os.path.dirname(torch.__file__)
    ir_dir = os.path.dirname(__file__)
    best: str | None = None
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        for frame in traceback.extract_tb(cur.__traceback__):
            fname = os.path.abspath(frame.filename)
            if fname.startswith(torch_dir) or fname.startswith(ir_dir) or "importlib" in fname:
                continue
            if "site-packages" in fname and "transformers" not in fname:
                continue
            best = f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
        cur = cur.__cause__ or cur.__context__
    return best


def _shares_storage(a: Any, b: Any) -> bool:
    """The traced output is a view of the input (ATen returned a view: a same-shape reshape of a
    strided tensor, a reshape its strides allow), by the fake tensors' storages."""
    try:
        return isinstance(a, torch.Tensor) and a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a storage-less tensor: decide by contiguity alone
        return False


def _meta_of(value: Any) -> TensorMeta | None:
    if isinstance(value, torch.Tensor):
        dims = tuple(value.shape)
        symbolic = any(isinstance(d, torch.SymInt) for d in dims)
        shape = tuple(int(d.node.hint) if isinstance(d, torch.SymInt) else int(d) for d in dims)
        sym = tuple(d.node.expr if isinstance(d, torch.SymInt) else None for d in dims) if symbolic else None
        return TensorMeta(shape=shape, dtype=str(value.dtype).removeprefix("torch."), sym=sym)
    return None


def _metas_of(value: Any) -> tuple[TensorMeta, ...]:
    if isinstance(value, (tuple, list)):
        return tuple(m for v in value if (m := _meta_of(v)) is not None)
    m = _meta_of(value)
    return (m,) if m is not None else ()


def _plain(value: Any, names: dict[str, str]) -> Any:
    """An FX argument as a plain value: nodes become "%name", containers become tuples."""
    if hasattr(value, "name") and hasattr(value, "meta"):
        return "%" + names.get(value.name, value.name)
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v, names) for v in value)
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    return str(value).removeprefix("torch.")


@dataclass(slots=True)
class _RawNode:
    fx_name: str
    target: Any
    args: list[tuple[int, str]]  # (position, value name) of tensor arguments
    plain_args: tuple[Any, ...]
    plain_kwargs: tuple[tuple[str, Any], ...]
    copies: bool  # a reshape-like op whose input is not contiguous: it materializes a new tensor
    outputs: tuple[TensorMeta, ...]
    module_path: str
    module_classes: dict[str, str]  # module path -> class name, from nn_module_stack


class _GraphBuilder:
    """Walks the exported FX graph once and assembles the typed Graph."""

    def __init__(self, exported: Any, prefix: str, containers: list[Container],
                 param_modules: dict[str, str], aliases: dict[str, str]) -> None:
        self.exported = exported
        self.prefix = prefix
        self.containers = containers
        self.param_modules = param_modules
        self.aliases = aliases  # other name of a tied parameter -> its first name
        self.names: dict[str, str] = {}  # fx placeholder name -> param FQN or input name
        self.metas: dict[str, TensorMeta] = {}
        self.param_names: set[str] = set()
        self.requires_grad: set[str] = set()  # values whose gradient backward computes
        # Transposes of fused-attention outputs: CUDA's attention kernels write [b, s, h, d] memory,
        # so the usual transpose(1, 2) back to [b, s, h, d] is contiguous and its reshape a view.
        self.sequence_major: set[str] = set()
        self.sdpa_outputs: set[str] = set()

    def _strip(self, path: str) -> str:
        return path[len(self.prefix):] if self.prefix and path.startswith(self.prefix) else \
            ("" if path + "." == self.prefix else path)

    def build(self, **summary: Any) -> Graph:
        sig = self.exported.graph_signature
        kinds = {spec.arg.name: spec for spec in sig.input_specs if hasattr(spec.arg, "name")}
        graph_inputs: dict[str, TensorMeta] = {}
        raw: list[_RawNode] = []
        for fx_node in self.exported.graph.nodes:
            if fx_node.op == "placeholder":
                self._placeholder(fx_node, kinds.get(fx_node.name), graph_inputs)
            elif fx_node.op == "call_function":
                raw.append(self._raw(fx_node))

        params = {
            fqn: ParamInfo(name=fqn, meta=self.metas[fqn], module_path=self.param_modules.get(fqn, ""),
                           block=None)
            for fqn in self.names.values() if fqn in self.param_names
        }
        instance = {r.fx_name: self._instance(r) for r in raw}
        block_types, segments, node_block = self._blocks(raw, instance, params)
        params = {k: ParamInfo(name=p.name, meta=p.meta, module_path=p.module_path,
                               block=self._param_block(k)) for k, p in params.items()}
        keys = _node_keys(raw, segments)
        nodes = [self._typed(r, node_block.get(r.fx_name), keys[r.fx_name]) for r in raw]
        batch, seq = _batch_and_seq(graph_inputs)
        tied = {alias: name for alias, name in self.aliases.items() if name in params}
        graph = Graph(nodes=nodes, graph_inputs=graph_inputs, params=params, block_types=[],
                      segments=segments, batch_size=batch, seq_len=seq, program=self.exported, tied=tied, **summary)
        graph.block_types = [
            BlockType(name=bt.name, container=bt.container, instances=bt.instances,
                      captured_instances=bt.captured_instances, template=bt.template,
                      num_params=bt.num_params,
                      forward_flops=sum(graph.node(n).flops for n in bt.template),
                      saved_bytes=graph.saved_bytes(bt.template))
            for bt in block_types
        ]
        return graph

    def _placeholder(self, fx_node: Any, spec: Any, graph_inputs: dict[str, TensorMeta]) -> None:
        meta = _meta_of(fx_node.meta.get("val"))
        kind = getattr(getattr(spec, "kind", None), "name", "USER_INPUT")
        if kind == "PARAMETER":
            # both names of a tied weight are placeholders of the export; the IR knows one
            name = self.aliases.get(self._strip(spec.target), self._strip(spec.target))
            self.param_names.add(name)
            self.requires_grad.add(name)
        elif kind in ("BUFFER", "CONSTANT_TENSOR"):
            name = self._strip(spec.target)
            if kind == "CONSTANT_TENSOR":  # a value fixed at export: causal_mask may read it
                fx_node.meta[CONSTANT_META] = self.exported.constants[spec.target]
        else:
            name = fx_node.name
        self.names[fx_node.name] = name
        if meta is not None:
            self.metas[name] = meta
            if kind != "PARAMETER":
                graph_inputs[name] = meta

    def _raw(self, fx_node: Any) -> _RawNode:
        args: list[tuple[int, str]] = []
        for pos, a in enumerate(fx_node.args):
            for item in (a if isinstance(a, (list, tuple)) else (a,)):
                if hasattr(item, "name") and hasattr(item, "meta"):
                    args.append((pos, self.names.get(item.name, item.name)))
        outputs = _metas_of(fx_node.meta.get("val"))
        plain_args = _plain(tuple(fx_node.args), self.names)
        plain_kwargs = tuple((k, _plain(v, self.names)) for k, v in fx_node.kwargs.items())
        self.names[fx_node.name] = fx_node.name
        if outputs:
            self.metas[fx_node.name] = outputs[0]
        stack = fx_node.meta.get("nn_module_stack") or {}
        classes = {self._strip(path): cls.rsplit(".", 1)[-1] if isinstance(cls, str) else
                   getattr(cls, "__name__", str(cls)) for path, cls in stack.values()}
        paths = [self._strip(path) for path, _ in stack.values()]
        first = fx_node.args[0] if fx_node.args else None
        first_val = first.meta.get("val") if hasattr(first, "meta") else None
        packet = op_packet(fx_node.target)
        first_name = self.names.get(first.name, first.name) if hasattr(first, "name") else None
        if packet == "transpose" and first_name is not None and sorted(fx_node.args[1:3]) == [1, 2] and \
                first_name in self.sdpa_outputs:
            self.sequence_major.add(fx_node.name)
        if packet == "scaled_dot_product_attention":
            self.sdpa_outputs.add(fx_node.name)
        val = fx_node.meta.get("val")
        if packet in ("reshape", "view", "_unsafe_view") and first_name in self.sdpa_outputs and \
                isinstance(val, torch.Tensor) and isinstance(first_val, torch.Tensor) and val.shape == first_val.shape:
            # a reshape to the output's own shape (transformers >= 5.24 writes one) is that memory
            self.sdpa_outputs.add(fx_node.name)
        copies = packet in _COPY_IF_STRIDED and isinstance(first_val, torch.Tensor) \
            and not first_val.is_contiguous() and first_name not in self.sequence_major \
            and not (packet != "clone" and _shares_storage(val, first_val))
        differentiable = isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())
        if differentiable and any(v in self.requires_grad for _, v in args):
            self.requires_grad.add(fx_node.name)
        return _RawNode(fx_name=fx_node.name, target=fx_node.target, args=args, copies=copies,
                        plain_args=plain_args, plain_kwargs=plain_kwargs, outputs=outputs,
                        module_path=paths[-1] if paths else "", module_classes=classes)

    def _instance(self, r: _RawNode) -> str | None:
        hit = instance_of(r.module_path, self.containers)
        if hit is None:
            return None
        container, idx = hit
        return f"{container.path}.{idx}" if container.path else str(idx)

    def _param_block(self, fqn: str) -> str | None:
        hit = instance_of(fqn.rpartition(".")[0], self.containers)
        return f"{hit[0].path}.{hit[1]}" if hit else None

    def _signature(self, nodes: list[_RawNode], prefix: str) -> tuple[Any, ...]:
        local = {n.fx_name: i for i, n in enumerate(nodes)}
        sig = []
        for n in nodes:
            ins = tuple((pos, local.get(v, relative_name(v, prefix) if v.startswith(prefix + ".")
                                    else "ext")) for pos, v in n.args)
            sig.append((op_packet(n.target), n.outputs, ins))
        return tuple(sig)

    def _blocks(self, raw: list[_RawNode], instance: dict[str, str | None],
                params: dict[str, ParamInfo]) -> tuple[list[BlockType], list[Segment], dict[str, str]]:
        by_instance: dict[str, list[_RawNode]] = {}
        order: list[str] = []
        for r in raw:
            inst = instance[r.fx_name]
            if inst is None:
                continue
            if inst not in by_instance:
                by_instance[inst] = []
                order.append(inst)
            by_instance[inst].append(r)

        types: dict[tuple[Any, ...], dict[str, Any]] = {}
        type_of: dict[str, str] = {}
        for inst in order:
            sig = self._signature(by_instance[inst], inst)
            if sig not in types:
                container = next(c for c in self.containers if inst.startswith(c.path + ".") or not c.path)
                base = by_instance[inst][0].module_classes.get(inst, container.class_name)
                taken = sum(1 for t in types.values() if t["base"] == base)
                types[sig] = {"base": base, "name": base if taken == 0 else f"{base}#{taken + 1}",
                              "container": container, "instances": [], "template": by_instance[inst]}
            types[sig]["instances"].append(inst)
            type_of[inst] = types[sig]["name"]

        # Shallow capture traced only the first children of each container; the rest share
        # the layout of the last traced one (find_containers checked class and parameters).
        extra: dict[str, list[str]] = {}  # last traced instance -> untraced instances after it
        for c in self.containers:
            traced_here = [i for i in order if i.startswith(c.path + ".") or not c.path]
            seen = {int(i.rsplit(".", 1)[-1]) for i in traced_here}
            untraced = [f"{c.path}.{k}" for k in range(c.num_children) if k not in seen]
            if traced_here and untraced:
                extra[traced_here[-1]] = untraced
                for u in untraced:
                    type_of[u] = type_of[traced_here[-1]]
        block_types: list[BlockType] = []
        for t in types.values():
            instances = [i for i in order + [u for us in extra.values() for u in us]
                         if type_of[i] == t["name"]]
            instances.sort(key=lambda i: (i.rsplit(".", 1)[0], int(i.rsplit(".", 1)[-1])))
            prefix0 = t["instances"][0]
            num_params = sum(p.meta.numel for k, p in params.items() if k.startswith(prefix0 + "."))
            block_types.append(BlockType(
                name=t["name"], container=t["container"].path, instances=tuple(instances),
                captured_instances=len(t["instances"]),
                template=tuple(n.fx_name for n in t["template"]),
                num_params=num_params, forward_flops=0, saved_bytes=0))

        segments: list[Segment] = []
        current: list[str] = []
        current_inst: str | None = None
        glue_count = 0

        def flush() -> None:
            nonlocal glue_count
            if not current:
                return
            if current_inst is None:
                label = "prologue" if not segments else f"glue.{glue_count}"
                glue_count += 1
                segments.append(Segment(name=label, block_type=None, nodes=tuple(current)))
            else:
                segments.append(Segment(name=current_inst, block_type=type_of[current_inst],
                                        nodes=tuple(current)))
                for u in extra.get(current_inst, []):
                    segments.append(Segment(name=u, block_type=type_of[u], nodes=()))

        for r in raw:
            inst = instance[r.fx_name]
            if inst != current_inst:
                flush()
                current, current_inst = [], inst
            current.append(r.fx_name)
        flush()
        if segments and segments[-1].block_type is None and glue_count > 1:
            last = segments[-1]
            segments[-1] = Segment(name="epilogue", block_type=None, nodes=last.nodes)
        node_block = {r.fx_name: instance[r.fx_name] for r in raw if instance[r.fx_name]}
        return block_types, segments, node_block

    def _typed(self, r: _RawNode, block: str | None, key: str) -> OpNode:
        rule = rule_for(r.target)
        input_metas = tuple(self.metas[v] for _, v in r.args if v in self.metas)
        params = tuple((pos, v) for pos, v in r.args if v in self.param_names)
        if rule is None:
            kind = "unknown"
            saved = tuple(v for _, v in r.args)
        else:
            kind = "move" if r.copies else rule.kind
            saved_list: list[str] = []
            grads = {v for _, v in r.args if v in self.requires_grad}
            if grads:  # an op none of whose inputs needs a gradient keeps nothing for backward
                for s in rule.saves:
                    if s == "out":
                        saved_list.append(r.fx_name)
                        continue
                    for pos, v in r.args:
                        # A product keeps each operand for the *other* operands' gradients only.
                        if pos == s and (not rule.cross or grads - {v} or
                                         sum(1 for _, w in r.args if w == v) > 1):
                            saved_list.append(v)
            saved = tuple(dict.fromkeys(saved_list))
        if op_packet(r.target) == "getitem":
            kind = "getitem"
        elif not r.outputs:
            kind = "scalar"  # works on Python numbers or dtypes only (sym_size, promote_types)
        cost = op_cost(rule, kind, input_metas, r.outputs, r.plain_args)
        return OpNode(
            name=r.fx_name, op=_op_name(r.target), kind=kind, inputs=tuple(v for _, v in r.args),
            args=r.plain_args, kwargs=r.plain_kwargs, input_metas=input_metas, outputs=r.outputs,
            params=params, flops=cost.flops, bytes_read=cost.bytes_read, bytes_written=cost.bytes_written,
            saved=saved, saved_extra_bytes=cost.saved_extra_bytes, module_path=r.module_path, block=block,
            key=key, known=rule is not None or kind in ("getitem", "scalar"))


def _node_keys(raw: list[_RawNode], segments: list[Segment]) -> dict[str, str]:
    """Each node's stable key inside its segment: `<module path>:<op>#<k>`, the k-th op of that
    kind in that module, the path relative to the block instance for nodes of a repeated block
    (`self_attn.q_proj:linear#0`), so every instance of a block type shares its keys. Keys name
    the same op across captures of one model (shallow or full, any batch, another dtype) where
    FX node names, numbered over the whole graph, shift; a Plan stores strategies by them."""
    segment_of = {name: seg for seg in segments for name in seg.nodes}
    counts: dict[tuple[str, str, str], int] = {}
    keys: dict[str, str] = {}
    for r in raw:
        segment = segment_of[r.fx_name]
        path = r.module_path
        if segment.block_type is not None:
            path = relative_name(path, segment.name) if path != segment.name else ""
        packet = op_packet(r.target)
        index = counts.get((segment.name, path, packet), 0)
        counts[(segment.name, path, packet)] = index + 1
        keys[r.fx_name] = f"{path}:{packet}#{index}"
    return keys


def _op_name(target: Any) -> str:
    if hasattr(target, "_schema") or hasattr(target, "overloadpacket"):
        namespace = getattr(target, "namespace", "aten")
        return f"{namespace}.{target.__name__}" if "." in target.__name__ else str(target)
    return getattr(target, "__name__", str(target))


def _batch_and_seq(inputs: dict[str, TensorMeta]) -> tuple[int, int | None]:
    for meta in inputs.values():
        if meta.dtype.startswith("int") and len(meta.shape) == 2:
            return meta.shape[0], meta.shape[1]
    for meta in inputs.values():
        if meta.shape:
            return meta.shape[0], meta.shape[1] if len(meta.shape) > 1 else None
    return 1, None
