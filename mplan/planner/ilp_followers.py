"""Nodes of a segment ILP whose strategy can be read off their producer's: folded, so that they
add no variables (`sharding_ilp.solve_segment_sharding`).

A Hugging Face block spells out what a preset's block leaves inside one op: upcasts, q/k norms,
views, reshapes and transposes, each a node with its own strategies and a copy variable per
producer strategy and layout. The Qwen3-8B block had 1436 ILP variables against 782 for the
Llama-family block of its shape, and HiGHS took 1-2.5 s on it against 0.2 s. Most of these
nodes read one value and do the obvious thing with its layout: a view of a column-sharded
projection stays sharded. This module proves, node by node and from the prices themselves, when
that obvious choice is optimal, and then the node's strategy is a function of its producer's.

Input: the segment's nodes in order, their strategies, the uses of every value (consumer, slot),
the placements required of values leaving the segment, each node's price per strategy and a
copy price. Output: `Follower` per folded node: its producer, the chain's root (the first node
up the chain that keeps its variables) and the strategy it runs for each strategy of the root.

The rule (exact: the folded ILP has the optimum of the unfolded one). Node v, with no
parameters, reads one value u, produced inside the segment, in one slot. For each strategy s u
can run (all of them, or for a folded u the ones its root can make it run), f(s) is v's
cheapest strategy that reads u's output under s with no copy (forward and backward). v follows
u where, for every s and every other strategy t of v,

    c[v,f(s)] + sum_(uses i of v) max_(k in K_i) max(0, r(f(s), k) - r(t, k))
        <= c[v,t] + (r_in(s, t) if v is u's only reader, else 0)

    c        the node's forward + backward seconds;  r(t, k) the copy of v's output under t into
             layout k;  K_i the layouts use i may want (its consumer's strategies, or the
             placement the segment's border requires);  r_in(s, t) the copy of u's output that t
             would read (shared with u's other readers otherwise, so not counted as saved).

Left side: what following costs at most beyond t, whatever v's readers pick (copies wanted by
several readers are made once, so the sum over uses bounds it from above); right side: what t
costs beyond u. Any solution where v runs t is then no cheaper than the same solution with v
running f(s), so an optimum in which v follows exists, and by induction down the chain one in
which every follower follows. Ties (a reshard before a view or after it, same bytes) go to the
follower. A resharding that is cheaper before the node (gathering bf16 before an upcast to
fp32, or a GQA key before its expansion) fails the test, and the node keeps its variables.
Only the objective is compared: a memory bound on the ILP is solved unfolded.

Free readers. A node c with no output and no parameters that reads one value u of the segment,
and that has, for every strategy u can run, a strategy reading u's output with no copy at c's
least price (an assertion: `op_registry._assertion`, dropped by the passes), is not counted
among the uses in the test above: from any solution, c switching to its free strategy adds
nothing and can only remove a copy, so an optimum exists in which c reads as it is laid out, and
c then follows u by the same rule (nothing reads it). Counted, an assertion beside a cast made
the cast's producer never "alone" and its readers' wanted layouts every placement: a tiny Hugging
Face Llama's prologue folds its four RoPE casts only so (20 followers against 16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from mplan.ir.graph import OpNode
from mplan.ir.placement import Placement
from mplan.ir.strategy import Strategy

Layout = tuple[Placement, Placement]  # (forward placement, gradient placement) of a copy
CopyPrice = Callable[[str, Placement, Layout], float]  # (value, its placement, layout) -> seconds, both passes

SLACK = 1e-12  # relative: sums of the same float terms in another order
"""Rounding allowed in the dominance test; a fold it admits costs at most this share of a node's price."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Follower:
    """A folded node: it reads `producer` as laid out and runs `pick[i]` when `root` runs its i-th
    strategy (`root` keeps its ILP variables; it is `producer`, or `producer`'s own root)."""

    producer: str
    root: str
    pick: tuple[int, ...]  # index into the follower's strategies, per strategy of `root`


