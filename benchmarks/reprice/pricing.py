"""What the cases share (and `report.machine_header`, which each report records as `priced_by`: the
checkout and machine that priced it): read a committed result (`Committed`: a missing file or field is one
`ResultError` naming both), capture the model as the planner sees it (`capture`), price it on a
preset or a committed profile (`cluster`), set the price beside the measurement
(`error`) and print the rows (`print_table`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mplan.cost_models.cluster import ClusterSpec
from mplan.models import build_model
from mplan.planner.planning import capture_for_planning

RESULTS = Path(__file__).resolve().parents[1] / "results"


class ResultError(ValueError):
    """A committed result file that is missing, is not JSON, or lacks a field a case reads."""


class Committed:
    """One committed result file (a path, or a name under benchmarks/results/); `at(*keys)`: a field or ResultError."""

    def __init__(self, name: str | Path) -> None:
        self.path = Path(name) if Path(name).is_file() else RESULTS / name
        try:
            self.data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ResultError(f"{self.path}: cannot be read as a result file ({exc})") from exc

    def at(self, *keys: str | int) -> Any:
        value = self.data
        for depth, key in enumerate(keys):
            try:
                value = value[key]
            except (KeyError, IndexError, TypeError):
                where = "".join(f"[{k!r}]" for k in keys[:depth + 1])
                raise ResultError(f"{self.path.name}: no {where}: not a result of the run this case prices") from None
        return value


def capture(model: Any, seq_len: int, batch: int = 1) -> Any:
    """The planner's graph of `model` at `batch` x `seq_len` tokens: an nn.Module as built; an mplan config or
    spec built on the meta device in bf16, the dtype it trains in; a config file (a Path) as `mplan plan` reads one."""
    if isinstance(model, Path):
        return capture_for_planning(str(model), seq_len=seq_len)
    if not isinstance(model, torch.nn.Module):
        model = build_model(model, device="meta", dtype=torch.bfloat16)
    return capture_for_planning(model, (torch.zeros(batch, seq_len, dtype=torch.long),))


def cluster(name: str, **overrides: Any) -> ClusterSpec:
    """A preset by name (with `overrides`), or a card's profile: a committed `.json`, named as `Committed` takes it."""
    if name.endswith(".json"):
        return ClusterSpec.from_json(str(Committed(name).path))
    return ClusterSpec.preset(name, **overrides)


def error(predicted: float, measured: float) -> float:
    """predicted / measured - 1: above 0 where the planner prices high."""
    return predicted / measured - 1


def print_table(rows: list[dict[str, Any]], columns: dict[str, str]) -> None:
    """`rows` aligned on stdout, a column per key of `columns` in its format spec ('+.1%' an error); None as '-'."""
    cells = [list(columns)] + [[format(row[key], spec) if row.get(key) is not None else "-"
                                for key, spec in columns.items()] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)), flush=True)
