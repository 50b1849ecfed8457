"""Per-step training metrics (`pm.last_metrics`, `mplan.runtime.metrics`) and learning-rate
schedulers on `pm.optimizer.optimizer`: one process, a tiny Llama in float64 on the CPU."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch

from mplan.runtime.metrics import StepMetrics

SPEC = "llama:layers=1,hidden=16,heads=2,kv_heads=1,ffn=32,seq=8,vocab=32"
BATCH, SEQ, VOCAB, LR = 4, 8, 32, 1e-2


def _pm(zero: int = 0):
    import mplan
    from mplan.models import build_model

    model = build_model(SPEC, device="cpu", dtype=torch.float64, seed=0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    optimizer = functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.1)
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=optimizer, global_batch=BATCH,
                            micro_batch_size=2, plan=f"dp=1,zero={zero}")
    return pm, ids


def test_a_step_leaves_its_metrics() -> None:
    pm, ids = _pm()
    assert pm.last_metrics is None
    losses = [pm.train_step(ids, ids) for _ in range(2)]
    m = pm.last_metrics
    assert isinstance(m, StepMetrics)
    assert m.step == 2 and m.loss == losses[-1]
    assert m.step_time_s > 0 and m.tokens == BATCH * SEQ
    assert m.tokens_per_s == pytest.approx(m.tokens / m.step_time_s, rel=1e-12)
    # the planner's count of the model's FLOPs (forward + backward), over the time and the one rank
    flops = pm.graph.training_flops / pm.graph.batch_size * BATCH
    assert m.model_tflops_per_s == pytest.approx(flops / m.step_time_s / 1e12, rel=1e-12)
    assert m.lr == LR
    # on CPU: no peak to take MFU against, no CUDA memory, and the `cpu` cluster's figures are nominal
    assert m.mfu is None and m.peak_memory_gib is None and m.predicted_step_time_s is None
    line = str(m)
    assert line.startswith(f"step 2 | loss {losses[-1]:.4f} | ") and "tok/s" in line and "FLOP/s/dev" in line
    assert "MFU" not in line and "GiB" not in line and "predicted" not in line and "lr 1.0e-02" in line
    assert m.to_dict()["loss"] == losses[-1]


def test_the_line_shows_what_is_known_and_omits_the_rest() -> None:
    full = StepMetrics(step=10, loss=4.12341, step_time_s=0.812, tokens=8192, tokens_per_s=10089.0,
                       model_tflops_per_s=3.21, mfu=0.412, peak_memory_gib=12.34, lr=3e-4,
                       predicted_step_time_s=0.79, predicted_mfu=0.45, predicted_memory_gib=11.8)
    assert full.line() == ("step 10 | loss 4.1234 | 812 ms (predicted 790 ms) | 10.1k tok/s | 3.2 TFLOP/s/dev | "
                           "MFU 41.2% (predicted 45.0%) | peak 12.3 GiB (predicted 11.8) | lr 3.0e-04")
    bare = StepMetrics(step=1, loss=2.0, step_time_s=0.05, tokens=64, tokens_per_s=1280.0,
                       model_tflops_per_s=None, mfu=None, peak_memory_gib=None, lr=None)
    assert str(bare) == "step 1 | loss 2.0000 | 50.0 ms | 1.3k tok/s"
    # a CPU rank's rate in a unit that shows it; a tiny MFU never reads 0.0%
    slow = StepMetrics(step=1, loss=2.0, step_time_s=2.5, tokens=64, tokens_per_s=25.6,
                       model_tflops_per_s=3e-4, mfu=4.3e-4, peak_memory_gib=None, lr=0.0)
    assert str(slow) == "step 1 | loss 2.0000 | 2500 ms | 26 tok/s | 300.0 MFLOP/s/dev | MFU 0.043% | lr 0.0e+00"


@pytest.mark.parametrize("zero", [0, 1])
def test_a_learning_rate_scheduler_sets_the_lr_the_step_uses(zero: int) -> None:
    """LambdaLR on the torch optimizer inside pm's (under ZeRO-1 the one over the master shards):
    lr 0 from the second step on leaves the parameters (AdamW, weight decay included) unchanged,
    and the step's metrics report the lr it ran at."""
    pm, ids = _pm(zero)
    schedule = torch.optim.lr_scheduler.LambdaLR(pm.optimizer.optimizer, lambda step: 1.0 if step == 0 else 0.0)
    before = pm.full_state_dict()
    pm.train_step(ids, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()": pm stepped it
        schedule.step()
    after_first = pm.full_state_dict()
    assert any(not torch.equal(before[k], after_first[k]) for k in before)  # lr 1e-2 moved them
    pm.train_step(ids, ids)
    after_second = pm.full_state_dict()
    assert all(torch.equal(after_first[k], after_second[k]) for k in after_first)
    assert pm.last_metrics.lr == 0.0 and pm.last_metrics.step == 2
