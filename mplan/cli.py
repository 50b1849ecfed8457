"""The `mplan` command: each subcommand is a thin wrapper over a library function.

`--json` prints exactly one JSON document on stdout; progress and tables for people go to
stderr/stdout through rich. Errors a user can cause (unknown model, bad file) print one line
naming the cause and exit with status 2.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
from typing import Any, Callable, NoReturn, Sequence

from mplan.cost_models.rates import flops_rate, percent
from mplan.planner.parallel_config import DEFAULT_RUNTIME, RUNTIMES
from mplan.progress import Progress
from mplan.refusal import ArgumentParser, is_refusal, report


PIPED_WIDTH = 400
"""Columns a table may take when stdout is no terminal (a file, a pipe, a CI log): wide enough
that no value is cut ("sta…"); a terminal's own width holds otherwise."""


def _console() -> Any:
    """rich's Console for stdout: the terminal's width, or PIPED_WIDTH when piped (rich would
    assume 80 columns and cut values to fit)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=PIPED_WIDTH)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1, refused with one line naming what was given (a zero
    batch would reach a division, a negative one a micro-batch count, after a capture)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def at_least_one(text: str) -> float:
    """An argparse type: a finite number >= 1.0 (a load factor over the mean)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 1.0, got {text!r}") from None
    if not 1.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 1.0, got {text}")
    return value


def _inspect(args: argparse.Namespace) -> int:
    from mplan.planner.planning import capture_spec
    from mplan.summary import summarize

    graph = capture_spec(args.model, batch=args.batch, seq_len=args.seq_len, shallow=args.shallow)
    doc = summarize(graph)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    _print_inspect(doc)
    return 0


def _print_inspect(doc: dict[str, Any]) -> None:
    from rich.table import Table

    console = _console()
    console.print(f"[bold]{doc['model']}[/]: {doc['num_parameters']:,} parameters, "
                  f"{doc['num_layers']} layers, batch {doc['batch_size']} x seq {doc['seq_len']}")
    fpt = doc["flops_per_token"]
    console.print(f"model FLOPs per token: forward {fpt['forward'] / 1e9:.3f} GFLOP, "
                  f"training {fpt['training'] / 1e9:.3f} GFLOP; captured in "
                  f"{doc['capture_seconds']:.2f} s ({'shallow' if doc['shallow'] else 'full'})")
    blocks = Table(title="repeated blocks")
    for col in ("block type", "container", "instances", "ops", "params/instance", "GFLOP/instance",
                "saved MiB/instance"):
        blocks.add_column(col, justify="right" if col not in ("block type", "container") else "left")
    for b in doc["block_types"]:
        blocks.add_row(b["name"], b["container"], str(b["instances"]), str(b["num_ops"]),
                       f"{b['params_per_instance']:,}", f"{b['forward_flops_per_instance'] / 1e9:.3f}",
                       f"{b['saved_bytes_per_instance'] / 2**20:.2f}")
    console.print(blocks)
    if "block_ops" in doc:
        ops = Table(title=f"ops of {doc['block_ops']['instance']} ({doc['block_ops']['block_type']})")
        for col in ("op", "kind", "output", "MFLOP", "MiB moved", "MiB saved", "params"):
            ops.add_column(col)
        for r in doc["block_ops"]["ops"]:
            ops.add_row(r["op"].removeprefix("aten.") + ("" if r["known"] else " (unknown)"),
                        r["kind"], r["output"], f"{r['flops'] / 1e6:.2f}", f"{r['bytes'] / 2**20:.2f}",
                        f"{r['saved_bytes'] / 2**20:.2f}", ", ".join(p.rsplit(".", 2)[-2] + "." +
                                                                   p.rsplit(".", 1)[-1] for p in r["params"]))
        console.print(ops)
    if doc.get("fusion"):
        _print_fusion(console, doc["fusion"])
    if doc.get("moe_layers"):
        m = doc["moe_layers"][0]
        capacity = "dropless" if m["capacity_factor"] is None else f"capacity {m['capacity_factor']:g}"
        console.print(
            f"MoE layers: {len(doc['moe_layers'])}, each one `moe_experts` op: {m['num_experts']} experts of ffn "
            f"{m['ffn']}, top-{m['top_k']}, {m['activation']}{' gated' if m['gated'] else ''}, {capacity}; router: "
            f"{m['routing']}; shared expert: "
            f"{'yes' if m['shared_expert'] else 'no'}; auxiliary loss: {'yes' if m['aux_loss'] else 'no'}")
    if doc.get("moe_declined"):
        _print_declined_experts(console, doc["moe_declined"])
    if doc["unknown_ops"]:
        console.print(f"[yellow]ops without a rule (replicated by the planner):[/] {doc['unknown_ops']}")


