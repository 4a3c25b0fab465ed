"""The docs stay honest: cited lint rules exist, every rule is documented, every relative link and anchor resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.lint import RULES

REPO = Path(__file__).resolve().parents[2]
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
FENCED = re.compile(r"^```.*?^```", re.M | re.S)
# Findings lint reports outside RULES (common/lint/: the config could not be read or sized).
EXTRA_FINDINGS = {"config-invalid", "config-not-found", "model-facts"}


RULE_ID = re.compile(r"`([a-z0-9.-]+)`")
# Rules documented in prose rather than in a table row; their fixes follow in the same sentence.
PROSE_RULES = re.compile(r"checked, from the libraries' own documentation: `([a-z0-9.-]+)`")


def table_rows(markdown: str, headers: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The cells under ``headers`` (in that order), one tuple a body row, in every Markdown table of ``markdown``
    that has all those columns."""
    rows, columns = [], None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        row = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if columns is None:
            columns = [row.index(header) for header in headers] if set(headers) <= set(row) else []
        elif columns and not set(line) <= set("|-: ") and max(columns) < len(row):
            rows.append(tuple(row[column] for column in columns))
    return rows


def table_column(markdown: str, header: str) -> list[str]:
    """The cells under ``header`` in every Markdown table of ``markdown`` that has that column."""
    return [cell for (cell,) in table_rows(markdown, (header,))]


def cited_rules(markdown: str) -> set[str]:
    """Rule ids in the "lint rule" column (backticked), plus any written as "`id` (FlashAttention ...)" prose."""
    ids = {rule for cell in table_column(markdown, "lint rule") for rule in RULE_ID.findall(cell)}
    return ids | set(PROSE_RULES.findall(markdown))


def rules_with_a_fix(markdown: str) -> set[str]:
    """Rule ids in a "lint rule" cell whose row's "fix" cell says what to do (not empty, not "—"), plus the rules
    documented in prose (``cited_rules``' sentence), whose fixes follow in the sentence."""
    rows = table_rows(markdown, ("lint rule", "fix"))
    ids = {rule for rule_cell, fix_cell in rows if fix_cell.strip("— ") for rule in RULE_ID.findall(rule_cell)}
    return ids | set(PROSE_RULES.findall(markdown))


def test_table_column_reads_only_that_column():
    text = "| a | lint rule |\n|---|---|\n| x | `one`, `two` |\n\n| lint rule |\n|---|\n| `three` |\n| b |\n"
    assert table_column(text, "lint rule") == ["`one`, `two`", "`three`", "b"]
    assert cited_rules(text) == {"one", "two", "three"}


def test_a_rule_without_a_row_or_without_a_fix_is_not_documented():
    text = (
        "| symptom | lint rule | fix |\n|---|---|---|\n| slow | `with-fix` | lower the bucket |\n"
        "| odd | `no-fix` | — |\n\n| symptom | lint rule |\n|---|---|\n| x | `no-fix-column` |\n"
    )
    assert rules_with_a_fix(text) == {"with-fix"}
    assert {"with-fix", "no-fix", "no-fix-column", "missing"} - rules_with_a_fix(text) == {
        "no-fix",
        "no-fix-column",
        "missing",
    }


def test_every_rule_cited_in_troubleshooting_exists_in_lint():
    cited = cited_rules(TROUBLESHOOTING.read_text())
    assert len(cited) >= 10, cited  # the tables were parsed
    unknown = cited - set(RULES) - EXTRA_FINDINGS
    assert not unknown, f"docs/troubleshooting.md cites rules that common/lint/ does not have: {sorted(unknown)}"


def test_every_lint_rule_has_a_row_with_its_fix_in_troubleshooting():
    missing = set(RULES) - rules_with_a_fix(TROUBLESHOOTING.read_text())
    assert not missing, f"lint rules without a row and a fix in docs/troubleshooting.md: {sorted(missing)}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, links and code marks dropped, punctuation removed
    (hyphens and underscores kept), spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor a Markdown page defines: its headings' (outside code blocks; a repeated one gets -1, -2, ...)
    and explicit ``<a id=...>`` / ``<a name=...>``."""
    found, seen = set(), {}
    for line in FENCED.sub("", markdown).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            anchor = github_anchor(heading.group(1))
            found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
            seen[anchor] = seen.get(anchor, 0) + 1
    return found | set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", markdown))


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file is missing, or whose ``#anchor`` that file does not define."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", page.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{target} (no heading gives #{anchor})")
    return broken


def test_anchors_follow_githubs_rule():
    text = "# Choosing a ZeRO stage\n## `zero-recipes probe RECIPE`\n```\n# not a heading\n```\n## Notes\n## Notes\n"
    assert anchors(text) == {"choosing-a-zero-stage", "zero-recipes-probe-recipe", "notes", "notes-1"}
    assert github_anchor("Checked (2 CPU processes, gloo, 3,170,817-parameter MLP)") == (
        "checked-2-cpu-processes-gloo-3170817-parameter-mlp"
    )


def test_a_dead_anchor_and_a_missing_file_are_reported(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Measured here\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#measured-here) [old](a.md#measured-2-cpu) [gone](c.md) [self](#top) [web](https://x.y/#z)\n"
    )
    assert broken_links(page) == [
        "a.md#measured-2-cpu (no heading gives #measured-2-cpu)",
        "c.md (no such file)",
        "#top (no heading gives #top)",
    ]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    assert not broken_links(page), f"{page.relative_to(REPO)}: broken links {broken_links(page)}"
