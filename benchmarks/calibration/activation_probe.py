"""The activations one transformer block keeps for backward, measured, against the IR's saved bytes.

For each model, a bf16 copy with 2 and with 4 layers runs one forward pass (with the loss) on the
device; the allocated bytes still held after forward, minus those before it, are the activations
kept for backward; the per-layer figure is the difference between the two depths divided by two
(the embedding, head and loss cancel out). The IR's count for the same block is computed by the
same case (capture on the meta device), so the comparison needs one run on the GPU:

    PYTHONPATH=. python -m benchmarks.calibration activation-probe --out $OUT/activation_probe.json

On a CPU machine it measures nothing and only reports the IR's figures (CPU allocations are not
counted by torch). (activation_probe_h*-*.json were made by the old `benchmarks/activation_probe.py`
with the same flags; its `gpu` was null on a CPU, now "cpu (smoke test)".)
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from benchmarks.report import run_header
from mplan.ir.trace import capture
from mplan.models import GPTConfig, LlamaConfig, build_model, example_inputs

MODELS = [
    ("gpt-h2048", GPTConfig(name="gpt-h2048", num_layers=2, hidden=2048, num_heads=16, seq_len=2048, vocab=50304), 8),
    ("gpt-h2560", GPTConfig(name="gpt-h2560", num_layers=2, hidden=2560, num_heads=32, seq_len=2048, vocab=50304), 4),
    ("llama-h2048", LlamaConfig(name="llama-h2048", num_layers=2, hidden=2048, num_heads=16, num_kv_heads=4,
                                ffn_hidden=5632, seq_len=2048, vocab=32000), 8),
    ("llama-h3072", LlamaConfig(name="llama-h3072", num_layers=2, hidden=3072, num_heads=24, num_kv_heads=8,
                                ffn_hidden=8192, seq_len=2048, vocab=128256, tie_embeddings=True), 4),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags: the GPU is measured where there is one."""


def kept_after_forward(config: Any, batch: int) -> int:
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=0)
    ids, labels = example_inputs(model, batch, config.seq_len, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(ids, labels=labels)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del loss, model
    torch.cuda.empty_cache()
    return kept


def predicted_block_bytes(config: Any, batch: int) -> int:
    model = build_model(config, device="meta")
    ids, labels = example_inputs(model, batch, config.seq_len, device="meta")
    graph = capture(model, (ids,), labels=labels, dtype=torch.bfloat16)
    return graph.block_types[0].saved_bytes


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name, config, batch in MODELS:
        row = {"name": name, "batch": batch, "predicted_block_mib": predicted_block_bytes(config, batch) / 2**20}
        if torch.cuda.is_available():
            two = kept_after_forward(config, batch)
            four = kept_after_forward(dataclasses.replace(config, num_layers=4), batch)
            row["measured_block_mib"] = (four - two) / 2 / 2**20
            row["error"] = row["predicted_block_mib"] / row["measured_block_mib"] - 1
        rows.append(row)
        print(row, flush=True)
    return {**run_header(torch.device("cuda" if torch.cuda.is_available() else "cpu")), "rows": rows}