def _print_declined_experts(console: Any, declined: list[dict[str, str]]) -> None:
    """One line per reason: experts modules that stay plain ATen ops (replicated, exact), and why."""
    by_why: dict[str, list[str]] = {}
    for d in declined:
        by_why.setdefault(d["why"], []).append(d["module"])
    for why, modules in by_why.items():
        where = modules[0] + (f" and {len(modules) - 1} more" if len(modules) > 1 else "")
        console.print(f"[yellow]MoE experts not recognized[/] ({where}), left as plain ATen ops (replicated, "
                      f"computed as written, no expert parallelism): {why}", markup=True, highlight=False)


def _print_fusion(console: Any, coverage: list[dict[str, Any]]) -> None:
    """Per block type, the kernels its chains fuse into; then the memory-bound ops left, the
    most bytes first (what a GPU run's `fuse_kernels` does; `--no-kernels` keeps ATen ops)."""
    from rich.table import Table

    console.print("[bold]fusion[/] (one instance of each block type):")
    for c in coverage:
        fused = ", ".join(f"{f['kernel']} x{f['count']}" for f in c["fused"]) or "nothing"
        left = f"{len(c['left'])} kinds of memory-bound op left, {c['left_bytes'] / 2**20:.1f} MiB" if c["left"] else \
            "no memory-bound op left"
        console.print(f"  {c['block_type']} x{c['instances']}: {fused}; {left}")
        for miss in c.get("skipped", ()):
            console.print(f"    {miss['kernel']} missed x{miss['count']}: {miss['why']}")
    rows = [(c["block_type"], op) for c in coverage for op in c["left"]]
    if rows:
        table = Table(title="memory-bound ops left unfused")
        for col in ("block type", "op", "count", "MiB moved", "why"):
            table.add_column(col, justify="right" if col in ("count", "MiB moved") else "left")
        for block, op in sorted(rows, key=lambda row: -row[1]["bytes"]):
            table.add_row(block, op["op"].removeprefix("aten."), str(op["count"]), f"{op['bytes'] / 2**20:.1f}",
                          op["why"])
        console.print(table)


