"""benchmarks/ stays readable (issue 35, item 3): every script the docs, tests or mplan name
exists, every script is placed under a question in benchmarks/README.md, and no new script is
named after the card it first ran on (the card belongs in the results it writes)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"

CITED_PATH = re.compile(r"benchmarks/([A-Za-z0-9_]+\.(?:py|sh))\b")
"""A script cited by its path from the repository root, as the docs and docstrings cite them."""

CARD = re.compile(r"_(?:h100|h200|a100|b200)(?:x\d+)?\.(?:py|sh)$", re.IGNORECASE)

NAMED_AFTER_A_CARD = {
    "profile_h200.py": "writes the H200's packaged profile, mplan/cost_models/profiles/h200.json",
    "multi_gpu_h200.sh": "the multi-GPU run the team's run book names (whichever multi-GPU kind is lent)",
}
"""Scripts still named after a card, each with why."""


def _scripts() -> set[str]:
    return {p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh")}


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


def test_every_script_is_placed_under_a_question_in_the_benchmarks_readme() -> None:
    readme = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    questions = readme.split("\n## Inventory")[0]
    unplaced = sorted(name for name in _scripts() if f"`{name}" not in questions)
    assert not unplaced, f"scripts benchmarks/README.md does not place under a question: {unplaced}"


def test_no_script_is_named_after_a_card_but_the_listed_ones() -> None:
    named = {name for name in _scripts() if CARD.search(name)}
    assert named <= set(NAMED_AFTER_A_CARD), f"named after a card: {sorted(named - set(NAMED_AFTER_A_CARD))}"
    assert set(NAMED_AFTER_A_CARD) <= _scripts(), "a listed script is gone: take it off NAMED_AFTER_A_CARD"
