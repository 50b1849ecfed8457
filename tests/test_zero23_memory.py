"""ZeRO-3's parameters between steps (issue 33): released storage that refuses to be read.

zero=3 frees each unit's gathered weights by resizing their storage to 0 bytes, so between steps
`pm.params` are tensors of the right shape over no memory; torch does not check, and reading one
read freed memory (garbage, or a crash). Now reading one raises one line naming
`pm.whole_parameter(name)` and `pm.full_state_dict()` (`runtime/released_parameters.py`), while
its metadata, the whole-parameter accessors, inference and the next step work as before. One
process (dp=1, zero=3 still shards and releases), tiny Llama in float64.
"""
from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch

from test_equivalence import batches, family

RELEASED = "embed.weight"


@pytest.fixture(scope="module")
def trained() -> tuple:
    """tiny-llama under dp=1,zero=3 after one step, its data, and the same model under zero=1."""
    import mplan

    data = batches(2, steps=2)
    built = {zero: mplan.autoparallel(family("tiny-llama")(), example_inputs=(data[0][0],), global_batch=2,
                                      plan=f"dp=1,zero={zero}", progress="quiet") for zero in (1, 3)}
    for pm in built.values():
        pm.train_step(*data[0])
    return built[3], built[1], data


@pytest.mark.parametrize("read", [
    lambda p: p.sum(), lambda p: p.tolist(), lambda p: p.clone(), lambda p: p + 1, lambda p: p[0],
    lambda p: p.detach().numpy(), lambda p: torch.save(p, io.BytesIO()), lambda p: p.t(),
], ids=["sum", "tolist", "clone", "add", "index", "numpy_of_detached", "save", "transpose"])
def test_reading_a_released_parameter_raises_one_line_naming_the_accessors(trained: tuple,
                                                                           read: Callable) -> None:
    pm, _, _ = trained
    with pytest.raises(RuntimeError) as err:
        read(pm.params[RELEASED])
    message = str(err.value)
    assert "\n" not in message and "released between steps" in message
    assert f"pm.whole_parameter('{RELEASED}')" in message and "pm.full_state_dict()" in message


def test_its_metadata_reads_as_usual_and_its_repr_says_how_to_read_it(trained: tuple) -> None:
    pm, _, _ = trained
    param = pm.params[RELEASED]
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad and param.grad is None
    assert (tuple(param.shape), param.dtype, param.untyped_storage().nbytes()) == ((64, 32), torch.float64, 0)
    assert f"pm.whole_parameter('{RELEASED}')" in repr(param) and f"{param}" in repr(param)


def test_the_whole_parameter_reads_the_trained_values(trained: tuple) -> None:
    """`pm.whole_parameter`, `pm.full_state_dict()` and reads inside `parameters_whole()` agree,
    and equal zero=1's parameter trained on the same step (one process: bit for bit)."""
    pm, zero1, _ = trained
    whole = pm.whole_parameter(RELEASED)
    assert torch.equal(whole, pm.full_state_dict()[RELEASED])
    with pm.optimizer.parameters_whole():
        assert torch.equal(pm.params[RELEASED].detach().clone(), whole)
    assert torch.equal(whole, zero1.params[RELEASED].detach())


def test_steps_and_inference_run_on_after_a_refused_read(trained: tuple) -> None:
    pm, zero1, data = trained
    with pytest.raises(RuntimeError):
        pm.params[RELEASED].sum()
    assert pm.train_step(*data[1]) == zero1.train_step(*data[1])
    assert torch.equal(pm(data[1][0]), zero1(data[1][0]))
    assert type(pm.params[RELEASED]).__name__ == "ReleasedParameter"
    assert type(zero1.params[RELEASED]) is torch.nn.Parameter  # whole between steps: nothing to guard
