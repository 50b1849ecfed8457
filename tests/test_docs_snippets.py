"""Every fenced code block of README.md and docs/*.md is checked against today's mplan (issue 20),
so the docs cannot drift from the CLI and the API again.

- Command lines (`mplan ...`, `python -m mplan ...`, `torchrun ... -m mplan ...`): every variant
  of a line (its bracketed options all out, all in, and each alternative of an `a | b` or `a|b`)
  parses under mplan's own parser with its placeholders (MODEL, B, plan.json, ...) filled in by
  PLACEHOLDERS. One variant of each line in RUN then runs for real, in-process, in an empty
  directory holding a plan.json and a cluster.json; every other line is in PARSE_ONLY, with why.
  Other programs (bash, pytest, torchrun of a script) are parse-only too: their files must
  exist and a script must accept the flags the line gives it.
- Python blocks: each is in PYTHON_BLOCKS, which runs it (in-process, in a fresh namespace and an
  empty directory, after a prelude that supplies the names the block takes as given: `model`,
  `ids`, ...), compares a signature block with the real function, or only parses it, with why.
  Substitutions are listed per block and each must still occur in it.
- JSON blocks: a complete cluster, profile or plan file is loaded with the project's reader; any
  other JSON block must be listed in JSON_FRAGMENTS and is loaded as JSON only.
- Any other block (program output, a diagram) is listed in TEXT_BLOCKS, with what it shows.

A block or a command line that none of these tables names fails
`test_every_code_block_and_command_line_is_classified`, and so does an entry naming nothing.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))

# ---------------------------------------------------------------------------------------------
# What each documented snippet is checked with
# ---------------------------------------------------------------------------------------------

FULL, BARE = "full", "bare"
"""The variant of a command line that RUN runs: every bracketed option in, or none."""

RUN = {
    "mplan inspect MODEL [--json]": BARE,
    "mplan plan MODEL --cluster dgx-h100 --nodes 128 --global-batch 1536 [--spec tp=8] [--fp8] [--no-kernels] "
    "[--runtime megatron] [--moe-imbalance 1.1] [-o plan.json] [--json]": FULL,
    "mplan explain plan.json [--json] [--gantt schedule.png]": FULL,
    "mplan bench MODEL --cluster dgx-h100 --global-batch 512 --plans auto tp=8,pp=4 dp=64 [--json] [--csv out.csv]":
        FULL,
    "mplan inspect MODEL [--batch B] [--seq-len S] [--shallow] [--json]": FULL,
    "mplan plan MODEL --global-batch B [--cluster C] [--nodes N] [--gpus-per-node G] [--seq-len S] [--vocab V] "
    "[--spec SPEC] [--allow-cross-node-tp] [--kernels | --no-kernels] [--fp8] [--runtime mplan|megatron] "
    "[--moe-imbalance X] [--documents TOKENS] [-o plan.json] [--json] [-q]": FULL,
    "mplan explain plan.json [--gantt schedule.png] [--json]": BARE,
    "mplan bench MODEL --global-batch B [--cluster C] [--nodes N] [--gpus-per-node G] [--seq-len S] [--vocab V] "
    "[--plans SPEC [SPEC ...]] [--measure [--profile]] [--moe-imbalance X] [--csv out.csv] [--out rows.json] [--json] "
    "[-q]": BARE,
}
"""Doc command line -> the one variant of it that runs for real (each takes a second or a few on
a 2-core CPU: captures of a 2-layer model, the planner on presets). The line's other variants are
parsed only: every option they hold is exercised by the run of another line or variant, and
running each would take the module past its minute."""

PARSE_ONLY = {
    "mplan data prepare 'STDLIB/*.py' -o out/tokens":
        "scripts/demo.sh runs it on the standard library; tests/test_train.py prepares a part of it",
    "torchrun --nproc-per-node 4 -m mplan train examples/train_stdlib.toml --set train.stop_at=70":
        "scripts/demo.sh runs it; tests/test_train.py stops and resumes jobs on gloo ranks",
    "torchrun --nproc-per-node 4 -m mplan train examples/train_stdlib.toml --set plan.spec=tp=2,dp=2,sp=1,zero=1":
        "scripts/demo.sh runs it; tests/test_train.py resumes under other plans",
    "mplan data prepare 'texts/**/*.txt' -o tokens/": "needs text files; tests/test_data.py prepares corpora",
    "torchrun --nproc-per-node 8 -m mplan train CONFIG.toml --set train.steps=1000 --set plan.spec=auto":
        "a training run on 8 ranks; tests/test_train.py runs mplan train on gloo ranks",
    "mplan checkpoint inspect ckpt": "needs a checkpoint; tests/test_checkpoint_cli.py runs inspect on real ones",
    "mplan checkpoint convert ckpt out/hf": "needs a checkpoint of a Hugging Face model; tests/test_hf_checkpoint.py "
                                            "converts both ways",
    "torchrun --nproc-per-node 8 -m mplan bench MODEL --cluster cluster.json --global-batch 64 --plans auto tp=8 "
    "--measure --out rows.json": "`--measure` trains every plan on 8 ranks; tests/test_profile_command.py runs "
                       "`bench --measure` for real on CPU ranks",
    "mplan profile [-o cluster.json] [--quick] [--no-links] [--no-runtime-host] [--json] [-q]":
        "times this machine's kernel grid (minutes without --quick); tests/test_profile_command.py runs "
        "`profile --quick --no-links -o cluster.json`",
    "mplan verify MODEL [--plan SPEC|plan.json] [--world-size N] [--steps N] [--bisect] [--json] [-q]":
        "starts gloo CPU ranks and trains twice (10-30 s each on 2 cores); tests/test_profile_command.py runs "
        "`mplan verify plan.json --world-size 2 --json`",
    "mplan verify plan.json [--world-size N] [--steps N] [--bisect] [--json] [-q]":
        "starts gloo CPU ranks (10-30 s on 2 cores); tests/test_profile_command.py runs it, "
        "tests/test_bisect.py runs --bisect",
    "mplan checkpoint inspect DIR [--json]": "needs a checkpoint; tests/test_checkpoint_cli.py runs it on real ones",
    "mplan checkpoint convert SRC DST [-q]": "needs a checkpoint; tests/test_checkpoint_cli.py and "
                                             "tests/test_hf_checkpoint.py convert both ways",
    "mplan data prepare INPUTS... -o DIR [--tokenizer DIR] [--vocab-size N] [--jsonl FILE] [--exclude PATTERN] [--shard-tokens N] [--json] [-q]":
        "needs a corpus; tests/test_data.py runs the command",
    "torchrun ... -m mplan train CONFIG.toml [--set KEY=VALUE ...] [--profile-steps A:B] [-q]":
        "a training run under torchrun; tests/test_train.py runs mplan train on gloo ranks",
    "mplan verify MODEL --plan SPEC_OR_PLAN_JSON [--world-size 4] [--steps 3] [--json]":
        "starts 4 gloo CPU ranks by default (tens of seconds on 2 cores)",
    "mplan verify plan.json [--world-size 4] [--steps 3]": "starts 4 gloo CPU ranks (tens of seconds on 2 cores)",
    "mplan verify gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128 --plan dp=2 --world-size 2 --steps 2":
        "starts 2 gloo CPU ranks and trains twice (10-20 s on 2 cores)",
    "bash scripts/demo.sh": "sets up .venv, plans GPT-3 175B and trains on 4 CPU ranks: minutes",
    '.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not script_smoke"': "the whole test suite, this module included",
    "torchrun --nproc-per-node 4 examples/train_your_model.py":
        "trains on 4 gloo ranks; tests/test_progress.py runs the script under torchrun on 2",
    "torchrun --nproc-per-node 4 examples/train_your_model.py --plan tp=2,dp=2,sp=1,zero=1 --check":
        "trains on 4 gloo ranks and on one process; tests/test_progress.py runs the script under torchrun on 2",
    "torchrun --nproc-per-node 4 examples/train_cpu.py --check":
        "trains on 4 gloo ranks and on one process; tests/test_refusals.py and tests/test_profile_command.py "
        "run the script under torchrun",
}
"""Doc command line -> why it is only parsed (by mplan's parser, or torchrun's and the script's)."""

PLACEHOLDERS = {
    "MODEL": "gpt:layers=2,hidden=64,heads=8,seq=32,vocab=128",  # 8 heads, for tp=8; the planner searches it in seconds
    "B": "16", "S": "32", "V": "128", "N": "1", "G": "8", "X": "1.1", "C": "dgx-h100",
    "SPEC": "tp=2", "SPEC_OR_PLAN_JSON": "tp=2,dp=2",
    "DIR": "ckpt", "SRC": "ckpt", "DST": "out", "INPUTS...": "texts/a.txt", "FILE": "data.jsonl", "PATTERN": "*/tests/*",
    "KEY=VALUE": "train.steps=3", "A:B": "1:2", "TOKENS": "tokens",
}
"""Placeholder word of a command line -> the small real value the check gives it. File names
(plan.json, cluster.json, schedule.png, ...) stay as written: the run's directory holds a real
plan.json and cluster.json, and the outputs are written there."""

OUTPUT_OPTIONS = ("-o", "--output", "--gantt", "--csv", "--out")
"""Options naming a file a command writes: after a run, that file must exist."""


@dataclass(frozen=True)
class Runs:
    """Run the block in-process in a fresh namespace and an empty directory, after `prelude` has
    made the `given` names the block takes for granted, with `replace` applied to its text."""
    why: str
    prelude: str = ""
    given: tuple[str, ...] = ()
    replace: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Signature:
    """The block is a function's signature: names, kinds, defaults and return must be the real ones."""
    function: str


@dataclass(frozen=True)
class ParseOnly:
    """Only parse the block (and import what it imports), for the reason given."""
    why: str


def _tiny_llama(rows: int) -> str:
    """A prelude: mplan's tiny Llama (vocab 64, seq 16) and one global batch of `rows` sequences."""
    return f"""
import torch
from mplan.models import build_model
model = build_model("tiny-llama")
make = torch.Generator().manual_seed(0)
ids, labels = (torch.randint(0, 64, ({rows}, 16), generator=make) for _ in range(2))
batches = [(ids, labels)]
"""


ONE_RANK = "substitutes: each multi-rank spec by its one-rank equivalent (every degree 1, the other keys kept), " \
           "as this process is one rank"

PYTHON_BLOCKS = {
    ("README.md", 'pm.save("ckpt", background=True, keep_latest=3)'): ParseOnly(
        why="needs torchrun ranks and a Hugging Face directory; tests/test_checkpoint_local.py, "
            "test_checkpoint_resharding.py and test_hf_checkpoint.py run every call"),
    ("docs/checkpoints.md", 'pm.save("ckpt", background=True, keep_latest=3)'): ParseOnly(
        why="needs torchrun ranks and a Hugging Face directory; tests/test_checkpoint_local.py, "
            "test_checkpoint_resharding.py and test_hf_checkpoint.py run every call"),
    ("README.md", 'mplan.plan("llama3-70b"'): Runs(
        why=f"{ONE_RANK}; llama3-70b by tiny-gpt (the same call: the 70B model plans in ~20 s, tiny-gpt in ~2)",
        prelude=_tiny_llama(64), given=("model", "ids", "labels"),
        replace=(('"llama3-70b"', '"tiny-gpt"'),
                 ('plan="tp=2,pp=2,dp=2,sp=1,zero=1"', 'plan="tp=1,pp=1,dp=1,sp=1,zero=1"'))),
    ("README.md", "num_replicas=pm.dp_size, rank=pm.dp_rank"): Runs(
        why=f"{ONE_RANK}; the model, loss and data of examples/train_your_model.py",
        prelude="""
import functools, importlib.util, pathlib, torch, mplan
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
path = pathlib.Path(mplan.__file__).resolve().parent.parent / "examples" / "train_your_model.py"
spec = importlib.util.spec_from_file_location("train_your_model", path)
example = importlib.util.module_from_spec(spec); spec.loader.exec_module(example)
model, loss_fn = example.TinyGPT(), example.loss_fn
tokens = torch.randint(0, 96, (128, 33), generator=torch.Generator().manual_seed(0))
dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
ids = tokens[:64, :-1]
""", given=("model", "ids", "loss_fn", "dataset")),
    ("docs/contract.md", 'plan = mplan.Plan.load("plan.json")'): Runs(
        why="llama3-70b by tiny-gpt (the same call: the 70B model plans in ~20 s, tiny-gpt in ~2)",
        prelude=_tiny_llama(64), given=("model", "ids", "labels"),
        replace=(('"llama3-70b"', '"tiny-gpt"'),)),
    ("docs/contract.md", "autoparallel(model, *, cluster=None"): Signature("mplan.autoparallel"),
    ("docs/contract.md", "plan(model, example_inputs=None, *"): Signature("mplan.plan"),
    ("docs/execution.md", 'build_model("llama:layers=2'): Runs(
        why=ONE_RANK, prelude=_tiny_llama(8).replace("(0, 64, (8, 16)", "(0, 128, (8, 32)"),
        given=("ids", "batches"),
        replace=(('plan="tp=2,dp=2,sp=1,zero=1"', 'plan="tp=1,dp=1,sp=1,zero=1"'),)),
    ("docs/execution.md", "verify_plan("): ParseOnly(
        "starts 4 gloo CPU ranks and trains twice (tens of seconds on 2 cores); tests/test_autoparallel.py "
        "runs verify_plan on llama3-70b at world size 4"),
    ("docs/models.md", "AutoModelForCausalLM.from_config"): Runs(
        why=f"{ONE_RANK}; path/to/model_dir by a directory holding a 1-layer LlamaConfig's config.json",
        prelude=_tiny_llama(64) + """
from transformers import LlamaConfig
LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16).save_pretrained("model_dir")
""", given=("ids",),
        replace=(('"path/to/model_dir"', '"model_dir"'), ('plan="tp=2,dp=2"', 'plan="tp=1,dp=1"'))),
    ("docs/training.md", "print(pm.last_metrics)"): Runs(
        why="the prelude makes `pm` one rank's ParallelModule of tiny-llama, and logs every step",
        prelude=_tiny_llama(8) + """
import mplan
pm = mplan.autoparallel(model, example_inputs=(ids,), global_batch=8, plan="dp=1")
log_every = 1
""", given=("pm", "batches", "log_every")),
    ("docs/training.md", "LambdaLR"): Runs(
        why="as written, on one rank", prelude=_tiny_llama(8), given=("model", "ids", "batches")),
}
"""(doc, a text only that block holds) -> how the python block is checked."""

TEXT_BLOCKS = {
    ("docs/checkpoints.md", "latest                   \"step-00001000\""): "a checkpoint directory's layout",
    ("docs/architecture.md", "model + example inputs"): "a diagram of the pipeline",
    ("docs/execution.md", "plan tp=2,dp=2,sp=1,zero=1: "): "the output of the command above it",
    ("docs/training.md", "plan tp=2,dp=2,sp=1,zero=1: "): "the output of the command above it",
    ("docs/training.md", "step 10 | loss 4.1234"): "a step line on GPUs, its figures made up",
}
"""(doc, a text only that block holds) -> what the block shows: output or a diagram, no code."""

JSON_FRAGMENTS: dict[tuple[str, str], str] = {}
"""(doc, a text only that block holds) -> what the JSON fragment shows (not a whole file)."""

# ---------------------------------------------------------------------------------------------
# Blocks and command lines
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced code block: its doc, the line its code starts on, its language tag, its text."""
    doc: str
    line: int
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def fenced_blocks(doc: str) -> list[Block]:
    """The fenced (```) code blocks of one markdown file, in order."""
    blocks, open_at, lang, lines = [], 0, "", []
    for number, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), start=1):
        fence = re.match(r"^\s*```\s*([\w+-]*)\s*$", line)
        if fence and not open_at:
            open_at, lang, lines = number + 1, fence.group(1).lower(), []
        elif fence:
            blocks.append(Block(doc, open_at, lang, "\n".join(lines) + "\n"))
            open_at = 0
        elif open_at:
            lines.append(line)
    assert not open_at, f"{doc}:{open_at - 1}: a code fence is never closed"
    return blocks


BLOCKS = [block for doc in DOCS for block in fenced_blocks(doc)]

PROGRAMS = ("mplan", "python", "python3", ".venv/bin/python", "torchrun", "bash")
"""First words of a line that makes a shell block one of commands rather than output."""


@dataclass(frozen=True)
class DocCommand:
    """One command line of a doc: comments cut, a wrapped line joined, spaces collapsed."""
    block: Block
    text: str

    def __str__(self) -> str:
        return f"{self.block}: {self.text}"


def command_lines(block: Block) -> list[DocCommand]:
    """The command lines of a shell block. A line starting with spaces (the contract's usage
    lines wrap so) or following a trailing backslash continues the line before."""
    joined: list[str] = []
    continues = False
    for raw in block.text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not line.strip():
            continues = False
            continue
        if joined and (continues or raw[:1].isspace()):
            joined[-1] += " " + line.strip()
        else:
            joined.append(line.strip())
        continues = joined[-1].endswith("\\")
        joined[-1] = joined[-1].rstrip("\\")
    return [DocCommand(block, " ".join(text.split())) for text in joined]


def is_command_block(block: Block) -> bool:
    """A bash block, or a plain one whose first word is a program: its lines are commands."""
    first = block.text.split()[0] if block.text.split() else ""
    return block.lang in ("bash", "sh", "shell", "console") or (block.lang == "" and first in PROGRAMS)


COMMANDS = [c for b in BLOCKS if is_command_block(b) for c in command_lines(b)]


def _owner(table: dict[tuple[str, str], Any], block: Block) -> list[tuple[str, str]]:
    """The keys of a (doc, marker) table that name this block."""
    return [key for key in table if key[0] == block.doc and key[1] in block.text]


# ---------------------------------------------------------------------------------------------
# Variants of a command line: bracketed options in and out, alternatives one by one
# ---------------------------------------------------------------------------------------------


@dataclass
class Word:
    """A word, or alternatives of one (`mplan|megatron`); `point` numbers its choice, if any."""
    alternatives: tuple[str, ...]
    point: int = -1


@dataclass
class Bracketed:
    """A bracketed part: alternatives (separated by ` | `), each a sequence of items."""
    alternatives: list[list[Any]]
    point: int


def _parse_brackets(text: str) -> list[Any]:
    """The items of a usage line: words and (nested) bracketed parts."""
    tokens = re.findall(r"\[|\]|(?<=\s)\|(?=\s)|[^\s\[\]]+", text)
    points = itertools.count()

    def sequence(until: str | None) -> list[list[Any]]:
        alternatives: list[list[Any]] = [[]]
        while tokens:
            token = tokens.pop(0)
            if token == until:
                return alternatives
            if token == "[":
                alternatives[-1].append(Bracketed(sequence("]"), next(points)))
            elif token == "|":
                alternatives.append([])
            elif token == "]":
                raise ValueError(f"unbalanced ] in {text!r}")
            else:
                words = tuple(token.split("|")) if "|" in token.strip("|") else (token,)
                alternatives[-1].append(Word(words, next(points) if len(words) > 1 else -1))
        if until is not None:
            raise ValueError(f"unbalanced [ in {text!r}")
        return alternatives

    top = sequence(None)
    if len(top) > 1:
        raise ValueError(f"a ` | ` outside brackets in {text!r}: a shell pipe, which this module does not check")
    return top[0]


def _render(items: list[Any], full: bool, pick: dict[int, int]) -> list[str]:
    """The words of one variant: optional parts all in (`full`) or all out, alternative
    `pick[point]` at a choice point (else the first); `...` (more of the same) dropped."""
    words: list[str] = []
    for item in items:
        if isinstance(item, Word):
            word = item.alternatives[pick.get(item.point, 0)]
            if word != "...":
                words.append(word)
        elif full or item.point in pick:
            words += _render(item.alternatives[pick.get(item.point, 0)], full, pick)
    return words


def _choice_points(items: list[Any]) -> Iterator[tuple[int, int]]:
    """(point, number of alternatives) of every choice with more than one alternative."""
    for item in items:
        if isinstance(item, Word) and item.point >= 0:
            yield item.point, len(item.alternatives)
        elif isinstance(item, Bracketed):
            if len(item.alternatives) > 1:
                yield item.point, len(item.alternatives)
            for alternative in item.alternatives:
                yield from _choice_points(alternative)


def variants(text: str) -> dict[str, str]:
    """Name -> text of every variant of a usage line: `bare` (no bracketed part), `full` (all of
    them, first alternatives), then `full` with each other alternative in turn."""
    items = _parse_brackets(text)
    found = {BARE: " ".join(_render(items, False, {})), FULL: " ".join(_render(items, True, {}))}
    for point, count in _choice_points(items):
        for choice in range(1, count):
            found[f"alternative {point}.{choice}"] = " ".join(_render(items, True, {point: choice}))
    return found


def fill(text: str) -> list[str]:
    """The words of a variant with its placeholders filled; an all-capitals word that
    PLACEHOLDERS does not know is an error, so a new placeholder is noticed."""
    words = []
    for word in text.split():
        if word in PLACEHOLDERS:
            word = PLACEHOLDERS[word]
        elif re.fullmatch(r"[A-Z][A-Z0-9_]*", word):
            raise AssertionError(f"placeholder {word!r} has no value in PLACEHOLDERS")
        words.append(word)
    return words


# ---------------------------------------------------------------------------------------------
# Parsing and running command lines
# ---------------------------------------------------------------------------------------------


def _torchrun_args(words: list[str]) -> argparse.Namespace:
    """torchrun's own parser on the words after `torchrun`."""
    from torch.distributed.run import get_args_parser

    return _quietly(get_args_parser(), words)


def _quietly(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    """parse_args, its usage error raised as an AssertionError carrying argparse's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(words)
        except SystemExit as exit_:
            message = err.getvalue().strip().splitlines()[-1:] or [f"exit status {exit_.code}"]
            raise AssertionError(f"{' '.join(words)!r} does not parse: {message[0]}") from None


def mplan_argv(words: list[str]) -> list[str] | None:
    """The arguments given to mplan's command line, or None when the line runs another program."""
    if words[0] == "mplan":
        return words[1:]
    if words[0] in PROGRAMS and words[0] not in ("bash", "torchrun") and words[1:3] == ["-m", "mplan"]:
        return words[3:]
    if words[0] == "torchrun":
        args = _torchrun_args(words[1:])
        if args.module and args.training_script == "mplan":
            return list(args.training_script_args)
    return None


def parse_mplan(argv: list[str]) -> argparse.Namespace:
    """mplan's real parser (mplan/cli.py) on `argv`; a usage error raises AssertionError."""
    from mplan.cli import _parser

    return _quietly(_parser(), argv)


def check_parses(text: str) -> None:
    """A filled-in command line parses: mplan's under mplan's parser (and torchrun's options
    under torchrun's); another program's files exist and a script accepts the flags given."""
    words = fill(text)
    argv = mplan_argv(words)
    if argv is not None:
        parse_mplan(argv)
    elif words[0] == "bash":
        assert (ROOT / words[1]).is_file(), f"{text!r}: no file {words[1]}"
    elif words[0] == "torchrun":
        args = _torchrun_args(words[1:])
        _check_script(args.training_script, list(args.training_script_args))
    elif words[1] == "-m":
        assert importlib.util.find_spec(words[2]) is not None, f"{text!r}: no module {words[2]}"
    else:
        _check_script(words[1], words[2:])


def _check_script(script: str, args: list[str]) -> None:
    """The script exists and every flag given to it is spelled in its source, as its argparse
    parser adds it (the source is read: running the script would start the job)."""
    path = ROOT / script
    assert path.is_file(), f"no script {script}"
    known = {node.value for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("-")}
    unknown = [a.split("=")[0] for a in args if a.startswith("-") and a.split("=")[0] not in known]
    assert not unknown, f"{script} adds no argument {unknown}"


def run_mplan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run mplan's command line in this process and return its stdout; it must exit 0, print
    one JSON document under --json and write every file an output option names."""
    from mplan.cli import main

    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, f"mplan {' '.join(argv)} exited {status}: {err.strip()[-2000:]}"
    if "--json" in argv:
        json.loads(out)
    for option, value in zip(argv, argv[1:]):
        if option in OUTPUT_OPTIONS:
            assert Path(value).is_file(), f"mplan {' '.join(argv)} did not write {value}"
    return out


# ---------------------------------------------------------------------------------------------
# Python blocks
# ---------------------------------------------------------------------------------------------


def substituted(block: Block, check: Runs) -> str:
    """The block's text with the check's replacements, each of which must occur in it."""
    text = block.text
    for old, new in check.replace:
        assert old in text, f"{block}: the substitution {old!r} no longer occurs in the block"
        text = text.replace(old, new)
    return text


def run_python(block: Block, check: Runs) -> dict[str, Any]:
    """Exec the prelude, then the block in a namespace holding only the given names; return it."""
    scratch: dict[str, Any] = {"__name__": "__doc_prelude__"}
    exec(compile(check.prelude, f"<prelude of {block}>", "exec"), scratch)
    namespace = {"__name__": "__doc_snippet__", **{name: scratch[name] for name in check.given}}
    exec(compile(substituted(block, check), str(block), "exec"), namespace)
    return namespace


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _same_default(documented: Any, real: Any) -> bool:
    """Defaults compare by value; a functools.partial by its function and arguments."""
    if isinstance(real, functools.partial):
        return isinstance(documented, functools.partial) and (documented.func, documented.args,
                                                              documented.keywords) == (real.func, real.args,
                                                                                       real.keywords)
    return documented == real


def signature_differences(text: str, function: Any) -> list[str]:
    """How a documented signature (`name(params) -> Return`) differs from the function's."""
    import torch

    tree = ast.parse(f"def {' '.join(text.split())}:\n    ...\n").body[0]
    assert isinstance(tree, ast.FunctionDef)
    args = tree.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    documented = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    documented += [(a.arg, "keyword", d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    real = [(p.name, "keyword" if p.kind is p.KEYWORD_ONLY else "positional", p.default)
            for p in inspect.signature(function).parameters.values()]
    differences = []
    if [(n, k) for n, k, _ in documented] != [(n, k) for n, k, _ in real]:
        differences.append(f"parameters {[(n, k) for n, k, _ in documented]} != {[(n, k) for n, k, _ in real]}")
    scope = {"functools": functools, "torch": torch}
    for (name, _, node), (_, _, default) in zip(documented, real):
        value = inspect.Parameter.empty if node is None else eval(ast.unparse(node), scope)  # noqa: S307
        if not _same_default(value, default):
            differences.append(f"{name}: documented default {value!r}, real {default!r}")
    returns = inspect.signature(function).return_annotation
    if tree.returns is not None and ast.unparse(tree.returns) != getattr(returns, "__name__", returns):
        differences.append(f"returns {ast.unparse(tree.returns)}, real {returns}")
    return differences


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


def unclassified(blocks: list[Block], commands: list[DocCommand]) -> list[str]:
    """Every block and command line no table names, and every table entry that names nothing."""
    problems = []
    for block in blocks:
        if block.lang == "python":
            owners = _owner(PYTHON_BLOCKS, block)
        elif block.lang == "json":
            owners = [("reader", "")] if _json_reader(json.loads(block.text)) else _owner(JSON_FRAGMENTS, block)
        elif is_command_block(block):
            owners = [("commands", "")]
        else:
            owners = _owner(TEXT_BLOCKS, block)
        if len(owners) != 1:
            problems.append(f"{block} ({block.lang or 'plain'}) is named by {len(owners)} entries: {owners}")
    for table in (PYTHON_BLOCKS, TEXT_BLOCKS, JSON_FRAGMENTS):
        for key in table:
            if sum(b.doc == key[0] and key[1] in b.text for b in blocks) != 1:
                problems.append(f"{key} names no block, or several")
    texts = [c.text for c in commands]
    for command in commands:
        if (command.text in RUN) == (command.text in PARSE_ONLY):
            problems.append(f"{command}: in neither RUN nor PARSE_ONLY (or in both)")
        elif command.text in RUN and mplan_argv(fill(variants(command.text)[RUN[command.text]])) is None:
            problems.append(f"{command}: RUN holds it, but it does not run mplan")
    problems += [f"stale entry, no doc line: {text}" for text in (*RUN, *PARSE_ONLY) if text not in texts]
    return problems


def test_every_code_block_and_command_line_is_classified() -> None:
    assert BLOCKS and COMMANDS
    assert unclassified(BLOCKS, COMMANDS) == []


def _test_id(command: DocCommand, variant: str) -> str:
    """`doc:line-subcommand-variant`, e.g. `README.md:53-plan-full`."""
    words = command.text.split()
    name = words[1] if words[0] == "mplan" else Path(words[0]).name
    return f"{command.block}-{name}-{variant.replace('alternative ', 'alt')}"


VARIANTS = [(_test_id(c, name), text) for c in COMMANDS for name, text in variants(c.text).items()
            if name != FULL or text != variants(c.text)[BARE]]  # a line without brackets: once


@pytest.mark.parametrize("text", [text for _, text in VARIANTS], ids=[name for name, _ in VARIANTS])
def test_every_variant_of_every_command_line_parses(text: str) -> None:
    check_parses(text)


@pytest.fixture(scope="module")
def files_commands_read(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding what documented commands read: plan.json (a plan of PLACEHOLDERS'
    MODEL on one DGX H100, its layout given rather than searched: it only has to be a real plan),
    cluster.json (the dgx-h100 preset) and tokens (token shards of a few lines)."""
    import mplan
    from mplan.data import prepare

    folder = tmp_path_factory.mktemp("doc-files")
    (folder / "text.txt").write_text("".join(f"line {i} of a tiny corpus\n" for i in range(40)), encoding="utf-8")
    prepare(str(folder / "text.txt"), str(folder / "tokens"), vocab_size=300, progress=None)
    cluster = mplan.ClusterSpec.preset("dgx-h100")
    cluster.to_json(str(folder / "cluster.json"))
    mplan.plan(PLACEHOLDERS["MODEL"], cluster=cluster, global_batch=16,
               spec="dp=4,tp=2,pp=1,vpp=1,mbs=2,sp=1,zero=1,recompute=none").save(str(folder / "plan.json"))
    return folder


RUNS = [c for c in COMMANDS if c.text in RUN]


@pytest.mark.parametrize("command", RUNS, ids=[_test_id(c, RUN[c.text]) for c in RUNS])
def test_the_cheap_command_lines_run(command: DocCommand, files_commands_read: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("plan.json", "cluster.json"):
        shutil.copy(files_commands_read / name, tmp_path / name)
    shutil.copytree(files_commands_read / "tokens", tmp_path / "tokens")
    monkeypatch.chdir(tmp_path)
    argv = mplan_argv(fill(variants(command.text)[RUN[command.text]]))
    assert argv is not None
    run_mplan(argv, capsys)


PYTHON = [(b, PYTHON_BLOCKS[k]) for b in BLOCKS if b.lang == "python" for k in _owner(PYTHON_BLOCKS, b)]
RUN_PYTHON = [(b, c) for b, c in PYTHON if isinstance(c, Runs)]


@pytest.mark.parametrize("block,check", RUN_PYTHON, ids=[str(b) for b, _ in RUN_PYTHON])
def test_the_python_blocks_run(block: Block, check: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = run_python(block, check)
    if "loss" in namespace:  # what pm.train_step returned: a float, the same on every rank
        assert isinstance(namespace["loss"], float) and math.isfinite(namespace["loss"])


SIGNATURES = [(b, c) for b, c in PYTHON if isinstance(c, Signature)]


@pytest.mark.parametrize("block,check", SIGNATURES, ids=[str(b) for b, _ in SIGNATURES])
def test_the_documented_signatures_are_the_real_ones(block: Block, check: Signature) -> None:
    assert signature_differences(block.text, _resolve(check.function)) == []


PARSED_PYTHON = [(b, c) for b, c in PYTHON if isinstance(c, ParseOnly)]


@pytest.mark.parametrize("block,check", PARSED_PYTHON, ids=[str(b) for b, _ in PARSED_PYTHON])
def test_the_parse_only_python_blocks_parse_and_import(block: Block, check: ParseOnly) -> None:
    tree = ast.parse(block.text, filename=str(block))
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), str(block), "exec"), {})


def _json_reader(obj: Any) -> Any:
    """The project's reader for a whole file of JSON, by what it holds; None for a fragment."""
    from mplan.cost_models.cluster import ClusterSpec
    from mplan.cost_models.profile import ClusterProfile
    from mplan.planner.plan import Plan

    if not isinstance(obj, dict):
        return None
    if obj.get("format") == "mplan.cluster":
        return ClusterSpec.from_dict
    if obj.get("format") == "mplan.profile":
        return ClusterProfile.from_dict
    if {"version", "mesh", "stages"} <= obj.keys():
        return Plan.from_dict
    return None


JSON_BLOCKS = [b for b in BLOCKS if b.lang == "json"]


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=[str(b) for b in JSON_BLOCKS])
def test_the_json_blocks_load_with_the_projects_readers(block: Block) -> None:
    obj = json.loads(block.text)
    reader = _json_reader(obj)
    if reader is None:
        assert _owner(JSON_FRAGMENTS, block), f"{block}: not a whole file any reader takes, nor a listed fragment"
        return
    reader(obj)


# ---------------------------------------------------------------------------------------------
# The checker checks: wrong snippets are reported
# ---------------------------------------------------------------------------------------------


def test_a_wrong_command_line_is_reported() -> None:
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-flag"):
        check_parses("mplan plan MODEL --global-batch B --no-such-flag")
    with pytest.raises(AssertionError, match="invalid choice"):
        check_parses("mplan plans MODEL --global-batch B")
    with pytest.raises(AssertionError, match="placeholder 'WIDTH'"):
        check_parses("mplan plan MODEL --global-batch WIDTH")
    with pytest.raises(AssertionError, match="unrecognized arguments: --measure"):
        check_parses("torchrun --nproc-per-node 2 -m mplan plan MODEL --global-batch B --measure")
    with pytest.raises(AssertionError, match=r"adds no argument \['--chek'\]"):
        check_parses("torchrun --nproc-per-node 4 examples/train_cpu.py --chek")


def test_every_bracketed_option_is_parsed_in_and_out() -> None:
    """So `[--no-such-flag]` on a doc line is caught, and each alternative is tried on its own."""
    found = variants("mplan plan MODEL [--kernels | --no-kernels] [--runtime mplan|megatron] [--plans A [A ...]]")
    assert found == {BARE: "mplan plan MODEL",
                     FULL: "mplan plan MODEL --kernels --runtime mplan --plans A A",
                     "alternative 0.1": "mplan plan MODEL --no-kernels --runtime mplan --plans A A",
                     "alternative 1.1": "mplan plan MODEL --kernels --runtime megatron --plans A A"}
    with pytest.raises(AssertionError, match="--no-such-flag"):
        check_parses(variants("mplan explain plan.json [--no-such-flag]")[FULL])


def test_a_command_that_parses_but_fails_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    """An A100 has no FP8: the line parses, and the run reports mplan's refusal."""
    with pytest.raises(AssertionError, match="(?s)exited 2: .*no FP8"):
        run_mplan(mplan_argv(fill("mplan plan MODEL --cluster dgx-a100 --global-batch B --fp8")) or [], capsys)


def test_an_unclassified_doc_line_or_block_is_reported() -> None:
    block = Block("docs/new.md", 1, "bash", "mplan explain plan.json --json\n")
    new_python = Block("docs/new.md", 9, "python", "print(1)\n")
    problems = unclassified([*BLOCKS, block, new_python], [*COMMANDS, *command_lines(block)])
    assert problems == ["docs/new.md:9 (python) is named by 0 entries: []",
                        "docs/new.md:1: mplan explain plan.json --json: in neither RUN nor PARSE_ONLY (or in both)"]


def test_a_python_block_that_no_longer_runs_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    block = Block("docs/new.md", 1, "python", "import mplan\nmplan.ClusterSpec.preset('dgx-h100').explain()\n")
    with pytest.raises(AttributeError, match="explain"):
        run_python(block, Runs(why="a self-check"))
    with pytest.raises(AssertionError, match="no longer occurs"):
        run_python(block, Runs(why="a self-check", replace=(("'llama3-70b'", "'tiny-llama'"),)))
    assert signature_differences("plan(model, *, cluster, global_batch=8) -> Plan", _resolve("mplan.plan"))
