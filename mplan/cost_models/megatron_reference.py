"""The published Megatron-LM runs the cost model is checked against, read and validated.

Input: megatron-sc21-a100.json, shipped as package data in ``mplan/cost_models/reference/``
(Narayanan et al., SC'21, Tables 1 and 2: GPT models of 1.7B to 1T parameters on 32 to 3072 A100s
with their TP/PP/DP, batch and achieved TFLOP/s). Output: `MegatronRun` records and the FLOP
conventions of that paper, so a prediction can be turned into the same "TFLOP/s per GPU with
recomputation counted".
"""
from __future__ import annotations

from dataclasses import dataclass

from mplan.json_fields import FieldReader, load_json_file
from mplan.cost_models.reference_data import ReferenceError, reference_path

__all__ = ["MegatronRun", "ReferenceError", "default_reference_path", "load_megatron_runs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronRun:
    id: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    num_gpus: int
    gpus_per_node: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    micro_batch: int | None  # not reported for Table 1
    schedule: str  # as the paper states it: Table 1 "interleaved 1F1B (...)", Table 2 "1F1B or interleaved (...)"
    measured_tflops_with_recompute: float

    def recompute_counted_flops(self) -> float:
        """Narayanan eq. 3: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), what the paper's TFLOP/s count."""
        B, s, l, h, V = self.global_batch, self.seq_len, self.layers, self.hidden, self.vocab
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))

    def measured_step_s(self) -> float:
        return self.recompute_counted_flops() / (self.measured_tflops_with_recompute * 1e12 * self.num_gpus)


def default_reference_path() -> str:
    """The packaged copy of the published runs (package data, never a file beside the checkout)."""
    return reference_path("megatron-sc21-a100.json")


def load_megatron_runs(path: str | None = None) -> list[MegatronRun]:
    path = path or default_reference_path()
    rows = load_json_file(path, ReferenceError)
    if not isinstance(rows, list):
        raise ReferenceError(f"{path}: the top level must be a list of runs")
    runs = []
    for i, row in enumerate(rows):
        r = FieldReader(row, file=path, path=f"[{i}]", error=ReferenceError)
        model, cluster, config = r.obj("model"), r.obj("cluster"), r.obj("config")
        micro = config.raw("micro_batch")
        runs.append(MegatronRun(
            id=r.string("id"), layers=model.integer("layers"), hidden=model.integer("hidden"),
            heads=model.integer("heads"), seq_len=model.integer("seq_len"), vocab=model.integer("vocab"),
            num_gpus=cluster.integer("n_gpus"), gpus_per_node=cluster.integer("gpus_per_node"),
            tp=config.integer("tp"), pp=config.integer("pp"), dp=config.integer("dp"),
            global_batch=config.integer("global_batch"), micro_batch=micro if isinstance(micro, int) else None,
            schedule=config.string("schedule"),
            measured_tflops_with_recompute=r.obj("measured").number("tflops_per_gpu_with_recompute_counted")))
    return runs
