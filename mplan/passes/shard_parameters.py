"""Build one TP rank's parameter shards (and the whole buffers) from any source of weights.

Input: a captured `Graph`, the TP choice, this rank's TP index and the axis size, and a source:
- the user's model on a real device: each parameter is sliced (see Storage below);
- a full state dict (`{fqn: tensor}`): sliced the same way; names and shapes are checked;
- a model on the meta device: each shard is initialized with the module's own init, one
  parameter at a time, so no rank ever holds the full model (see below).
Output: `{fqn: local tensor}` under the placement `parameter_layouts` derives from the choice.

Meta-device models, how each parameter is made:
- mplan's families (`DecoderLM`): `init_weights(seed)` draws every parameter from its own
  generator seeded by (seed, name), so re-running its rule for one parameter on the CPU
  reproduces exactly the values the single-device model built with that seed has. The full
  parameter is generated (its RNG stream cannot be entered mid-way), sliced, and dropped:
  peak extra memory is one parameter, never the model.
- any other module: each module that owns parameters is copied (on meta, free), materialized
  without its children on the device the shards go to, and initialized once (for all its
  parameters) under a seed drawn from (seed, module name): a Hugging Face model's by its own
  `_init_weights(module)` (the rule transformers applies when it builds a model from a config:
  norms to one, projections normal(0, initializer_range), biases zero), any other by the module's
  `reset_parameters()`. Every rank then builds the same full parameter before slicing, so shards
  are consistent; the values are the model's init distribution, not the weights of some other
  single-device instance. A module neither rule initializes is an error. On a GPU the rule runs
  there: with it on the CPU, `autoparallel`'s lowering of a 2.5B-parameter bf16 model took 98-107 s
  on an H100's host and of a 1.7B one 47-51 s (on a 2-core CPU, the fill, init and NaN check of
  the CPU path were 22 s of a 1.7B fp32 model's 24 s of lowering); on the device the same work is
  a few passes over the weights at memory bandwidth (not yet measured there). Ranks agree because
  each seeds its device's generator alike and CUDA's generator is deterministic for a given seed,
  kernel and card, the assumption Megatron's and torchtitan's on-device init make too (a job
  mixing card types would draw differently).
Buffers are never sharded (`materialize_buffers`): a real model's own (moved if on another
device; the local program only reads them); for a model on meta, the state dict's where it holds
the buffer, else recomputed by the owner's `reset_tables()` (mplan's RoPE) or a Hugging Face
model's `_init_weights`, and refused, naming it, where that rule leaves any element unset.
Whatever the dtype (complex, integer, bool, float), no rank ever reads uninitialized memory.

Storage: a TP shard, or a parameter moved to another device or dtype, is a copy that owns its
storage, so the full model can be freed. A parameter stored whole (replicated: all of them at
tp=1) on the source's own device and dtype is the source's tensor itself, detached, as DDP
shares the module's parameters: no parameter is ever held twice, and training updates the
source in place.

Invariants: chunk i of a sharded dim goes to TP rank i (as in collectives/redistribute.py); returned
tensors are contiguous and detached.
"""
from __future__ import annotations

import copy
from typing import Callable, Collection, Mapping

import torch
from torch import nn

from mplan.ir.graph import Graph
from mplan.ir.placement import Placement, Shard
from mplan.ir.sharding import parameter_layouts
from mplan.ir.strategy import Strategy
from mplan.models.decoder import DecoderLM, parameter_seed

ParameterSource = nn.Module | Mapping[str, torch.Tensor]


