"""Finding a recipe and asking it about a run: the one place where the tools meet the recipes.

A recipe is a folder with an entry script, ``train.py``, and its Accelerate twin ``train_accelerate.py``. The
source checkout ships ``recipes/<name>/``, named ``nlp``, ``cv``, ``science``; a recipe copied by ``zero-recipes
cp`` is named by its folder's path (``my_run/``). A folder may hold more entry points, each a Lightning script
with its Accelerate twin beside it (``finetune.py`` + ``finetune_accelerate.py``): ``nlp:finetune`` (or
``my_run:finetune``) names one, and its configs are the ones named after it (``configs/finetune_*.yaml``).

The tools never import a recipe: :func:`describe` runs ``python <entry> --describe`` and reads the one JSON
object it prints (:mod:`common.describe`), the recipe's own process validating the config.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.describe import RecipeDescription
from common.errors import MISSING_INPUT_EXIT_CODE, ConfigError, InputMissing, nearest

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_ENTRY = "train"
ACCELERATE_SUFFIX = "_accelerate"
BACKENDS = ("lightning", "accelerate")
# What a wheel install (no recipes/ beside common/) says to every command that needs a shipped recipe.
SOURCE_CHECKOUT_ONLY = (
    "the recipes ship with the source checkout: git clone <the zero-recipes repository> && cd zero-recipes && "
    f"pip install -e . (this installation has no {RECIPES_DIR})"
)
DESCRIBE_TIMEOUT_S = 600.0
# A launcher's variables in the tools' own environment (a tool run inside a job) must not make a recipe it starts
# think it is one rank of that job.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


@dataclass(frozen=True)
class Recipe:
    """One entry point of a recipe folder.

    Attributes:
        name: what the user typed, normalised: ``nlp``, ``nlp:finetune``, or a copy's folder path (``my_run``,
            ``my_run:finetune``).
        folder: the recipe's folder, absolute.
        entry: the entry script's stem: ``train`` or another one with an Accelerate twin (``finetune``).
        shipped: a folder of the source checkout's ``recipes/`` (False: a copy elsewhere).
    """

    name: str
    folder: Path
    entry: str = DEFAULT_ENTRY
    shipped: bool = True

    @property
    def script(self) -> Path:
        """The Lightning entry script: ``train.py`` or ``<entry>.py``."""
        return self.folder / f"{self.entry}.py"

    def backend_script(self, backend: str) -> Path:
        """``train.py`` for ``lightning``, ``train_accelerate.py`` for ``accelerate`` (``<entry>...`` likewise)."""
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be lightning or accelerate, got {backend!r}{nearest(backend, BACKENDS)}")
        return self.script if backend == "lightning" else self.folder / f"{self.entry}{ACCELERATE_SUFFIX}.py"

    def shown_script(self, backend: str) -> str:
        """The backend script as a command names it: from the repository root for a shipped recipe (the docs'
        commands), else from the current folder when it lies below it, else absolute."""
        script = self.backend_script(backend)
        base = REPO_ROOT.resolve() if self.shipped else Path.cwd().resolve()
        return str(script.relative_to(base)) if script.is_relative_to(base) else str(script)

    @property
    def run_dir(self) -> Path:
        """Where the recipe's commands are run from: the repository root (the recipes' docs give paths from it),
        or the folder holding a copy."""
        return REPO_ROOT if self.shipped else self.folder.parent

    def configs(self) -> list[Path]:
        """This entry's YAML configs: ``configs/<entry>_*.yaml`` for a second entry, the others for ``train``."""
        folder = self.folder / "configs"
        found = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
        others = [e for e in entry_points(self.folder) if e != DEFAULT_ENTRY]
        if self.entry != DEFAULT_ENTRY:
            return [p for p in found if p.name.startswith(f"{self.entry}_")]
        return [p for p in found if not p.name.startswith(tuple(f"{e}_" for e in others))]

    def summary(self) -> str:
        """The first line of the entry script's docstring (read, not imported)."""
        doc = ast.get_docstring(ast.parse(self.script.read_text()))
        return doc.strip().splitlines()[0] if doc else ""


