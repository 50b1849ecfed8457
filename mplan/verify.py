"""`verify_plan`: run a plan scaled down on gloo CPU ranks and compare it with one process.

Input: a model spec (the grammar of docs/models.md), a plan (spec string or plan.json), a world size and a
number of steps. Output: a `VerifyReport` with the per-step losses of both runs and the largest
relative differences of losses and of every parameter after the last step. `mplan verify` calls
this; the correctness bar (docs/execution.md) is a relative error under 1e-9 in float64.

Scaling down, so any model and plan verify in seconds on a laptop:
- the model keeps its family and its structure (tied or not, grouped-query ratio, kv_heads < tp
  when the plan had it, experts) at head_dim 8, ffn 2x hidden, seq 16 and vocab 64, with 2
  layers or as many as the plan's pipeline stages need; Hugging Face configs get the same sizes
  through their attribute names;
- the mesh keeps the plan's parallelisms where the world allows (`scaled_plan`: tp' <= tp and
  pp' <= pp, dp fills, ep' <= ep the largest that divides dp' and the scaled model's 4 experts),
  with vpp, schedule, SP, ZeRO, recomputation and a capacity factor as planned, micro-batches of
  one sequence (at least two, a multiple of pp');
- TP strategies are Megatron's layout on the scaled model, and stage cuts are priced again on
  it: the plan's per-op choices and cuts were made for the full-size shapes and need not exist
  on the small ones.
So this checks the plan's parallel layout and the passes and runtime that execute it, not the
cost model's choice at full size.

The one-process reference accumulates gradients over the same micro-batches the plan runs, so a
model whose loss is not a plain mean over sequences (an MoE's capacity-bounded routing and
load-balancing loss depend on the batch) is compared like for like; for dense models this is
the same as one full-batch step.

With `bisect=True` the ranks also run `runtime.bisect` before training, on the first micro-batch and the
scaled model's initial weights (the one-process model's, so a parameter sharded wrongly shows too): the
first op whose value or gradient differs from one device, with its placement and error
(`VerifyReport.bisect`; a pipeline plan is refused, `bisect_refused` says why).

Ranks are fresh `spawn`ed processes joined in a gloo group over a TCP store the parent owns.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import queue
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mplan.runtime.bisect import BisectReport

TOLERANCE = 1e-9  # the project's bar: float64 plans match one process to this relative error
SCALED = {"num_layers": 2, "seq_len": 16, "vocab": 64}
SCALED_EXPERTS = 4  # experts per MoE layer of a scaled model (an EP degree of the scaled plan divides it)


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReport:
    model: str  # the spec as given
    scaled_model: str  # the configuration that ran
    plan: str  # as given
    executed: str  # the layout that ran (dp, tp, sp, zero, micro-batching)
    world_size: int
    steps: int
    losses: tuple[float, ...]  # parallel run, per step
    reference_losses: tuple[float, ...]  # one process, per step
    max_loss_rel_err: float
    max_param_rel_err: float
    worst_param: str
    seconds: float
    bisect: BisectReport | None = None  # with bisect=True: the first op that differs, op by op
    bisect_refused: str | None = None  # why bisect could not run this plan (a pipeline)

    @property
    def passed(self) -> bool:
        agrees = self.bisect is None or self.bisect.agrees
        return self.max_loss_rel_err < TOLERANCE and self.max_param_rel_err < TOLERANCE and agrees

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "bisect": self.bisect.to_dict() if self.bisect else None,
                "passed": self.passed, "tolerance": TOLERANCE}


def verify_plan(model_spec: str, plan_spec: str, world_size: int, steps: int = 3, *,
                timeout_s: float = 300.0, bisect: bool = False) -> VerifyReport:
    """Run `plan_spec` on `world_size` gloo CPU ranks and one process; compare (see module doc);
    `bisect`: also op by op on one micro-batch."""
    import torch.distributed as dist

    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = context.Queue()
    ranks = [context.Process(target=_rank_main, daemon=True,
                             args=(rank, world_size, store.port, model_spec, plan_spec, steps, results, bisect))
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    try:
        report = _wait(ranks, results, time.monotonic() + timeout_s)
    finally:
        for process in ranks:
            if process.is_alive():
                process.terminate()
            process.join()
    return dataclasses.replace(report, model=model_spec, plan=plan_spec, seconds=time.perf_counter() - start)


def _wait(ranks: list[Any], results: Any, deadline: float) -> VerifyReport:
    while True:
        try:
            ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            failed = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"verify: ranks {failed} died (exit codes "
                                   f"{[ranks[r].exitcode for r in failed]})") from None
            if time.monotonic() > deadline:
                raise TimeoutError("verify: the ranks did not finish in time") from None
            continue
        if not ok:
            raise RuntimeError(f"verify: a rank failed:\n{payload}")
        return payload


def _rank_main(rank: int, world_size: int, port: int, model_spec: str, plan_spec: str, steps: int,
               results: Any, bisect: bool = False) -> None:
    import torch
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        report = _run(model_spec, plan_spec, world_size, steps, bisect=bisect)
        if rank == 0:
            results.put((True, report))
    except BaseException:  # noqa: BLE001 - the parent must see every failure
        results.put((False, f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()
        dist.destroy_process_group()


@dataclass(frozen=True, kw_only=True, slots=True)
class ScaledPlan:
    """The layout a plan runs with on the verifying ranks."""

    spec: str  # what autoparallel is given
    tp: int
    pp: int
    vpp: int
    ep: int
    num_micro_batches: int  # per replica, one sequence each

    @property
    def num_layers(self) -> int:
        """Layers of the scaled model: two, or as many as the stages need (embedding and head
        are units too, so pp * vpp stages need pp * vpp - 2 layers)."""
        return max(SCALED["num_layers"], self.pp * self.vpp - 2)


def scaled_plan(plan_spec: str, world_size: int) -> ScaledPlan:
    """The layout that runs on `world_size` ranks: of the degrees tp' <= tp and pp' <= pp whose
    product divides the world, the pair that keeps the most of the plan's parallelisms (TP, PP,
    then DP), then the largest; dp fills; vpp, schedule, SP, ZeRO and recomputation as planned; micro-batches of
    one sequence, at least two and a multiple of pp' (the interleaved schedule needs it)."""
    from mplan.planner.parallel_config import parse_plan_spec
    from mplan.planner.plan import Plan

    if plan_spec.strip().endswith(".json"):
        made = Plan.load(plan_spec.strip())
        tp, pp, vpp, sp, zero = made.mesh.tp, made.mesh.pp, made.mesh.vpp, int(made.sequence_parallel), made.zero
        schedule, dp, recompute = made.schedule, made.mesh.dp, made.recompute
        ep, capacity = made.mesh.ep, made.capacity_factor
    else:
        spec = parse_plan_spec(plan_spec)
        tp, pp, vpp, sp, zero = spec.tp or 1, spec.pp or 1, spec.vpp or 1, spec.sp or 0, spec.zero or 0
        schedule, dp = spec.schedule or ("interleaved" if vpp > 1 else "1f1b"), spec.dp or 1
        recompute, ep, capacity = spec.recompute or "none", spec.ep or 1, spec.capacity
    pairs = [(t, p) for t in range(1, min(tp, world_size) + 1) for p in range(1, min(pp, world_size) + 1)
             if world_size % (t * p) == 0]
    tp_, pp_ = max(pairs, key=lambda q: ((q[0] > 1) == (tp > 1), (q[1] > 1) == (pp > 1),
                                           (world_size // (q[0] * q[1]) > 1) == (dp > 1), q[0] * q[1], q[1]))
    vpp_ = vpp if pp_ > 1 else 1
    dp_ = world_size // (tp_ * pp_)
    ep_ = max(e for e in range(1, min(ep, dp_) + 1) if dp_ % e == 0 and SCALED_EXPERTS % e == 0)
    micro = max(2, pp_) if pp_ > 1 else 2
    layout = f"dp={dp_},tp={tp_},ep={ep_},sp={sp},zero={zero},mbs=1,recompute={recompute}"
    if capacity is not None:
        layout += f",capacity={capacity:g}"
    if pp_ > 1:
        layout += f",pp={pp_},vpp={vpp_},schedule={schedule if vpp_ > 1 or schedule != 'interleaved' else '1f1b'}"
    return ScaledPlan(spec=layout, tp=tp_, pp=pp_, vpp=vpp_, ep=ep_, num_micro_batches=micro)


def scaled_model(model_spec: str, tp: int, num_layers: int = SCALED["num_layers"]) -> Any:
    """A small config of the same family and structure with `num_layers` layers (see the module
    docstring)."""
    from mplan.models.spec import resolve_model

    source = resolve_model(model_spec)
    config = source.config
    kv = getattr(config, "kv_heads", None) or getattr(config, "num_key_value_heads", None) or 1
    heads = getattr(config, "num_heads", None) or getattr(config, "num_attention_heads", None) or 1
    group = max(1, heads // kv)
    kv_small = tp if kv >= tp else kv
    step = math.lcm(kv_small, tp)
    q_small = max(kv_small * min(group, 2), tp)
    q_small = -(-q_small // step) * step
    hidden = q_small * 8
    if source.family in ("gpt", "llama", "moe"):
        fields = {**SCALED, "num_layers": num_layers, "num_heads": q_small, "hidden": hidden}
        if source.family != "gpt":
            fields.update(num_kv_heads=kv_small, ffn_hidden=2 * hidden)
        else:
            fields["ffn_hidden"] = 2 * hidden
        if source.family == "moe":
            fields.update(num_experts=SCALED_EXPERTS, top_k=min(config.top_k, 2),
                          shared_ffn=2 * hidden if config.shared_ffn else 0)
        return dataclasses.replace(config, **{k: v for k, v in fields.items() if hasattr(config, k)})
    if source.family == "hf":
        small = config.__class__.from_dict(config.to_dict())
        for key, value in (("num_hidden_layers", num_layers), ("hidden_size", hidden), ("intermediate_size", 2 * hidden),
                           ("num_attention_heads", q_small), ("num_key_value_heads", kv_small),
                           ("vocab_size", 64), ("max_position_embeddings", 32), ("head_dim", 8),
                           # Mixtral's and Qwen-MoE's experts, as the moe family's
                           ("moe_intermediate_size", 2 * hidden), ("shared_expert_intermediate_size", 2 * hidden),
                           ("num_local_experts", SCALED_EXPERTS), ("num_experts", SCALED_EXPERTS)):
            if hasattr(small, key):
                setattr(small, key, value)
        if hasattr(small, "num_experts_per_tok"):
            small.num_experts_per_tok = min(small.num_experts_per_tok, 2)
            # the float64 reference runs transformers' loop over the experts (its grouped_mm
            # default has no float64 kernel); the parallel run captures either as one op
            small._experts_implementation = "eager"
        small.use_cache = False
        return dataclasses.replace(source, config=small)
    return source


def _run(model_spec: str, plan_spec: str, world_size: int, steps: int, *, bisect: bool = False) -> VerifyReport:
    import functools

    import torch

    from mplan.api import autoparallel
    from mplan.models.spec import build_model

    layout = scaled_plan(plan_spec, world_size)
    spec = layout.spec
    config = scaled_model(model_spec, layout.tp, layout.num_layers)
    dp = world_size // (layout.tp * layout.pp)
    global_batch = layout.num_micro_batches * dp
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (global_batch, 16), generator=generator),
                torch.randint(0, 64, (global_batch, 16), generator=generator)) for _ in range(steps)]
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    model = perturbed(build_model(config, device="cpu", dtype=torch.float64, seed=0))
    if bisect:  # before autoparallel, whose whole parameters share the model's storage and then train
        from mplan.ir.trace import capture_for_training

        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        captured = capture_for_training(model, (batches[0][0],))
    pm = autoparallel(model, example_inputs=(batches[0][0],), optimizer=optimizer, global_batch=global_batch,
                      plan=spec, max_grad_norm=1.0)
    divergence, refused = _bisect(pm, batches[0], captured, weights) if bisect else (None, None)
    losses = tuple(pm.train_step(x, y) for x, y in batches)
    state = pm.full_state_dict()
    reference = perturbed(build_model(config, device="cpu", dtype=torch.float64, seed=0))
    ref_opt = optimizer(reference.parameters())
    ref_losses = []
    micro = global_batch // pm.plan.num_micro_batches // dp  # rows per micro-batch (mbs)
    for x, y in batches:
        ref_opt.zero_grad()
        total = 0.0
        for start in range(0, global_batch, micro):
            out = reference(x[start:start + micro], labels=y[start:start + micro])
            loss = (out if isinstance(out, torch.Tensor) else out.loss) * (micro / global_batch)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_losses.append(total)
    errors = {name: _rel(state[name], p.detach()) for name, p in reference.named_parameters() if name in state}
    worst = max(errors, key=errors.__getitem__)
    return VerifyReport(model=model_spec, scaled_model=str(config), plan=plan_spec, executed=pm.plan.describe(),
                        world_size=world_size, steps=steps, losses=losses, reference_losses=tuple(ref_losses),
                        max_loss_rel_err=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                        max_param_rel_err=errors[worst], worst_param=worst, seconds=0.0,
                        bisect=divergence, bisect_refused=refused)


def _bisect(pm: Any, batch: tuple[Any, Any], captured: Any, weights: dict[str, Any]) -> tuple[Any, str | None]:
    """`runtime.bisect` on the first micro-batch (every rank the same one), or why it cannot run."""
    from mplan.runtime.bisect import BisectRefused, bisect

    try:
        return bisect(pm, batch[0], batch[1], captured=captured, weights=weights), None
    except BisectRefused as refused:
        return None, str(refused)


def perturbed(model: Any, scale: float = 0.01) -> Any:
    """`model` with seeded noise added to every parameter (the same for the same model).

    Inits leave biases at exactly 0 and norm weights at 1. A parameter whose gradient is zero
    in exact arithmetic (a GPT key bias: softmax ignores a shift shared by all keys) then holds
    nothing but rounding noise amplified by Adam, and its relative error would be noise over
    noise; after the perturbation every parameter has a scale to be compared against."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def _rel(actual: Any, expected: Any) -> float:
    scale = float(expected.norm())
    error = float((actual - expected).norm())
    return error / scale if scale else error
