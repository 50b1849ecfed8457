"""Placements on one mesh axis: a tiny frozen algebra printed `S(d)`, `R`, `P`.

The vocabulary shared by the planner (which chooses placements), the passes (which emit the
collectives between them) and the runtime (which stores parameters under them), so it lives
below all three, as DTensor's placements live below their users.

A tensor on a mesh axis of size n is either split along tensor dim d (`Shard(d)`), whole on
every rank (`Replicate()`), or a sum of per-rank partial values (`Partial()`). Moving between
placements costs a collective (`transition`): the planner prices each one with the cost
model; the passes insert exactly these collectives.

    S(d) -> R      all-gather            P -> R     all-reduce
    P -> S(d)      reduce-scatter        R -> S(d)  local slice (free)
    S(d) -> S(e)   all-to-all            x -> x     nothing
    R -> P / S -> P  not allowed: it would need one rank to keep the value and the others zeros,
                     which no pass emits (`transition` raises; the planner prices it as impossible)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int  # non-negative tensor dimension

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial
R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def parse_placement(text: str) -> Placement:
    """Inverse of `str`: `S(1)`, `R`, `P`."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("S(") and text.endswith(")") and text[2:-1].isdigit():
        return Shard(int(text[2:-1]))
    raise ValueError(f"bad placement {text!r}: expected S(<dim>), R or P")


def transition(src: Placement, dst: Placement) -> str | None:
    """The collective that turns `src` into `dst` on one axis (None when no communication)."""
    if src == dst:
        return None
    if isinstance(dst, Replicate):
        return "all_gather" if isinstance(src, Shard) else "all_reduce"
    if isinstance(dst, Shard):
        if isinstance(src, Replicate):
            return None
        return "reduce_scatter" if isinstance(src, Partial) else "all_to_all"
    raise ValueError(f"no collective turns {src} into {dst}")


def can_transition(src: Placement, dst: Placement) -> bool:
    return src == dst or not isinstance(dst, Partial)


def grad_placement(output: Placement) -> Placement:
    """The gradient of a value arrives with its forward placement, except that the gradient of a
    partial sum is replicated (every rank's addend receives the whole gradient)."""
    return R if isinstance(output, Partial) else output


def local_shape(shape: tuple[int, ...], placement: Placement, n: int) -> tuple[int, ...]:
    """Shape of one rank's piece (even split; strategies only shard divisible dims)."""
    if isinstance(placement, Shard):
        dims = list(shape)
        dims[placement.dim] = -(-dims[placement.dim] // n)
        return tuple(dims)
    return shape
