"""What the fused kernels keep for backward, against their references and the planner's count.

The planner counts the activations an op keeps for backward from the captured (unfused) graph;
mplan's fused kernels keep other tensors than their references (a fused norm keeps its input and
rstd, not the normalized tensor; a fused SwiGLU keeps gate and up, not silu(gate)). This case
measures one block of a small Llama and GPT trained through `mplan.autoparallel(kernels=True)` in
fp32 at tp=1: the bytes the forward leaves allocated for backward with the Triton kernels (run by
the Triton interpreter, in a child process started with TRITON_INTERPRET=1) and with their
PyTorch references, beside the planner's count (its units at tp=1 and this batch, recompute none,
priced as the search prices them: each chain the pass fuses counted by what its kernel keeps,
`fused_pricing.find_fused_saves`). One block is half the difference between 4 and 2 layers, so
the embedding, head and loss cancel.

Why: on 2 H200s Llama-3-8B at tp=2 with SP and no recomputation peaked 18% under the planner's
prediction (benchmarks/results/bench_llama3-8b_h200x2-2026-11-29-session7.json); this tells
whether the planner's count of a block is off for the fused kernels already at tp=1
(fused_activation_bytes-cpu-2026-11-29.json, by the command below, when the planner counted the
ATen ops' saves; fused_activation_bytes-cpu-2026-12-07.json with the fused saves).

    PYTHONPATH=. python -m benchmarks.reprice activation-bytes --out /tmp/fused_activation_bytes.json
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from typing import Any

import torch

import mplan
from benchmarks.report import machine_header
from benchmarks.reprice.pricing import cluster, error, print_table
from mplan.ir.trace import capture_for_training
from mplan.models import build_model
from mplan.planner.search import Planner

MODELS = {"llama": "llama:layers={layers},hidden=128,heads=4,kv_heads=2,ffn=352,seq=64,vocab=64",
          "gpt": "gpt:layers={layers},hidden=128,heads=4,seq=64,vocab=64"}
"""each at 2 and 4 layers: half the difference is one block's bytes (embedding, head and loss cancel)"""
BATCH = 4
CHILD = ("import sys; from benchmarks.reprice.activation_bytes import _program, kept_after_forward; "
         "print(kept_after_forward(*_program(sys.argv[1])))")
"""what the child process under the Triton interpreter runs, on one model spec (PYTHONPATH=. as the harness runs)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags: the models are the two small ones above."""


def _program(spec: str) -> Any:
    model = build_model(spec, device="cpu", dtype=torch.float32, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 64, (BATCH, model.config.seq_len), generator=gen) for _ in range(2))
    pm = mplan.autoparallel(model, example_inputs=(ids,), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                            global_batch=BATCH, plan="dp=1,tp=1", device="cpu", kernels=True)
    return pm, pm._feed(pm.program, (ids, labels))


def kept_after_forward(pm: Any, feed: Any) -> int:
    """Bytes the forward allocates and has not freed when backward would start (CPU allocator)."""
    pm.program(*feed)  # first call: any one-time work out of the measurement
    with torch.profiler.profile(profile_memory=True) as prof:
        loss = pm.program(*feed)
    del loss
    return sum(event.self_cpu_memory_usage for event in prof.events())


def planner_saved_bytes(spec: str) -> int:
    """The planner's count of what the forward keeps at tp=1 and `BATCH` sequences (recompute none),
    on the capture `autoparallel` plans, fused kernels priced (`Planner(kernels=True)`)."""
    model = build_model(spec, device="cpu", dtype=torch.float32, seed=0)
    graph = capture_for_training(model, (torch.zeros(BATCH, model.config.seq_len, dtype=torch.long),))
    planner = Planner(graph, cluster("cpu"), kernels=True, runtime="mplan")
    return sum(u.saved_bytes for u in planner.units(1, False, BATCH))


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"priced_by": machine_header(), "torch": torch.__version__, "dtype": "float32", "batch": BATCH,
                              "per_block": "half the difference between 4 and 2 layers", "models": {}}
    for name, template in MODELS.items():
        figures: dict[int, dict[str, int]] = {}
        for layers in (2, 4):
            spec = template.format(layers=layers)
            child = subprocess.run([sys.executable, "-c", CHILD, spec], check=True, capture_output=True, text=True,
                                   env={**os.environ, "TRITON_INTERPRET": "1"})
            pm, feed = _program(spec)
            figures[layers] = {"kept_with_kernels_bytes": int(child.stdout.split()[-1]),
                               "kept_with_references_bytes": kept_after_forward(pm, feed),
                               "planner_saved_bytes": planner_saved_bytes(spec)}
        row = {key: (figures[4][key] - figures[2][key]) // 2 for key in figures[2]}
        row["planner_vs_kernels"] = error(row["planner_saved_bytes"], row["kept_with_kernels_bytes"])
        report["models"][name] = {"spec": template, "per_block": row}
    print_table([{"model": name, **entry["per_block"]} for name, entry in report["models"].items()],
                {"model": "", "kept_with_kernels_bytes": "", "kept_with_references_bytes": "",
                 "planner_saved_bytes": "", "planner_vs_kernels": "+.1%"})
    return report
