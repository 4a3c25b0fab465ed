"""``zero-recipes cp RECIPE DEST``: copy a recipe as the starting point of your own work (torchtune's ``tune cp``).

What is copied: the recipe's scripts (``*.py``), its configs, its accelerate config and DeepSpeed JSON,
plus a generated smoke test, so that from any folder::

    zero-recipes cp nlp my_run/
    python my_run/train.py max_steps=20
    pytest my_run/

The smoke test runs ``train.py`` with the overrides the recipe lists in ``SMOKE_OVERRIDES`` (a tiny, few-step run
a user could type too; the module beside ``train.py`` that defines it is found by reading, not importing, the
recipe) and checks the run directory. A destination that holds anything
is refused unless ``--force`` is given; even then a file that differs from the recipe's is never replaced (your
edits stay yours: delete the file to take the recipe's again), so ``--force`` only adds what is missing.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from common.errors import ConfigError, nearest
from common.tools.recipes import DEFAULT_ENTRY, find_recipe

SMOKE_TEST = '''"""Smoke test of this recipe copy: a few training steps through train.py, then the run directory.

Run with `pytest {dest_name}` from any folder.
"""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from {smoke_module} import SMOKE_OVERRIDES  # noqa: E402


def test_train_runs_and_writes_a_run_directory(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(HERE / "train.py"), *SMOKE_OVERRIDES, f"out_dir={{out}}"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] >= 1
    for name in ("config.yaml", "ds_config.json", "env.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
'''


SMOKE_NAME = "SMOKE_OVERRIDES"


def _assigns_smoke_overrides(path: Path) -> bool:
    """Whether the module assigns ``SMOKE_OVERRIDES`` at its top level (``X = ...`` or ``X: list[str] = ...``)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == SMOKE_NAME for t in targets):
            return True
    return False


def smoke_overrides_module(recipe_dir: Path) -> str:
    """The module beside ``train.py`` that defines ``SMOKE_OVERRIDES``: one ``train.py`` imports, else any.

    Raises:
        ConfigError: no module of the folder defines it.
    """
    script = recipe_dir / f"{DEFAULT_ENTRY}.py"
    imported = [
        node.module
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    ]
    local = [recipe_dir / f"{name}.py" for name in imported if (recipe_dir / f"{name}.py").is_file()]
    for path in local + sorted(recipe_dir.glob("*.py")):
        if _assigns_smoke_overrides(path):
            return path.stem
    raise ConfigError(f"{recipe_dir}: no module beside {script.name} defines {SMOKE_NAME} (the smoke test's run)")


def files_to_copy(recipe_dir: Path, config: str | None) -> list[Path]:
    """The recipe's files, relative to its folder (pure: copies nothing)."""
    files = [p for p in recipe_dir.iterdir() if p.is_file() and p.suffix in (".py", ".yaml", ".json", ".md")]
    configs_dir = recipe_dir / "configs"
    configs = sorted(configs_dir.glob("*.yaml")) if configs_dir.is_dir() else []
    if config is not None:
        names = [c.stem for c in configs]
        if config not in names:
            raise ConfigError(f"recipe has no config {config!r}{nearest(config, names)}; configs: {', '.join(names)}")
        # The default config stays: train.py falls back to it and the smoke test uses it.
        configs = [c for c in configs if c.stem in (config, "tiny_cpu")]
    return sorted(p.relative_to(recipe_dir) for p in files + configs)


def differing_files(contents: dict[Path, bytes]) -> list[Path]:
    """Paths of ``contents`` that exist with other bytes (or are not files): what a copy would destroy (pure read)."""
    return [
        path for path, data in contents.items() if path.exists() and (not path.is_file() or path.read_bytes() != data)
    ]


def copy_recipe(recipe: str, dest: str | Path, config: str | None = None, force: bool = False) -> list[Path]:
    """Copy recipe ``recipe`` (a name or a copy's folder: the whole folder) into ``dest`` with a smoke test; return
    the written paths.

    Args:
        force: copy into a folder that already holds something; files that are already there with the same content
            are kept, files that differ are refused (never replaced).

    Raises:
        ConfigError: unknown recipe or config, ``dest`` is a file, ``dest`` is not empty without ``force``, or a
            file in ``dest`` differs from the one the copy would write. Nothing is written then.
    """
    source, dest = find_recipe(recipe).folder, Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"{dest} is a file, not a folder; choose another destination")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise ConfigError(
            f"{dest} is not empty; choose a new folder, or pass --force to add the recipe's missing files "
            "(files you changed are never replaced)"
        )
    contents = {dest / rel: (source / rel).read_bytes() for rel in files_to_copy(source, config)}
    smoke = SMOKE_TEST.format(dest_name=dest.name, smoke_module=smoke_overrides_module(source))
    contents[dest / "test_smoke.py"] = smoke.encode()
    differ = differing_files(contents)
    if differ:
        raise ConfigError(
            f"{differ[0]} differs from the recipe's ({len(differ)} file(s) differ); --force never replaces a changed "
            "file: move it away to take the recipe's copy"
        )
    for path, data in contents.items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return list(contents)


def cmd_cp(args: argparse.Namespace) -> int:
    written = copy_recipe(args.recipe, args.dest, config=args.config, force=args.force)
    for path in written:
        print(path)
    print(f"next: python {Path(args.dest) / 'train.py'}   and   pytest {args.dest}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``cp`` to the ``zero-recipes`` command."""
    cp = subparsers.add_parser("cp", help="copy a recipe with its configs and a smoke test")
    cp.add_argument("recipe", help="recipe name (zero-recipes ls) or the folder of a copy")
    cp.add_argument("dest", help="destination folder")
    cp.add_argument("--config", default=None, help="copy only this config (plus the default tiny_cpu)")
    cp.add_argument(
        "--force", action="store_true", help="copy into a non-empty folder (adds missing files, never replaces one)"
    )
    cp.set_defaults(func=cmd_cp)
