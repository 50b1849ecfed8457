"""benchmarks/gpu_time.py's host table on a CPU profile (the harnesses' cases are tested in
tests/test_bench_<question>.py: the whole-model race's in tests/test_bench_models.py)."""
from __future__ import annotations


def test_the_host_table_counts_each_steps_host_ops() -> None:
    """gpu_time.host_table: per step, the CPU ops with their self time and calls (no launches or
    waits on the CPU), so a profile of a host-bound step says where the host's time went."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_time import host_table

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            (x @ x).relu_()
    table = host_table(prof, 4)
    assert (table["launches"], table["wait_calls"]) == (0, 0)
    assert table["top_ops_self_ms"]["aten::mm"]["calls"] == 1
    assert table["top_ops_self_ms"]["aten::relu_"]["calls"] == 1
    assert table["top_ops_self_ms"]["aten::mm"]["ms"] > 0
