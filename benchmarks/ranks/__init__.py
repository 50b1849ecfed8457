"""Ranks: what mplan's runtime does on many ranks (gloo CPU ranks, or GPUs under torchrun), beside
what the planner predicts or the synchronous run it replaces.

    zero-memory     a rank's peak memory under ZeRO 0-3 on 4 gloo ranks against the memory model's
                    prediction (about 25 s)
    zero3-prefetch  how much of zero=3's unit gathers the prefetch hides: a torchrun job of 4 ranks
                    per variant and round, each on a commit's mplan extracted by `git archive`
    outer-loop      the outer loop across 2 sites of 2 ranks against synchronous DP on the same
                    tokens: losses step by step and held out
    checkpoint      save and load times and a background save's stall, on gloo CPU ranks it starts
                    (`--ranks N`), under torchrun on GPUs, or in one process
    two-sites       data parallelism across a rate-limited link: 2 sites of 2 gloo ranks in two network
                    namespaces joined by a veth pair (root; nothing is left behind), flat against
                    hierarchical against the planner's choice and its price

Cases on CPU ranks start them in this process (tests/distributed.py's `run_ranks`); torchrun starts
only jobs that must be fresh process trees (zero3-prefetch's per-commit jobs, GPUs); two-sites starts
each rank in its site's namespace (`ip netns exec ... python -m benchmarks.ranks two-sites --worker`). `launch.py`
holds what the cases share: starting ranks, timing between barriers, the report's header.

    PYTHONPATH=. python -m benchmarks.ranks zero-memory -o /tmp/zero_memory.json
    PYTHONPATH=. python -m benchmarks.ranks outer-loop --steps 16 -o /tmp/outer_loop.json
    PYTHONPATH=. python -m benchmarks.ranks zero3-prefetch --rounds 1 --steps 2 -o /tmp/zero3_prefetch.json
    PYTHONPATH=. python -m benchmarks.ranks checkpoint --ranks 2 --model tiny-llama -o /tmp/checkpoint.json
    sudo PYTHONPATH=. .venv/bin/python -m benchmarks.ranks two-sites --settings 100:5 --probe-only -o /tmp/link.json
    PYTHONPATH=. torchrun --nproc-per-node 8 -m benchmarks.ranks checkpoint --plan tp=8 --other dp=8,zero=1 -o FILE
    PYTHONPATH=. python -m benchmarks.ranks CASE -h
"""