def shard_tensor(tensor: torch.Tensor, placement: Placement, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a whole tensor (a view for S(d), the tensor itself for R)."""
    if not isinstance(placement, Shard) or size == 1:
        return tensor
    length = tensor.shape[placement.dim]
    if length % size:
        raise ValueError(f"cannot shard dim {placement.dim} of size {length} over {size} ranks "
                         f"({length} % {size} = {length % size})")
    chunk = length // size
    return tensor.narrow(placement.dim, rank * chunk, chunk)


def shard_parameters(graph: Graph, choice: Mapping[str, Strategy], tp_rank: int, tp_size: int,
                     source: ParameterSource, *, seed: int = 0, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None, names: Collection[str] | None = None,
                     experts: Collection[str] = (), ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter of `graph`, or of those in `names` (the ones a
    pipeline rank's stages read) (see the module docstring). Parameters in `experts` (stacked
    expert weights) are also split on dim 0: EP rank `ep_rank` of `ep_size` holds chunk `ep_rank`."""
    layouts = parameter_layouts(graph, choice)
    target = _indexed(device) if device is not None else None
    read = _reader(graph, source, seed, target)
    shards: dict[str, torch.Tensor] = {}
    for name, layout in layouts.items():
        if names is not None and name not in names:
            continue
        full = read(name)
        expected = graph.params[name].meta.shape
        if tuple(full.shape) != expected:
            raise ValueError(f"parameter {name}: the source has shape {tuple(full.shape)}, the "
                             f"captured graph {expected}")
        piece = shard_tensor(full.detach(), layout.placement, tp_rank, tp_size)
        if name in experts:
            piece = shard_tensor(piece, Shard(0), ep_rank, ep_size)
        where, kind = target or full.device, dtype or full.dtype
        if piece.shape == full.shape and (piece.device, piece.dtype) == (where, kind):
            shards[name] = piece.contiguous()  # the source's own storage (see Storage above)
        else:
            shards[name] = piece.to(device=where, dtype=kind, copy=True).contiguous()
    return shards


def _indexed(device: torch.device | str) -> torch.device:
    """`device` with its index filled in ("cuda" is the current GPU, equal to a tensor's "cuda:0")."""
    return torch.empty(0, device=device).device


def _reader(graph: Graph, source: ParameterSource, seed: int,
            device: torch.device | None) -> Callable[[str], torch.Tensor]:
    if isinstance(source, Mapping):
        missing = [name for name in graph.params if name not in source]
        if missing:
            raise KeyError(f"the state dict lacks parameters {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}")
        return lambda name: source[name]
    params = dict(source.named_parameters(remove_duplicate=False))
    missing = [name for name in graph.params if name not in params]
    if missing:
        raise KeyError(f"the model has no parameters named {missing[:5]}: is it the captured model?")
    if not any(params[name].is_meta for name in graph.params):
        return lambda name: params[name]
    if isinstance(source, DecoderLM):
        return lambda name: _init_decoder_parameter(source, name, params[name], seed)
    init = getattr(source, "_init_weights", None)
    rule = init if callable(init) and hasattr(source, "config") else None  # a transformers PreTrainedModel's
    return _ModuleInitializer(source, seed, rule, device if device is not None and device.type == "cuda" else None)


class _OneParameter:
    """What `DecoderLM.init_weights` reads of `self`, narrowed to one CPU parameter."""

    def __init__(self, config: object, name: str, tensor: torch.Tensor) -> None:
        self.config, self._item = config, (name, tensor)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [self._item]

    def modules(self) -> list[nn.Module]:
        return []


def _init_decoder_parameter(model: DecoderLM, name: str, meta: torch.Tensor, seed: int) -> torch.Tensor:
    tensor = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
    # init_weights is the single definition of the family's init; running it on a one-parameter
    # view keeps shards bit-identical to the single-device model built with the same seed.
    DecoderLM.init_weights(_OneParameter(model.config, name, tensor), seed)  # type: ignore[arg-type]
    return tensor


class _ModuleInitializer:
    """Parameter `name`, initialized on a copy of its owner module (without its children), on
    `device` (a GPU) or the CPU: by `init(module)` (a Hugging Face model's `_init_weights`), else by
    the module's own `reset_parameters()`; refused where the rule leaves any element of it unset.
    The last owner's copy is kept, so a module's parameters (a weight and its bias) cost one init."""

    def __init__(self, model: nn.Module, seed: int, init: Callable[[nn.Module], None] | None,
                 device: torch.device | None) -> None:
        self.model, self.seed, self.init, self.device = model, seed, init, device or torch.device("cpu")
        self._owner: tuple[str, dict[str, torch.Tensor]] | None = None

    def __call__(self, name: str) -> torch.Tensor:
        owner_name, _, leaf = name.rpartition(".")
        if self._owner is None or self._owner[0] != owner_name:
            self._owner = owner_name, self._initialized(owner_name, name)
        return self._owner[1][leaf]

    def _initialized(self, owner_name: str, name: str) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of module `owner_name`, initialized and checked; `name`: the
        parameter asked for, which a refusal names."""
        owner = self.model.get_submodule(owner_name)
        if self.init is None and not hasattr(owner, "reset_parameters"):
            raise TypeError(f"parameter {name} is on the meta device and {type(owner).__name__} "
                            f"({owner_name or 'the root'}) has no reset_parameters(); build the model on a real "
                            f"device or pass a state dict")
        init = self.init
        rule: Callable[[nn.Module], None] = init if init is not None else (lambda module: module.reset_parameters())
        seeded = parameter_seed(self.seed, owner_name)
        # A NaN survives whatever arithmetic a rule does to it, so one run shows an element the rule
        # left alone wherever the dtype has NaN (float and complex: every trainable parameter), at the
        # cost of one init of a possibly large module. Other dtypes have no value a rule could not
        # write itself: two runs from different fills must agree.
        values = _run_rule(owner, rule, seed=seeded, fill=0, device=self.device)
        again = None
        for leaf, _ in owner.named_parameters(recurse=False):  # its buffers are materialize_buffers's
            value = values[leaf]
            if _has_nan(value):
                unset = bool(torch.isnan(value).any())
            else:
                if again is None:
                    again = _run_rule(owner, rule, seed=seeded, fill=1, device=self.device)
                unset = not torch.equal(value, again[leaf])
            if unset:
                what = "_init_weights" if init is not None else "reset_parameters()"
                raise TypeError(f"parameter {'.'.join(filter(None, (owner_name, leaf)))} ({_dtype_name(value)}) is "
                                f"on the meta device and {type(self.model).__name__}'s {what} leaves it "
                                f"uninitialized; build the model on a real device or pass a state dict")
        return values


def _has_nan(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _run_rule(owner: nn.Module, rule: Callable[[nn.Module], None], *, seed: int, fill: int,
              device: torch.device) -> dict[str, torch.Tensor]:
    """`owner`'s own parameters and buffers after `rule` ran on a copy of `owner` on `device`
    (its children stay on meta) whose own tensors were first filled with NaN where their dtype has
    it, else `fill`: what the rule leaves alone shows, never uninitialized memory. Only the CPU's
    generator and `device`'s are seeded, and both are restored after."""
    fresh = copy.deepcopy(owner).to_empty(device=device, recurse=False)
    on_gpu = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index] if on_gpu else []), torch.no_grad():
        for tensor in (*fresh.parameters(recurse=False), *fresh.buffers(recurse=False)):
            tensor.fill_(float("nan") if _has_nan(tensor) else fill)
        torch.random.default_generator.manual_seed(seed)
        if on_gpu:
            with torch.cuda.device(device):  # that GPU's generator alone (manual_seed seeds the current one)
                torch.cuda.manual_seed(seed)
        rule(fresh)
    return {leaf: tensor.detach() for leaf, tensor in (*fresh.named_parameters(recurse=False),
                                                      *fresh.named_buffers(recurse=False))}


