"""The fusion registry: every entry whole, and one name per kernel in every table that reads it.

`entry_gaps` names what an entry lacks; the test that it finds nothing in FUSIONS is paired with
one that shows it can fail (a pattern with no anchors, a measured price with no source, no
launches, a `lesser` that names no entry).
"""
from __future__ import annotations

import dataclasses

import pytest

from mplan.fusion import FUSIONS, MATCHED, AtenPricing, FusionEntry, FusionPattern, MeasuredPricing, PairedPattern
from mplan.fusion.entry import NOT_MARKED
from mplan.fusion.fp8 import fp8_linear_entry
from mplan.fusion.registry import entry


def entry_gaps(e: FusionEntry, names: set[str]) -> list[str]:
    """What `e` lacks (an empty list when it is whole); `names`: every entry's name."""
    gaps = []
    if not e.name:
        gaps.append("name")
    if isinstance(e.pattern, FusionPattern):
        if not e.pattern.anchors or not callable(e.pattern.match):
            gaps.append("pattern")
    elif not (isinstance(e.pattern, PairedPattern) and e.pattern.of in names and e.pattern.consumers):
        gaps.append("pattern")
    if not e.forms or not all(e.forms):
        gaps.append("forms")
    if not callable(e.keeps):
        gaps.append("keeps")
    if isinstance(e.pricing, MeasuredPricing):
        forward, backward = e.pricing.copy_fraction
        traffic = e.pricing.traffic
        if not (0 < forward <= 1 and 0 < backward <= 1) or not e.pricing.source or \
                traffic.forward_row_tensors < 1 or traffic.backward_row_tensors < 1 or not traffic.what:
            gaps.append("pricing")
    elif not (isinstance(e.pricing, AtenPricing) and e.pricing.why):
        gaps.append("pricing")
    launches = e.launches
    if launches.forward_triton + launches.forward_aten < 1 or launches.backward_triton + launches.backward_aten < 1:
        gaps.append("launches")
    if not callable(e.emit):
        gaps.append("emit")
    if not (e.marks in (NOT_MARKED, None, "all") or isinstance(e.marks, int)):
        gaps.append("marks")
    if e.lesser is not None and e.lesser not in names:
        gaps.append("lesser")
    return gaps


ENTRIES = [*FUSIONS, fp8_linear_entry(losses=())]
NAMES = {e.name for e in ENTRIES}


@pytest.mark.parametrize("fusion", ENTRIES, ids=lambda e: e.name)
def test_no_entry_lacks_a_field(fusion: FusionEntry) -> None:
    assert entry_gaps(fusion, NAMES) == []


def test_the_check_sees_an_entry_with_gaps() -> None:
    rope = entry("rope")
    broken = dataclasses.replace(
        rope, pattern=FusionPattern(anchors=(), match=rope.pattern.match), forms=(),
        pricing=dataclasses.replace(rope.pricing, source=""),
        launches=dataclasses.replace(rope.launches, forward_triton=0), lesser="rope_kv")
    assert entry_gaps(broken, NAMES) == ["pattern", "forms", "pricing", "launches", "lesser"]
    assert entry_gaps(dataclasses.replace(rope, pricing=AtenPricing(why="")), NAMES) == ["pricing"]


def test_one_entry_per_kernel_tried_longer_chains_first() -> None:
    names = [e.name for e in FUSIONS]
    assert len(set(names)) == len(names)
    for longer, shorter in [("rms_norm_residual", "rms_norm"), ("linear_swiglu", "swiglu"),
                            ("linear_geglu", "geglu"), ("linear_cross_entropy", "cross_entropy")]:
        assert names.index(longer) < names.index(shorter)
        assert entry(longer).lesser == shorter
    assert [e.name for e in FUSIONS if e not in MATCHED] == ["rope_qk"]  # paired, not matched
    with pytest.raises(KeyError, match="no fused kernel 'softmax'"):
        entry("softmax")


def test_the_registry_loads_neither_triton_nor_the_kernels_nor_the_passes() -> None:
    """The planner matches the patterns and prices their chains for every plan: neither may load
    Triton, the kernels, the passes or the models."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys, mplan.fusion.coverage, mplan.planner.fused_pricing\n"
              "print(sorted(m for m in sys.modules\n"
              "             if m == 'triton' or m.startswith(('mplan.kernels', 'mplan.passes', 'mplan.models'))))")
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"
