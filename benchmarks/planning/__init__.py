"""Planning: how long `mplan plan` takes, and what the planner chooses for the jobs users ask about.

Every case runs on the CPU; `time` and `capture` measure wall and CPU seconds (each run in a fresh
process, start-up included), `context` and `dynamic-cp` are predictions of mplan's cost models
(nothing in them is measured on a GPU).

    time        wall time of `mplan plan ... --json` on the presets and on every HF config of benchmarks/configs/
    capture     time and peak memory of capturing the largest presets on the meta device
    context     the plans chosen at 131072 tokens (issue 34): an 8B on 64 H100s, a 405B-class model on 16384
    dynamic-cp  what a context-parallel size chosen per sequence or document would save over one fixed size

    PYTHONPATH=. python -m benchmarks.planning time --out FILE [--only qwen3-8b] [--seq-lens 131072]
    PYTHONPATH=. python -m benchmarks.planning CASE -h
"""
