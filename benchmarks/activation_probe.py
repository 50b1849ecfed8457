"""Measure the activations one transformer block keeps for backward, to check the IR's saved bytes.

For each model, a bf16 copy with 2 and with 4 layers runs one forward pass (with the loss) on the
device; the allocated bytes still held after forward, minus those before it, are the activations
kept for backward; the per-layer figure is the difference between the two depths divided by two
(the embedding, head and loss cancel out). The IR's count for the same block is computed by the
same script (capture on the meta device), so the comparison needs one run on the GPU:

    PYTHONPATH=. python3 benchmarks/activation_probe.py --out $OUT/activation_probe.json

On a CPU machine it measures nothing and only prints the IR's figures (`--device cpu` is refused:
CPU allocations are not counted by torch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

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


def kept_after_forward(config, batch: int) -> int:  # noqa: ANN001
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


def predicted_block_bytes(config, batch: int) -> int:  # noqa: ANN001
    model = build_model(config, device="meta")
    ids, labels = example_inputs(model, batch, config.seq_len, device="meta")
    graph = capture(model, (ids,), labels=labels, dtype=torch.bfloat16)
    return graph.block_types[0].saved_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
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
    if args.out:
        doc = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
