"""One torch.export capture per model and inputs, for tests that build the same model many times
(test code only).

`mplan.autoparallel` captures the model it is given (`mplan.api.capture_for_training`, and again
without the loss for a model that returns only its loss); on the tiny models of the distributed
tests that is most of a check's time, and a module's checks build the same few models over and
over on every rank. Inside `reused_captures(key)`, where `key` names the model's construction
(`test_equivalence.family(spec)`'s spec, say: the same key must always build the same module
structure, patched methods included), the first capture of that model at those inputs is traced
as usual, and a deep copy of it is kept for this process; every later one is a deep copy of that,
so no run's passes see another's graph. What a capture depends on besides the module is in the
key too: the first two example rows (all `capture_for_training` traces at), the loss function,
`with_loss` and `shallow`. Weights and buffers never come from the kept graph (`parallelize` reads them from the
model it is given), so a check still trains its own model; a graph of another model would make
its run differ from the one-process reference, a failure, never a pass.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import mplan.api

_KEPT: dict[tuple, Any] = {}
"""This process's captures, by (model key, inputs, options)."""


def _inputs_key(example_inputs: Any) -> tuple:
    """What `capture_for_training` reads of the inputs: their first two rows (fewer rows differ)."""
    return tuple((tuple(x[:2].shape), x.dtype, str(x.device), x[:2].cpu().numpy().tobytes())
                 for x in example_inputs)


def captured(model_key: Hashable, model: torch.nn.Module, example_inputs: Any, *, loss_fn: Any = None,
             with_loss: bool = True, shallow: bool = False) -> Any:
    """`capture_for_training(model, example_inputs, ...)`, traced once per process for `model_key`."""
    key = (model_key, _inputs_key(example_inputs), loss_fn, with_loss, shallow)
    if key in _KEPT:
        return _copy(_KEPT[key])
    graph = _REAL(model, example_inputs, loss_fn=loss_fn, with_loss=with_loss, shallow=shallow)
    _KEPT[key] = _copy(graph)  # kept apart from `model`, whose training updates the tensors its capture holds
    return graph


def _copy(graph: Any) -> Any:
    with warnings.catch_warnings():  # torch's pytree deprecations, raised by copying its specs
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(graph)


_REAL = mplan.api.capture_for_training


@contextmanager
def reused_captures(model_key: Hashable | None) -> Iterator[None]:
    """`mplan.autoparallel`'s captures go through `captured(model_key, ...)` while open (a None key:
    every capture traced as usual)."""
    if model_key is None:
        yield
        return

    def capture(model: torch.nn.Module, example_inputs: Any, **options: Any) -> Any:
        return captured(model_key, model, example_inputs, **options)

    mplan.api.capture_for_training = capture
    try:
        yield
    finally:
        mplan.api.capture_for_training = _REAL
