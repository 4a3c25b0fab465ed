"""``common.lightning_cpu`` warns once on a Lightning version outside ``TESTED_LIGHTNING``; the docs name that range."""

from __future__ import annotations

import warnings

import lightning
from _util import REPO

from common import lightning_cpu
from common.lightning_cpu import TESTED_LIGHTNING, ZeroDeepSpeedStrategy, untested_lightning_message


def test_the_installed_lightning_is_a_tested_one():
    """CI runs tests/distributed on the installed Lightning: it must be inside the range the module claims."""
    assert untested_lightning_message(lightning.__version__) is None


def test_versions_outside_the_range_get_a_message_naming_it():
    assert untested_lightning_message("2.6.0") is None and untested_lightning_message("2.6.6") is None
    for version in ("2.5.1", "2.7.0", "3.0.0"):
        message = untested_lightning_message(version)
        assert message and version in message and str(TESTED_LIGHTNING) in message


def strategies_built_with(monkeypatch, version: str, count: int) -> list[str]:
    """Build ``count`` strategies as a user's Trainer would, with Lightning reporting ``version``; the warnings."""
    monkeypatch.setattr(lightning, "__version__", version)
    lightning_cpu._warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(count):
            ZeroDeepSpeedStrategy(config={"zero_optimization": {"stage": 2}})
    lightning_cpu._warn_once.cache_clear()
    return [str(w.message) for w in caught if "common.lightning_cpu is tested with" in str(w.message)]


def test_the_strategy_warns_once_on_an_untested_lightning(monkeypatch):
    assert strategies_built_with(monkeypatch, "2.7.0", 3) == [untested_lightning_message("2.7.0")]


def test_the_strategy_is_silent_on_a_tested_lightning(monkeypatch):
    assert strategies_built_with(monkeypatch, "2.6.6", 2) == []


def test_docs_name_the_tested_range():
    """docs/foundation.md states the tested Lightning range exactly as the code holds it."""
    assert f"lightning `{TESTED_LIGHTNING}`" in (REPO / "docs" / "foundation.md").read_text()
