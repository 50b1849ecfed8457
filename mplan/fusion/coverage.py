"""Fusion coverage: which chains of a captured model become which fused kernel, which patterns
came close and why they missed, and what memory-bound work is left, per block type (what
`mplan inspect` shows).

Input: a captured `Graph` with its program. Output: one `Coverage` per block type (its first
instance stands for every one) and one for the code outside blocks (embedding, final norm,
head, loss): each fused kernel with how often it fires and the ATen ops it replaces, each near
miss (`Miss`) with its reason, then each memory-bound op left (elementwise, norm, reduction, loss
and data movement: an op that reads and writes memory with little arithmetic) with how often it
occurs, the bytes it moves and why no entry took it.

The chains are the ones `fuse_kernels` fuses: the registry's entries in its order, each node
claimed by the first chain that takes it, matched on the captured program without rewriting it.
(The pass rewrites as it goes, so a chain that only exists after an earlier rewrite would be
missed here; none of the entries depends on another.) A miss is reported where nothing took the
anchor, or where the entry's `lesser` took it (the head + loss missed, the loss fused alone).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch.fx import Node

from mplan.fusion.entry import FusionEntry, Miss, PatternMatch
from mplan.fusion.graph_match import uses
from mplan.fusion.registry import MATCHED, entry
from mplan.fusion.rope import pair_rope_matches
from mplan.ir.graph import Graph, OpNode

__all__ = ["Coverage", "FusedKernel", "LeftOp", "OUTSIDE_BLOCKS", "SkippedPattern", "fused_calls", "fused_chains",
           "fusion_coverage", "missed_chains"]

OUTSIDE_BLOCKS = "(outside blocks)"
"""The `Coverage.block_type` of the embedding, final norm, output head and loss."""

MEMORY_BOUND_KINDS = frozenset({"elementwise", "norm", "reduction", "loss", "move"})
"""Op kinds (mplan.ir.op_table) whose time is their memory traffic."""

_WHY: dict[str, str] = {
    "to": "a dtype cast whose value is also used outside any chain",
    "_to_copy": "a dtype cast whose value is also used outside any chain",
    "type_as": "a dtype cast whose value is also used outside any chain",
    "cat": "a concatenation outside any chain (RoPE's cos/sin tables are built once per step)",
    "embedding": "a gather: one read per token, nothing to fuse it with",
    "contiguous": "a layout copy, free at run time when its input is already laid out so (attention "
                  "kernels write [batch, seq, heads, head_dim], which transpose(1, 2).contiguous() reads)",
}


@dataclass(frozen=True, slots=True)
class FusedKernel:
    kernel: str
    """the fused op's name (a FusionReport key)"""
    count: int
    """chains of this kernel in one instance"""
    ops: tuple[str, ...]
    """the ATen ops one chain replaces, in graph order"""


@dataclass(frozen=True, slots=True)
class SkippedPattern:
    kernel: str
    """the entry that came close"""
    count: int
    """anchors in one instance where it missed"""
    why: str


@dataclass(frozen=True, slots=True)
class LeftOp:
    op: str
    """the ATen overload left as it is"""
    count: int
    bytes: int
    """bytes it reads and writes, all `count` of them, in one instance"""
    why: str


@dataclass(frozen=True, slots=True)
class Coverage:
    block_type: str
    """a BlockType's name, or OUTSIDE_BLOCKS"""
    instances: int
    fused: tuple[FusedKernel, ...]
    skipped: tuple[SkippedPattern, ...]
    left: tuple[LeftOp, ...]
    """memory-bound ops no entry takes, the most bytes first"""

    @property
    def left_bytes(self) -> int:
        return sum(op.bytes for op in self.left)


def fusion_coverage(graph: Graph) -> list[Coverage]:
    """One Coverage per block type, then one for the code outside blocks; empty without a program."""
    if graph.program is None:
        return []
    with _training_outputs(graph):
        found, misses = _chains(graph, MATCHED)
        matches, paired_misses = pair_rope_matches(found)
    misses = misses + [("rope_qk", node, miss) for node, miss in paired_misses]
    claimed = _erased_with(graph, {n.name for _, match in matches for n in match.chain},
                           {n.name for _, match in matches for n in match.inputs})
    coverages = []
    for block in graph.block_types:
        names = set(block.template)
        coverages.append(_coverage(block.name, block.num_instances, graph, names, matches, misses, claimed))
    outside = {node.name for node in graph.nodes if node.block is None}
    coverages.append(_coverage(OUTSIDE_BLOCKS, 1, graph, outside, matches, misses, claimed))
    return coverages


def fused_chains(graph: Graph, entries: Sequence[FusionEntry] | None = None) -> list[tuple[str, PatternMatch]]:
    """(kernel, match) for every chain the pass would fuse in `graph`'s training program, first
    entry winning, no node in two chains (also what the planner prices and its memory model
    counts). `entries`: the registry's matched ones (MATCHED) by default, in their order."""
    with _training_outputs(graph):
        return _chains(graph, MATCHED if entries is None else tuple(entries))[0]


