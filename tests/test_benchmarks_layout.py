"""benchmarks/ stays readable (issue 35, item 3): every script, harness module and harness case the
docs, tests or mplan name exists, every script and harness is placed under a question in
benchmarks/README.md, and no new script is named after the card it first ran on (the card belongs
in the results it writes)."""
from __future__ import annotations

import importlib.machinery
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

CITED_PATH = re.compile(r"(?<!:)benchmarks/((?:[a-z_]+/)?[A-Za-z0-9_]+\.(?:py|sh))\b")
"""A script or a harness's module cited by its path from the repository root, as the docs and
docstrings cite them (not a retired one cited at a commit, `git show REV:benchmarks/x.py`)."""
CITED_CASE = re.compile(r"-m benchmarks\.([a-z_]+) ([a-z0-9-]+)")
"""A harness's case cited by its command (`python -m benchmarks.kernel_peers fused ...`)."""
CASE_KEY = re.compile(r'"([a-z0-9-]+)": ')

CARD = re.compile(r"_(?:h100|h200|a100|b200)(?:x\d+)?\.(?:py|sh)$", re.IGNORECASE)

NAMED_AFTER_A_CARD = {
    "multi_gpu_h200.sh": "the multi-GPU run the team's run book names (whichever multi-GPU kind is lent)",
}
"""Scripts still named after a card, each with why."""


def _harnesses() -> set[str]:
    """Packages run as `python -m benchmarks.<name> CASE` (benchmarks/harness.py)."""
    return {p.parent.name for p in BENCHMARKS.glob("*/__main__.py")}


def _scripts() -> set[str]:
    """Top-level scripts by name, and each harness's modules as `<harness>/<module>.py`."""
    return ({p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}
            | {f"{h}/{p.name}" for h in _harnesses() for p in (BENCHMARKS / h).glob("*.py")})


def _cases(harness: str) -> set[str]:
    """The case names a harness's `__main__` hands to `harness.main`."""
    return set(CASE_KEY.findall((BENCHMARKS / harness / "__main__.py").read_text(encoding="utf-8")))


def _citing_files() -> list[Path]:
    """What a reader or the code reads: the docs, benchmarks/README.md, tests, mplan and scripts.
    Not the benchmark scripts themselves, whose docstrings record how their results were made."""
    files = [ROOT / "README.md", BENCHMARKS / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder, pattern in (("tests", "*.py"), ("mplan", "**/*.py"), ("mplan", "**/*.md"), ("scripts", "*.sh")):
        files += sorted((ROOT / folder).glob(pattern))
    return files


def test_every_script_the_docs_tests_and_mplan_cite_exists() -> None:
    scripts = _scripts()
    missing = sorted({f"{path.relative_to(ROOT)}: benchmarks/{name}"
                      for path in _citing_files()
                      for name in CITED_PATH.findall(path.read_text(encoding="utf-8"))
                      if name not in scripts})
    assert not missing, "cited scripts that benchmarks/ does not hold:\n" + "\n".join(missing)


def test_every_harness_case_the_docs_tests_and_mplan_cite_exists() -> None:
    harnesses = _harnesses()
    cited = [(path, harness, case) for path in [*_citing_files(), *sorted(BENCHMARKS.glob("*/*.py"))]
             for harness, case in CITED_CASE.findall(path.read_text(encoding="utf-8"))]
    assert cited, "no harness command is cited anywhere: the pattern has gone stale"
    missing = sorted({f"{path.relative_to(ROOT)}: benchmarks.{harness} {case}" for path, harness, case in cited
                      if harness not in harnesses or case not in _cases(harness)})
    assert not missing, "cited harness cases that do not exist:\n" + "\n".join(missing)


def test_every_script_is_placed_under_a_question_in_the_benchmarks_readme() -> None:
    readme = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    questions = readme.split("\n## Inventory")[0]
    unplaced = sorted(name for name in _scripts() if "/" not in name and f"`{name}" not in questions)
    unplaced += sorted(h for h in _harnesses() if f"python -m benchmarks.{h}" not in questions)
    assert not unplaced, f"scripts and harnesses benchmarks/README.md does not place under a question: {unplaced}"


def test_no_harness_hides_a_package_of_the_same_name() -> None:
    """A script run from benchmarks/ (`python benchmarks/report.py`) has that folder first on its
    path, so a harness named like an installed package would shadow it for everything the script
    imports (a harness named `kernels` broke transformers, which imports the `kernels` package)."""
    elsewhere = [p for p in sys.path if p and Path(p).resolve() != BENCHMARKS]
    shadowed = sorted(h for h in _harnesses() if importlib.machinery.PathFinder.find_spec(h, elsewhere) is not None)
    assert not shadowed, f"harnesses named like importable modules: {shadowed}"


def test_no_script_is_named_after_a_card_but_the_listed_ones() -> None:
    named = {name for name in _scripts() if CARD.search(name)}
    assert named <= set(NAMED_AFTER_A_CARD), f"named after a card: {sorted(named - set(NAMED_AFTER_A_CARD))}"
    assert set(NAMED_AFTER_A_CARD) <= _scripts(), "a listed script is gone: take it off NAMED_AFTER_A_CARD"
