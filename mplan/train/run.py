"""A whole training run from one config: `mplan train CONFIG.toml` on every rank.

Input: a `TrainConfig` (`config.py`) and this process's torchrun environment (or none: one
process). Output: the trained `ParallelModule`'s run, `RunSummary`, and on disk what the config
asks: checkpoints every `checkpoint.interval` steps, the metrics JSONL, a loss-curve PNG, a
Hugging Face export, profiler traces (`observe.py`).

In order, every rank alike:
1. the data (`mplan.data.TokenShards` + `PackedLoader`: packed, shuffled from `train.seed`,
   each DP rank reading its own rows; `data.packing = "cp_aligned"` packs the windows for the
   plan's cp ranks once the plan is known) and the model, built from its spec with the data's
   vocabulary and `train.seq_len` (a family spec's own are replaced; a Hugging Face or factory
   model must already hold the data's vocabulary);
2. `mplan.autoparallel` under `plan.spec` (`auto`: the planner searches on the graph that runs);
3. the optimizer and the learning-rate schedule (`lr_schedule.py`);
4. resume: the newest checkpoint of `checkpoint.dir` (weights, optimizer state, step, schedule,
   the loader's position, RNG), whatever plan and world size wrote it; else `model.init_from`;
5. the loop: `train_step` on the loader's next rows, the schedule's step, the step's metrics to
   the JSONL and the progress line, a checkpoint at every interval, and at the end a last
   checkpoint, the export and the plot.

Why the loader's position is an `extras` entry of the checkpoint: it is counted in samples, so a
resume on another DP size or global batch continues at the very next sample.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mplan.train.config import ConfigError, TrainConfig
from mplan.train.lr_schedule import make_schedule
from mplan.train.observe import Observer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunSummary:
    """What a run did: the steps it ran (this process), its last loss, where things went."""

    plan: str
    first_step: int
    """the step it started from (0, or the checkpoint's)"""
    last_step: int
    final_loss: float | None
    checkpoint: str | None
    exported: str | None
    metrics: str | None
    plot: str | None


def train(config: TrainConfig, *, progress: Any = None) -> RunSummary:
    """Run `config` (collective: every rank calls it alike)."""
    import mplan
    from mplan.data import PackedLoader, TokenShards
    from mplan.data.loader import packed_document_ids
    from mplan.runtime.checkpoint import committed_steps
    from mplan.runtime.launch import init_distributed_from_env

    Observer.preflight(config)
    init_distributed_from_env()
    rank = dist.get_rank() if dist.is_initialized() else 0
    shards = TokenShards.open(config.data.path)
    t = config.train
    loader = PackedLoader(shards, seq_len=t.seq_len, global_batch=t.global_batch, seed=t.seed)
    model = build_model(config, vocab=shards.vocab_size)
    ids, _ = loader.global_batch(0)
    pm = mplan.autoparallel(model, cluster=_cluster(config), example_inputs=(ids,), optimizer=_optimizer(config),
                            global_batch=t.global_batch, plan=None if config.plan.spec == "auto" else config.plan.spec,
                            max_grad_norm=config.optimizer.max_grad_norm or None, seed=t.seed, progress=progress,
                            hang_timeout_s=config.plan.hang_timeout_s or None, cuda_graphs=config.plan.cuda_graphs,
                            document_mask=config.data.document_mask)
    del model
    if config.data.packing != "stream":  # windows packed for the plan's cp ranks
        loader = PackedLoader(shards, seq_len=t.seq_len, global_batch=t.global_batch, seed=t.seed,
                              packing=config.data.packing, shares=pm.plan.mesh.cp)
    s = config.schedule
    schedule = make_schedule(pm.optimizer.optimizer, warmup=s.warmup_steps, total=t.steps, decay=s.decay,
                             min_ratio=s.min_lr_ratio)
    extras = {"lr_scheduler": schedule, "data": loader}
    c = config.checkpoint
    if c.dir and c.resume and committed_steps(c.dir):
        pm.load(c.dir, extras=extras)
    elif config.model.init_from:
        pm.load(config.model.init_from)
    first = pm.step
    last = min(t.steps, t.stop_at) if t.stop_at else t.steps
    observer = Observer(config, rank=rank, first_step=first, total_steps=t.steps, stop=last, plan=pm.plan)
    loss = None
    for _ in range(first, last):
        ids, labels = loader.next_batch(pm.dp_rank, pm.dp_size)
        doc_ids = packed_document_ids(ids, shards.eos_id) if config.data.document_mask else None
        with observer.step(pm.step):
            loss = pm.train_step(ids, labels, local=True, doc_ids=doc_ids)
        lr = schedule.get_last_lr()[0]
        schedule.step()
        observer.record(pm, loss, lr)
        if c.dir and c.interval and pm.step % c.interval == 0 and pm.step < last:
            pm.save(c.dir, background=c.background, keep_latest=c.keep_latest, extras=extras)
    saved = None
    if c.dir:
        if pm.step > first or not committed_steps(c.dir):
            pm.save(c.dir, background=c.background, keep_latest=c.keep_latest, extras=extras)
        saved = pm.wait_for_save() or os.path.join(c.dir, f"step-{pm.step:08d}")
    exported = None
    if c.export_hf and pm.step == t.steps:
        pm.save(c.export_hf, format="hf")
        exported = c.export_hf
    plot = observer.finish()
    return RunSummary(plan=pm.plan.spec(), first_step=first, last_step=pm.step, final_loss=loss, checkpoint=saved,
                      exported=exported, metrics=config.metrics.jsonl or None, plot=plot)


def build_model(config: TrainConfig, *, vocab: int) -> torch.nn.Module:
    """The model of `model.spec` in `model.dtype`, with the data's vocabulary and `train.seq_len`
    (a family's numbers replaced; any other model must already read the data's token ids)."""
    from mplan.models import build_model as build
    from mplan.models.spec import resolve_model

    try:
        source = resolve_model(config.model.spec)
    except ValueError as exc:
        raise ConfigError(f"model.spec: {exc}") from None
    dtype = DTYPES[config.model.dtype]
    if source.family in ("gpt", "llama", "moe"):
        # on the meta device: autoparallel draws each rank's shards from the seed exactly as
        # `init_weights` would, so no rank builds (or holds a second copy of) the whole model
        return build(dataclasses.replace(source.config, vocab=vocab, seq_len=config.train.seq_len), device="meta",
                     dtype=dtype, seed=config.train.seed)
    if source.vocab is not None and source.vocab < vocab:
        raise ConfigError(f"model.spec: {source.name} reads {source.vocab} token ids, the data {config.data.path} "
                          f"holds {vocab}: prepare the data with the model's tokenizer (--tokenizer)")
    return build(source, device="cpu", dtype=dtype, seed=config.train.seed)


def _cluster(config: TrainConfig) -> Any:
    import mplan

    name = config.cluster.name
    if name == "local":
        return None  # autoparallel's: the job's own ranks
    if os.path.exists(name):
        return mplan.ClusterSpec.from_json(name)
    c = config.cluster
    return mplan.ClusterSpec.preset(name, nodes=c.nodes, sites=c.sites, inter_site_gbps=c.inter_site_gbps,
                                    inter_site_latency_ms=c.inter_site_latency_ms)


def _optimizer(config: TrainConfig) -> Any:
    o = config.optimizer
    if o.name == "sgd":
        return functools.partial(torch.optim.SGD, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return functools.partial(torch.optim.AdamW, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
