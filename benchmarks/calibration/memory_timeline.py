"""What is alive at the peak of one mplan training step, against what the memory model priced.

`mplan bench CONFIG --measure` on Hugging Face Llama (TinyLlama-1.1B shape, batch 8 x 2048)
measured a peak 6.6% above the prediction for mplan's runtime (hf_bench_h200-2026-12-02.json):
about one model's gradients. This case finds what the difference is. It trains the model under
`mplan.autoparallel(plan="dp=1,tp=1,pp=1")` (fused kernels, fused AdamW, clipping), records the
CUDA allocator's history over one step after warm-up, replays the allocations to find the moment
of the peak, and groups the blocks alive then by the innermost frame of mplan, transformers or
torch.autograd that allocated them. It also records memory_allocated at the step's phase
boundaries (before forward, after forward, after backward, after the optimizer) and the plan's
predicted breakdown (params, grads, optimizer, activations, transient).

Run on the GPU:
    PYTHONPATH=. python -m benchmarks.calibration memory-timeline --out $OUT/memory_timeline.json
CPU smoke test (tiny model, no allocator history):
    PYTHONPATH=. python -m benchmarks.calibration memory-timeline --device cpu --small --out /tmp/mt.json
(memory_timeline_h200-2026-12-02*.json were made by the old `benchmarks/memory_timeline.py` with the
same flags.)
"""
from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import torch

from benchmarks import harness
from benchmarks.calibration.gpu import GiB, device_of
from benchmarks.report import run_header


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_device_flags(parser)


def build(small: bool, device: torch.device) -> tuple[torch.nn.Module, int, int, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if small:
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=512, use_cache=False, tie_word_embeddings=False)
        batch, seq = 2, 32
    else:
        cfg = LlamaConfig(num_hidden_layers=22, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                          intermediate_size=5632, vocab_size=32000, use_cache=False, tie_word_embeddings=False,
                          rms_norm_eps=1e-5, max_position_embeddings=2048, rope_theta=10000.0)
        batch, seq = 8, 2048
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    return model, batch, seq, cfg.vocab_size


def _frame(frames: list[dict[str, Any]]) -> str:
    """The innermost frame from code worth naming (mplan, transformers, autograd, optimizer)."""
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in ("/mplan/", "/transformers/", "torch/autograd", "torch/optim", "torch/nn/utils")):
            return f"{name.split('/site-packages/')[-1].split('/work/')[-1]}:{f.get('line')}:{f.get('name')}"
    return "(other)" if not frames else f"{frames[0].get('filename', '?')}:{frames[0].get('name', '?')}"


def live_at_peak(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Replay the device trace: the peak allocated bytes over the step and the blocks alive then."""
    trace = snapshot["device_traces"][0]
    live: dict[int, tuple[int, str]] = {}  # blocks allocated before recording started are not in the trace
    now = peak = 0
    peak_blocks: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _frame(event.get("frames", [])))
            now += size
            if now > peak:
                peak, peak_blocks = now, dict(live)
        elif action == "free_completed" and addr in live:
            now -= live.pop(addr)[0]
    groups: dict[str, int] = defaultdict(int)
    for size, frame in peak_blocks.values():
        groups[frame] += size
    top = sorted(groups.items(), key=lambda kv: -kv[1])[:40]
    return {"peak_above_start_gib": peak / GiB,
            "by_frame_gib": {k: v / GiB for k, v in top}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = device_of(args, "memory-timeline")
    import mplan

    model, batch, seq, vocab = build(args.small, device)
    ids = torch.randint(0, vocab, (batch, seq))
    cuda = device.type == "cuda"
    pm = mplan.autoparallel(model, example_inputs=(ids[:1],), global_batch=batch, plan="dp=1,tp=1,pp=1",
                            kernels=cuda, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4, fused=cuda),
                            max_grad_norm=1.0, dtype=model.dtype, device=device)
    del model
    doc: dict[str, Any] = {**run_header(device), "script": "benchmarks.calibration memory-timeline",
                           "transformers": importlib.metadata.version("transformers"),
                           "plan": pm.plan.spec(), "micro_batch_size": pm.plan.micro_batch_size,
                           "predicted_gib": [asdict(m) for m in pm.plan.predicted.memory_by_stage],
                           "fused": str(pm.program.meta.get("fuse_kernels"))}
    for _ in range(3):
        pm.train_step(ids, ids)
    if cuda:
        torch.cuda.synchronize()
        phases: dict[str, float] = {"before_step": torch.cuda.memory_allocated() / GiB}
        params = sum(t.numel() * t.element_size() for t in pm.params.values())
        opt = sum(v.numel() * v.element_size() for s in pm.optimizer.optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v))
        doc["held_gib"] = {"params": params / GiB, "optimizer_state": opt / GiB}
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        pm.train_step(ids, ids)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        phases["peak_step"] = torch.cuda.max_memory_allocated() / GiB
        phases["after_step"] = torch.cuda.memory_allocated() / GiB
        doc["phases_gib"] = phases
        doc["at_peak"] = live_at_peak(snapshot)
        doc["at_peak"]["peak_including_held_gib"] = phases["before_step"] + doc["at_peak"]["peak_above_start_gib"]
    doc = json.loads(json.dumps(doc, default=str))  # the plan's fields as the old script wrote them (str)
    print(json.dumps(doc, indent=1)[:6000])
    return doc
