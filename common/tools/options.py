"""Command-line options that belong to one mode of a command: given in another mode, they are refused, not ignored.

A user who types ``zero-recipes doctor --sizes 1MiB`` (sizes are read by ``--collectives`` only) gets one line naming
the mode the option belongs to, instead of a report that silently ignored it. Options checked this way default to
None, so that an option typed with its default value is told apart from one not typed at all.
"""

from __future__ import annotations

import argparse
from typing import Any

from common.errors import ConfigError


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count that must be 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def given(value: Any) -> bool:
    """Whether an option was typed: not its None default, not an unset flag, not an empty ``append`` list."""
    return value is not None and value is not False and value != []


def refuse_outside_mode(args: argparse.Namespace, options: dict[str, str], belongs_to: str, mode: str) -> None:
    """Refuse the first of ``options`` (attribute -> flag as typed) given on the command line.

    Args:
        args: the parsed command line.
        options: the options that do not apply in ``mode``, e.g. ``{"sizes": "--sizes"}``.
        belongs_to: the mode(s) they apply to, as a user would type them: ``"doctor --collectives"``.
        mode: the mode of this command line: ``"doctor without --collectives"``.

    Raises:
        ConfigError: one line, ``--sizes applies to doctor --collectives, not to doctor without --collectives``.
    """
    for attribute, flag in options.items():
        if given(getattr(args, attribute, None)):
            raise ConfigError(f"{flag} applies to {belongs_to}, not to {mode}")
