"""The planner: op strategies, the TP/SP sharding ILP, pipeline stage cuts and the outer search
over (dp, tp, pp, ...) that price each choice with the cost models, and the Plan they produce
(JSON, `explain`, `bench`). `planning.plan` is the entry point."""
