"""The boundary between the tools and the recipes, read from the code itself.

- The tools (``common/tools``) learn about a recipe only through its command line (``--describe``): running
  ``estimate``, ``lint`` and ``config`` in-process imports no recipe module and no domain package.
- ``common/`` has no import cycle (module-level and function-level imports alike), nothing in ``common/``
  outside ``common/tools`` imports the tools, and no recipe or domain package imports them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "common"
TOOLS = "common.tools"
# What belongs to the recipes' side: the recipe folders and the domain packages their scripts import.
RECIPE_SIDE = ("recipes", "nlp", "cv", "science")


# --- the tools run without a recipe in their process -------------------------------------------------------

# Runs the CLI's main in-process for each command line and writes what ended up in sys.modules to argv[1].
IN_PROCESS = """
import json, sys
from common.tools import cli

commands = json.loads(sys.argv[2])
codes = []
for argv in commands:
    try:
        codes.append(cli.main(argv))
    except SystemExit as exc:
        codes.append(exc.code)
modules = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
with open(sys.argv[1], "w") as out:
    json.dump({"codes": codes, "modules": modules}, out)
"""

COMMANDS = [
    ["config", "nlp", "--world-size", "2"],
    ["estimate", "--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB"],
    ["estimate", "--recipe", "science", "--json"],
    ["lint", "recipes/science/configs/tiny_cpu.yaml"],
    ["lint", "recipes/nlp/configs/tiny_cpu.yaml", "--recipe", "nlp"],
    ["lint", "recipes/nlp/ds_config.json"],
]


def recipe_module_names() -> set[str]:
    """Every name a recipe file could be imported under: its stem (``train``, ``nlp_config``, ``pretraining``...)
    with its folder on ``sys.path``, and the old loader's ``zero_recipes_recipe_*`` names."""
    return {p.stem for p in (REPO / "recipes").rglob("*.py")}


def test_estimate_lint_and_config_import_no_recipe_module(tmp_path):
    report = tmp_path / "modules.json"
    # A fresh interpreter: other tests in this process may have imported recipe modules themselves.
    proc = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, str(report), json.dumps(COMMANDS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["codes"] == [0] * len(COMMANDS), (data["codes"], proc.stderr[-3000:])
    modules = data["modules"]
    assert "common.tools.cli" in modules and "common.tools.recipes" in modules  # the probe saw the tools load
    by_name = sorted(
        name
        for name in modules
        if name.split(".")[0] in RECIPE_SIDE or name in recipe_module_names() or name.startswith("zero_recipes_recipe_")
    )
    assert by_name == [], f"the tools imported recipe code: {by_name}"
    recipe_dirs = [(REPO / side).resolve() for side in RECIPE_SIDE]
    by_file = sorted(
        name
        for name, file in modules.items()
        if file and any(Path(file).resolve().is_relative_to(folder) for folder in recipe_dirs)
    )
    assert by_file == [], f"the tools loaded files of the recipes' side: {by_file}"


# --- imports, read with ast ---------------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in the file, at any depth (function-level ones too).

    ``from a.b import c`` gives ``a.b.c`` (it is a module or a name of ``a.b``: the graph keeps what exists).
    """
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def resolve(name: str, modules: set[str]) -> str | None:
    """The module of ``modules`` that an imported name lands in: itself, or its longest importable prefix."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def common_import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in COMMON.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for imported, _ in imported_names(path):
            target = resolve(imported, set(files))
            if target and target != name and target not in name:  # a package's own __init__ is not an edge back
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each a list of module names."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    """The reference the next test relies on: a three-module loop and a two-module loop are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_common_has_no_import_cycle():
    graph = common_import_graph()
    assert len(graph) > 20 and "common.tools.recipes" in graph["common.tools.probe"]  # the graph is real
    found = cycles(graph)
    assert found == [], "import cycles in common/: " + "; ".join(" <-> ".join(c) for c in found)


def imports_of_tools(paths: list[Path]) -> list[str]:
    return [
        f"{p.relative_to(REPO)}:{line}: {name}"
        for p in paths
        for name, line in imported_names(p)
        if name == TOOLS or name.startswith(TOOLS + ".")
    ]


def test_only_the_tools_import_the_tools():
    outside = [p for p in COMMON.rglob("*.py") if not p.is_relative_to(COMMON / "tools")]
    assert len(outside) > 10
    assert imports_of_tools(outside) == []


def test_recipes_and_domain_packages_never_import_the_tools():
    recipe_side = [p for side in RECIPE_SIDE for p in (REPO / side).rglob("*.py")]
    assert any(p.name == "train.py" for p in recipe_side)
    assert imports_of_tools(recipe_side) == []
