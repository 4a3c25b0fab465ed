"""Every command line the docs give is accepted by the parser it is meant for (parse only, nothing runs).

Commands are taken from README.md and docs/*.md, in fenced code blocks and in inline backticks:
``zero-recipes ...`` goes through the CLI's own argparse parser; ``python recipes/...`` (and the script part of
``accelerate launch ... recipes/...``, ``torchrun ... recipes/...`` and ``deepspeed ... recipes/...``) through the
recipe's argument parser, then its config class: every key must be a field, every value must convert to the field's
type, and the config must build (presets, precisions, choices).

Placeholders a user fills in are written in the docs as ``UPPER_CASE`` words, ``<name>``, ``...`` or a path of
their own (``data=my_images/``): those values are not converted, the key still has to exist; ``recipes/<r>/`` stands
for every recipe. ``[--opt x|y]`` is an optional group and ``x|y`` a choice: both are checked with the first choice.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import importlib.util
import io
import re
import shlex
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.config import build_config, coerce, parse_overrides, read_yaml, recipe_arg_parser
from common.errors import ConfigError, nearest
from common.tools.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`]+)`")
SCRIPT = re.compile(r"^recipes/(?P<folder>[^/\s]+)/(?P<stem>[A-Za-z_]+)\.py$")
LAUNCHERS = ("torchrun", "deepspeed")  # launchers that take a script path (train_pipeline.py's commands)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|<[^>]*>|\.\.\.")


@dataclass(frozen=True)
class DocCommand:
    """One command line found in the docs: where, and its tokens from the program on."""

    where: str
    kind: str  # "cli" (zero-recipes) or "script" (a recipe script and its arguments)
    tokens: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {' '.join(self.tokens)}"


# --- extraction ---------------------------------------------------------------------------------------------


def expand_optional_groups(text: str) -> str:
    """``[--backend a|b|c]`` -> ``--backend a``; ``[--config ...]`` (nothing concrete to check) -> dropped."""

    def one(match: re.Match) -> str:
        inner = match.group(1)
        if "..." in inner:
            return ""
        return re.sub(r"(\S+?)\|\S+", r"\1", inner)

    return re.sub(r"\[(--[^\]]*)\]", one, text)


def logical_lines(text: str) -> list[str]:
    """Lines with ``\\`` continuations joined, comments dropped, split at ``&&`` and ``;``."""
    joined = re.sub(r"\\\n\s*", " ", text)
    parts = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        parts += [p.strip() for p in re.split(r"&&|;", line) if p.strip()]
    return parts


def command_in(part: str, where: str) -> DocCommand | None:
    """The ``zero-recipes`` or recipe-script command that ``part`` holds, or None."""
    part = expand_optional_groups(part.removeprefix("$ ").strip())
    part = re.sub(r"<[^<>]*>", lambda m: m.group(0).replace(" ", "_"), part)  # "<base folder>" is one placeholder
    try:
        tokens = shlex.split(part)
    except ValueError:
        return None
    # A synopsis gives choices as a|b|c: check the first.
    tokens = [t.split("|")[0] if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", t) else t for t in tokens]
    for i, token in enumerate(tokens):
        if token == "zero-recipes" and i == 0:
            return DocCommand(where, "cli", tuple(tokens[1:]))
        launcher = tokens[i - 1] if i else ""
        launched = "launch" in " ".join(tokens[:i]) or tokens[0] in LAUNCHERS
        if SCRIPT.match(token) and (launcher == "python" or launched):
            return DocCommand(where, "script", tuple(tokens[i:]))
    return None


def doc_commands() -> list[DocCommand]:
    """Every command of README.md and docs/*.md, in code blocks and in inline backticks."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(REPO).as_posix()
        for block in FENCE.finditer(text):
            line = text[: block.start()].count("\n") + 2
            for part in logical_lines(block.group(1)):
                if command := command_in(part, f"{name}:{line}+"):
                    found.append(command)
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for span in INLINE.finditer(prose):
            line = prose[: span.start()].count("\n") + 1
            for part in logical_lines(span.group(1).replace("\n", " ")):
                if command := command_in(part, f"{name}:{line}"):
                    found.append(command)
    return found


# --- checking ---------------------------------------------------------------------------------------------


def check_cli(tokens: tuple[str, ...]) -> str | None:
    """None when the CLI's parser accepts ``tokens``, else its one-line error."""
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if len(tokens) == 1:  # "`zero-recipes probe`" in prose names a command: the name must exist
        return None if tokens[0] in subcommands else f"no subcommand {tokens[0]!r}{nearest(tokens[0], subcommands)}"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(list(tokens))
    except SystemExit as exc:
        if exc.code:
            return stderr.getvalue().strip() or f"exit {exc.code}"
    return None


@functools.cache
def script_config(script: Path) -> tuple[type, Path]:
    """(config class, default config) that a recipe script passes to ``parse_recipe_args(Cls, DEFAULT, ...)``.

    Read from the script (the call and the import of those two names), then that one module is imported by its
    file under a name of its own (the recipes' config modules would clash as top-level names).
    """
    tree = ast.parse(script.read_text())
    call = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "parse_recipe_args"
    )
    cls_name, default_name = (arg.id for arg in call.args[:2])
    module_name = next(
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and cls_name in {alias.name for alias in node.names}
    )
    spec = importlib.util.spec_from_file_location(
        f"docs_check_{script.parent.name}_{module_name}", script.parent / f"{module_name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return getattr(module, cls_name), Path(getattr(module, default_name))


def is_users_own(value: str) -> bool:
    """A placeholder, or a path the user has (``data=my_images/``, ``out_dir=runs/again``) that the repo does not.

    A path under ``recipes/`` names a shipped file: it is the repo's, and must exist.
    """
    if PLACEHOLDER.search(value):
        return True
    looks_like_path = "/" in value or value.endswith((".npz", ".jsonl", ".txt", ".yaml", ".json"))
    return looks_like_path and not value.startswith("recipes/") and not (REPO / value).exists()


def check_script(tokens: tuple[str, ...], folder: str) -> str | None:
    """None when the recipe accepts the arguments: argparse, keys, value types, and the config class's checks."""
    stem = SCRIPT.match(tokens[0])["stem"]
    if not (REPO / "recipes" / folder / f"{stem}.py").is_file():
        return f"no script recipes/{folder}/{stem}.py"
    cls, default_config = script_config(REPO / "recipes" / folder / f"{stem}.py")
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = recipe_arg_parser(default_config).parse_args(list(tokens[1:]))
    except SystemExit as exc:
        return stderr.getvalue().strip() or f"exit {exc.code}"
    config = Path(args.config) if Path(args.config).is_absolute() else REPO / args.config
    try:
        # A config the docs name in the repo must exist; one the user writes (probe/recommended.yaml) stands for the
        # recipe's default.
        if not is_users_own(args.config) or config.is_file():
            values = read_yaml(config)
        else:
            values = read_yaml(default_config)
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        for key, value in parse_overrides(args.overrides, typed=False).items():
            if key not in fields:
                return f"unknown key {key!r}{nearest(key, fields)}"
            if is_users_own(value):
                continue  # the key exists; the value is the user's to fill in
            values[key] = coerce(key, value, hints[key])
        build_config(cls, values, source=str(config))
    except ConfigError as exc:
        return str(exc)
    return None


def recipe_folders(script: str) -> list[str]:
    """The recipe folders a script path names (``recipes/<r>/train.py``: every recipe)."""
    folder = SCRIPT.match(script)["folder"]
    if folder.startswith("<"):
        return sorted(p.parent.name for p in (REPO / "recipes").glob("*/train.py"))
    return [folder]


