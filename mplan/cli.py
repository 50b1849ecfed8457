"""The `mplan` command: each subcommand is a thin wrapper over a library function.

`--json` prints exactly one JSON document on stdout; progress and tables for people go to
stderr/stdout through rich. Errors a user can cause (unknown model, bad file) print one line
naming the cause and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence


def _inspect(args: argparse.Namespace) -> int:
    from mplan.ir.summary import capture_spec, summarize

    graph = capture_spec(args.model, batch=args.batch, seq_len=args.seq_len, shallow=args.shallow)
    doc = summarize(graph)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    _print_inspect(doc)
    return 0


def _print_inspect(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
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
    if doc["unknown_ops"]:
        console.print(f"[yellow]ops without a rule (replicated by the planner):[/] {doc['unknown_ops']}")


Command = Callable[[argparse.Namespace], int]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mplan", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="the captured graph: parameters, FLOPs, repeated blocks")
    p.add_argument("model", help="preset, family:k=v,..., config.json path or package.module:factory")
    p.add_argument("--batch", type=int, default=1, help="batch size traced (sequences)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--shallow", action="store_true",
                   help="trace two instances of each repeated block and scale (fast for deep models)")
    p.add_argument("--json", action="store_true", help="print one JSON document and nothing else")
    p.set_defaults(func=_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    func: Command = args.func
    try:
        return func(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"mplan {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a library error type with a message meant for users
        if type(exc).__name__.endswith("Error") and type(exc).__module__.startswith("mplan"):
            print(f"mplan {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise
