"""Checkpoints in one process: the directory layout, keep_latest, a learning-rate schedule and the
random generators come back, and the arithmetic that cuts ZeRO-1's flat ranges into rectangles."""
from __future__ import annotations

import functools
import math
import os

import pytest
import torch

from mplan.runtime.checkpoint_chunks import flat_range_rectangles

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2)


def _pm(seed: int = 0):
    import mplan
    from mplan.models import build_model

    model = build_model("tiny-gpt", device="cpu", dtype=torch.float64, seed=seed)
    return mplan.autoparallel(model, example_inputs=(_batch(0)[0],), optimizer=OPTIMIZER, global_batch=4,
                              plan="dp=1", progress="quiet")


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 6), ()])
def test_a_flat_range_is_cut_into_contiguous_rectangles_in_order(shape) -> None:
    n = math.prod(shape)
    whole = torch.arange(n).reshape(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            rects = flat_range_rectangles(shape, start, stop)
            assert len(rects) <= max(1, 2 * len(shape) - 1)
            flat = []
            for offsets, sizes, first in rects:
                block = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                assert block.tolist() == list(range(first, first + block.numel()))
                flat += block.tolist()
            assert flat == list(range(start, stop)), (shape, start, stop, rects)


def test_steps_are_directories_and_keep_latest_prunes(tmp_path) -> None:
    from mplan.runtime.checkpoint import committed_steps, resolve_checkpoint

    pm = _pm()
    for i in range(3):
        pm.train_step(*_batch(i))
        pm.save(str(tmp_path), keep_latest=2)
    assert committed_steps(str(tmp_path)) == [2, 3]
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    assert resolve_checkpoint(str(tmp_path)) == str(tmp_path / "step-00000003")
    assert sorted(os.listdir(tmp_path / "step-00000003")) == ["__0_0.distcp", "dcp.json", "mplan.json"]


def test_a_schedule_and_the_generators_resume_exactly(tmp_path) -> None:
    def scheduled(pm):
        return torch.optim.lr_scheduler.LambdaLR(pm.optimizer.optimizer, lambda step: 1.0 / (1 + step))

    first = _pm()
    schedule = scheduled(first)
    for i in range(2):
        first.train_step(*_batch(i))
        schedule.step()
    first.save(str(tmp_path), extras={"lr_scheduler": schedule})
    lr = first.optimizer.optimizer.param_groups[0]["lr"]
    noise = torch.rand(3)  # what the generator gives next
    straight = []
    for i in range(2, 4):
        straight.append(first.train_step(*_batch(i)))
        schedule.step()

    second = _pm(seed=5)
    resumed_schedule = scheduled(second)
    torch.manual_seed(123)
    second.load(str(tmp_path), extras={"lr_scheduler": resumed_schedule})
    assert torch.equal(torch.rand(3), noise)
    assert resumed_schedule.last_epoch == 2 and second.optimizer.optimizer.param_groups[0]["lr"] == lr
    resumed = []
    for i in range(2, 4):
        resumed.append(second.train_step(*_batch(i)))
        resumed_schedule.step()
    assert resumed == straight


def test_asking_for_extras_a_checkpoint_lacks_is_refused(tmp_path) -> None:
    from mplan.runtime.checkpoint import CheckpointError

    pm = _pm()
    pm.train_step(*_batch(0))
    pm.save(str(tmp_path))
    schedule = torch.optim.lr_scheduler.StepLR(pm.optimizer.optimizer, step_size=1)
    with pytest.raises(CheckpointError, match="holds no state for 'lr_scheduler'"):
        pm.load(str(tmp_path), extras={"lr_scheduler": schedule})
