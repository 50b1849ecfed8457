"""One question, several cases: the command line every benchmark harness shares.

A harness is a package `benchmarks/<question>/` that answers one question (are the kernels faster
than their peers, does the price of a committed run still hold, ...). Its `__main__` hands
`main` its docstring and its cases; each case is a module of the package with

    add_arguments(parser)      the case's own flags (`--out` is the harness's)
    run(args) -> dict | None   the report: what it measured and against what, with the header of
                               `report.run_header` where it ran on a device; None on a rank of a
                               distributed case that does not report (rank 0 does)

and a docstring that says what it measures, how, and the command that made its cited results.
The harness writes the report where `--out` says and records the command that made it, so a
result names the harness and case that wrote it whatever the file is called; a case that refuses
its input (ValueError, OSError: a missing or malformed file, a bad value) ends in one line naming
the cause and exit status 2, writing nothing:

    PYTHONPATH=. python -m benchmarks.<question> <case> --out FILE [flags]
    PYTHONPATH=. python -m benchmarks.<question> <case> -h
"""
from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Any

from benchmarks.report import write_report


def add_device_flags(parser: argparse.ArgumentParser, small: bool = True) -> None:
    """The flags of a case that runs on a GPU: `--device` (cpu: its smoke mode) and, where the case
    has tiny shapes, `--small`."""
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the smoke mode")
    if small:
        parser.add_argument("--small", action="store_true", help="tiny shapes (with --device cpu: the smoke mode)")


def _summary(module: ModuleType) -> str:
    return (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""


def main(question: str, doc: str, cases: dict[str, ModuleType], argv: list[str] | None = None) -> int:
    """Parse `<case> --out FILE [flags]`, run that case and write its report with the command."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{question}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="case", required=True, metavar="CASE")
    for name, module in cases.items():
        case_parser = subparsers.add_parser(name, help=_summary(module), description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter)
        case_parser.add_argument("-o", "--out", required=True, help="where to write the JSON report")
        module.add_arguments(case_parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        report: dict[str, Any] | None = cases[args.case].run(args)
    except (ValueError, OSError) as bad:  # a missing or malformed input file, a bad flag value: one line
        print(f"{parser.prog} {args.case}: {bad}", file=sys.stderr)
        return 2
    if report is not None:
        write_report(args.out, {"harness": f"benchmarks.{question} {args.case}", "command": argv, **report})
    return 0