def entry_points(folder: Path) -> list[str]:
    """The entry scripts of a recipe folder: ``train`` first, then every ``X`` with ``X.py`` and ``X_accelerate.py``."""
    twins = sorted(
        p.stem.removesuffix(ACCELERATE_SUFFIX)
        for p in folder.glob(f"*{ACCELERATE_SUFFIX}.py")
        if (folder / f"{p.stem.removesuffix(ACCELERATE_SUFFIX)}.py").is_file()
    )
    first = [DEFAULT_ENTRY] if (folder / f"{DEFAULT_ENTRY}.py").is_file() else []
    return first + [e for e in twins if e != DEFAULT_ENTRY]


def require_source_checkout() -> Path:
    """``recipes/`` of the source checkout, or the one sentence that says where the recipes are."""
    if not RECIPES_DIR.is_dir():
        raise ConfigError(SOURCE_CHECKOUT_ONLY)
    return RECIPES_DIR


def shipped_recipes() -> list[Recipe]:
    """Every entry point under ``recipes/``, by name: ``cv``, ``nlp``, ``nlp:finetune``, ``science``."""
    found = []
    for folder in sorted(p for p in require_source_checkout().iterdir() if (p / f"{DEFAULT_ENTRY}.py").is_file()):
        for entry in entry_points(folder):
            name = folder.name if entry == DEFAULT_ENTRY else f"{folder.name}:{entry}"
            found.append(Recipe(name, folder.resolve(), entry))
    return found


def _looks_like_a_name(text: str) -> bool:
    return "/" not in text and os.sep not in text and not text.startswith(".")


def find_recipe(text: str | Path) -> Recipe:
    """The recipe that ``text`` names.

    Accepted: a shipped recipe's name (``nlp``, ``nlp:finetune``); a folder holding ``train.py`` (a copy made by
    ``zero-recipes cp``), with ``:ENTRY`` for another entry point; an entry script's path (``my_run/finetune.py``).
    A bare word is a shipped recipe first (write ``./nlp`` for a folder of that name).

    Raises:
        ConfigError: nothing of that name (naming the nearest recipe), or a name without a source checkout.
    """
    text = str(text)
    base, entry = text, ""
    if ":" in text and not Path(text).exists():
        base, _, entry = text.rpartition(":")
    if base.endswith(".py") and not entry:
        script = Path(base)
        base, entry = str(script.parent), script.stem.removesuffix(ACCELERATE_SUFFIX)
    if _looks_like_a_name(base) and (RECIPES_DIR / base / f"{DEFAULT_ENTRY}.py").is_file():
        recipe = Recipe(base, (RECIPES_DIR / base).resolve(), DEFAULT_ENTRY)
    elif Path(base).is_dir():
        recipe = Recipe(base.rstrip("/") or base, Path(base).resolve(), DEFAULT_ENTRY, shipped=False)
    elif _looks_like_a_name(base):
        names = [r.name for r in shipped_recipes()]  # no checkout: the sentence that says where the recipes are
        raise ConfigError(
            f"unknown recipe {text!r}{nearest(text, names)}; recipes: {', '.join(names)} (or the folder of a copy "
            "made by zero-recipes cp)"
        )
    else:
        raise ConfigError(f"recipe folder not found: {base}")
    return _with_entry(recipe, entry or DEFAULT_ENTRY)


def _with_entry(recipe: Recipe, entry: str) -> Recipe:
    entries = entry_points(recipe.folder)
    if entry not in entries:
        where = f"{recipe.name} ({recipe.folder})"
        if not entries:
            raise ConfigError(f"{where} is not a recipe: it has no {DEFAULT_ENTRY}.py")
        raise ConfigError(
            f"recipe {where} has no entry point {entry!r}{nearest(entry, entries)}; entry points: {', '.join(entries)}"
        )
    if entry == DEFAULT_ENTRY:
        return recipe
    return Recipe(f"{recipe.name}:{entry}", recipe.folder, entry, recipe.shipped)


