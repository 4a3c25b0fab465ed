"""Recipe configs: a dataclass per recipe, YAML files whose keys equal its fields, ``key=value`` overrides.

The flow is the same in every recipe::

    cfg = load_config(NLPConfig, "recipes/nlp/configs/tiny_cpu.yaml", ["max_steps=50", "devices=2"])

Unknown keys are an error that names the nearest valid key; values are converted to the field's type
(``"2"`` -> 2, ``"1e-3"`` -> 0.001, ``"true"`` -> True) and a value that does not convert is an error
naming the key and the expected type. YAML is read with ``yaml.safe_load`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from common.errors import MISSING_INPUT_EXIT_CODE, ConfigError, InputMissing, nearest

T = TypeVar("T")

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~", ""}


def parse_value(text: str) -> Any:
    """Turn the right side of ``key=value`` into a Python value without knowing the target type.

    Numbers (including ``1e6``, which YAML 1.1 would keep as a string), booleans, ``null``, and JSON
    lists or objects are recognised; anything else stays a string.
    """
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    for convert in (int, float):
        try:
            return convert(stripped)
        except ValueError:
            pass
    if stripped[:1] in "[{":
        try:
            return json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"cannot parse {text!r} as JSON: {exc.msg}") from None
    return stripped


def parse_overrides(items: list[str] | None, typed: bool = True) -> dict[str, Any]:
    """Parse ``["a=1", "b.c=true"]`` into ``{"a": 1, "b.c": True}``; a missing ``=`` is an error.

    Args:
        items: ``key=value`` strings.
        typed: convert values with :func:`parse_value` (for untyped targets such as DeepSpeed keys);
            False keeps the text for a dataclass field's own type to convert.
    """
    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value")
        overrides[key.strip()] = parse_value(value) if typed else value.strip()
    return overrides


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with ``yaml.safe_load``; missing file or non-mapping content is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__}: {str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value, got {type(data).__name__}")
    return data


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise a ConfigError naming ``key``.

    Supports ``int``, ``float``, ``bool``, ``str``, ``X | None``, ``list[X]`` and ``dict``.
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in _NONE):
            return None
        errors = []
        for arg in args:
            try:
                return coerce(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and value.strip().startswith("["):
            value = parse_value(value)
        elif isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [coerce(key, v, item_tp) if item_tp is not Any else v for v in value]
    if origin is dict or tp is dict:
        if isinstance(value, str) and value.strip().startswith("{"):
            value = parse_value(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if tp is Any:
        return parse_value(value) if isinstance(value, str) else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value)
                if number.is_integer():
                    return int(number)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def build_config(cls: type[T], values: dict[str, Any], source: str = "config") -> T:
    """Build dataclass ``cls`` from ``values``: unknown keys name the nearest field, values are coerced.

    The dataclass's ``__post_init__`` then checks cross-field rules and raises ConfigError.
    """
    types_by_name = _field_types(cls)
    unknown = [k for k in values if k not in types_by_name]
    if unknown:
        key = unknown[0]
        raise ConfigError(f"{source}: unknown key {key!r}{nearest(key, types_by_name)}")
    kwargs = {k: coerce(k, v, types_by_name[k]) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{source}: {exc}") from None


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None) -> T:
    """Load a recipe config: defaults <- YAML file <- ``key=value`` overrides.

    Args:
        cls: the recipe's config dataclass.
        path: a YAML file whose keys equal ``cls``'s fields, or None for the dataclass defaults.
        overrides: ``["key=value", ...]`` from the command line, or an already parsed dict.
    """
    values: dict[str, Any] = read_yaml(path) if path else {}
    source = str(path) if path else "config"
    types_by_name = _field_types(cls)
    for key in values:
        if key not in types_by_name:
            raise ConfigError(f"{source}: unknown key {key!r}{nearest(key, types_by_name)}")
    # Command-line values stay text here and are converted by the field's type in coerce(): a str field
    # given "none" (activation_checkpointing=none) must stay the word, not become None.
    parsed = overrides if isinstance(overrides, dict) else parse_overrides(overrides, typed=False)
    for key in parsed:
        if key not in types_by_name:
            raise ConfigError(
                f"unknown key {key!r}{nearest(key, types_by_name)}; valid keys: {', '.join(types_by_name)}"
            )
    values.update(parsed)
    return build_config(cls, values, source=source)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as a plain dict (for ``config.yaml`` in the run directory)."""
    return dataclasses.asdict(cfg)


def dump_yaml(data: dict[str, Any]) -> str:
    """YAML text of a plain dict, keys in their original order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def recipe_arg_parser(default_config: str | Path) -> argparse.ArgumentParser:
    """The argparse half of a recipe's command line (``tests/unit/test_docs_commands.py`` parses the docs with it).

    The description is the running script's docstring.
    """
    main_doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    parser = argparse.ArgumentParser(description=main_doc.split("\n")[0])
    parser.add_argument("--config", default=str(default_config), help="YAML config (default: %(default)s)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument(
        "--describe",
        action="store_true",
        help="print one JSON object (resolved config, world size, DeepSpeed config, model facts) and exit",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def parse_recipe_args(
    cls: type[T],
    default_config: str | Path,
    argv: list[str] | None = None,
    describe: Callable[[T], Any] | None = None,
) -> T:
    """A recipe's command line: ``--config FILE`` (default ``default_config``), ``key=value`` overrides,
    ``--print-config`` (print the resolved config and exit) and ``--describe`` (print
    ``describe(cfg).to_json()`` as one JSON object on stdout and exit; :mod:`common.describe`).

    While ``describe`` runs, anything it prints goes to stderr, so stdout holds the JSON alone.
    """
    args = recipe_arg_parser(default_config).parse_args(argv)
    loaded = load_config(cls, args.config, args.overrides)
    if args.print_config:
        print(dump_yaml(config_to_dict(loaded)), end="")
        sys.exit(0)
    if args.describe:
        if describe is None:
            raise ConfigError(f"{Path(sys.argv[0]).name} has no --describe")
        try:
            with contextlib.redirect_stdout(sys.stderr):
                description = describe(loaded).to_json()
        except InputMissing as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(MISSING_INPUT_EXIT_CODE)
        print(json.dumps(description))
        sys.exit(0)
    return loaded
