"""Autograd-aware collectives between placements: the one collective vocabulary of mplan.

A leaf package (it knows placements, `mplan.ir.placement`, and torch.distributed, nothing of
planning): the passes emit `redistribute` edges into local programs, the runtime uses the flat
primitives (ZeRO's reduce-scatter and all-gather) and `apply_transition` (gathering shards).

    flat.py           collectives on flat contiguous buffers, chunk i on group rank i
    redistribute.py   any placement to any other, forward and backward; Megatron's named pairs
    uneven.py         all-to-all of rows in uneven splits (expert dispatch and combine), with autograd
    context_attention.py  attention over a sequence split on a context-parallel group (all-gather of
                      K/V, ring, or all-to-all of heads), exact forward and backward
"""