def materialize_buffers(graph: Graph, model: nn.Module, names: list[str], *, device: torch.device | str,
                        state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The whole buffers `names` (IR names) on `device`. A buffer of a model on meta comes from
    `state_dict` where that holds it (a persistent buffer), else is recomputed (`_recompute_buffer`)."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in buffers:
            raise KeyError(f"the model has no buffer {name}")
        value = buffers[name]
        if value.is_meta and state_dict is not None and name in state_dict:
            given = state_dict[name]
            if tuple(given.shape) != tuple(value.shape) or given.dtype != value.dtype:
                raise ValueError(f"buffer {name}: the state dict has {_dtype_name(given)}{list(given.shape)}, "
                                 f"the model {_dtype_name(value)}{list(value.shape)}")
            value = given
        elif value.is_meta:
            value = _recompute_buffer(model, name)
        out[name] = value.detach().to(device=device)
    return out


def _recompute_buffer(model: nn.Module, name: str) -> torch.Tensor:
    """Buffer `name` recomputed on a CPU copy of its owner: by mplan's `reset_tables()`, or by a
    Hugging Face model's `_init_weights` (which recomputes RoPE's inverse frequencies).

    The rule runs twice, under seeds 0 and 1, from fills that differ (0 then 1) or never equal
    themselves (NaN, where the dtype has it), and must give the same tensor both times: an
    element it leaves unset keeps its fill and one it draws at random differs, and either way the
    buffer is not what the model computes, so it is refused. This holds for every dtype alike (a
    NaN check alone misses integer and bool buffers, and a complex one unless asked for), and
    costs little, as buffers are small tables."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    init = getattr(model, "_init_weights", None) if hasattr(model, "config") else None
    rule: Callable[[nn.Module], None]
    if hasattr(owner, "reset_tables"):
        rule, what = (lambda module: module.reset_tables()), f"{type(owner).__name__}.reset_tables()"
    elif callable(init):
        rule, what = init, f"{type(model).__name__}._init_weights"
    else:
        raise TypeError(f"buffer {name} is on the meta device and not in a state dict, and {type(owner).__name__} "
                        f"cannot recompute it (no reset_tables()); build the model on a real device")
    cpu = torch.device("cpu")
    first = _run_rule(owner, rule, seed=0, fill=0, device=cpu)[leaf]
    if not torch.equal(first, _run_rule(owner, rule, seed=1, fill=1, device=cpu)[leaf]):
        raise TypeError(f"buffer {name} ({_dtype_name(first)}) is on the meta device and not in a state dict, "
                        f"and {what} leaves it unset (or random); build the model on a real device, or register "
                        f"the buffer as persistent and pass it in the state dict")
    return first
