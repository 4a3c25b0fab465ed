"""The docs stay honest: cited lint rules exist, every rule is documented, relative links resolve."""

from __future__ import annotations

import re
from pathlib import Path

from common.lint import RULES

REPO = Path(__file__).resolve().parents[2]
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
OWN_DOCS = ["README.md", "docs/choosing_a_stage.md", "docs/troubleshooting.md", "docs/run_directory.md"]
# Findings lint reports outside RULES (common/lint.py: the config could not be read or sized).
EXTRA_FINDINGS = {"config-invalid", "config-not-found", "model-facts"}


def table_column(markdown: str, header: str) -> list[str]:
    """The cells under ``header`` in every Markdown table of ``markdown`` that has that column."""
    cells, column = [], None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        row = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if column is None:
            column = row.index(header) if header in row else -1
        elif column >= 0 and not set(line) <= set("|-: ") and column < len(row):
            cells.append(row[column])
    return cells


def cited_rules(markdown: str) -> set[str]:
    """Rule ids in the "lint rule" column (backticked), plus any written as "`id` (FlashAttention ...)" prose."""
    ids = {rule for cell in table_column(markdown, "lint rule") for rule in re.findall(r"`([a-z0-9.-]+)`", cell)}
    ids |= set(re.findall(r"checked, from the libraries rather than the guides: `([a-z0-9.-]+)`", markdown))
    return ids


def test_table_column_reads_only_that_column():
    text = "| a | lint rule |\n|---|---|\n| x | `one`, `two` |\n\n| lint rule |\n|---|\n| `three` |\n| b |\n"
    assert table_column(text, "lint rule") == ["`one`, `two`", "`three`", "b"]
    assert cited_rules(text) == {"one", "two", "three"}


def test_every_rule_cited_in_troubleshooting_exists_in_lint():
    cited = cited_rules(TROUBLESHOOTING.read_text())
    assert len(cited) >= 10, cited  # the tables were parsed
    unknown = cited - set(RULES) - EXTRA_FINDINGS
    assert not unknown, f"docs/troubleshooting.md cites rules that common/lint.py does not have: {sorted(unknown)}"


def test_every_lint_rule_is_in_troubleshooting():
    missing = set(RULES) - cited_rules(TROUBLESHOOTING.read_text())
    assert not missing, f"lint rules without a row in docs/troubleshooting.md: {sorted(missing)}"


def test_relative_links_in_own_docs_resolve():
    broken = []
    for name in OWN_DOCS:
        path = REPO / name
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{name}: {target}")
    assert not broken, broken