def missed_chains(graph: Graph) -> list[tuple[str, Node, Miss]]:
    """(kernel, anchor, miss) for every near miss the module docstring reports."""
    with _training_outputs(graph):
        found, misses = _chains(graph, MATCHED)
        return misses + [("rope_qk", node, miss) for node, miss in pair_rope_matches(found)[1]]


def fused_calls(graph: Graph) -> list[tuple[str, PatternMatch]]:
    """(kernel, match) for every fused call the pass leaves in `graph`'s training program: the
    chains of `fused_chains`, RoPE's on q and k paired into one `rope_qk`."""
    return pair_rope_matches(fused_chains(graph))[0]


@contextlib.contextmanager
def _training_outputs(graph: Graph) -> Iterator[None]:
    """The program returning its loss alone while the patterns look: a training step's local
    program drops the model's other outputs (`insert_collectives`), so the logits a Hugging Face
    model also returns are no use a fused head + loss must keep."""
    output = next((node for node in graph.program.graph.nodes if node.op == "output"), None)
    if output is None or not graph.has_loss or not isinstance(output.args[0], (tuple, list)):
        yield
        return
    returned = output.args
    output.args = ((output.args[0][0],),)
    try:
        yield
    finally:
        output.args = returned


def _chains(graph: Graph, entries: tuple[FusionEntry, ...]) -> tuple[list[tuple[str, PatternMatch]],
                                                                    list[tuple[str, Node, Miss]]]:
    taken: set[str] = set()
    found: list[tuple[str, PatternMatch]] = []
    tried: list[tuple[str, Node, Miss]] = []
    for node in graph.program.graph.nodes:
        if node.op != "call_function" or node.name in taken:
            continue
        for candidate in entries:
            if node.target not in candidate.pattern.anchors:
                continue
            match = candidate.pattern.match(node)
            if isinstance(match, Miss):
                tried.append((candidate.name, node, match))
                continue
            names = {n.name for n in match.chain} if match is not None else set()
            if names and not names & taken:
                taken |= names
                found.append((candidate.name, match))
                break
    by_anchor = {n.name: kernel for kernel, match in found for n in match.chain}
    misses = [(kernel, node, miss) for kernel, node, miss in tried
              if by_anchor.get(node.name) in (None, entry(kernel).lesser)]
    return found, misses


def _erased_with(graph: Graph, chains: set[str], read: set[str]) -> set[str]:
    """The chains' nodes, plus what only they use and their fused ops do not `read` (the pass
    erases it with them: transformers' causal mask once attention runs causally), as node names."""
    gone = set(chains)
    for node in reversed(graph.program.graph.nodes):
        if node.name in read:
            continue
        users = uses(node)
        if node.op == "call_function" and users and all(user.name in gone for user in users):
            gone.add(node.name)
    return gone


def _coverage(block_type: str, instances: int, graph: Graph, names: set[str],
              matches: list[tuple[str, PatternMatch]], misses: list[tuple[str, Node, Miss]],
              claimed: set[str]) -> Coverage:
    kernels: Counter[tuple[str, tuple[str, ...]]] = Counter()
    for kernel, match in matches:
        if match.anchor.name in names:
            kernels[(kernel, tuple(_short(str(n.target)) for n in match.chain))] += 1
    fused = tuple(FusedKernel(kernel, count, ops) for (kernel, ops), count in kernels.items())
    skipped_count = Counter((kernel, miss.why) for kernel, node, miss in misses if node.name in names)
    skipped = tuple(SkippedPattern(kernel, count, why) for (kernel, why), count in skipped_count.items())
    left_count: Counter[str] = Counter()
    left_bytes: Counter[str] = Counter()
    for node in graph.nodes_of(sorted(names)):
        if node.name in claimed or not _memory_bound(node):
            continue
        left_count[node.op] += 1
        left_bytes[node.op] += node.bytes_read + node.bytes_written
    left = tuple(sorted((LeftOp(op, left_count[op], left_bytes[op], _why(op)) for op in left_count),
                        key=lambda op: (-op.bytes, op.op)))
    return Coverage(block_type=block_type, instances=instances, fused=fused, skipped=skipped, left=left)


def _memory_bound(node: OpNode) -> bool:
    moved = node.bytes_read + node.bytes_written
    return node.kind in MEMORY_BOUND_KINDS and moved > 0 and not node.op.startswith(("aten.arange", "aten.sym"))


def _short(target: str) -> str:
    """aten.mul.Tensor -> mul (the overload and namespace say nothing a reader needs here)."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else target


def _why(op: str) -> str:
    return _WHY.get(_short(op), "no fusion entry matches it here")
