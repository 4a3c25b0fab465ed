"""One error type for bad user input, and the helper that names the nearest valid choice.

Every entry point catches :class:`ConfigError` and prints its message as one line, exit code 2,
no traceback: a user who typed ``preset=nlpp`` needs "did you mean 'nlp'", not a stack.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

USAGE_EXIT_CODE = 2
# ``--describe`` of a run whose model or data is not there yet (the config itself may be fine): the tools that
# need only the config (lint) go on without the model's facts.
MISSING_INPUT_EXIT_CODE = 3


class ConfigError(ValueError):
    """Bad user input: unknown preset or key, wrong type, incompatible combination, missing data."""


class InputMissing(ConfigError):
    """A file the run reads (a base model, a dataset) does not exist yet; the config may still be valid."""


def nearest(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""`` when nothing is close."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def exit_on_user_error(*error_types: type[BaseException]) -> Callable[[F], F]:
    """Decorate a ``main()`` so that user errors print one line and exit 2, without a traceback.

    Args:
        error_types: extra exception types that mean bad input (a domain's ``DataError``, ...).
    """
    caught = (ConfigError, *error_types)

    def decorate(fn: F) -> F:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except caught as exc:
                print(f"error: {exc}", file=sys.stderr, flush=True)
                sys.exit(USAGE_EXIT_CODE)

        return wrapper  # type: ignore[return-value]

    return decorate
