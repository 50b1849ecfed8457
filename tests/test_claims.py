"""The figures README.md and docs/*.md quote agree with the results files they cite
(benchmarks/claims.py, run as `python benchmarks/report.py --check`), and the check fails when
they do not: each test below edits a copy of a doc the way drift would and sees the check say so.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import claims  # noqa: E402


def readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def edited(old: str, new: str, doc: str = "README.md") -> claims.ClaimsReport:
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} is not once in {doc}: update this test with the doc"
    return claims.check(ROOT, docs={doc: text.replace(old, new)})


def test_every_registered_figure_matches_its_results_file() -> None:
    report = claims.check(ROOT)
    assert report.problems == []
    assert report.checked_figures >= 200  # the zoo table alone is 132


def test_the_command_passes_here_and_fails_on_a_drifted_copy(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 problems" in run.stdout
    copy = tmp_path / "repo"
    (copy / "benchmarks").mkdir(parents=True)
    (copy / "tests").mkdir()
    os.symlink(ROOT / "benchmarks" / "results", copy / "benchmarks" / "results")
    os.symlink(ROOT / "mplan", copy / "mplan")
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "tests" / "zoo_models.py", copy / "tests" / "zoo_models.py")
    (copy / "README.md").write_text(readme().replace("4.78 s per step", "4.70 s per step"), encoding="utf-8")
    assert claims.main(["--check"], root=copy) == 1


def test_a_wrong_figure_is_named_with_the_files_value() -> None:
    report = edited("1.1e-13 on the parameters", "1.3e-13 on the parameters")
    assert any("says 1.3e-13 where experts-cpu-2026-12-02.json gives 1.1e-13" in p for p in report.problems), \
        report.problems


def test_a_zoo_table_cell_that_drifts_fails() -> None:
    report = edited("| gptj | 2e-05 | 1.1e-07 |", "| gptj | 2e-05 | 1.2e-07 |")
    assert any("says 1.2e-07 where zoo-cpu-2026-12-02.json gives 1.1e-07" in p for p in report.problems), \
        report.problems


def test_a_range_that_the_file_does_not_give_fails() -> None:
    """The audit's "-3% to +49%": all five rows are high, and the largest rounds to 48%."""
    report = edited("predicted +3% to +48% of measured", "predicted -3% to +49% of measured")
    assert any("says -3% to +49% where bench_cpu4_experts-2026-12-02.json gives +3% to +48%" in p
               for p in report.problems), report.problems


def test_a_claim_whose_sentence_was_rewritten_fails() -> None:
    report = edited("where ep=8 would take 5.13 s;", "where expert parallelism would be slower;")
    assert any("is not in the doc" in p and "drops EP" in p for p in report.problems), report.problems


def test_a_figure_must_sit_beside_the_citation_of_its_file() -> None:
    report = edited("`benchmarks/results/capture-cpu-2026-11-29.json`", "the capture run")
    assert any("does not cite capture-cpu-2026-11-29.json" in p for p in report.problems), report.problems


def test_a_cited_results_file_that_does_not_exist_fails() -> None:
    report = edited("`benchmarks/results/capture-cpu-2026-11-29.json`", "`benchmarks/results/capture-cpu-2026-01-01.json`")
    assert any("cites capture-cpu-2026-01-01.json, which benchmarks/results/ does not hold" in p
               for p in report.problems), report.problems


def test_a_hand_assembled_file_must_be_called_so_where_it_is_cited() -> None:
    report = edited("; both hand-assembled: `mplan bench --measure` rows", "; both: `mplan bench --measure` rows")
    assert any("bench_llama3-8b_h200x2-2026-11-29-session7.json" in p and "without saying it is hand-assembled" in p
               for p in report.problems), report.problems


def test_figures_near_a_citation_that_no_claim_checks_are_listed() -> None:
    text = readme() + "\n\nA new result: 12.5 ms (`benchmarks/results/capture-cpu-2026-11-29.json`).\n"
    report = claims.check(ROOT, docs={"README.md": text})
    assert report.problems == []
    assert any(unit.text.startswith("A new result") and figures == ["12.5"] for unit, figures in report.unchecked)


@pytest.mark.parametrize("value, digits, text", [(1.06e-13, 1, "1.1e-13"), (2.04e-16, 0, "2e-16"),
                                                 (5.766e-06, 0, "6e-06"), (1.28e-06, 1, "1.3e-06")])
def test_scientific_figures_print_as_the_tables_do(value: float, digits: int, text: str) -> None:
    assert claims.sci(value, digits) == text


def test_percent_figures_round_and_sign_as_the_docs_do() -> None:
    assert claims.percent(0.48488, 0, sign=True) == "+48%"
    assert claims.percent(-0.3865, 0, sign=True) == "-39%"
    assert claims.percent(0.016356) == "1.6%"
    assert claims.span([0.0301, 0.4849], lambda v: claims.percent(v, 0, sign=True), " to ") == "+3% to +48%"
