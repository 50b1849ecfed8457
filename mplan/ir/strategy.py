"""How one op runs on a mesh axis: the `Strategy` record, and its text form in a Plan.

A `Strategy` says, for one op on an axis of size n, which placement each tensor input must have,
which placement the output then has, which placements the input gradients come out with in
backward, whether the op's work is split n ways, the collectives the op issues itself, and the
`lowering`: the name of the rule by which the passes run the op on local shards
(`mplan.passes.local_ops.LOWERINGS`). The planner's op registry (`planner/op_registry.py`)
makes strategies; a Plan stores the chosen one of every op as text; the passes read that text
back and obey it, never consulting the registry: whatever the planner can pick names its
lowering, and a test holds every lowering the registry names to an entry of the passes' table.

Text form (`str(strategy)`, `parse_strategy`), one line, e.g. a column-parallel linear:

    column:local[S(2),S(0)->S(2)|S(2),S(0)]*

    name:lowering[input placements->output|input-gradient placements], then `*` when the work
    is split, then `{all_reduce:4096,...}` for the op's own collectives (kind:bytes, forward).

Invariants: one input placement and one input-gradient placement per tensor input of the op.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from mplan.ir.placement import Placement, R, parse_placement


LOWERINGS: frozenset[str] = frozenset({
    "replicated", "dropped", "local", "reshape_local", "expand_local", "row_bias", "kv_replicated_attention",
    "vocab_embedding", "vocab_loss", "batch_loss", "experts"})
"""The names of the rules by which the passes run an op on local shards; what each does and why it
is exact is in `mplan/passes/local_ops.py`, which implements every one of them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    name: str  # short label for explain: "replicate", "column", "row", "heads", "vocab", ...
    inputs: tuple[Placement, ...]  # one per OpNode.inputs entry
    output: Placement
    input_grads: tuple[Placement, ...]  # placement of each input's gradient in backward
    split: bool  # the op's work (FLOPs and bytes) is divided by the axis size
    comm: tuple[tuple[str, int], ...] = ()  # collectives the op issues itself: (kind, bytes), forward
    lowering: str = "local"  # how the passes run it on local shards (passes/local_ops.LOWERINGS)

    def __str__(self) -> str:
        ins = ",".join(map(str, self.inputs))
        grads = ",".join(map(str, self.input_grads))
        comm = "{" + ",".join(f"{kind}:{nbytes}" for kind, nbytes in self.comm) + "}" if self.comm else ""
        return f"{self.name}:{self.lowering}[{ins}->{self.output}|{grads}]{'*' if self.split else ''}{comm}"

    @property
    def is_replicated(self) -> bool:
        """Every input whole, output whole, work not split: the single-device op."""
        return not self.split and self.output == R and all(p == R for p in self.inputs)


def replicated(num_inputs: int, lowering: str = "replicated") -> Strategy:
    """The strategy every op has: all inputs whole, the op as on one device."""
    return Strategy(name="replicate", inputs=(R,) * num_inputs, output=R, input_grads=(R,) * num_inputs,
                    split=False, lowering=lowering)


class StrategyParseError(ValueError):
    """A strategy string that is not in the text form of the module docstring."""


_TEXT = re.compile(r"^(?P<name>[^:\[\]]+):(?P<lowering>\w+)\[(?P<ins>[^\]>]*)->(?P<out>[^|\]]+)\|(?P<grads>[^\]]*)\]"
                   r"(?P<split>\*?)(?:\{(?P<comm>[^}]*)\})?$")


def parse_strategy(text: str) -> Strategy:
    """Inverse of `str(strategy)`; a malformed string raises `StrategyParseError` quoting it."""
    m = _TEXT.match(text.strip())
    if m is None:
        raise StrategyParseError(f"bad strategy {text!r}: expected name:lowering[ins->out|grads][*][{{kind:bytes,...}}]")
    try:
        ins = _placements(m["ins"])
        grads = _placements(m["grads"])
        output = parse_placement(m["out"])
        comm = tuple((kind, int(nbytes)) for kind, _, nbytes in
                     (item.partition(":") for item in m["comm"].split(","))) if m["comm"] else ()
    except ValueError as exc:
        raise StrategyParseError(f"bad strategy {text!r}: {exc}") from None
    if len(ins) != len(grads):
        raise StrategyParseError(f"bad strategy {text!r}: {len(ins)} input placements but {len(grads)} gradient ones")
    return Strategy(name=m["name"], lowering=m["lowering"], inputs=ins, output=output, input_grads=grads,
                    split=bool(m["split"]), comm=comm)


def _placements(text: str) -> tuple[Placement, ...]:
    return tuple(parse_placement(p) for p in text.split(",")) if text.strip() else ()