def _cluster(args: argparse.Namespace):  # noqa: ANN202 - ClusterSpec
    from mplan.cost_models.cluster import ClusterSpec

    if args.cluster.endswith(".json"):
        cluster = ClusterSpec.from_json(args.cluster)
        _say_completion(cluster, args.cluster)
    else:
        cluster = ClusterSpec.preset(args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    if args.sites is None:
        return cluster  # a file's own sites, or a preset's one
    return cluster.with_sites(args.sites, inter_site_gbps=args.inter_site_gbps,
                              inter_site_latency_ms=args.inter_site_latency_ms)


def _progress(args: argparse.Namespace) -> Progress:
    """Phases and news on stderr (`mplan.progress`): a live line on a terminal, one line per phase
    in a log, nothing with -q; stdout stays the command's own (`--json`: one document)."""
    return Progress("quiet" if args.quiet else "auto")


def _plan(args: argparse.Namespace) -> int:
    from mplan.planner.planning import plan

    _check_vocab(args)
    if args.documents is not None:  # a directory that is no prepared shards: refused before the capture
        from mplan.train.packing_advice import check_documents

        check_documents(args.documents)
    cluster = _cluster(args)
    made = plan(args.model, cluster=cluster, global_batch=args.global_batch, spec=args.spec,
                seq_len=args.seq_len, allow_cross_node_tp=args.allow_cross_node_tp, kernels=args.kernels,
                fp8=args.fp8, runtime=args.runtime, moe_imbalance=args.moe_imbalance, progress=_progress(args),
                inexact_ok=args.allow_inexact)
    if args.output:
        made.save(args.output)
    if args.json:
        print(made.to_json())
        _print_documents(args, made, cluster, file=sys.stderr)  # stdout holds the Plan JSON alone
        return 0

    from mplan.planner.explain import render

    render(made, _console())
    if args.output:
        print(f"plan written to {args.output}; planning took {made.planner.get('total_seconds', 0):.2f} s")
    _print_documents(args, made, cluster, file=sys.stdout)
    return 0


def _print_documents(args: argparse.Namespace, made: Any, cluster: Any, *, file: Any) -> None:
    """`--documents TOKENS`: the data's mix of lengths priced for the plan's cp (`mplan.train.packing_advice`)."""
    if args.documents is None:
        return
    from mplan.models.spec import resolve_model
    from mplan.train.packing_advice import documents_section

    source = resolve_model(args.model, seq_len=args.seq_len, vocab=args.vocab)
    print("\n".join(documents_section(args.documents, made, source, cluster)), file=file)


def _explain(args: argparse.Namespace) -> int:
    from mplan.planner.explain import explain_data, render
    from mplan.planner.gantt import draw_gantt
    from mplan.planner.plan import Plan

    loaded = Plan.load(args.plan)
    if args.gantt:
        draw_gantt(loaded, args.gantt)
    if args.json:
        print(json.dumps(explain_data(loaded), indent=1))
        return 0

    render(loaded, _console())
    if args.gantt:
        print(f"Gantt chart written to {args.gantt}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from mplan.bench import bench_plans, rankings, write_csv

    progress = _progress(args)
    reports = int(os.environ.get("RANK", "0")) == 0  # under torchrun (--measure) every rank runs the plans

    cluster = _cluster(args)

    def document(rows: list[dict[str, Any]]) -> dict[str, Any]:
        # `figures`: what every predicted figure rests on (measured, datasheet, completed, nominal)
        return {"plans": rows, "figures": cluster.figures, **({"ranking": rankings(rows)} if args.measure else {})}

    def write_so_far(rows: list[dict[str, Any]]) -> None:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(document(rows), f, indent=1)

    _check_vocab(args)
    with progress.phase("bench", f"{len(args.plans)} plan{'s' if len(args.plans) > 1 else ''}"
                                 f"{', measured' if args.measure else ''}"):
        rows = bench_plans(args.model, cluster, args.global_batch, args.plans, seq_len=args.seq_len,
                           vocab=args.vocab,
                           measure=args.measure, profile=args.profile, moe_imbalance=args.moe_imbalance,
                           progress=progress,
                           on_row=write_so_far if args.out and reports else None)
    if not reports:
        return 0
    if args.csv:
        write_csv(rows, args.csv)
    if args.json:
        print(json.dumps(document(rows), indent=1))
        return 0
    _print_bench(rows, cluster.figures)
    if args.measure:
        order = rankings(rows)
        print(f"fastest first, predicted: {' < '.join(order['predicted'])}")
        print(f"fastest first, measured:  {' < '.join(order['measured'])}")
    return 0


def _print_bench(rows: list[dict[str, Any]], figures: str) -> None:
    from rich.markup import escape
    from rich.table import Table

    from mplan.planner.explain import PREDICTION_BASIS

    table = Table(title="plans side by side, priced for mplan's runtime (predicted unless marked measured): "
                        + escape(PREDICTION_BASIS.get(figures, PREDICTION_BASIS["unrecorded"])))
    for col in ("plan", "mesh dp/tp/pp/vpp/ep/cp", "fits", "step ms", "FLOP/s per device", "MFU", "memory GiB",
                "all-to-all", "measured ms", "note"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["spec"], *_bench_cells(r), _measured_ms(r.get("measured")), r["error"] or "")
        without = r.get("without_ep")
        if without is not None:  # what expert parallelism buys: the best plan of the same spec with ep=1
            note = without["error"] or f"{without['slower']:+.1%} step vs the plan above"
            table.add_row("  best with ep=1", *_bench_cells(without), "-", note)
    _console().print(table)


def _bench_cells(row: dict[str, Any]) -> list[str]:
    """Mesh, fits and predicted figures of a bench row (or of its `without_ep` entry)."""
    p, mesh = row["predicted"] or {}, row["mesh"] or {}
    a2a = f"{p['a2a_s'] * 1e3:.0f} ms ({p['a2a_s'] / p['step_time_s']:.1%})" if p.get("a2a_s") else "-"
    sites = f" sites={mesh['sites']}" if mesh.get("sites", 1) > 1 else ""
    return ["/".join(str(mesh.get(k, "-")) for k in ("dp", "tp", "pp", "vpp", "ep", "cp")) + sites,
            "yes" if row["fits"] else "no",
            f"{p['step_time_s'] * 1e3:.1f}" if p else "-", flops_rate(p["tflops_per_gpu"] * 1e12) if p else "-",
            percent(p["mfu"]) if p else "-", f"{p['memory_gib']:.1f}" if p else "-", a2a]


def _measured_ms(measured: dict[str, Any] | None) -> str:
    if not measured:
        return "-"
    return f"{measured['step_time_s'] * 1e3:.1f}" if "step_time_s" in measured else f"not run: {measured['error']}"


def _profile(args: argparse.Namespace) -> int:
    from mplan.cost_models.profile_cluster import profile_cluster
    from mplan.runtime.launch import init_distributed_from_env

    progress = _progress(args)
    with progress.phase("profile", "kernels" + ("" if args.no_links else " and links")):
        world = init_distributed_from_env()
        cluster = profile_cluster(args.output, world, quick=args.quick, links=not args.no_links, progress=progress)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # every rank measured; rank 0 reports
    cluster = _calibrate_host(cluster, args, alone=world is None or world.size() == 1, progress=progress)
    if args.json:
        print(json.dumps(cluster.to_dict(), indent=1))
    elif args.output:
        print(f"cluster profile written to {args.output}")
    _say_completion(cluster, args.output or "the profile")
    return 0


def _calibrate_host(cluster: Any, args: argparse.Namespace, *, alone: bool, progress: Any) -> Any:
    """On a GPU, in a one-process profile: mplan's runtime host factor measured (`host_calibration`)
    and written into the profile's host figures (and `--output`); elsewhere the profile keeps the
    planner's constant, and a multi-rank profile says so."""
    import dataclasses

    host = cluster.profile.device.host if cluster.profile is not None and cluster.profile.device else None
    if host is None or not host.overlaps or args.no_runtime_host:
        return cluster
    if not alone:
        print("mplan: the runtime's host factor is measured by a one-process `mplan profile` only; this profile "
              "keeps the planner's constant (planner/host_cost.py)", file=sys.stderr)
        return cluster
    from mplan.host_calibration import calibrate

    with progress.phase("runtime host", "a host-bound Llama trained through mplan, its step fitted"):
        result = calibrate(cluster)
    print(f"mplan: runtime host factor: {result.why}", file=sys.stderr)
    if result.factor is None:
        return cluster
    device = dataclasses.replace(cluster.profile.device, host=dataclasses.replace(host, runtime_factor=result.factor))
    cluster = cluster.with_profile(dataclasses.replace(cluster.profile, device=device))
    if args.output:
        cluster.to_json(args.output)
    return cluster


def _say_completion(cluster: Any, file: str) -> None:
    """On stderr, whatever `--json` says: a cluster file whose kernel tables are too thin to price
    a model (`mplan profile --quick`'s) is completed from the datasheet; every plan made with it
    says so too (`ClusterSpec.figures`)."""
    from mplan.cost_models.profile import completion_note

    device = cluster.profile.device if cluster.profile is not None else None
    note = completion_note(device) if device is not None else None
    if note is not None:
        print(f"mplan: {file}: {note}", file=sys.stderr)


def _check_vocab(args: argparse.Namespace) -> None:
    """--vocab gives a factory module's vocabulary; where the model states another, one line says so."""
    if args.vocab is not None:
        from mplan.models.spec import resolve_model

        resolve_model(args.model, seq_len=args.seq_len, vocab=args.vocab)


def _verify(args: argparse.Namespace) -> int:
    from mplan.verify import verify_plan

    model, plan = args.target, args.plan
    if args.target.endswith(".json"):
        from mplan.planner.plan import Plan

        model, plan = Plan.load(args.target).model.name, args.target
    _check_verify(model, plan, args.world_size)
    progress = _progress(args)
    with progress.phase("verify", f"{plan} scaled down on {args.world_size} CPU ranks and on one process"):
        report = verify_plan(model, plan, args.world_size, steps=args.steps, bisect=args.bisect)
    doc = {"model": report.model, "scaled_model": report.scaled_model, "plan": report.plan,
           "executed": report.executed, "world_size": report.world_size, "steps": report.steps,
           "losses": list(report.losses), "reference_losses": list(report.reference_losses),
           "max_loss_rel_err": report.max_loss_rel_err, "max_param_rel_err": report.max_param_rel_err,
           "worst_param": report.worst_param, "passed": report.passed, "seconds": round(report.seconds, 2)}
    if args.bisect:
        doc["bisect"] = report.bisect.to_dict() if report.bisect else {"refused": report.bisect_refused}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"{report.executed} on {report.world_size} gloo ranks ({report.scaled_model}), {report.steps} steps: "
              f"largest relative difference from one process: loss {report.max_loss_rel_err:.2e}, "
              f"parameters {report.max_param_rel_err:.2e} ({report.worst_param}) -> "
              f"{'PASS' if report.passed else 'FAIL'}")
        if args.bisect:
            print(report.bisect.describe() if report.bisect else f"bisect: not run: {report.bisect_refused}")
    return 0 if report.passed else 1


def _check_verify(model: str, plan: str, world_size: int) -> None:
    """What `verify` would refuse once its ranks have started and captured, refused before it starts
    them: the model spec, the plan spec (or plan file) and experts asked of a model without them."""
    from mplan.models.spec import resolve_model, stated_shape
    from mplan.planner.parallel_config import PlanSpecError, parse_plan_spec
    from mplan.planner.plan import Plan
    from mplan.planner.spec_check import experts_refusal
    from mplan.verify import scaled_plan

    source = resolve_model(model)
    scaled_plan(plan, world_size)  # parses the spec or reads the plan file, as each rank will
    asked = Plan.load(plan).spec() if plan.strip().endswith(".json") else plan
    reason = experts_refusal(parse_plan_spec(asked), f"plan spec {asked!r}", source.name,
                             stated_shape(source.config, source.name).num_experts)
    if reason:
        raise PlanSpecError(reason)


def _checkpoint_inspect(args: argparse.Namespace) -> int:
    from mplan.runtime.inspect_checkpoint import describe_checkpoint

    doc = describe_checkpoint(args.directory)
    if args.json:
        print(json.dumps(doc, indent=1))
    elif doc["format"] == "huggingface":
        _print_hf_checkpoint(doc)
    else:
        _print_checkpoint(doc)
    return 0


def _print_checkpoint(doc: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    totals = doc["totals"]
    console.print(f"[bold]{escape(doc['path'])}[/]: {doc['format']} version {doc['version']}, step {doc['step']}, "
                  f"saved {doc['saved_at']}")
    files = f"{len(doc['files'])} file{'s' if len(doc['files']) != 1 else ''}"
    console.print(f"model {escape(doc['model'])}: {totals['num_parameters']:,} parameters "
                  f"({_size(totals['parameter_bytes'])}), optimizer state {_size(totals['optimizer_state_bytes'])}, "
                  f"{_size(totals['stored_bytes'])} on disk in {files}")
    plan = doc["plan"]
    mesh = "" if plan is None else " ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    console.print(f"plan: {'converted (no plan)' if plan is None else escape(plan['spec'])}"
                  f"{f' (mesh {mesh})' if mesh else ''}, saved by {doc['world_size']} "
                  f"rank{'s' if doc['world_size'] != 1 else ''}")
    optimizer = doc["optimizer"] or {"class": "", "param_groups": []}
    if not optimizer["param_groups"]:
        console.print(f"optimizer {escape(optimizer['class']) or 'state'}: none saved (weights only)")
    for k, group in enumerate(optimizer["param_groups"]):
        hyper = ", ".join(f"{key}={value}" for key, value in group.items())
        console.print(f"optimizer {escape(optimizer['class'])}"
                      f"{f' group {k}' if len(optimizer['param_groups']) > 1 else ''}: {escape(hyper)}")
    console.print(f"extras: {escape(', '.join(doc['extras'])) if doc['extras'] else 'none'}")
    table = Table(title="tensors")
    for col in ("tensor", "dtype", "shape", "bytes", "chunks", "on disk"):
        table.add_column(col, justify="right" if col in ("bytes", "chunks", "on disk") else "left")
    for t in doc["tensors"]:
        name = t["name"] + (f" (= {', '.join(t['aliases'])})" if t.get("aliases") else "")
        table.add_row(escape(name), t["dtype"], str(tuple(t["shape"])), f"{t['bytes']:,}", str(t["chunks"]),
                      f"{t['stored_bytes']:,}")
    console.print(table)
    if doc["root"] is not None:
        steps = ", ".join(str(s) for s in doc["committed_steps"]) or "none"
        latest = f" (latest: {escape(doc['latest'])})" if doc["latest"] else ""
        console.print(f"committed steps under {escape(doc['root'])}: {steps}{latest}")


def _print_hf_checkpoint(doc: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    totals = doc["totals"]
    what = ", ".join(doc["architectures"] or []) or doc["model_type"] or "architecture not stated"
    dtype = f" (config dtype {escape(doc['config_dtype'])})" if doc["config_dtype"] else ""
    console.print(f"[bold]{escape(doc['path'])}[/]: Hugging Face model directory, {escape(what)}{dtype}")
    files = f"{len(doc['files'])} safetensors file{'s' if len(doc['files']) != 1 else ''}"
    console.print(f"{totals['num_parameters']:,} parameters in {totals['num_tensors']} tensors "
                  f"({_size(totals['bytes'])}), {_size(totals['stored_bytes'])} on disk in {files}"
                  f"{' (sharded, with an index)' if doc['sharded'] else ''}")
    table = Table(title="tensors")
    for col in ("tensor", "dtype", "shape", "bytes", "file"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for t in doc["tensors"]:
        table.add_row(escape(t["name"]), t["dtype"], str(tuple(t["shape"])), f"{t['bytes']:,}", escape(t["file"]))
    console.print(table)


def _size(num_bytes: int) -> str:
    """Bytes as a person reads them: the largest binary unit in which the figure is at least 1."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def _checkpoint_convert(args: argparse.Namespace) -> int:
    from mplan.runtime.hf_checkpoint import convert_checkpoint  # safetensors, only when asked

    progress = _progress(args)
    with progress.phase("convert", f"{args.src} -> {args.dst}"):
        written = convert_checkpoint(args.src, args.dst)
    print(f"converted {args.src} -> {written}")
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from mplan.data.prepare_command import run  # tokenizers, only when asked

    return run(args, _progress(args))


def _train(args: argparse.Namespace) -> int:
    from mplan.train.config import load_config
    from mplan.train.run import train  # the data package and tokenizers, only when asked

    overrides = list(args.set) + ([f"metrics.profile_steps={args.profile_steps}"] if args.profile_steps else [])
    summary = train(load_config(args.config, overrides), progress=_progress(args))
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        loss = "" if summary.final_loss is None else f", loss {summary.final_loss:.4f}"
        where = "".join(f"; {what} {path}" for what, path in (("checkpoint", summary.checkpoint),
                        ("Hugging Face export", summary.exported), ("metrics", summary.metrics),
                        ("loss curve", summary.plot)) if path)
        print(f"mplan train: steps {summary.first_step} -> {summary.last_step} under {summary.plan}{loss}{where}")
    return 0


Command = Callable[[argparse.Namespace], int]


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="mplan", description=__doc__.splitlines()[0])  # usage errors: rank 0
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="the captured graph: parameters, FLOPs, repeated blocks")
    p.add_argument("model", help="preset, family:k=v,..., config.json path or package.module:factory")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size traced (sequences)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--shallow", action="store_true",
                   help="trace two instances of each repeated block and scale (fast for deep models)")
    p.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    p.set_defaults(func=_inspect)

    def quiet_arg(q: argparse.ArgumentParser) -> None:
        q.add_argument("-q", "--quiet", action="store_true",
                       help="no progress on stderr (default: a live line on a terminal, one line per phase in a log)")

    def cluster_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--cluster", default="dgx-h100",
                       help="preset (dgx-a100, dgx-h100, dgx-h200, h200, cpu) or a cluster JSON file")
        q.add_argument("--nodes", type=positive_int, default=1, help="nodes of the preset")
        q.add_argument("--gpus-per-node", type=positive_int, default=None, help="override the preset's GPUs per node")
        q.add_argument("--sites", type=positive_int, default=None,
                       help="data centers the --nodes are split among (default: the file's, or one); TP, EP and CP "
                            "stay inside a site, DP may run hierarchically across")
        q.add_argument("--inter-site-gbps", type=float, default=0.0,
                       help="the long-haul link between sites, Gb/s per direction, a site's whole share")
        q.add_argument("--inter-site-latency-ms", type=float, default=0.0, help="its one-way latency, ms")
        q.add_argument("--global-batch", type=positive_int, required=True, help="sequences per optimizer step")
        q.add_argument("--seq-len", type=positive_int, default=None,
                       help="sequence length (default: the model's; the plan says which it used)")
        q.add_argument("--vocab", type=positive_int, default=None,
                       help="vocabulary of a package.module:factory model whose module states none (the token ids "
                            "bench --measure draws); refused where the model states another")

    p = sub.add_parser("plan", help="search the fastest plan that fits and explain it")
    p.add_argument("model", help="preset, family:k=v,..., config.json path or package.module:factory")
    cluster_args(p)
    p.add_argument("--spec", default="auto", help="fix some choices, e.g. tp=8,pp=4 (others searched)")
    p.add_argument("--allow-cross-node-tp", action="store_true", help="let tensor parallelism span nodes")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="price memory-bound chains as mplan's fused kernels (default: on for GPU clusters)")
    p.add_argument("--fp8", action="store_true", help="a plan whose block linears run as FP8 GEMMs, priced so")
    p.add_argument("--allow-inexact", action="store_true",
                   help="across sites, also try an outer loop (outer_steps=H, DiLoCo-style): sites train alone "
                        "between outer steps, which is not the single-device loop's arithmetic")
    p.add_argument("--runtime", choices=RUNTIMES, default=DEFAULT_RUNTIME,
                   help="whose runtime to price (default %(default)s, the one that runs the plan, as bench "
                        "and autoparallel price it): mplan's (bf16 in place at zero=0, fp32 master shards at "
                        "zero=1) or Megatron-LM's (fp32 masters, gradients and moments at any zero)")
    p.add_argument("--moe-imbalance", type=at_least_one, default=1.0,
                   help="MoE models: the busiest expert-parallel rank's token load over the mean (1.0: uniform)")
    p.add_argument("--documents", default=None, metavar="TOKENS",
                   help="prepared token shards: price their mix of lengths under the plan's cp (predicted)")
    p.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan JSON and nothing else")
    quiet_arg(p)
    p.set_defaults(func=_plan)

    p = sub.add_parser("explain", help="why a plan won: stages, memory, time, per-op sharding, alternatives")
    p.add_argument("plan", help="a plan JSON file")
    p.add_argument("--gantt", default=None, help="draw the simulated schedule to this PNG")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p.set_defaults(func=_explain)

    p = sub.add_parser("bench", help="compare plans side by side")
    p.add_argument("model", help="preset, family:k=v,..., config.json path or package.module:factory")
    cluster_args(p)
    p.add_argument("--plans", nargs="+", default=["auto"], help="plan specs: auto, tp=8,pp=4, dp=64, ...")
    p.add_argument("--measure", action="store_true", help="also run each plan for real on this machine's ranks")
    p.add_argument("--profile", action="store_true",
                   help="with --measure on GPUs: one more step under the profiler, its kernel time by kind")
    p.add_argument("--moe-imbalance", type=at_least_one, default=1.0,
                   help="MoE models: the busiest expert-parallel rank's token load over the mean (1.0: uniform)")
    p.add_argument("--csv", default=None, help="also write the table as CSV")
    p.add_argument("--out", default=None, help="also write the rows as JSON here, rewritten after each plan")
    p.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    quiet_arg(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser("profile", help="measure this machine's kernels and links (run under torchrun on every rank)")
    p.add_argument("-o", "--output", default="cluster.json", help="cluster file to write (rank 0)")
    p.add_argument("--quick", action="store_true", help="a small grid: seconds, for a smoke test")
    p.add_argument("--no-links", action="store_true", help="time the device only")
    p.add_argument("--no-runtime-host", action="store_true",
                   help="skip training a small model through mplan to measure its runtime's host time per op (GPU)")
    p.add_argument("--json", action="store_true", help="print the cluster file and nothing else")
    quiet_arg(p)
    p.set_defaults(func=_profile)

    p = sub.add_parser("verify", help="run a plan scaled down on CPU ranks, compare with one device")
    p.add_argument("target", help="a plan.json, or a model spec (then --plan gives the plan)")
    p.add_argument("--plan", default="tp=2,dp=2,sp=1,zero=1", help="plan spec string or plan.json")
    p.add_argument("--world-size", type=positive_int, default=4, help="gloo CPU ranks to start")
    p.add_argument("--steps", type=positive_int, default=3, help="optimizer steps to compare")
    p.add_argument("--bisect", action="store_true",
                   help="also compare one micro-batch op by op: name the first op whose value or gradient differs")
    p.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    quiet_arg(p)
    p.set_defaults(func=_verify)

    p = sub.add_parser("checkpoint", help="inspect or convert a checkpoint (mplan's or a Hugging Face directory)")
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("inspect", help="plan, step, tensors and sizes of a checkpoint, from its metadata alone")
    q.add_argument("directory", help="a checkpoint root (its latest step), one step-N directory, or a Hugging Face "
                                     "model directory (config.json + safetensors)")
    q.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    q.set_defaults(func=_checkpoint_inspect)
    q = actions.add_parser("convert", help="an mplan checkpoint to a Hugging Face directory (safetensors), or back")
    q.add_argument("src", help="an mplan checkpoint (root or step-N directory) or a Hugging Face model directory")
    q.add_argument("dst", help="the directory to write, in the other format")
    quiet_arg(q)
    q.set_defaults(func=_checkpoint_convert)

    from mplan.data.prepare_command import add_arguments as data_prepare_args

    p = sub.add_parser("data", help="real training data: text to memory-mapped token shards")
    actions = p.add_subparsers(dest="action", required=True)
    q = actions.add_parser("prepare", help="tokenize text files (globs) or JSONL into token shards + tokenizer.json")
    data_prepare_args(q)
    quiet_arg(q)
    q.set_defaults(func=_data_prepare)

    p = sub.add_parser("train", help="a whole training run from one config: data, plan, checkpoints, metrics "
                                     "(every rank, under torchrun)")
    p.add_argument("config", help="the run's TOML file (docs/training.md lists every key)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set train.steps=100 (repeatable)")
    p.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="a torch profiler trace of steps A to B-1 (metrics.profile_steps)")
    quiet_arg(p)
    p.set_defaults(func=_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; `argv` None: the process's own arguments, as the `mplan` program (which
    then ends without tearing the interpreter down, `_exit_without_teardown`)."""
    args = _parser().parse_args(argv)
    func: Command = args.func
    try:
        status = func(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        status = report(exc, prog=f"mplan {args.command}", hint=False)  # one line, rank 0 only
    except Exception as exc:  # a library error type with a message meant for users
        if not is_refusal(exc):
            raise
        status = report(exc, prog=f"mplan {args.command}", hint=False)
    if argv is None and (args.command in ("plan", "inspect", "explain") or
                         (args.command == "bench" and not args.measure) or
                         (args.command == "checkpoint" and args.action == "inspect")):
        _exit_without_teardown(status)
    return status


def _exit_without_teardown(status: int) -> NoReturn:
    """End the `mplan` program once a command that ran in this process alone is done: its output
    flushed and the exit handlers run (log handlers, file locks, torch's), but without the
    interpreter's teardown, which frees torch's, sympy's and the exporter's module graphs object by
    object: 1.2-1.4 s of a `mplan plan` run on the 2-core machine (0.7 s after `import torch`
    alone), a tenth of the time the issue allows a plan. Not for commands that start processes
    or process groups (profile, verify, bench --measure), and only where no other thread runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    if threading.active_count() > 1:
        sys.exit(status)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