def recipe_of_config(path: str | Path) -> Recipe | None:
    """The recipe a YAML config belongs to, from where it lies: ``<recipe folder>/configs/<file>``.

    The folder is a shipped recipe or a copy (it holds ``train.py``); a file named after a second entry point
    (``finetune_tiny_cpu.yaml``) belongs to that entry (``nlp:finetune``). None when the file lies elsewhere.
    """
    path = Path(path).resolve()
    folder = path.parent.parent
    if path.parent.name != "configs" or not (folder / f"{DEFAULT_ENTRY}.py").is_file():
        return None
    shipped = folder.parent == RECIPES_DIR.resolve()
    recipe = Recipe(folder.name if shipped else str(folder), folder, DEFAULT_ENTRY, shipped)
    for entry in entry_points(folder):
        if entry != DEFAULT_ENTRY and path.name.startswith(f"{entry}_"):
            return _with_entry(recipe, entry)
    return recipe


# --- asking a recipe: --describe ---------------------------------------------------------------------------

# (entry script, config, overrides) -> the recipe's answer: its description, or (until describe raises it once) the
# error it refused the run with.
_DESCRIPTIONS: dict[tuple[str, str | None, tuple[str, ...]], RecipeDescription | ConfigError] = {}


def recipe_env(**extra: str) -> dict[str, str]:
    """This process's environment for a recipe subprocess, without a launcher's rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def describe_command(recipe: Recipe, config_path: Path | None, overrides: list[str]) -> list[str]:
    """``python <entry> --describe [--config F] [key=value ...]``."""
    config = ["--config", str(config_path)] if config_path else []
    return [sys.executable, str(recipe.script), "--describe", *config, *overrides]


def describe(
    recipe: Recipe | str, config_path: str | Path | None = None, overrides: list[str] | None = None
) -> RecipeDescription:
    """What the recipe's entry point says about the run of ``config_path`` + ``overrides`` (``--describe``).

    The recipe runs in its own process (one thread, no launcher variables): its config class validates the
    config, its ``describe(cfg)`` counts the model on the meta device. The answer is cached in this process per
    (entry, config, overrides), since the subprocess takes seconds.

    Raises:
        InputMissing: the run's model or data does not exist yet (the recipe's exit code 3).
        ConfigError: the config file is missing, or the recipe refused the config (its ``error:`` line), or the
            recipe failed otherwise (its last line, and the command to see the rest).
    """
    recipe = find_recipe(recipe) if isinstance(recipe, str) else recipe
    config = Path(config_path).resolve() if config_path else None
    if config is not None and not config.is_file():
        raise ConfigError(f"config file not found: {config_path}")
    overrides = [str(o) for o in overrides or []]
    key = (str(recipe.script), str(config) if config else None, tuple(overrides))
    if key not in _DESCRIPTIONS:
        _DESCRIPTIONS[key] = _answer(recipe, describe_command(recipe, config, overrides))
    answer = _DESCRIPTIONS[key]
    if isinstance(answer, ConfigError):
        del _DESCRIPTIONS[key]  # a refusal is told once: the file, or the model it needs, may be fixed before the next
        raise answer
    return answer


def describe_configs(recipe: Recipe | str, config_paths: list[str | Path]) -> dict[Path, RecipeDescription]:
    """:func:`describe` of several configs of one entry point in one recipe process: the imports, which take most
    of a ``--describe``'s seconds, are paid once.

    The process runs the entry script's own command line, ``<entry> --describe --config F``, once per config (the
    script re-executed in the same interpreter, as ``python <entry>`` would run it). The answers fill
    :func:`describe`'s cache, so a later ``describe(recipe, F)`` returns at once, or raises (once) the error the
    recipe refused ``F`` with.

    Returns:
        The description of each config the recipe described, by resolved path; a config it refused is left out.
    """
    recipe = find_recipe(recipe) if isinstance(recipe, str) else recipe
    configs = [Path(c).resolve() for c in config_paths]
    answers = describe_runs(recipe, [(config, []) for config in configs])
    return {config: answer for config, answer in zip(configs, answers) if isinstance(answer, RecipeDescription)}


def describe_runs(
    recipe: Recipe | str, runs: list[tuple[str | Path | None, list[str]]]
) -> list[RecipeDescription | ConfigError]:
    """:func:`describe` of several runs (a config file or None, and ``key=value`` overrides) in one recipe process.

    Each run is the entry script's own ``--describe [--config F] [key=value ...]``, re-executed in one interpreter
    (see :func:`describe_configs`); the answers fill :func:`describe`'s cache, so that ``describe(recipe, F,
    overrides)`` of each returns at once, or raises (once) the error the recipe refused it with. The probe describes
    all of its candidates this way before it runs the first one.

    Returns:
        Per run, in order: its description, or the error :func:`describe` raises for it.
    """
    recipe = find_recipe(recipe) if isinstance(recipe, str) else recipe
    asked = [(Path(config).resolve() if config else None, [str(o) for o in overrides]) for config, overrides in runs]
    argvs = [describe_command(recipe, config, overrides)[3:] for config, overrides in asked]  # after --describe
    command = [sys.executable, "-m", "common.tools.recipes", str(recipe.script), json.dumps(argvs)]
    ran = json.loads(_run_recipe_process(recipe, command).stdout.strip().splitlines()[-1])
    answers = []
    for (config, overrides), answer in zip(asked, ran):
        alone = describe_command(recipe, config, overrides)  # the command the answer stands for, named in a failure
        key = (str(recipe.script), str(config) if config else None, tuple(overrides))
        _DESCRIPTIONS[key] = _answer(recipe, alone, answer)
        answers.append(_DESCRIPTIONS[key])
    return answers


def _run_recipe_process(recipe: Recipe, command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            command,
            cwd=recipe.run_dir,
            env=recipe_env(OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=DESCRIBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{recipe.script} --describe did not answer in {DESCRIBE_TIMEOUT_S:.0f} s") from None


def _answer(recipe: Recipe, command: list[str], ran: dict[str, Any] | None = None) -> RecipeDescription | ConfigError:
    """What ``command`` (a ``--describe``) answered: the description, or the error to raise for it. ``ran``: its exit
    code and output when it has run already (in :func:`describe_configs`'s process); else it runs now."""
    if ran is None:
        proc = _run_recipe_process(recipe, command)
        ran = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    if ran["returncode"] != 0:
        lines = [line.strip() for line in ran["stderr"].splitlines() if line.strip()]
        refused = [line for line in lines if line.startswith("error: ")]
        if refused:
            error = InputMissing if ran["returncode"] == MISSING_INPUT_EXIT_CODE else ConfigError
            return error(refused[-1].removeprefix("error: "))
        shown = " ".join(command[1:])
        return ConfigError(
            f"recipe {recipe.name}: --describe failed (exit {ran['returncode']}): {lines[-1] if lines else 'no output'}"
            f"; run `python {shown}` to see its whole output"
        )
    try:
        return RecipeDescription.from_json(_json_object(ran["stdout"], recipe))
    except ConfigError as exc:
        return exc


def _json_object(stdout: str, recipe: Recipe) -> dict[str, Any]:
    """The JSON object of a ``--describe`` output: all of stdout, or its last line (after a library's notice)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    for text in (stdout, lines[-1] if lines else ""):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict):
            return data
    raise ConfigError(f"recipe {recipe.name}: {recipe.script.name} --describe printed no JSON object")


def _describe_in_this_process(script: Path, arguments: list[str]) -> dict[str, Any]:
    """``python <script> --describe <arguments>`` run in this interpreter: its exit code, stdout and stderr."""
    stdout, stderr = io.StringIO(), io.StringIO()
    returncode = 0
    argv = sys.argv
    sys.argv = [str(script), "--describe", *arguments]
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        returncode = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            stderr.write(f"{exc.code}\n")
    except Exception:  # a crash: its traceback, as the script alone would print it
        returncode = 1
        stderr.write(traceback.format_exc())
    finally:
        sys.argv = argv
    return {"returncode": returncode, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def main(argv: list[str] | None = None) -> None:
    """``python -m common.tools.recipes SCRIPT ARGUMENTS``: :func:`describe_runs`'s recipe process. ``ARGUMENTS`` is a
    JSON list of the argument lists after ``--describe``, one per run. Prints one JSON list, an ``{returncode,
    stdout, stderr}`` object per run, as the last line of stdout."""
    script, arguments = argv if argv is not None else sys.argv[1:]
    sys.path.insert(0, str(Path(script).parent))  # what `python SCRIPT` puts first: the recipe's own modules
    answers = [_describe_in_this_process(Path(script), run) for run in json.loads(arguments)]
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
