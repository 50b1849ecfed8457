"""Does the planner's price of what ran on GPUs still hold? Committed GPU measurements priced again
with this checkout, on a CPU, each price beside what was measured (predicted / measured - 1).

    races             the one-GPU price of `models peers`' families, graphed and eager, against the race's steps
    e2e               mplan's own models' steps of a `models e2e` run (eager, fused, FP8) predicted again
    activation-bytes  what the fused kernels keep for backward, against the planner's count
    host-fit          one host factor fitted on one measured step, held out on the rest
    adamw-share       how much of mplan's lead over torch.compile is its AdamW (derived)
    megatron          every published Megatron-LM SC'21 run predicted with its own configuration

    PYTHONPATH=. python -m benchmarks.reprice CASE --out FILE [flags]

Each case's docstring (`-h`) says how it prices, what it reads and the command that made each
result the docs cite; `pricing` is what the cases share. `python -m benchmarks.calibration bench-cli --reprice`
and `python -m benchmarks.calibration steps-check` price runs again too, beside the GPU harnesses that make them.
"""
