"""`mplan data prepare`: the command's body, so `mplan/cli.py` only declares its arguments.

    mplan data prepare 'texts/**/*.txt' -o tokens/ [--tokenizer DIR] [--vocab-size N] [--jsonl FILE]
        [--exclude PATTERN ...] [--shard-tokens N] [--json] [-q]

Prints what was written (files, documents, tokens, shards, the fingerprint) on stdout, or with
`--json` the summary `prepare` returns as one JSON document; progress goes to stderr. A refusal
(no file matched, a non-empty output directory, a bad JSONL line, parquet without pyarrow) is a
`DataError`, reported by the command as one line.
"""
from __future__ import annotations

import argparse
import json

from mplan.data.shards import DEFAULT_SHARD_TOKENS, prepare
from mplan.data.tokenizer import DEFAULT_VOCAB_SIZE
from mplan.progress import Progress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `prepare` subcommand's arguments (one flag per line, each with its help)."""
    parser.add_argument("inputs", nargs="*", help="text files or glob patterns (quote them: 'texts/**/*.txt'); "
                                                  "each file is one document; a .jsonl file: one per line; a "
                                                  ".parquet file: one per row of its 'text' column (with pyarrow)")
    parser.add_argument("-o", "--output", required=True, help="directory to write (new or empty)")
    parser.add_argument("--tokenizer", default=None,
                        help="a local Hugging Face tokenizer directory or tokenizer.json (default: train a "
                             "byte-level BPE on the inputs)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="vocabulary of the trained tokenizer (default %(default)s)")
    parser.add_argument("--jsonl", action="append", default=[],
                        help="a JSONL dataset, its 'text' field one document per line (repeatable)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="leave out paths matching this pattern (fnmatch on the whole path, e.g. "
                             "'*/site-packages/*'; repeatable)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help="close a shard after the document that takes it past this many tokens")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON document")


def run(args: argparse.Namespace, progress: Progress) -> int:
    """Prepare the shards and report them; 0 on success (refusals raise DataError)."""
    inputs = list(args.inputs) + list(args.jsonl)
    with progress.phase("prepare", args.output) as phase:
        summary = prepare(inputs, args.output, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                          shard_tokens=args.shard_tokens, exclude=args.exclude, progress=progress)
        phase.detail = (f"{summary['num_documents']} documents, {summary['num_tokens']} tokens in "
                        f"{summary['num_shards']} shard(s)")
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"wrote {summary['directory']}: {summary['num_tokens']} tokens ({summary['dtype']}) of "
          f"{summary['num_documents']} documents from {summary['num_files']} files in {summary['num_shards']} "
          f"shard(s), vocab {summary['vocab_size']} (tokenizer: {summary['tokenizer']}), eos id {summary['eos_id']}")
    if summary["skipped"]:
        print(f"skipped {len(summary['skipped'])} file(s) that are not UTF-8 text, e.g. {summary['skipped'][0]}")
    print(f"fingerprint {summary['fingerprint']}")
    return 0