COMMANDS = doc_commands()


def test_the_docs_give_commands_of_both_kinds():
    kinds = [c.kind for c in COMMANDS]
    # README alone gives 6 zero-recipes lines and 4 recipe scripts; the docs many more.
    assert kinds.count("cli") >= 30 and kinds.count("script") >= 30, kinds


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where}:{' '.join(c.tokens)[:60]}" for c in COMMANDS])
def test_every_doc_command_is_accepted_by_its_parser(command):
    if command.kind == "cli":
        problem = check_cli(command.tokens)
    else:
        problems = [check_script(command.tokens, f) for f in recipe_folders(command.tokens[0])]
        problem = next((p for p in problems if p), None)
    assert problem is None, f"{command}\n  -> {problem}"


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("zero-recipes probe --recipe cv", "cli"),  # the line docs/cv.md gave: probe takes the recipe positionally
        ("zero-recipes estimat --params 7e9", "cli"),
        ("python recipes/nlp/train.py max_step=5", "script"),
        ("python recipes/cv/train.py preset=deepspeed_stage2", "script"),
        ("python recipes/science/train.py max_steps=many", "script"),
        ("python recipes/nlp/finetune.py --config recipes/nlp/configs/no_such.yaml", "script"),
        ("python recipes/nlp/train.py ds_overrides=[zero_optimization.stage=2]", "script"),
    ],
)
def test_a_wrong_command_is_caught(line, kind):
    command = command_in(line, "test")
    assert command is not None and command.kind == kind
    if kind == "cli":
        assert check_cli(command.tokens) is not None
    else:
        assert check_script(command.tokens, SCRIPT.match(command.tokens[0])["folder"]) is not None