def find_followers(nodes: Sequence[OpNode], strategies: Mapping[str, Sequence[Strategy]],
                   uses: Mapping[str, Sequence[tuple[str, int]]], outputs: Mapping[str, Placement],
                   cost: Mapping[str, Sequence[float]], copy: CopyPrice) -> dict[str, Follower]:
    """Every node of the segment that follows its producer by the rule in the module docstring,
    in the segment's order (a producer is decided before its readers)."""
    reads: dict[str, list[tuple[str, int]]] = {}
    for u, consumers in uses.items():
        for v, slot in consumers:
            reads.setdefault(v, []).append((u, slot))
    free = _free_readers(nodes, strategies, reads, cost, copy)
    live = {u: [(c, k) for c, k in consumers if c not in free] for u, consumers in uses.items()}
    followers: dict[str, Follower] = {}
    for v in nodes:
        read = reads.get(v.name, [])
        if v.params or len(strategies[v.name]) < 2 or len(read) != 1 or read[0][0] not in strategies:
            continue
        u, slot = read[0]
        above = followers.get(u)
        reachable = sorted(set(above.pick)) if above else range(len(strategies[u]))
        picks = {s: _follow(v.name, u, slot, s, strategies, live, outputs, cost, copy) for s in reachable}
        if any(p is None for p in picks.values()):
            continue
        root_picks = above.pick if above else tuple(range(len(strategies[u])))
        followers[v.name] = Follower(producer=u, root=above.root if above else u,
                                     pick=tuple(picks[s] for s in root_picks))  # type: ignore[misc]
    return followers


def _free_readers(nodes: Sequence[OpNode], strategies: Mapping[str, Sequence[Strategy]],
                  reads: Mapping[str, Sequence[tuple[str, int]]], cost: Mapping[str, Sequence[float]],
                  copy: CopyPrice) -> set[str]:
    """The nodes that read every layout of their one input for free ("Free readers" above)."""
    free = set()
    for c in nodes:
        read = reads.get(c.name, [])
        if c.outputs or c.params or len(read) != 1 or read[0][0] not in strategies:
            continue
        (u, slot), least = read[0], min(cost[c.name])
        cheapest = [t for t, price in zip(strategies[c.name], cost[c.name]) if price <= least]
        if all(any(copy(u, s.output, (t.inputs[slot], t.input_grads[slot])) == 0.0 for t in cheapest)
               for s in strategies[u]):
            free.add(c.name)
    return free


def _follow(v: str, u: str, slot: int, s: int, strategies: Mapping[str, Sequence[Strategy]],
            uses: Mapping[str, Sequence[tuple[str, int]]], outputs: Mapping[str, Placement],
            cost: Mapping[str, Sequence[float]], copy: CopyPrice) -> int | None:
    """f(s): the strategy v runs when u runs its s-th, where it dominates every other; else None.
    `uses` leaves out the free readers ("Free readers" above)."""
    out = strategies[u][s].output
    mine = strategies[v]

    def read_copy(t: Strategy) -> float:
        return copy(u, out, (t.inputs[slot], t.input_grads[slot]))
    free = [i for i, t in enumerate(mine) if read_copy(t) == 0.0]
    if not free:
        return None
    f = min(free, key=lambda i: cost[v][i])
    wanted = [{(t.inputs[k], t.input_grads[k]) for t in strategies[c]} for c, k in uses.get(v, ())]
    if v in outputs:
        wanted.append({(outputs[v], outputs[v])})
    alone = all(c == v for c, _ in uses[u]) and u not in outputs
    for i, t in enumerate(mine):
        if i == f:
            continue
        extra = sum(max(max(0.0, copy(v, mine[f].output, k) - copy(v, t.output, k)) for k in layouts)
                    for layouts in wanted)
        saved = cost[v][i] + (read_copy(t) if alone else 0.0)
        if cost[v][f] + extra > saved * (1 + SLACK):
            return None
    return f
